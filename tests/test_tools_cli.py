"""CLI conventions: --version, -q/-v, batch lines, one JSON document, help everywhere, width, colour, hints, demo
cleanup, and a peak RSS that is the converter's own.

Under test: `weightshare ...` in child processes (a pipe, as in CI; a pseudo-terminal for colour).
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

import numpy as np
import onnx
import pytest
import typer.core
import typer.main
from onnx import TensorProto, helper, numpy_helper

from weightshare import __version__
from weightshare._samples import mlp_onnx
from weightshare.cli import app

ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    return mlp_onnx(d / "a.onnx", layers=1, dim=256), mlp_onnx(d / "b.onnx", layers=2, dim=128, seed=1)


def test_version(cli):
    res = cli("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"weightshare {__version__}"


@pytest.mark.slow
def test_quiet_convert_prints_nothing_and_batch_prints_one_line_per_model(two, cli, tmp_path):
    a, b = two
    res = cli("convert", a, "-o", tmp_path / "q", "-q")
    assert res.returncode == 0 and res.stdout == "" and res.stderr == ""
    res = cli("-q", "convert", a, "-o", tmp_path / "q2")
    assert res.returncode == 0 and res.stdout == ""
    res = cli("convert", a, b, "-o", tmp_path / "batch")
    lines = res.stdout.strip().splitlines()
    assert res.returncode == 0 and len(lines) == 3, res.stdout
    assert lines[0].startswith(f"{a}: ") and lines[1].startswith(f"{b}: ") and lines[2].startswith("total: 2 models")
    res = cli("convert", a, b, "-o", tmp_path / "json", "--json")
    doc = json.loads(res.stdout)  # one document
    assert [Path(m["model"]).name for m in doc["reports"]] == ["a.onnx", "b.onnx"]
    assert all(m["tensors_moved"] > 0 and m["folder"] is None for m in doc["reports"])
    res = cli("-v", "convert", a, b, "-o", tmp_path / "verbose")
    assert res.stdout.count("payloads moved") >= 4  # a table per model, then the lines


def test_every_option_has_help():
    group = typer.main.get_command(app)
    missing = [
        f"{name} {p.opts}"
        for name, cmd in [("", group), *group.commands.items()]
        for p in cmd.params
        if isinstance(p, typer.core.TyperOption) and not (p.help or "").strip()
    ]
    assert missing == []


def test_unpack_accepts_only_implemented_values(two, cli, tmp_path):
    """`--unpack int8` was accepted and implemented nowhere: a usage error naming the values each format declares."""
    res = cli("convert", two[0], "-o", tmp_path / "out", "--unpack", "int8", env={"COLUMNS": "200"})
    assert res.returncode == 2 and not (tmp_path / "out").exists()
    assert res.stderr.strip() == (
        "weightshare: error: unknown --unpack value int8: no registered format declares it "
        "(tflite: 'sparse', 'dequantize'; onnx: 'ort-cpu')"
    ), res.stderr


@pytest.mark.slow
def test_help_paragraphs_wrap_cleanly(cli):
    """Docstring paragraphs are reflowed: no ragged lines holding one word of a sentence that goes on."""
    for command in ["", "convert", "merge", "inspect", "check", "verify", "bench", "demo"]:
        res = cli(*([command] if command else []), "--help", env={"COLUMNS": "80"})
        assert res.returncode == 0, res.stderr
        text = res.stdout.split("╭", 1)[0]
        ragged = [
            line for line in text.splitlines() if len(line.split()) == 1 and not line.strip().endswith((".", ":"))
        ]
        assert ragged == [], (command, ragged)


@pytest.mark.slow
def test_tables_are_not_cut_at_80_columns_in_a_pipe(cli, tmp_path):
    name = "encoder.layers.11.self_attention.query_key_value.weight_with_a_long_exporter_generated_suffix_0123456789"
    w = numpy_helper.from_array(np.ones((64, 64), np.float32), name)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", name], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "long.onnx"))
    res = cli("inspect", tmp_path / "long.onnx")
    assert res.returncode == 0 and name in res.stdout and "…" not in res.stdout
    assert max(len(line) for line in res.stdout.splitlines()) > 120
    assert not ANSI.search(res.stdout)  # a pipe: no colour


def _in_terminal(args: list[str], env: dict) -> str:
    """Run the CLI with stdout/stderr on a pseudo-terminal; return what it wrote."""
    leader, follower = pty.openpty()
    # a terminal has a size (a new pty has 0 x 0, and tqdm draws nothing in 0 columns)
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "weightshare", *args],
        stdout=follower,
        stderr=follower,
        env={**os.environ, "TERM": "xterm-256color", **env},
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=60)
    os.close(leader)
    return b"".join(chunks).decode("utf-8", "replace")


@pytest.mark.slow
def test_colour_only_on_a_terminal_and_never_with_no_color(two):
    a, _ = two
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    coloured = _in_terminal(["inspect", str(a)], {**env, "COLUMNS": "200"})
    assert ANSI.search(coloured), coloured[:300]
    plain = _in_terminal(["inspect", str(a)], {"NO_COLOR": "1", "COLUMNS": "200"})
    assert "payload" in plain and not ANSI.search(plain), plain[:300]


def test_bench_plot_without_matplotlib_is_a_one_line_hint(two, cli, tmp_path):
    a, _ = two
    fake = tmp_path / "site"
    (fake / "matplotlib").mkdir(parents=True)
    (fake / "matplotlib" / "__init__.py").write_text("raise ImportError('No module named matplotlib')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(fake), os.environ.get("PYTHONPATH", "")])}
    res = cli("bench", a, "--plot", tmp_path / "p.png", env=env)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip().splitlines() == [
        'weightshare: error: --plot needs matplotlib: pip install "weightshare[plot]"'
    ]


def test_demo_clean_removes_only_what_the_demo_wrote(cli, tmp_path):
    """Before: --clean removed any mlp_fp16.onnx, converted/ and prepacked/ in --dir, a user's own included, and
    the demo wrote its model over a user's mlp_fp16.onnx. Now: only what the outputs records prove it wrote."""
    from weightshare._demo import clean_demo

    demo = tmp_path / "demo"
    (demo / "converted").mkdir(parents=True)
    (demo / "mlp_fp16.onnx").write_bytes(b"x")  # named like the demo's files, written by nobody's demo
    (demo / "converted" / "mlp_fp16.onnx").write_bytes(b"x")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "e.txt").write_text("outside")
    (demo / "prepacked").symlink_to(elsewhere)
    res = cli("demo", "--clean", "--dir", demo)
    assert res.returncode == 0 and "nothing the demo wrote to remove" in res.stdout, res.stdout
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "demo",
        "demo/converted",
        "demo/converted/mlp_fp16.onnx",
        "demo/mlp_fp16.onnx",
        "demo/prepacked",
        "elsewhere",
        "elsewhere/e.txt",
    ]
    # the demo itself refuses to write over the user's model of that name, in one line
    (demo / "prepacked").unlink()  # (a link there is refused first: tests/test_envelope.py)
    res = cli("demo", "--dir", demo, "--layers", "1", "--sessions", "1")
    assert res.returncode == 2 and "mlp_fp16.onnx: exists, and no weightshare record" in res.stderr, res.stderr
    assert (demo / "mlp_fp16.onnx").read_bytes() == b"x"
    # what a demo run wrote goes, the user's files beside it stay (the conversion steps alone: no sessions needed)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    (mine / "converted").mkdir()
    (mine / "converted" / "user.txt").write_text("keep me too")
    from weightshare import api
    from weightshare._atomic import OutputTransaction
    from weightshare._outputs_record import run_key
    from weightshare._replacement import attach
    from weightshare._samples import mlp_onnx

    with OutputTransaction() as tx:  # as run_demo writes its model
        record = attach(tx, mine, 0, [])
        mlp_onnx(tx.new_file(mine / "mlp_fp16.onnx"), layers=1, dim=64)
        record.add(run_key("demo", [mine / "mlp_fp16.onnx"]), tx.finals(), [])
    api.convert(mine / "mlp_fp16.onnx", mine / "converted")
    (mine / "converted" / "edited.onnx").write_bytes(b"y")
    removed, kept = clean_demo(mine)
    assert removed and kept == [], kept
    assert sorted(p.relative_to(mine).as_posix() for p in mine.rglob("*")) == [
        "converted",
        "converted/edited.onnx",
        "converted/user.txt",
        "notes.txt",
    ]


