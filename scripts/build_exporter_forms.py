"""Build the forms real exporters write, from random configs, offline (run with an exporter venv, not the project's).

    /work/exvenv/torch-genai/bin/python scripts/build_exporter_forms.py OUTDIR [FORM ...]
    /work/exvenv/optimum/bin/python scripts/build_exporter_forms.py OUTDIR optimum-whisper optimum-vit

Each form needs its exporter's venv (``VENVS``; optimum-onnx pins transformers 4.57, onnxruntime-genai's builder
needs 5.x): run the script with that venv's python, once per venv; a form asked of the wrong venv is refused
with the venv it needs.

Forms (each in OUTDIR/FORM; a form already built is kept):
  genai-int4   onnxruntime-genai's model builder, ``-p int4 -e cpu`` on a random Llama config with a tokenizer
               trained here: GroupQueryAttention, MatMulNBits (bits 4, block 32, accuracy_level 4)
  genai-fp32   the same builder, ``-p fp32 -e cpu``
  dynamo-fp32  ``torch.onnx.export(..., dynamo=True)`` of a random Qwen3 decoder (GQA, 8 layers of 512, vocab
               4096), weights in model.onnx.data
  dynamo-fp16  the same after ``model.to(torch.float16)``
  dynamo-fp16-wide  the same at Qwen3-0.6B's widths (hidden 1024, MLP 3072, 16 heads of 128, 8 KV heads), 8 layers
  vit-fp16     a random ViT-S/16 (12 layers of 384) exported with ``torch.onnx.export(dynamo=True)``, then
               ``python -m onnxruntime.transformers.optimizer --model_type vit --float16``
  vit-fp16-base  the same at ViT-B/16's widths (12 layers of 768, MLP 3072, 12 heads)
  optimum-whisper  optimum-onnx's ``main_export(task="automatic-speech-recognition-with-past")`` of a random
               Whisper (d_model 256, 2+2 layers, 80 mel bins, 1500 source positions, vocab 4096):
               encoder_model.onnx, decoder_model_merged.onnx (If on use_cache_branch), config.json
  optimum-t5   optimum-onnx's ``main_export(task="text2text-generation-with-past")`` of a random T5 at t5-small's
               shapes (d_model 512, 6+6 layers, d_ff 2048, 8 heads, vocab 32128): encoder_model.onnx,
               decoder_model.onnx, decoder_with_past_model.onnx, decoder_model_merged.onnx (the three decoders hold
               the same weights), config.json and generation_config.json as optimum writes them
  optimum-t5-base  the same at t5-base's shapes (d_model 768, 12+12 layers, d_ff 3072, 12 heads)
  optimum-bart  the same task on a random BART (d_model 512, 6+6 layers, FFN 2048, 8 heads, vocab 16000)
  optimum-marian  the same task on a random Marian (opus-mt's widths: d_model 512, 6+6 layers, FFN 2048, 8 heads;
               vocab 16000)
  genai-phi3-int4 / genai-qwen2-int4 / genai-gemma2-int4 / genai-qwen2-fp32  the genai builder on random Phi-3
               (hidden 768, 6 layers, 12 heads), Qwen2 (hidden 896, 6 layers, 14 heads, 2 KV heads) and Gemma2
               (hidden 768, 6 layers, 4 heads of 256, 2 KV heads, a window of 8, soft-capping, tied embedding)
               configs, the tokenizer trained here
  bert-int8    optimum's ``feature-extraction`` export of a random BERT at bert-base's shapes (12 layers of 768,
               vocab 30522), ``python -m onnxruntime.transformers.optimizer --model_type bert``, then
               ``quantize_dynamic(weight_type=QInt8)``: one model.onnx, weights embedded
  bert-qdq     the same export (before the optimizer: the quantizer cannot type the fused ops' outputs, so it
               would leave every activation in float) through ``quant_pre_process`` and ``quantize_static`` (QDQ,
               QInt8 activations and weights, MinMax on 4 random batches)
  matmul-conv  no exporter: a 456 MiB fp32 Conv stem + MLP (tests/prepack_samples.mixed_onnx: 2 Conv 3x3 of 256
               channels, a 256 x 4096 projection, 7 Gemm/MatMul of 4096 x 4096), weights in model.data
  optimum-vit  optimum-onnx's ``main_export(task="feature-extraction")`` of a random ViT (384 wide, 4 layers,
               224 x 224, patch 16): model.onnx with pixel_values [batch_size, num_channels, height, width]
Each form's folder gets ``form.json``: the model file name and its inputs' example shapes (for the benchmark).
See ../shared/EXPORTERS.md for the venvs; the optimum one here: ``python3.11 -m venv``, then ``pip install`` the
CPU torch 2.13.0 wheel, ``optimum-onnx==0.1.0`` (it brings transformers 4.57) and ``onnxruntime==1.32.0``.
Weights are random (seeded); nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

FORMS = (
    "genai-int4", "genai-fp32", "dynamo-fp32", "dynamo-fp16", "vit-fp16", "dynamo-fp16-wide", "vit-fp16-base",
    "optimum-whisper", "optimum-vit", "optimum-t5", "optimum-t5-base", "optimum-bart", "optimum-marian",
    "genai-phi3-int4", "genai-qwen2-int4", "genai-gemma2-int4", "genai-qwen2-fp32", "bert-int8", "bert-qdq",
    "matmul-conv",
)  # fmt: skip
# Where the venvs live differs between machines: WS_EXVENV_TORCH_GENAI / WS_EXVENV_OPTIMUM name them (only the
# refusal line prints them; the check is that this python imports the module).
_TORCH_GENAI = os.environ.get("WS_EXVENV_TORCH_GENAI", "/work/exvenv/torch-genai")
_OPTIMUM = os.environ.get("WS_EXVENV_OPTIMUM", "/work/exvenv/optimum")
VENVS = {  # form prefix -> the venv (../shared/EXPORTERS.md) and a module only that venv has
    "genai-": (_TORCH_GENAI, "onnxruntime_genai"),
    "dynamo-": (_TORCH_GENAI, "torch"),
    "vit-": (_TORCH_GENAI, "torch"),
    "optimum-": (_OPTIMUM, "optimum.exporters.onnx"),
    "bert-": (_OPTIMUM, "optimum.exporters.onnx"),
    "matmul-": (_OPTIMUM, "onnx"),  # any venv with onnx: built in code, no exporter
}

# Big enough that per-session copies stand out from a session's own state; every MatMulNBits buffer stays below
# 1 MiB, so the default layout (64 KiB alignment from 1 MiB on, 64 bytes below) puts them at small alignments.
LLAMA = {
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 4096,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}


def _tokenizer(hf: Path, vocab: int) -> None:
    """A byte-level BPE trained on a few lines of text, saved beside the config (the genai builder copies it)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<pad>", "<s>", "</s>", "<unk>"])
    corpus = [f"sentence {i} about weights, sessions and shared pages number {i * 7 % 13}" for i in range(2000)]
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.save_pretrained(hf)


