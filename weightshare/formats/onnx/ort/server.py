"""The run's onnxruntime child for ``--prepack``: one process optimizes and packs every model of a run.

A child per model started the interpreter, onnx and onnxruntime (0.33 s of CPU, measured on the 2-core machine)
and measured the CPU's probes again for each model: a 3-model decoder family spent 1.1 s of its 3.1 s of CPU
starting children. Here the run's first model starts the child (``child.serve``) and every later model of the
run sends it a request; the child ends with the run (``run_child``: as long as the run's transaction or zoo
stack lives), or with the converter (PR_SET_PDEATHSIG).

Each model keeps its own bounds: the child applies the model's ``limits.ChildLimits`` to itself before the
model's work (``limits.apply_limits``), the parent waits for the answer no longer than the model's wall time
(then kills the child), and the peak RSS reported is the model's (the child's high-water mark, reset per model).
A model that fails ends the child (its error on stderr, as a child per model gave it); the next model starts a
new one. The child's environment is the run's: a model asked for under another environment gets a new child.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import weakref
from contextlib import ExitStack
from typing import IO
from weakref import WeakKeyDictionary

from .limits import ChildLimits, die_with_parent

__all__ = ["CHILD_MODULE", "OrtChild", "run_child"]

CHILD_MODULE = "weightshare.formats.onnx.ort.child"


class OrtChild:
    """One ``child.serve`` process, started on demand; ``started`` counts the processes it started."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.err: IO[bytes] | None = None  # the child's stderr (a file: a pipe nobody reads would block it)
        self.env: dict[str, str] | None = None
        self.started = 0

    def request(
        self, argv: list[str], limits: ChildLimits, env: dict[str, str], scoped: dict[str, str] | None = None
    ) -> tuple[subprocess.CompletedProcess[str], bool]:
        """One model (``child.run``'s arguments) under ``limits``: the result as a child run for it alone gives it
        (exit status; the answer line on stdout; on failure, what the child wrote to stderr for it), and whether a
        new child was started for it. ``subprocess.TimeoutExpired`` past the wall time (the child killed).
        ``scoped``: variables the child sets for this model alone (a model's own, which start no new child)."""
        fresh = self.proc is None or self.proc.poll() is not None or env != self.env
        if fresh:
            self.close()
            self._start(env)
        assert self.proc is not None and self.proc.stdin is not None and self.err is not None
        errors_from = os.fstat(self.err.fileno()).st_size
        line = json.dumps({"argv": argv, "limits": limits.to_json(), "env": scoped or {}}) + "\n"
        try:
            self.proc.stdin.write(line.encode())
            self.proc.stdin.flush()
            answer = self._answer(limits.wall_s)
        except BrokenPipeError:  # it died before reading the request: its exit status and stderr say why
            answer = None
        except BaseException:  # past the wall time, or Ctrl-C: the model's work stops with the caller
            self.close(kill=True)
            raise
        if answer is not None:
            return subprocess.CompletedProcess(argv, 0, answer, ""), fresh
        returncode = self.proc.wait()
        self.err.seek(errors_from)
        stderr = self.err.read().decode(errors="replace")
        self.close()
        return subprocess.CompletedProcess(argv, returncode, "", stderr), fresh

    def _start(self, env: dict[str, str]) -> None:
        parent = os.getpid()
        self.err = tempfile.TemporaryFile()
        self.env = dict(env)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", CHILD_MODULE, "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.err,
            env=env,
            preexec_fn=lambda: die_with_parent(parent),
        )
        self.started += 1

    def _answer(self, wall_s: float) -> str | None:
        """The child's next answer line, or None when it ended without one."""
        import time

        assert self.proc is not None and self.proc.stdout is not None
        fd, got = self.proc.stdout.fileno(), bytearray()
        deadline = time.monotonic() + wall_s
        while not got.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise subprocess.TimeoutExpired(self.proc.args, wall_s)
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            got += chunk
        return got.decode()

    def close(self, kill: bool = False) -> None:
        """End the child: its input closed (it exits once its current model is done), or ``kill``."""
        proc, self.proc = self.proc, None
        if proc is not None:
            if kill:
                proc.kill()
            for stream in (proc.stdin, proc.stdout):
                try:
                    if stream is not None:
                        stream.close()
                except OSError:
                    pass
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.err is not None:
            self.err.close()
            self.err = None


_children: WeakKeyDictionary[object, OrtChild] = WeakKeyDictionary()


def run_child(run: object) -> OrtChild:
    """The child serving the run ``run`` stands for (its transaction, or a zoo's staging stack), ended when
    ``run`` is: as a zoo's stack closes, or when the transaction goes."""
    child = _children.get(run)
    if child is None:
        child = _children[run] = OrtChild()
        if isinstance(run, ExitStack):
            run.callback(child.close)
        weakref.finalize(run, child.close)
    return child
