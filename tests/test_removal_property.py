"""Property: whatever a user does to OUT, its record and the inputs between folder or zoo runs, weightshare removes
only what it wrote.

Before: a model folder (models, side files, a subfolder), a directory outside it, and OUT after a first run.
Under test: random sequences of folder runs, or of zoo runs (the folder's top-level models, ``--shared-blob
blobs/zoo``), at ``--blob-grace 0`` (in-process, the CLI's code path) interleaved
with: input files deleted, added or changed; the user's own files placed in OUT (at an output's name too, edited
in place); directories of OUT swapped for links to a directory inside OUT, outside it, or into the input; the
record flipped, truncated, deleted, or forged (resealed) to name files through links or with a wrong identity.
After every run: every file outside OUT, every input file and every file in OUT that weightshare did not write
has its bytes (SHA-256) unchanged, unless this run wrote an output at that very path.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import weightshare
from weightshare import _outputs_record as outputs_record
from weightshare._outputs_record import RECORD
from weightshare._samples import mlp_onnx
from weightshare.errors import WeightshareError

_MODELS: dict[int, bytes] = {}


def _model_bytes(seed: int) -> bytes:
    if seed not in _MODELS:
        with tempfile.TemporaryDirectory() as d:
            _MODELS[seed] = mlp_onnx(Path(d) / "m.onnx", layers=1, dim=16, weights="float32", seed=seed).read_bytes()
    return _MODELS[seed]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _regular_files(root: Path) -> dict[Path, str]:
    """Every regular file under ``root``, no link followed, by path."""
    found = {}
    for here, _dirs, names in os.walk(root):
        for name in names:
            p = Path(here) / name
            if p.is_file() and not p.is_symlink():
                found[p] = _digest(p)
    return found


USER_NAMES = [
    "m0.portable.onnx",
    "m0.weights.0123456789ab.safetensors",
    "sub/x.txt",
    "notes.txt",
    "lnk/y.txt",
    "zoo.0123456789ab.safetensors",
    "blobs/zoo.0123456789ab.safetensors",
]
LINK_NAMES = ["sub", "lnk", "onnx", "blobs"]
STEP = st.one_of(
    st.tuples(st.just("run")),
    st.tuples(st.just("drop_input"), st.integers(0, 20)),
    st.tuples(st.just("add_input"), st.sampled_from(["", "sub/", "onnx/"]), st.integers(0, 3)),
    st.tuples(st.just("change_model"), st.integers(0, 20), st.integers(0, 3)),
    st.tuples(st.just("user_file"), st.integers(0, 40), st.binary(max_size=8)),
    st.tuples(st.just("link"), st.sampled_from(LINK_NAMES), st.sampled_from(["outside", "repo", "repo/sub", "inner"])),
    st.tuples(st.just("edit_record"), st.integers(0, 5), st.integers(0, 10_000)),
)


class World:
    def __init__(self, root: Path, zoo: bool = False) -> None:
        self.zoo = zoo  # zoo runs: the folder's top-level models into OUT, one blob in OUT/blobs/
        self.root, self.repo, self.outside, self.out = root, root / "repo", root / "outside", root / "out"
        for d in (self.repo / "sub", self.outside / "d"):
            d.mkdir(parents=True)
        (self.repo / "m0.onnx").write_bytes(_model_bytes(0))
        (self.repo / "sub" / "m1.onnx").write_bytes(_model_bytes(1))
        (self.repo / "config.json").write_text("{}")
        (self.repo / "sub" / "a.txt").write_text("a")
        (self.outside / "o.txt").write_text("outside")
        (self.outside / "d" / "x.txt").write_text("outside too")
        self.user: dict[Path, str] = {}  # files in OUT weightshare did not write, by their path in OUT
        self.n = 0

    def inputs(self) -> list[Path]:
        return sorted(p for p in self.repo.rglob("*") if p.is_file() and not p.is_symlink())

    def run(self) -> None:
        protected = {**_regular_files(self.repo), **_regular_files(self.outside)}
        user = {p: d for p, d in self.user.items() if p.is_file()}
        written: set[str] = set()
        try:
            if self.zoo:
                models = sorted(p for p in self.repo.glob("*.onnx") if p.is_file())
                zoo = weightshare.convert_zoo(models, self.out, "blobs/zoo", blob_grace=0)
                outputs = [o for m in zoo.models for o in m.outputs] + [str(self.out / ".weightshare-zoo.json")]
            else:
                report = weightshare.convert_folder(self.repo, self.out, blob_grace=0)
                outputs = [o for m in report.models for o in m.outputs] + report.copied
        except WeightshareError:
            pass
        else:
            written = {os.path.realpath(o) for o in outputs}
        for p, d in {**protected, **user}.items():
            if os.path.realpath(p) in written:
                self.user.pop(p, None)  # an output of this run now: replaced, as any output replaces its path
                continue
            assert p.is_file() and _digest(p) == d, f"{p} lost or changed"

    def step(self, op: tuple) -> None:
        kind = op[0]
        self.n += 1
        if kind == "run":
            self.run()
        elif kind == "drop_input":
            files = self.inputs()
            models = [p for p in files if p.suffix == ".onnx"]
            victim = files[op[1] % len(files)]
            if victim.suffix != ".onnx" or len(models) > 1:
                victim.unlink()
        elif kind == "add_input":
            d = self.repo / op[1]
            d.mkdir(parents=True, exist_ok=True)
            if op[2] == 0:
                (d / f"m{self.n + 10}.onnx").write_bytes(_model_bytes(self.n + 10))
            else:
                (d / f"side{op[2]}.txt").write_text(str(self.n))
        elif kind == "change_model":
            models = [p for p in self.inputs() if p.suffix == ".onnx"]
            if models:
                models[op[1] % len(models)].write_bytes(_model_bytes(op[2] + 2))
        elif kind == "user_file":
            self._user_file(op[1], op[2])
        elif kind == "link":
            self._link(op[1], op[2])
        else:
            self._edit_record(op[1], op[2])

    def _user_file(self, pick: int, data: bytes) -> None:
        existing = sorted(
            p.relative_to(self.out).as_posix() for p in self.out.rglob("*") if p.is_file() and p.name != RECORD
        )
        names = USER_NAMES + existing  # an output's own name too: edited in place, it is no longer weightshare's
        path = self.out / names[pick % len(names)]
        if not self.out.is_dir() or not path.parent.is_dir():
            return
        path.write_bytes(b"user:" + data)
        real = Path(os.path.realpath(path))
        if str(real).startswith(str(self.out) + os.sep):
            self.user[real] = _digest(path)  # outside OUT (through a link) it is protected as an outside file

    def _link(self, name: str, target: str) -> None:
        if not self.out.is_dir():
            return
        link = self.out / name
        if target == "inner":
            (self.out / "inner").mkdir(exist_ok=True)
        if link.is_symlink():
            link.unlink()
        elif link.is_dir():  # the user moves it elsewhere (another disk) and links it back
            moved = self.outside / f"moved{self.n}"
            shutil.move(link, moved)
            for p in list(self.user):
                if link in p.parents:
                    del self.user[p]  # now outside OUT: protected as such
            target = str(moved.relative_to(self.root))
        elif link.exists():
            return
        dest = self.out / "inner" if target == "inner" else self.root / target
        link.symlink_to(dest, target_is_directory=True)

    def _edit_record(self, mode: int, pos: int) -> None:
        record = self.out / RECORD
        if not record.is_file():
            return
        raw = record.read_bytes()
        if not raw:  # truncated to nothing by an earlier edit
            return
        if mode == 0:
            record.write_bytes(raw[: pos % len(raw)] + bytes([raw[pos % len(raw)] ^ 0x21]) + raw[pos % len(raw) + 1 :])
        elif mode == 1:
            record.write_bytes(raw[: pos % len(raw)])
        elif mode == 2:
            record.unlink()
        else:
            try:
                runs = json.loads(raw)["runs"]
            except (ValueError, KeyError):
                return
            victims = [self.repo / "config.json", self.outside / "o.txt", *self.user]
            victim = victims[pos % len(victims)]
            if not victim.is_file():
                return
            s = victim.stat()
            ident = [s.st_dev, s.st_ino, s.st_size, s.st_ctime_ns, 0]
            rel = {
                3: "lnk/config.json",  # through a link, with the victim's true identity
                4: "sub/o.txt",
                5: victim.relative_to(self.out).as_posix() if victim in self.user else "lnk/x.txt",
            }[mode]
            if mode == 5:
                ident[3] -= 1  # a user file in OUT named with an identity one ns off: not what weightshare wrote
            for entry in runs.values() if isinstance(runs, dict) else []:
                if isinstance(entry, dict):
                    entry["dropped"] = {rel: ident}
            text = {"format": outputs_record.FORMAT, "runs": runs, "seal": outputs_record._seal(runs)}
            record.write_text(json.dumps(text))


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(st.lists(STEP, min_size=1, max_size=10))
@example([("drop_input", 2), ("link", "sub", "outside"), ("run",)])  # case 1: out/sub moved away and linked back
@example([("link", "lnk", "repo"), ("edit_record", 3, 0), ("run",)])  # case 1: a record naming lnk/config.json
@example([("user_file", 1, b"x"), ("run",)])  # case 2: a blob of unknown origin in OUT
@example([("user_file", 0, b"x"), ("user_file", 7, b"y"), ("run",)])  # case 2: a user's twin; an output edited
def test_nothing_weightshare_did_not_write_is_ever_lost(steps):
    with tempfile.TemporaryDirectory() as d:
        world = World(Path(d).resolve())
        world.run()
        for op in steps:
            world.step(op)
        world.run()


@pytest.mark.slow
@settings(max_examples=20, deadline=None)
@given(st.lists(STEP, min_size=1, max_size=10))
@example([("user_file", 6, b"x"), ("change_model", 0, 1)])  # a user's file named like an old blob
@example([("link", "blobs", "x"), ("link", "blobs", "inner"), ("user_file", 6, b"y")])  # blobs/ -> OUT/inner
@example([("add_input", "", 0), ("run",), ("user_file", 10, b"z"), ("drop_input", 2)])  # a dropped model, edited
def test_nothing_a_zoo_did_not_write_is_ever_lost(steps):
    with tempfile.TemporaryDirectory() as d:
        world = World(Path(d).resolve(), zoo=True)
        world.run()
        for op in steps:
            world.step(op)
        world.run()
