"""ExecuTorch programs from the real exporter (random weights), and what loading them costs, before and after
weightshare's conversion. Run by hand with the ExecuTorch venv (torch 2.13.0+cpu, executorch 1.5.1):

    /work/exvenv/et/bin/python scripts/build_executorch.py build OUT [--dim 2048 --layers 4]
    /work/exvenv/et/bin/python scripts/build_executorch.py measure OUT [--convert]

``build`` exports an MLP of ``layers`` x Linear(dim, dim) with
``to_edge_transform_and_lower(torch.export.export(m, args), partitioner=[XnnpackPartitioner()]).to_executorch()``:
  xnnpack.pte            weights inside the program (XNNPACK named data in its segments)
  xnnpack_ext.pte/.ptd   the same with ExecutorchBackendConfig(external_constants=True): weights in a .ptd
  portable.pte           not delegated: portable kernels read the constant segment
  lora_a.pte, lora_b.pte + foundation.ptd  two programs (same frozen base, different adapters) whose base
                         weights are tagged external (one .ptd, written twice by the exporter: both copies must be
                         equal); adapters stay inside each program
``measure`` loads each with ``executorch.runtime`` (``load_program`` + ``load_method`` + one ``execute``) in fresh
processes started with ``MALLOC_MMAP_THRESHOLD_=1048576`` and prints PSS (``/proc/<pid>/smaps_rollup``) above an idle
process that imported the runtime: 1/2/4 programs in one process, 2 processes; ``--convert`` first converts each
with weightshare (``python -m weightshare convert``, the project venv) into OUT/converted and measures both side by
side, plus the outputs compared with ``np.array_equal`` at batch 1 and 8, and the converter's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROJECT_PYTHON = REPO / ".venv" / "bin" / "python"


def _mlp(dim: int, layers: int, seed: int):  # type: ignore[no-untyped-def]
    import torch

    torch.manual_seed(seed)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(dim, dim), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods[:-1]).eval()


def _lora(base, dim: int, seed: int):  # type: ignore[no-untyped-def]
    """A frozen base MLP plus a rank-8 adapter per layer (the LoRA shape: x @ A @ B added to each layer's output).
    Made here, not at import: the measuring parent must not hold torch (a forked child's peak RSS counts it)."""
    import torch

    class Lora(torch.nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.base = base
            g = torch.Generator().manual_seed(seed)
            n = sum(isinstance(m, torch.nn.Linear) for m in base)
            self.a = torch.nn.ParameterList(
                [torch.nn.Parameter(torch.randn(dim, 8, generator=g) * 0.01) for _ in range(n)]
            )
            self.b = torch.nn.ParameterList(
                [torch.nn.Parameter(torch.randn(8, dim, generator=g) * 0.01) for _ in range(n)]
            )

        def forward(self, x):  # type: ignore[no-untyped-def]
            k = 0
            for m in self.base:
                if isinstance(m, torch.nn.Linear):
                    x = m(x) + (x @ self.a[k]) @ self.b[k]
                    k += 1
                else:
                    x = m(x)
            return x

    return Lora()


def _export(model, dim: int, out: Path, name: str, delegate: bool, external, tag=None) -> None:  # type: ignore[no-untyped-def]
    """``tag``: node -> .ptd name for the weights the XNNPACK delegate reads (``delegate_external_constants_pass_
    unlifted``, as export_llama_lib does); ``external``: ``ExecutorchBackendConfig.external_constants``."""
    import torch
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes.external_constants_pass import delegate_external_constants_pass_unlifted

    args = (torch.randn(1, dim),)
    ep = torch.export.export(model, args)
    if tag is not None:
        module = ep.module()
        delegate_external_constants_pass_unlifted(module=module, gen_tag_fn=tag)
        ep = torch.export.export(module, args)
    t0 = time.perf_counter()
    edge = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()] if delegate else [])
    config = ExecutorchBackendConfig(external_constants=external) if external is not None else ExecutorchBackendConfig()
    prog = edge.to_executorch(config)
    (out / f"{name}.pte").write_bytes(prog.buffer)
    if prog._tensor_data:
        prog.write_tensor_data_to_file(str(out))
    print(
        f"{name}: {len(prog.buffer) / 2**20:.1f} MiB .pte, data files {sorted(prog._tensor_data)}, "
        f"{time.perf_counter() - t0:.1f} s",
        flush=True,
    )


def build(out: Path, dim: int, layers: int, only_xnnpack: bool = False) -> None:
    out.mkdir(parents=True, exist_ok=True)
    base = _mlp(dim, layers, 0)
    if only_xnnpack:  # the conversion's peak RSS on a large program
        _export(base, dim, out, "xnnpack", True, None)
        return
    if not (out / "xnnpack.pte").exists():
        _export(base, dim, out, "xnnpack", True, None)
    if not (out / "portable.pte").exists():
        _export(base, dim, out, "portable", False, None)
    ext = out / "ext"
    ext.mkdir(exist_ok=True)
    if not (ext / "xnnpack_ext.ptd").exists():

        def everything(node) -> str:  # type: ignore[no-untyped-def]
            return "xnnpack_ext"

        _export(base, dim, ext, "xnnpack_ext", True, everything, tag=everything)

    # LoRA-style: the base's weights tagged external, the adapters not (a callable picks the nodes); once with
    # portable kernels (lora/), once XNNPACK-delegated (xlora/).
    def base_only(node) -> str | None:  # type: ignore[no-untyped-def]
        return "foundation" if "base" in str(node.target) or "base" in node.name else None

    for folder, delegate in (("lora", False), ("xlora", True)):
        lora = out / folder
        lora.mkdir(exist_ok=True)
        for name, seed in (("lora_a", 1), ("lora_b", 2)):
            _export(_lora(base, dim, seed), dim, lora, name, delegate, base_only, tag=base_only if delegate else None)
            (lora / "foundation.ptd").rename(lora / f"foundation.{name}.ptd")
        pair = sorted(lora.glob("foundation.*.ptd"))
        same = pair[0].read_bytes() == pair[1].read_bytes()
        pair[0].rename(lora / "foundation.ptd")
        pair[1].unlink()
        print(f"{folder}: both programs wrote the same foundation.ptd: {same}; kept one", flush=True)


# ---------------------------------------------------------------- measuring (children)

_CHILD = r"""
import json, os, sys
import numpy as np
from executorch.runtime import Runtime
import torch

def pss():
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0

spec = json.loads(sys.argv[1])
rt = Runtime.get()
if spec["loader"]:
    sys.path.insert(0, spec["repo"])
    from weightshare.formats.executorch import program
base = pss()
held, outs, after = [], [], {}
for k, (pte, ptd) in enumerate(spec["programs"]):
    if spec["loader"]:
        p = program(pte, ptd)
    else:
        p = rt.load_program(pte, **({"data_path": ptd} if ptd else {}))
    m = p.load_method("forward")
    for seed in (1, 2, 3):
        x = torch.from_numpy(np.random.default_rng(seed).standard_normal((1, spec["dim"]), np.float32))
        y = m.execute([x])[0]
        if k == 0:
            outs.append(y.numpy().tobytes().hex())
    held.append((p, m))
    after[k + 1] = pss() - base
print(json.dumps({"base": base, "pss": pss(), "after": after, "outs": outs}), flush=True)
if spec["wait"]:
    sys.stdin.readline()
    print(json.dumps({"pss": pss()}), flush=True)
"""


def _env() -> dict[str, str]:
    return {**os.environ, "MALLOC_MMAP_THRESHOLD_": "1048576"}


def _spec(programs: list[tuple[Path, Path | None]], wait: bool, loader: bool, dim: int) -> str:
    listed = [(str(p), str(d) if d else None) for p, d in programs]
    return json.dumps({"programs": listed, "dim": dim, "wait": wait, "loader": loader, "repo": str(REPO)})


def _run(programs: list[tuple[Path, Path | None]], dim: int, loader: bool) -> dict:
    """One child loads ``programs`` in order: PSS above its idle baseline after each, outputs of the first."""
    spec = _spec(programs, False, loader, dim)
    out = subprocess.run([sys.executable, "-c", _CHILD, spec], capture_output=True, text=True, env=_env(), check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _two_processes(pte: Path, ptd: Path | None, dim: int, loader: bool) -> int:
    """PSS above each one's idle baseline, summed, while both hold one loaded program."""
    spec = _spec([(pte, ptd)], True, loader, dim)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, spec], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env()
        )
        for _ in range(2)
    ]
    firsts = [json.loads(p.stdout.readline()) for p in procs]  # type: ignore[union-attr]
    for p in procs:
        p.stdin.write("\n")  # type: ignore[union-attr]
        p.stdin.flush()  # type: ignore[union-attr]
    seconds = [json.loads(p.stdout.readline()) for p in procs]  # type: ignore[union-attr]
    for p in procs:
        p.wait()
    return sum(s["pss"] - f["base"] for f, s in zip(firsts, seconds))