def _hf_llama(d: Path) -> Path:
    """A random LlamaForCausalLM in HF layout plus a tokenizer trained on a few lines of text."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = d / "hf"
    if (hf / "config.json").exists():
        return hf
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA, bos_token_id=1, eos_token_id=2, pad_token_id=0))
    model.save_pretrained(hf)
    _tokenizer(hf, LLAMA["vocab_size"])
    return hf


_SPECIAL = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
# Gemma2's window is 8 tokens: genai refuses a KV cache shorter than the window, and the benchmarks generate
# 8 to 17 tokens (so the window is crossed).
ARCHS = {  # small configs of the architectures the genai builder has its own code for
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        hidden_size=768, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=12, num_key_value_heads=12,
        vocab_size=4096, max_position_embeddings=512, original_max_position_embeddings=512, tie_word_embeddings=False,
    )),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        hidden_size=896, intermediate_size=2432, num_hidden_layers=6, num_attention_heads=14, num_key_value_heads=2,
        vocab_size=4096, max_position_embeddings=512, tie_word_embeddings=False,
    )),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        hidden_size=768, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
        head_dim=256, query_pre_attn_scalar=256, sliding_window=8, vocab_size=4096, max_position_embeddings=512,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, tie_word_embeddings=True,
    )),
}  # fmt: skip


def _hf_arch(d: Path, arch: str) -> Path:
    """A random model of ``arch`` (a key of ARCHS) in HF layout plus the trained tokenizer."""
    import torch
    import transformers

    hf = d / "hf"
    if (hf / "config.json").exists():
        return hf
    config_cls, model_cls, cfg = ARCHS[arch]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**cfg, **_SPECIAL))
    model.save_pretrained(hf)
    _tokenizer(hf, cfg["vocab_size"])
    return hf


def genai(d: Path, precision: str, arch: str = "llama") -> dict:
    hf = _hf_llama(d.parent / "_llama") if arch == "llama" else _hf_arch(d.parent / f"_{arch}", arch)
    out = d / "model"
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out)]
    cmd += ["-p", precision, "-e", "cpu", "-c", str(d / "cache")]
    subprocess.run(cmd, check=True)
    shutil.rmtree(d / "cache", ignore_errors=True)
    return {"kind": "genai", "folder": "model", "model": "model/model.onnx"}


def _qwen3(dtype: str, wide: bool = False):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    widths = (
        dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8, head_dim=128)
        if wide  # Qwen3-0.6B's
        else dict(hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=2, head_dim=64)
    )
    cfg = Qwen3Config(
        **widths, num_hidden_layers=8, vocab_size=4096, max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip
    model = Qwen3ForCausalLM(cfg).eval()
    return model.to(torch.float16) if dtype == "fp16" else model


class _Decoder:
    """Plain-tensor wrapper: the exporter sees input_ids / attention_mask / position_ids only (prefill)."""

    def __new__(cls, model):
        import torch

        class Wrapped(torch.nn.Module):
            def __init__(self, m):
                super().__init__()
                self.m = m

            def forward(self, input_ids, attention_mask, position_ids):
                out = self.m(
                    input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
                )
                return out.logits

        return Wrapped(model)


def dynamo(d: Path, dtype: str, wide: bool = False) -> dict:
    import torch

    model = _Decoder(_qwen3(dtype, wide))
    batch, seq = 2, 16
    args = (
        torch.randint(3, 4000, (batch, seq)),
        torch.ones(batch, seq, dtype=torch.int64),
        torch.arange(seq).expand(batch, seq).contiguous(),
    )
    b, s = torch.export.Dim("batch", max=64), torch.export.Dim("seq", max=256)
    dims = {"input_ids": {0: b, 1: s}, "attention_mask": {0: b, 1: s}, "position_ids": {0: b, 1: s}}
    d.mkdir(parents=True, exist_ok=True)
    torch.onnx.export(
        model, args, str(d / "model.onnx"), dynamo=True, external_data=True, dynamic_shapes=dims,
        input_names=["input_ids", "attention_mask", "position_ids"], output_names=["logits"],
    )  # fmt: skip
    return {"kind": "decoder", "model": "model.onnx"}


def vit(d: Path, base: bool = False) -> dict:
    import torch
    from transformers import ViTConfig, ViTModel

    torch.manual_seed(0)
    hidden, heads = (768, 12) if base else (384, 6)  # ViT-B/16's widths, or ViT-S/16's
    cfg = ViTConfig(
        hidden_size=hidden, num_hidden_layers=12, num_attention_heads=heads, intermediate_size=4 * hidden,
        image_size=224, patch_size=16,
    )  # fmt: skip
    model = ViTModel(cfg, add_pooling_layer=False).eval()

    class Wrapped(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, pixel_values):
            return self.m(pixel_values=pixel_values).last_hidden_state

    d.mkdir(parents=True, exist_ok=True)
    raw = d / "raw.onnx"
    torch.onnx.export(
        Wrapped(model), (torch.randn(2, 3, 224, 224),), str(raw), dynamo=True, external_data=True,
        dynamic_shapes={"pixel_values": {0: torch.export.Dim("batch", max=64)}},
        input_names=["pixel_values"], output_names=["last_hidden_state"],
    )  # fmt: skip
    cmd = [sys.executable, "-m", "onnxruntime.transformers.optimizer", "--input", str(raw), "--output"]
    cmd += [str(d / "model.onnx"), "--model_type", "vit", "--num_heads", str(heads), "--hidden_size", str(hidden)]
    cmd += ["--float16"]
    cmd += ["--use_external_data_format"]
    subprocess.run(cmd, check=True)
    for f in d.glob("raw.onnx*"):
        f.unlink()
    for f in d.iterdir():
        os.chmod(f, 0o644)  # the optimizer writes its .data with mode 0600
    return {"kind": "vision", "model": "model.onnx"}


def optimum(d: Path, form: str) -> dict:
    """optimum-onnx's main_export of a random Whisper or ViT saved in HF layout (weights random, seeded)."""
    import torch
    from optimum.exporters.onnx import main_export

    torch.manual_seed(0)
    hf = d / "hf"
    if form == "optimum-whisper":
        from transformers import WhisperConfig, WhisperForConditionalGeneration

        cfg = WhisperConfig(
            d_model=256, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
            encoder_ffn_dim=1024, decoder_ffn_dim=1024, num_mel_bins=80, max_source_positions=1500,
            max_target_positions=448, vocab_size=4096, decoder_start_token_id=1, pad_token_id=0, eos_token_id=2,
            bos_token_id=1,
        )  # fmt: skip
        WhisperForConditionalGeneration(cfg).eval().save_pretrained(hf)
        main_export(str(hf), str(d), task="automatic-speech-recognition-with-past", no_post_process=False)
        info = {"kind": "seq2seq", "folder": ".", "model": "decoder_model_merged.onnx", "encoder": "encoder_model.onnx"}
    elif form in SEQ2SEQ:
        import transformers

        config_cls, model_cls, cfg = SEQ2SEQ[form]
        getattr(transformers, model_cls)(getattr(transformers, config_cls)(**cfg)).eval().save_pretrained(hf)
        # weights embedded, as optimum writes them at these sizes; validation off: it changes no file
        main_export(str(hf), str(d), task="text2text-generation-with-past", do_validation=False)
        info = {"kind": "seq2seq", "folder": ".", "model": "decoder_model_merged.onnx", "encoder": "encoder_model.onnx"}
    else:
        from transformers import ViTConfig, ViTModel

        cfg = ViTConfig(
            hidden_size=384, num_hidden_layers=4, num_attention_heads=6, intermediate_size=1536, image_size=224,
            patch_size=16,
        )  # fmt: skip
        ViTModel(cfg, add_pooling_layer=False).eval().save_pretrained(hf)
        main_export(str(hf), str(d), task="feature-extraction")
        info = {"kind": "vision", "model": "model.onnx", "config_dims": True}
    shutil.rmtree(hf)
    return info


