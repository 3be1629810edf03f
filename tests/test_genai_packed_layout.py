"""A genai-builder int4 folder converted with `--prepack` at DEFAULT options shares its packed weights.

Before: the packed MatMulNBits buffers of such a folder (each below 1 MiB) went into the blob at 64-byte offsets.
onnxruntime maps a saved pre-packed buffer only when its address is aligned (1.32 on x86-64: 256 bytes; found with
strace: unaligned buffers are pread into a per-session heap copy), so 4 og.Models of the builder's real output
cost 1.58x one, 4 sessions the same (scripts/bench_genai.py --folder). Under test: `convert --prepack` with no
layout option on the structure the model builder writes for a small Llama (`-p int4 -e cpu`: fused qkv_proj
MatMulNBits into GroupQueryAttention's packed QKV input, K=512 / N=768, 512, 1536 and K=1536 / N=512, bits 4,
block 32, accuracy_level 4, 2-D scales, int4 lm_head). After: every packed buffer is page-aligned in the blob
(so the mapping ORT makes is page-aligned too), each default-option session past the first adds what the runtime
keeps of its own, not the packed weights the original's sessions copy (data PSS, CPU arena off,
MALLOC_MMAP_THRESHOLD_=1048576), and genai generates the original's tokens and logits.
"""

from __future__ import annotations

import genai_model as gm
import onnx
import pytest

from weightshare.formats.onnx.ort.prepack import PACKED_ALIGN

ort = pytest.importorskip("onnxruntime")

MiB = 1 << 20


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from conftest import run_cli

    d = tmp_path_factory.mktemp("genai-layout")
    src = gm.genai_folder(d / "src", mib=12, seed=1)
    out = d / "out"
    res = run_cli("convert", src, "-o", out, "-q", "--prepack")
    assert res.returncode == 0, res.stderr
    return src, out


def _packed_buffers(model) -> list[tuple[str, int, int]]:
    """(tensor, offset, size) of every buffer a ``prepacked_N`` entry names."""
    found = []
    for t in onnx.load(str(model), load_external_data=False).graph.initializer:
        for e in t.external_data:
            if e.key.startswith("prepacked_"):
                for part in e.value.split("|")[1:]:
                    offset, size = (int(x) for x in part.split(";")[:2])
                    found.append((t.name, offset, size))
    return found


def test_the_fixture_has_the_builders_structure(converted):
    src, _ = converted
    m = onnx.load(str(src / "model.onnx"), load_external_data=False)
    nbits = [n for n in m.graph.node if n.op_type == "MatMulNBits"]
    attrs = {(a.name, onnx.helper.get_attribute_value(a)) for n in nbits for a in n.attribute}
    assert {("bits", 4), ("block_size", 32), ("accuracy_level", 4)} <= attrs
    assert {("N", 768), ("K", 1536), ("N", 2048)} <= attrs  # fused qkv (8 + 2 * 2 heads of 64), down, lm_head
    gqa = [n for n in m.graph.node if n.op_type == "GroupQueryAttention"]
    assert gqa and all(list(n.input[1:3]) == ["", ""] for n in gqa)  # packed QKV


def test_default_layout_puts_every_packed_buffer_on_a_page(converted):
    _, out = converted
    packed = _packed_buffers(out / "model.onnx")
    assert len(packed) >= 16
    # Their sizes are not page multiples: alignment here does not come from the buffers' own sizes.
    assert all(size % 256 for _, _, size in packed)
    assert [(name, off) for name, off, _ in packed if off % PACKED_ALIGN] == []
    assert PACKED_ALIGN % 4096 == 0  # a mapping starts on a page: the address is as aligned as the offset


@pytest.mark.slow  # child processes measuring memory
def test_four_default_sessions_cost_what_one_does(converted):
    from weightshare._runtimes.ort import measure_sessions
    from weightshare.formats.onnx.measure import MALLOC_ENV

    src, out = converted

    def per_session(model) -> float:
        """MiB each of sessions 2-4 adds to the first (data PSS: what one process's libraries weigh, which moves
        with whatever else maps them, is no part of it)."""
        rows = {r["sessions"]: r for r in measure_sessions(str(model), [1, 4], share=False, env=MALLOC_ENV)}
        return (rows[4]["data_pss_mib"] - rows[1]["data_pss_mib"]) / 3

    packed = sum(size for _n, _o, size in _packed_buffers(out / "model.onnx")) / MiB
    original, shared = per_session(src / "model.onnx"), per_session(out / "model.onnx")
    # the original's sessions each pre-pack every packed weight again; the converted model's map the blob's, and
    # keep only the runtime's own state (1.2-2.0 MiB per session measured): not a quarter of the packed bytes more
    assert original - shared >= 0.5 * packed, (original, shared, packed)
    assert shared <= 0.25 * packed + 2.5, (shared, packed)


@pytest.mark.slow
def test_genai_generates_the_originals_tokens(converted):
    import numpy as np

    pytest.importorskip("onnxruntime_genai")
    src, out = converted
    for prompt in ([1, 5, 7, 9, 11], [3, 200, 17, 2000]):
        tokens_a, logits_a = gm.generate(src, prompt, 8)
        tokens_b, logits_b = gm.generate(out, prompt, 8)
        assert tokens_a == tokens_b
        assert all(np.array_equal(a, b) for a, b in zip(logits_a, logits_b, strict=True))