@pytest.mark.slow
def test_demo_says_where_it_writes_and_how_much(cli, tmp_path):
    demo = tmp_path / "d"
    res = cli("-v", "demo", "--dir", demo, "--layers", "1", "--sessions", "2")
    assert res.returncode == 0, res.stderr
    first = res.stdout.splitlines()[0]
    assert first.startswith("writing about 56.0 MiB to ") and str(demo) in first and "--clean" in first
    written = sum(p.stat().st_size for p in demo.rglob("*") if p.is_file())
    assert 55 << 20 < written < 57 << 20, written
    # in a pipe with -v, the stages of its half minute of work are named on stderr (stdout stays the report)
    stages = [line for line in res.stderr.splitlines() if line.endswith(" ...")]
    assert stages[0].startswith("building ") and any(s.startswith("converting with --prepack") for s in stages)
    assert cli("demo", "--clean", "--dir", demo).returncode == 0 and not demo.exists()


PARENT = r"""
import json, subprocess, sys
import numpy as np
ballast = np.ones(300 << 18, np.float32)  # 300 MiB resident in the parent
res = subprocess.run([sys.executable, "-m", "weightshare", "convert", sys.argv[1], "-o", sys.argv[2], "--json"],
                     capture_output=True, text=True)
print(res.stdout)
"""