_T5 = dict(
    vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_decoder_layers=6, num_heads=8,
    decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
)  # fmt: skip
_BART = dict(
    vocab_size=16000, d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
    decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048, max_position_embeddings=512,
    pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
)  # fmt: skip
SEQ2SEQ = {  # form -> (config class, model class, config)
    "optimum-t5": ("T5Config", "T5ForConditionalGeneration", _T5),
    "optimum-t5-base": (
        "T5Config", "T5ForConditionalGeneration",
        {**_T5, "d_model": 768, "d_ff": 3072, "num_layers": 12, "num_decoder_layers": 12, "num_heads": 12},
    ),
    "optimum-bart": ("BartConfig", "BartForConditionalGeneration", _BART),
    "optimum-marian": (
        "MarianConfig", "MarianMTModel",
        {**_BART, "pad_token_id": 15999, "eos_token_id": 0, "decoder_start_token_id": 15999, "bos_token_id": 0,
         "decoder_vocab_size": 16000, "share_encoder_decoder_embeddings": True},
    ),
}  # fmt: skip
BERT = dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)


def bert(d: Path, form: str) -> dict:
    """optimum's feature-extraction export of a random BERT, ORT's transformer optimizer, then int8 or QDQ."""
    import onnx
    import torch
    from optimum.exporters.onnx import main_export
    from transformers import BertConfig, BertModel

    work = d.parent / "_bert"
    opt = work / "optimized.onnx"
    if not opt.exists():
        shutil.rmtree(work, ignore_errors=True)
        torch.manual_seed(0)
        BertModel(BertConfig(**BERT), add_pooling_layer=False).eval().save_pretrained(work / "hf")
        main_export(str(work / "hf"), str(work / "export"), task="feature-extraction", do_validation=False)
        cmd = [sys.executable, "-m", "onnxruntime.transformers.optimizer", "--input", str(work / "export/model.onnx")]
        cmd += ["--output", str(opt), "--model_type", "bert", "--num_heads", "12", "--hidden_size", "768"]
        subprocess.run(cmd, check=True)
    # ORT's shape inference types no output of its fused contrib ops: the quantizer asks for the default
    extra = {"DefaultTensorType": onnx.TensorProto.FLOAT}
    # the quantizers write their temporaries (sym_shape_infer_temp.onnx, <uuid>.data: 415 MiB) into the current
    # directory: the build's work directory, never the checkout
    with contextlib.chdir(work):
        _quantize(form, d, work, opt, extra)
    return {"kind": "bert", "model": "model.onnx"}


