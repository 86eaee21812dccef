"""The one sentence a person reads first: PASS/FAIL, which op, where in the model, and
which bound it broke (issue 22). Used by the terminal summary, the HTML report and the
JSON summary, so all three say the same thing.

`verdict_sentence(row, counts)` takes the first failing row as a plain mapping (op name,
seqid, module path, and the verdict's DecidingMetric / DecidingValue / DecidingBound /
DecidedBy / PrecisionDtype columns) and nothing else, so a later flag (e.g. whether the
error was caused at this op or inherited from an earlier one: the `Origin` column) plugs
in here without touching the renderers. Light: no pandas, no numpy.
"""

from __future__ import annotations

import math
import re
from typing import Any, Mapping

from accucmp.compare.verdict import ROUNDING_HOW, ROUNDING_ONE_SIDED

# how a deciding metric is named in a sentence (the csv keeps the full column name)
METRIC_WORDS = {
    "RelativeEuclideanDistance": "RelErr",
    "MaxAbsoluteError/GoldenAbsMax": "MaxAbsErr/max|golden|",
    "MaxAbsoluteError": "MaxAbsErr",
    "TargetErrorVsFp64": "error vs fp64",
    "CosineSimilarity": "Cosine",
    "MaxRelativeError": "MaxRelErr",
    "MeanRelativeError": "MeanRelErr",
    "ExactMismatches": "differing elements",
    "NonFiniteMismatch": "NaN/Inf on one side only",
    # judged by the op's own error (vs float64 on the inputs it got: load-replay, plain and
    # compiled dumps)
    "OwnErrorVsFp64": "own error vs fp64",
    "OwnMaxErrorVsFp64/OwnRefAbsMax": "own MaxAbsErr/max|ref|",
    # a compiled golden's node, judged by its own error (the golden's op is what differs)
    "GoldenOwnErrorVsFp64": "the golden's own error vs fp64",
    "GoldenOwnMaxErrorVsFp64/OwnRefAbsMax": "the golden's own MaxAbsErr/max|ref|",
}
# thresholds whose bound is in unit roundoffs of the op's precision (DecidingValue/Bound in u)
_IN_ULPS = ("RelativeEuclideanDistanceUlps", "MaxAbsoluteErrorUlps", "InputUlps", "PointwiseUlps")
# thresholds derived from the op's dtype (scaled by --tolerance); any other DecidedBy is a
# metric's absolute threshold a user gave with -t
_KNOB_FROM_DTYPE = ("RelativeEuclideanDistanceUlps", "RelativeEuclideanDistanceFloor", "MaxAbsoluteErrorUlps",
                    "MaxAbsoluteErrorFloor", "Fp64Factor", "Fp64FloorUlps", "ExactTolerance", "InputUlps",
                    "PointwiseUlps", "SumCancellationFactor")


def scaled_by_tolerance(knob: str) -> bool:
    """Whether --tolerance F moves the bound of threshold `knob` (the dtype-derived ones, and
    UnderflowLoss, verdict._judge_cast); a share such as RoundingBias or
    UpdateAbsorbedFraction moves only with -t."""
    return knob in _KNOB_FROM_DTYPE or knob == "UnderflowLoss"


# metrics where a larger value is better (a failure is value < bound)
_HIGHER_IS_BETTER = ("CosineSimilarity",)


