"""verify for ONNX: both models in onnxruntime (CPU, default session options), outputs compared byte for byte."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...errors import UsageError
from ...verify import OriginalFails, VerifyReport, compare_names, compare_outputs, first_line, hint


def verify_in_runtime(
    report: VerifyReport, original: Path, converted: Path, opts: dict[str, Any], broken: bool
) -> None:
    from ...runtimes.ort import index_bounds, new_session, random_feeds

    try:
        a = new_session(str(original), share=False, log_level=4)
    except Exception as e:  # noqa: BLE001 -- any runtime refusal is reported, not raised as a bug
        raise OriginalFails(
            f"the original model fails in onnxruntime: {first_line(e)} ({hint('onnx')})", original
        ) from None
    report.paths.append("onnxruntime CPU, default session options")
    if broken:
        report.mismatches.append("the converted model was not run: its external data is broken (see above)")
        return
    try:
        b = new_session(str(converted), share=False, log_level=4)
    except Exception as e:  # noqa: BLE001
        report.mismatches.append(f"the converted model fails to load in onnxruntime: {first_line(e)}")
        return
    symbolic = {str(d) for i in a.get_inputs() for d in i.shape if isinstance(d, str)}
    unknown = sorted(set(opts["dims"]) - symbolic - {"*"})
    if unknown:  # a typo would otherwise be ignored silently and the dim left at 1
        raise UsageError(
            f"--dim {unknown[0]}: no input of {original.name} has a dimension of that name "
            f"(symbolic dims: {', '.join(sorted(symbolic)) or 'none'}; '*' sets every dynamic one)"
        )
    compare_names(report, "input", [i.name for i in a.get_inputs()], [i.name for i in b.get_inputs()])
    names_a, names_b = [o.name for o in a.get_outputs()], [o.name for o in b.get_outputs()]
    compare_names(report, "output", names_a, names_b)
    if report.mismatches:
        return
    bounds = index_bounds(str(original))
    for r in range(opts["runs"]):
        feeds = random_feeds(a, opts["seed"] + r, opts["dims"], opts["inputs"], bounds)
        try:
            outs_a = dict(zip(names_a, a.run(None, feeds)))
        except Exception as e:  # noqa: BLE001
            raise OriginalFails(
                f"the original model fails in onnxruntime: {first_line(e)} ({hint('onnx')})", original
            ) from None
        try:
            outs_b = dict(zip(names_b, b.run(None, feeds)))
        except Exception as e:  # noqa: BLE001
            report.mismatches.append(f"run {r}: the converted model fails in onnxruntime: {first_line(e)}")
            return
        compare_outputs(report, names_a, outs_a, outs_b, r)
        report.runs += 1
