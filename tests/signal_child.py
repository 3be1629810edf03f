"""Run `weightshare ARGS...` in this process and send it signal NAME once BYTES payload bytes are written.

    python tests/signal_child.py NAME:BYTES ARGS...

The interrupt and kill tests need the signal to land mid-write deterministically; timing a signal from outside
either misses the write on a fast machine or fires before Python has started on a slow one. The hook wraps the
blob writer's progress callback here, in the test harness: production code reads no test switch.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import weightshare._pipeline as pipeline
from weightshare.cli import main


def install(spec: str) -> None:
    name, _, after = spec.partition(":")
    signum, threshold, seen = getattr(signal, name), int(after or 0), [0, False]
    write_payloads = pipeline.write_payloads

    def signalling(container: Any, payloads: Any, report: Any, progress: Any = None) -> Any:
        def hook(n: int) -> None:
            seen[0] += n
            if not seen[1] and seen[0] >= threshold:
                seen[1] = True
                os.kill(os.getpid(), signum)
            if progress is not None:
                progress(n)

        return write_payloads(container, payloads, report, hook)

    pipeline.write_payloads = signalling


if __name__ == "__main__":
    # Ctrl-C as in a terminal: a parent that ignores SIGINT (a test worker after some native library set it so)
    # passes SIG_IGN on, and Python then leaves SIGINT ignored; the test is about the CLI's answer to it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    install(sys.argv[1])
    sys.argv = ["weightshare", *sys.argv[2:]]
    main()