def _quantize(form: str, d: Path, work: Path, opt: Path, extra: dict) -> None:
    import numpy as np
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quant_pre_process,
        quantize_dynamic,
        quantize_static,
    )

    if form == "bert-int8":
        quantize_dynamic(str(opt), str(d / "model.onnx"), weight_type=QuantType.QInt8, extra_options=extra)
    else:

        class Reader(CalibrationDataReader):
            def __init__(self) -> None:
                rng = np.random.default_rng(0)
                self.batches = iter(
                    {
                        "input_ids": rng.integers(0, BERT["vocab_size"], (1, 16), dtype=np.int64),
                        "attention_mask": np.ones((1, 16), np.int64),
                        "token_type_ids": np.zeros((1, 16), np.int64),
                    }
                    for _ in range(4)
                )

            def get_next(self) -> dict | None:
                return next(self.batches, None)

        pre = work / "preprocessed.onnx"
        quant_pre_process(str(work / "export/model.onnx"), str(pre), skip_symbolic_shape=True)  # it gives up on BERT
        quantize_static(
            str(pre), str(d / "model.onnx"), Reader(), quant_format=QuantFormat.QDQ,
            activation_type=QuantType.QInt8, weight_type=QuantType.QInt8, extra_options=extra,
        )  # fmt: skip