@pytest.mark.slow
def test_report_peak_rss_is_the_converters_own_not_its_parents(two, tmp_path):
    a, _ = two
    res = subprocess.run([sys.executable, "-c", PARENT, str(a), str(tmp_path / "o")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    peak = json.loads(res.stdout)["reports"][0]["peak_rss_mib"]
    assert 10 < peak < 250, peak  # ru_maxrss would report the parent's 300+ MiB


@pytest.mark.slow
def test_global_flags_work_after_the_command_too(two, cli, tmp_path):
    """`-v`/`-q` go before or after the command (`weightshare convert -v ...` was "No such option: -v")."""
    after = cli("convert", two[0], "-o", tmp_path / "a", "-v")
    before = cli("-v", "convert", two[0], "-o", tmp_path / "b")
    assert after.returncode == before.returncode == 0, after.stderr
    # the same report either way, up to the figures (time, peak RSS) and the output path
    same = [
        re.sub(r"[\d.]+|\s+", "", r.stdout.replace(str(tmp_path / d), "OUT")) for r, d in ((after, "a"), (before, "b"))
    ]
    assert same[0] == same[1]
    quiet = cli("inspect", two[0], "--no-measure", "-q")
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    # after `--`, a -v is an argument, not a flag: here a file name that does not exist
    res = cli("inspect", "--", "-v")
    assert res.returncode == 2 and "-v" in res.stderr and "no such file" in res.stderr


@pytest.mark.slow
def test_prepack_on_a_terminal_names_its_onnxruntime_phase(tmp_path):
    """The bar sat at 0.00B through the onnxruntime child (most of a --prepack run): its phase is named now."""
    from weightshare._samples import mlp_onnx

    src = mlp_onnx(tmp_path / "m.onnx", layers=2, dim=256, weights="float32")
    shown = _in_terminal(["convert", str(src), "-o", str(tmp_path / "out"), "--prepack"], {"COLUMNS": "200"})
    assert "onnxruntime optimizes and packs the weights" in shown, shown
    assert (tmp_path / "out" / "m.onnx").is_file()