def _convert(src: Path, out_dir: Path) -> tuple[float, float]:
    """weightshare convert in a child; (its peak RSS in MiB, from wait4, and seconds)."""
    t0 = time.perf_counter()
    child = subprocess.Popen(
        [str(PROJECT_PYTHON), "-m", "weightshare", "convert", str(src), "-o", str(out_dir)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
    )
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        raise SystemExit(f"weightshare convert {src} failed ({child.returncode})")
    return usage.ru_maxrss / 1024, time.perf_counter() - t0


CASES = [
    ("xnnpack", "xnnpack.pte", None),
    ("portable", "portable.pte", None),
    ("lora_a", "lora/lora_a.pte", "lora/foundation.ptd"),
    ("lora_b", "lora/lora_b.pte", "lora/foundation.ptd"),
    ("xlora_a", "xlora/lora_a.pte", "xlora/foundation.ptd"),
    ("xlora_b", "xlora/lora_b.pte", "xlora/foundation.ptd"),
]


def measure(out: Path, dim: int, convert: bool, only: list[str]) -> None:
    for label, pte_rel, ptd_rel in CASES:
        pte = out / pte_rel
        if not pte.exists() or (only and label not in only):
            continue
        ptd = out / ptd_rel if ptd_rel else None
        variants = [("original", pte, ptd, False)]
        if convert:
            conv = out / "converted" / Path(pte_rel).parent
            conv.mkdir(parents=True, exist_ok=True)
            peak, secs = _convert(pte, conv)
            print(f"{label}: converted in {secs:.1f} s, converter peak RSS {peak:.0f} MiB", flush=True)
            cptd = None
            if ptd is not None:
                cptd = conv / ptd.name
                if not cptd.exists():
                    _convert(ptd, conv)
            variants += [("converted", conv / pte.name, cptd, False), ("conv+loader", conv / pte.name, cptd, True)]
        outs = {}
        for name, p, d, loader in variants:
            run = _run([(p, d)] * 4, dim, loader)
            mib = [run["after"][str(n)] / 2**20 for n in (1, 2, 4)]
            two = _two_processes(p, d, dim, loader) / 2**20
            outs[name] = run["outs"]
            print(
                f"{label:9s} {name:11s} PSS 1/2/4 programs {mib[0]:6.1f} {mib[1]:6.1f} {mib[2]:6.1f} MiB "
                f"({mib[2] / mib[0]:.2f}x)  2 processes {two:6.1f} MiB ({two / mib[0]:.2f}x)",
                flush=True,
            )
        same = all(o == outs["original"] for o in outs.values())
        print(f"{label}: outputs of 3 inputs byte-identical across {sorted(outs)}: {same}", flush=True)
    for folder in ("lora", "xlora"):  # the pair: a, b, a, b over one foundation.ptd in one process
        if only and folder not in only:
            continue
        for name, base, loader in (
            ("original", out / folder, False),
            ("conv+loader", out / "converted" / folder, True),
        ):
            for f in ("lora_a.pte", "lora_b.pte", "foundation.ptd"):
                if not (base / f).exists():
                    base.mkdir(parents=True, exist_ok=True)
                    _convert(out / folder / f, base)
            ptd = base / "foundation.ptd"
            pair = [(base / "lora_a.pte", ptd), (base / "lora_b.pte", ptd)] * 2
            run = _run(pair, dim, loader)
            mib = [run["after"][str(n)] / 2**20 for n in (1, 2, 4)]
            print(
                f"{folder} pair {name:11s} PSS a / a+b / a+b+a+b {mib[0]:6.1f} {mib[1]:6.1f} {mib[2]:6.1f} MiB "
                f"({mib[1] / mib[0]:.2f}x, {mib[2] / mib[0]:.2f}x)",
                flush=True,
            )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["build", "measure"])
    ap.add_argument("out", type=Path)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--convert", action="store_true")
    ap.add_argument("--only-xnnpack", action="store_true", help="build: only the XNNPACK program")
    ap.add_argument("--only", default="", help="measure: these cases (comma-separated labels)")
    a = ap.parse_args()
    if a.what == "build":
        build(a.out, a.dim, a.layers, a.only_xnnpack)
    else:
        measure(a.out, a.dim, a.convert, [c for c in a.only.split(",") if c])


if __name__ == "__main__":
    main()