def matmul_conv(d: Path) -> dict:
    """The 456 MiB fp32 Conv + MLP model, generated in code (no exporter writes this form; it stands for the
    vision backbones with a large classifier head)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from prepack_samples import mixed_onnx

    mixed_onnx(d / "model.onnx", conv_layers=2, channels=256, mm_layers=7, dim=4096, spatial=16)
    return {"kind": "mixed", "model": "model.onnx", "input": [256, 16, 16]}


def _venv_for(form: str) -> tuple[str, str]:
    return next(v for prefix, v in VENVS.items() if form.startswith(prefix))


def build(out: Path, form: str) -> None:
    d = out / form
    if (d / "form.json").exists():
        return
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    if form.startswith("genai-"):
        parts = form.split("-")  # genai-PRECISION (Llama) or genai-ARCH-PRECISION
        info = genai(d, parts[-1], parts[1] if len(parts) == 3 else "llama")
    elif form.startswith("bert-"):
        info = bert(d, form)
    elif form == "matmul-conv":
        info = matmul_conv(d)
    elif form.startswith("dynamo-"):
        info = dynamo(d, form.split("-")[1], wide=form.endswith("-wide"))
    elif form.startswith("optimum-"):
        info = optimum(d, form)
    else:
        info = vit(d, base=form.endswith("-base"))
    (d / "form.json").write_text(json.dumps(info) + "\n")
    print(f"built {form}", flush=True)


def main() -> None:
    out = Path(sys.argv[1])
    forms = sys.argv[2:] or list(FORMS)
    bad = [f for f in forms if f not in FORMS]
    if bad:
        sys.exit(f"unknown form(s) {bad}; known: {', '.join(FORMS)}")
    import importlib.util

    for form in forms:
        venv, module = _venv_for(form)
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            sys.exit(f"{form} needs the venv {venv} (no {module} here): run {venv}/bin/python {sys.argv[0]} ...")
    for form in forms:
        build(out, form)


if __name__ == "__main__":
    main()