def as_float(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def _text(v: Any) -> str:
    return v if isinstance(v, str) else ""      # empty csv cells come back as NaN


def _g(v: float) -> str:
    if math.isinf(v):
        return "inf"
    return f"{v:.3g}"


def seqid_text(v: Any) -> str:
    f = as_float(v)
    if math.isnan(f):
        return ""
    return str(int(f)) if f.is_integer() else _g(f)


def bound_clause(row: Mapping[str, Any]) -> str:
    """'RelErr 41 u > 6 u allowed for bfloat16': the test that decided a failing row, from
    the verdict's Deciding* columns; the row's FailReason when it has none (an older csv)."""
    metric = _text(row.get("DecidingMetric"))
    knob = _text(row.get("DecidedBy"))
    value, bound = as_float(row.get("DecidingValue")), as_float(row.get("DecidingBound"))
    dtype = _text(row.get("PrecisionDtype")) or _text(row.get("DataType"))
    if knob == "CompareStatus":                 # size mismatch, corrupt data: the reason says it
        return _text(row.get("CompareFailReason")) or metric
    if metric == "NonFiniteMismatch":
        return METRIC_WORDS[metric]
    if knob == "RoundingBias":
        # the verdict's sentence says the side and the share; what kernel does so is for the
        # details line (verdict._check_rounding_sides)
        for part in (_text(row.get("FailReason")) or "").split("; "):
            if ROUNDING_ONE_SIDED in part:
                return part.split(ROUNDING_HOW, 1)[0]
    if not metric or math.isnan(value):
        reason = _text(row.get("FailReason")) or _text(row.get("CompareFailReason"))
        return reason.split(" [", 1)[0]         # the hint in brackets is for the details line
    words = METRIC_WORDS.get(metric, metric)
    if metric == "ExactMismatches":
        return f"{_g(value)} {words} ({dtype or 'exact dtype'} must agree exactly)"
    unit = " u" if knob in _IN_ULPS else ""
    op = "<" if metric in _HIGHER_IS_BETTER else ">"
    allowed = "required" if op == "<" else "allowed"
    if knob not in _KNOB_FROM_DTYPE:            # an absolute threshold a user gave
        return f"{words} {_g(value)}{unit} {op} {_g(bound)}{unit} {allowed} (-t {knob})"
    floor = " (floor)" if knob.endswith("Floor") else ""
    return f"{words} {_g(value)}{unit} {op} {_g(bound)}{unit} {allowed}{floor} for {dtype or 'its dtype'}"



# the Source column: "file:line in function: code" (the dumper's record_stack form)
_SOURCE = re.compile(r"^(?P<file>.+?):(?P<line>\d+)(?: in |$)")
_PATH_SEP = re.compile(r"[/\\]")


def source_place(source: Any) -> str:
    """'modeling_bert.py:293', the file's name and line of a Source cell
    ('/…/transformers/models/bert/modeling_bert.py:293 in forward: hidden_states = …'); ""
    when there is none."""
    m = _SOURCE.match(_text(source).strip())
    if not m:
        return ""
    name = _PATH_SEP.split(m["file"])[-1]
    return f"{name}:{m['line']}"


def where_clause(row: Mapping[str, Any]) -> str:
    """'aten.gelu.default #153 in encoder.layer.3.mlp at modeling_bert.py:293' (the module
    and the source line left out when unknown)."""
    op = _text(row.get("NPUDump")) or _text(row.get("GoldenOp")) or "?"
    seq = seqid_text(row.get("SeqId")) or seqid_text(row.get("GoldenSeqId"))
    text = f"{op} #{seq}" if seq else op
    module = _text(row.get("Module"))
    phase = _text(row.get("Phase"))
    if module:
        text += f" in {module}"
    if phase == "backward":
        text += " (backward)"
    place = source_place(row.get("Source"))
    if place:
        text += f" at {place}"
    return text


def verdict_sentence(row: Mapping[str, Any] | None, counts: Mapping[str, int], total: int | None = None) -> str:
    """The first line of every report. `row`: the first failing row (None when none fails);
    `counts`: tensors per Result."""
    n_fail, n_pass = counts.get("fail", 0), counts.get("pass", 0)
    total = sum(counts.values()) if total is None else total
    others = ", ".join(f"{counts[k]} {k}" for k in ("unmatched", "skipped") if counts.get(k))
    if row is not None and n_fail:
        if str(row.get("Origin") or "") == "departs":
            # the run itself left its recording here (accucmp/compare/departures.py): the
            # sentence names the module first, where a user looks
            return f"FAIL: {_text(row.get('FailReason')) or _text(row.get('CompareFailReason'))}"
        # the verdict's Origin column (accucmp/compare/op_policies.py): the op whose inputs still agree
        caused = str(row.get("Origin") or "") == "caused here" or row.get("CausedHere") is True
        what = "first op caused here" if caused else "first failing op"
        return f"FAIL: {what} is {where_clause(row)}: {bound_clause(row)}"
    if n_fail:                                   # counted but no row at hand (should not happen)
        return f"FAIL: {n_fail} of {total} tensors fail"
    if n_pass == 0:
        return (f"FAIL: no tensor could be compared ({others or f'{total} tensors'}); "
                "see CompareFailReason in the result")
    return f"PASS: {n_pass} tensors within bounds" + (f" ({others})" if others else "")


# shortening a name to a width lives in accucmp/report/fit.py; re-exported for the plot and tests
from accucmp.report.fit import middle_ellipsis  # noqa: E402,F401
