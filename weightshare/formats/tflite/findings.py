"""What LiteRT's XNNPACK delegate copies per interpreter, and stale weight caches: TFLite's finding codes."""

from __future__ import annotations

from ..._findings import CodeInfo, Severity, TextEnum, register_codes

__all__ = ["CODES", "TfliteCode"]


class TfliteCode(TextEnum):
    """TFLite's own finding codes (``Format.findings``); docs/ci.md lists them with the others."""

    XNNPACK_PACK_COPY = "xnnpack-pack-copy-per-interpreter"
    XNNPACK_CACHE_MISMATCH = "xnnpack-cache-mismatch"


CODES: dict[TextEnum, CodeInfo] = {
    TfliteCode.XNNPACK_PACK_COPY: CodeInfo(
        Severity.WARNING,
        "LiteRT's default XNNPACK delegate packs FULLY_CONNECTED/CONV weights into a private copy per interpreter.",
        "create interpreters with OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES, or "
        "use CompiledModel with an XNNPACK weight cache file",
    ),
    TfliteCode.XNNPACK_CACHE_MISMATCH: CodeInfo(
        Severity.ERROR,
        "An XNNPACK weight cache beside a TFLite model was built for other content (another "
        "model, blob or LiteRT version): LiteRT used with it directly would compute with the cached weights, "
        "not the model's.",
        "re-run weightshare convert MODEL -o OUT --prepack (builds the matching cache), or delete the stale cache file",
    ),
}

register_codes(CODES)  # known to Finding.of as soon as the codes exist, whether or not the registry was asked
