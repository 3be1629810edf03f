"""verify on TFLite models as the converters write them: signature names that are not the tensors' names, and a
two-signature LM (prefill + decode over one copy of the weights, KV cache in and out, int32 tokens into GATHER).

Before: `verify` drew token ids for the decode signature from [-100, 100) (the op list it read was the primary
subgraph's only) and LiteRT's GATHER refused them; `--decode-steps` refused TFLite; `--input` fed one file to both
signatures. Under test: `weightshare verify` and the library `verify` on the converter-style fixtures. After: exit 0
with no hand inputs, a prefill + 4 decode steps compared bit for bit, a weight read only by decode fails it.
"""

from __future__ import annotations

import numpy as np
import pytest
from tflite_fixtures import keras_style_model, two_signature_lm

from weightshare._verify import verify
from weightshare.api import convert
from weightshare.options import ConvertOptions

pytest.importorskip("ai_edge_litert")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("signatures")
    out = {}
    for name, build in (("keras", keras_style_model), ("lm", two_signature_lm)):
        src = build(root / f"{name}.tflite")
        convert(src, root / "plain", ConvertOptions())
        convert(src, root / "prepack", ConvertOptions(prepack=True))
        out[name] = (src, root / "plain" / src.name, root / "prepack" / src.name)
    # the same LM but for the decode signature's own constant (its mask): the weights both signatures share are
    # the same bytes, so only decode can tell the two apart
    (root / "other").mkdir()
    other = two_signature_lm(root / "other" / "lm.tflite", decode_mask_seed=99)
    convert(other, root / "other_out", ConvertOptions())
    out["changed"] = (out["lm"][0], root / "other_out" / "lm.tflite", None)
    return out


def test_signature_bounds_of_each_signature(models):
    from weightshare._runtimes.litert import signature_bounds

    src = models["lm"][0]
    assert signature_bounds(str(src)) == {
        "prefill": {"tokens": 2048, "input_pos": 32},
        "decode": {"tokens": 2048, "input_pos": 32},
    }


@pytest.mark.parametrize("name", ["keras", "lm"])
@pytest.mark.parametrize("variant", [1, 2], ids=["plain", "prepack"])
def test_verify_passes_without_hand_inputs(cli, models, name, variant):
    src, converted = models[name][0], models[name][variant]
    res = cli("verify", src, converted, "--runs", "2")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "compared with the original" not in res.stdout  # TFLite compares outputs, not payloads
    expected_paths = 3 if variant == 2 else 2
    assert res.stdout.count("LiteRT") == expected_paths, res.stdout


def test_decode_steps_on_the_lm(models):
    src, plain, prepack = models["lm"]
    for converted, paths in ((plain, 2), (prepack, 3)):
        report = verify(src, converted, runs=1, decode_steps=4)
        assert report.passed, report.mismatches
        assert report.decode_steps == 4 and len(report.paths) == paths, report.paths
        # per path: 2 signatures x 3 outputs in the run, then 3 outputs in each of the 5 chain steps
        assert report.outputs_compared == paths * (6 + 5 * 3)


def test_a_weight_only_decode_reads_fails_verify(cli, models):
    src, changed, _ = models["changed"]
    res = cli("verify", src, changed, "--runs", "1", "--decode-steps", "4")
    assert res.returncode == 1, res.stdout + res.stderr
    fails = [ln for ln in res.stdout.splitlines() if ln.startswith("FAIL:")]
    assert fails and all("decode:'logits'" in ln for ln in fails), fails


def test_decode_steps_chain_catches_the_decode_weight(models):
    """The chain alone (given tokens for the runs would not matter): its first decode step differs."""
    from weightshare._runtimes.litert import MODES, entry_points, open_mode
    from weightshare._verify import VerifyReport
    from weightshare.formats.tflite.decode import plan, run_chain

    src, changed, _ = models["changed"]
    ea = dict(entry_points(open_mode(str(src), MODES[0]), str(src)))
    eb = dict(entry_points(open_mode(str(changed), MODES[0]), str(changed)))
    lm = plan(ea, src)
    assert (lm.prefill, lm.decode, lm.kv, lm.positions, lm.tokens, lm.logits) == (
        "prefill",
        "decode",
        ("kv_cache_k_0", "kv_cache_v_0"),
        "input_pos",
        "tokens",
        "logits",
    )
    report = VerifyReport(str(src), str(changed), "tflite")
    opts = {"decode_steps": 4, "inputs": {}, "shapes": {}, "dims": {}, "seed": 0}
    run_chain(report, "no delegate", lm, ea, eb, opts, count=True)
    assert report.mismatches and all("decode step 1" in m for m in report.mismatches), report.mismatches
    assert report.decode_steps == 0  # the prefill matched, the first decode step did not


def test_decode_steps_refusals(cli, models):
    src, plain, _ = models["keras"]
    res = cli("verify", src, plain, "--decode-steps", "2")
    assert res.returncode == 2 and "nothing to decode" in res.stderr, res.stderr
    src, plain, _ = models["lm"]
    res = cli("verify", src, plain, "--decode-steps", "40")
    assert res.returncode == 2 and "at most 24 steps" in res.stderr, res.stderr


def test_input_per_signature(cli, models, tmp_path):
    """--input SIGNATURE:NAME=FILE reaches that signature only; an input no signature takes is refused."""
    import weightshare._runtimes.litert as L

    src, plain, _ = models["lm"]
    prompt, token = np.arange(8, dtype=np.int32).reshape(1, 8) + 100, np.array([[7]], np.int32)
    given = {"prefill:tokens": prompt, "decode:tokens": token}
    entries = dict(L.entry_points(L.open_mode(str(src), L.MODES[0]), str(src)))
    assert np.array_equal(entries["prefill"].feeds(0, given)["tokens"], prompt)
    assert np.array_equal(entries["decode"].feeds(0, given)["tokens"], token)
    assert entries["decode"].feeds(0, {"tokens": token})["tokens"] is token  # NAME alone: every signature
    assert verify(src, plain, runs=1, inputs=given).passed
    np.save(tmp_path / "t.npy", token)
    res = cli("verify", src, plain, "--input", f"decode:tokenz={tmp_path / 't.npy'}")
    assert res.returncode == 2 and "decode:tokens" in res.stderr and len(res.stderr.strip().splitlines()) == 1
