"""Verdicts: thresholds applied to a comparison table, separately from the metrics.

`apply_verdict(table, thresholds)` adds `Result` (pass / fail / unmatched / skipped),
`FailReason`, `Severity` (measured error / allowed error, > 1 fails) and `ErrorUlps`
(the error in unit roundoffs of the op's precision). It reads only table columns, so
it re-runs on a saved result csv with other thresholds.

The rule (docs/COMPARE.md has the reasoning and the measurements behind each default):

* precision: an op's error is bounded by the LEAST precise dtype among everything it
  touched: all its input and output tensors on both sides and its compute dtype
  (column PrecisionDtype, filled by compare). u = that dtype's unit roundoff.
* floating tensors pass when
      RelativeEuclideanDistance <= max(RelativeEuclideanDistanceUlps * u, RelativeEuclideanDistanceFloor)
  and  MaxAbsoluteError <= max(MaxAbsoluteErrorUlps * u, MaxAbsoluteErrorFloor) * GoldenAbsMax.
  With an fp64 golden replay (columns TargetErrorVsFp64 / GoldenErrorVsFp64) the first
  test becomes: the target's error against fp64 <= Fp64Factor * the golden device's own
  error against fp64 + Fp64FloorUlps * u (never below RelativeEuclideanDistanceUlps * u); a
  result whose golden error vs fp64, carried to the target's precision, is >= 100% holds no
  correct digit there (cancellation) and is skipped as ill-conditioned.
* rows judged by the op's own error against float64 on the inputs it got (OwnErrorVsFp64:
  load-replay, plain dumps of a reduced-precision run) are bounded by the op's class
  (op_policies.bound_class): PointwiseUlps for correctly rounded elementwise ops, a sum's
  cancellation (SumCancellationFactor x kappa x u) for bias/norm-parameter gradients and
  reductions, RelativeEuclideanDistanceUlps for the rest. In independent runs such a row that
  passes while its distance from the golden fails the plain rule passes as inherited
  (judge_row's docstring), and input rows follow MadeBy.
* integer and bool tensors must agree exactly (RelativeEuclideanDistance <= ExactTolerance; with
  the default 0, also no element may differ in ExactMismatches, counted on the native values).
* NaN/Inf where the other side is finite fails; size mismatch and corrupt data fail;
  empty tensors and outputs of empty-like ops are skipped; unpaired tensors are unmatched.
* a metric name as a threshold (e.g. CosineSimilarity=0.99) adds an absolute test in the
  metric's direction; RelativeEuclideanDistance / MaxAbsoluteError given this way replace
  their dtype-scaled test.
* Tolerance (`--tolerance F`, default 1) multiplies every dtype-derived bound at once (the
  RelativeEuclideanDistance*, MaxAbsoluteError*, Fp64* and ExactTolerance ones), never an
  absolute metric threshold a user gave.
* one knob per idea: the MaxAbsoluteError/max|golden| test is never stricter than the
  relative-error bound in effect, so loosening the relative error (-t RelativeEuclideanDistance,
  -t RelativeEuclideanDistanceUlps/Floor, --tolerance) does not leave the row failing on
  max abs for the same size of error.

Each failure also names the test that decided it (the one with the largest measured/allowed
ratio): DecidedBy (the threshold to change to pass it), DecidingMetric, DecidingValue and
DecidingBound (value and bound in the metric's own unit; `ErrorUlps`-style unit roundoffs
when DecidedBy ends in "Ulps").

The verdict stage of the comparison: `judge` turns a Measured batch into a Judged one. The
per-op rules are op_policies.py, the queries over a judged table report/findings.py. The
rest stays one module (~450 lines): the thresholds, the decision of one row (judge_row,
read top to bottom as the rule above) and the per-op hints share the same defaults and
dtype tables, and are one rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np
import pandas as pd

from dumpfile import schema as S
from dumpfile.opclass import is_cast
from dumpfile.errors import DumpError

from accucmp.compare.departures import STATUS_DEPARTURE, STATUS_UNPAIRED_OP, with_measure
from accucmp.compare.metrics import METRICS
from accucmp.compare.op_policies import (ARGS_DEPARTURE, CLASS_POINTWISE, CLASS_SUM, RANDOM_DRAWS, UNDERFLOW_CLAUSE,
                                          apply_op_policies, bound_class, independent_elements, rounded_by_cast)
from accucmp.compare.rows import MATCHED_BY_CAST, NOT_MEASURED, READS_SCALED, STATUS_EMPTY, STATUS_UNINITIALIZED

if TYPE_CHECKING:
    from accucmp.compare.measure import Measured

RESULT_PASS, RESULT_FAIL, RESULT_UNMATCHED, RESULT_SKIPPED = "pass", "fail", "unmatched", "skipped"

DEFAULT_THRESHOLDS: dict[str, float] = {
    # 2.8 u: worst clean fp32-vs-bf16 replay op measured (layer-norm backward); 12.7 u: a 5% fault
    "RelativeEuclideanDistanceUlps": 6.0,
    # fp32 ops with long reductions reach tens of u (~1e-6); a 1% fault is 1e-2
    "RelativeEuclideanDistanceFloor": 1e-4,
    # max |x-y| relative to max |y|: catches a few wildly wrong elements that RED averages away
    "MaxAbsoluteErrorUlps": 64.0,
    "MaxAbsoluteErrorFloor": 1e-3,
    # with an fp64 golden replay: target error vs fp64 <= factor * golden error vs fp64 + floor * u
    # and never below the plain rule's RelativeEuclideanDistanceUlps * u (a clean fp16
    # conv_backward grad_weight reaches 4.2 u vs fp64 with an exact golden)
    "Fp64Factor": 2.0,
    "Fp64FloorUlps": 4.0,
    # own-error rows of correctly rounded elementwise ops (op_policies.POINTWISE): what correct
    # rounding of the result allows (0.5 u, double rounding through float32 rarely 1 u); a
    # GELU computed by the sigmoid approximation (1.1%) is 2.8 u of bfloat16
    "PointwiseUlps": 1.5,
    # own-error rows of sums (dumpfile/opclass.py) that cancel: kappa = ||sum |terms| || / ||sum||
    # widens the bound to this factor x kappa x u (PyTorch's CPU LayerNorm-backward grad_bias in
    # bf16/fp16: 0.2-0.4 x kappa u); kappa x u >= 1 leaves no correct digit: not judged
    "SumCancellationFactor": 0.5,
    # an in-place update of state (a parameter, an optimizer moment) in a coarser dtype than the
    # golden's: fails when this share of the elements the golden changed keep their old value,
    # the change rounded away (column UpdateAbsorbed, op_policies' ABSORBED rule); a half means
    # the target learns less than half of what the golden does there
    "UpdateAbsorbedFraction": 0.5,
    # rounding to a dtype of smaller range (float16) moves values in its normal range by at
    # most half a unit; below it, it keeps fewer bits. A target-only cast that moves its tensor
    # by more than this RelativeEuclideanDistance, or an op right on what it got whose golden
    # values lose more than this rounded to its dtype (column RangeLoss), fails as underflow:
    # most of the values hold a few spacings of the format (float16 gradients of 3e-7 without
    # a loss scaler: 0.26). Below it the format keeps the tensor to a few percent (GPT-2's
    # gelu_new gradients of 1e-5: 0.007), judged as precision, as the own-error rows near the
    # underflow edge are
    "UnderflowLoss": 0.0625,
    # own-error rows: of the elements that differ from the correctly rounded float64 result
    # (columns OwnInexact, OwnTowardZero, OwnUpward), the share on one side, as |2 share - 1|
    # (0: as many each way, 1: all one way), fails above this: 0.9 is 95% on one side. A kernel
    # that rounds to nearest is off only where its arithmetic crossed a rounding boundary,
    # either way alike (GPT-2-shaped bf16 / fp16 products accumulated in float32 in another
    # order: <= 0.06 where at least 256 elements differ; PyTorch's CPU kernels in the clean
    # runs of 11 Hugging Face models leave fewer than 256 off); one that truncates puts every
    # such element nearer zero (1.0): 1 u of bfloat16 per element against 6 allowed, but all
    # one way, step after step
    "RoundingBias": 0.9,
    # ... judged only where at least this many elements differ (a few can all fall one way)
    "RoundingBiasMinElements": 256.0,
    # integer / bool tensors: allowed relative Euclidean distance (0 = exact)
    "ExactTolerance": 0.0,
    # --tolerance: one factor on every dtype-derived bound above (2 = twice as lenient)
    "Tolerance": 1.0,
    # load-replay: a parameter/buffer/batch input whose live value differs from the recorded
    # one (a departure, compare/departures.py) passes only within what a cast to the live
    # dtype can do: RelativeEuclideanDistance <= InputUlps * u (a correctly rounded cast moves
    # each element by at most u; the replay records only values that are not that cast)
    "InputUlps": 1.0,
}

# the columns apply_verdict adds after the metrics, in order
VERDICT_COLUMNS = ("Result", "FailReason", "Severity", "ErrorUlps",
                   "DecidedBy", "DecidingMetric", "DecidingValue", "DecidingBound")


class VerdictError(DumpError):
    """Bad threshold name or value, or a table that is not a comparison result."""


def thresholds_with(overrides: Mapping[str, float] | None) -> dict[str, float]:
    """Defaults merged with overrides; metric names allowed too. Unknown names -> VerdictError."""
    th: dict[str, float] = dict(DEFAULT_THRESHOLDS)
    by_lower = {k.lower(): k for k in (*DEFAULT_THRESHOLDS, *METRICS)}
    for name, value in (overrides or {}).items():
        key = by_lower.get(str(name).strip().lower())
        if key is None:
            raise VerdictError(f"unknown threshold {name!r}; known: {', '.join(by_lower.values())}")
        if key in METRICS and not METRICS[key].numeric:
            raise VerdictError(f"{key} is a display string and takes no threshold")
        try:
            v = float(value)
        except (TypeError, ValueError) as e:
            raise VerdictError(f"threshold {key}={value!r}: not a number") from e
        if math.isnan(v):
            raise VerdictError(f"threshold {key}: NaN is not a threshold")
        if key == "Tolerance" and not (0 < v < math.inf):
            raise VerdictError(f"--tolerance {value!r}: must be a positive finite factor (1 = the defaults)")
        th[key] = v
    return th


def _num(v: Any) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return math.nan
    return f


def _str(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)) or v is pd.NA:
        return ""
    return str(v)


def _check_rounding_sides(row: Mapping[str, Any], th: Mapping[str, float], check, whose: str) -> None:
    """RoundingBias of an own-error row: whether the elements off the correctly rounded result
    lie on one side of it (nearer zero or farther; above or below), judged where at least
    RoundingBiasMinElements of them are, in a dtype coarser than float32, of an op whose
    elements are computed apart (op_policies.independent_elements). Not scaled by Tolerance:
    a share, no dtype's bound.

    Left out, because a correct kernel's errors there share a cause and go one way together:
    float32 results of an op with a Python number (converted to float32 first: Falcon's
    q * 8**-0.25 puts 43% of its elements one unit off, all on one side) and ops that apply a
    value computed once to many elements (a BatchNorm's per-channel scale and shift, a
    softmax's or layer norm's per-row statistics: clean fp16 MobileNet, 0.77)."""
    n = _num(row.get("OwnInexact"))
    if not n >= max(th["RoundingBiasMinElements"], 1.0) or not S.coarser(_str(row.get("DataType")), "float32") \
            or not independent_elements(_str(row.get("NPUDump"))):
        return
    sides = []
    for metric, share, yes, no in (("OwnTowardZero", _num(row.get("OwnTowardZero")), "nearer zero", "farther from zero"),
                                   ("OwnUpward", _num(row.get("OwnUpward")), "above it", "below it")):
        if 0.0 <= share <= 1.0:
            sides.append((abs(2 * share - 1), metric, share if share >= 0.5 else 1 - share, yes if share >= 0.5 else no))
    if not sides:
        return
    bias, metric, share, where = max(sides)
    how = {"nearer zero": "a kernel that truncates (rounds toward zero instead of to nearest)",
           "farther from zero": "a kernel that rounds away from zero",
           "above it": "a kernel that rounds up (toward +inf)",
           "below it": "a kernel that rounds down (toward -inf)"}[where]
    # (no "; " in the sentence: FailReason joins failures with it; the headline takes the
    # part before ROUNDING_HOW, report/headline.bound_clause)
    check(bias, th["RoundingBias"],
          f"{whose}{ROUNDING_ONE_SIDED}: {100 * share:.1f}% of the {n:,.0f} elements off the correctly rounded "
          f"float64 result lie {where}{ROUNDING_HOW}{how} does, or one that computes with a constant "
          f"rounded that way (a scale factor cast to the tensor's dtype): RoundingBias |2 share - 1|",
          "RoundingBias", metric)


def _is_exact_dtype(d: str) -> bool:
    return bool(d) and d not in S.FLOATING_DTYPES and d not in S.COMPLEX_DTYPES


def _unit_roundoff(row: dict) -> tuple[float, str]:
    prec = _str(row.get("PrecisionDtype"))
    cands = [prec, _str(row.get("DataType")), _str(row.get("GoldenDataType")), _str(row.get("ComputeDtype"))]
    best, u = "", -1.0
    for d in cands:
        if S.UNIT_ROUNDOFF.get(d, -1.0) > u:
            best, u = d, S.UNIT_ROUNDOFF[d]
    return (u if u > 0 else S.UNIT_ROUNDOFF["float32"]), (best or "float32")


SUBNORMAL_SPACINGS = 8.0         # own-error rows near the underflow edge within this many spacings pass


def _failure_hint(prec: str, g_absmax: float, red: float, golden_dtype: str) -> str:
    """One clause that tells a user what a failure on a small or cancelling result means."""
    tiny = S.SMALLEST_NORMAL.get(prec)
    hint = ""
    if tiny and 0 < g_absmax < 4 * tiny:
        hint = (f" [golden max|x| {g_absmax:.2g} is near or below {prec}'s smallest normal {tiny:.2g}: "
                f"underflow in {prec} (what loss scaling is for), not necessarily a kernel bug]")
    if red >= 1 and S.UNIT_ROUNDOFF.get(golden_dtype, 0) < S.UNIT_ROUNDOFF.get(prec, 0):
        hint += (f" [error >= 100%: if this result cancels (a sum of terms much larger than it, e.g. the "
                f"bias gradient of a layer followed by a normalisation, which is 0 in exact arithmetic) it is "
                f"rounding noise at {prec}; --golden-fp64 tells noise from a fault]")
    return hint


def _status(row: dict) -> str:
    st = _str(row.get("CompareStatus"))
    if st:
        return st
    # a table without the column (an older or hand-made csv): infer from the paths
    if not _str(row.get("NPUDumpPath")) or not _str(row.get("GroundTruthPath")):
        return "unmatched"
    return "compared"


_NO_DECISION = ("", "", math.nan, math.nan)


def _judge_departure(row: dict, reason: str, th: Mapping[str, float]) -> tuple:
    """A way the target run left its recording (compare/departures.py): an op inserted or
    missing, a changed argument fail as they are; a differing input by how much it differs."""
    if _str(row.get("Departure")) != "input":
        return (RESULT_FAIL, reason, math.inf, math.nan) + ("Departure", "Departure", math.nan, math.nan)
    red = _num(row.get("RelativeEuclideanDistance"))
    u, prec = _unit_roundoff(row)
    allowed = th["InputUlps"] * th.get("Tolerance", 1.0)
    bound = allowed * max(u, 0.0)
    if math.isnan(red):             # the golden is all zero (or NaN/Inf differ): any change fails
        return (RESULT_FAIL, with_measure(reason, ""), math.inf, math.nan) + ("Departure", "Departure", math.nan,
                                                                               math.nan)
    ulps = red / u if u > 0 else math.nan
    if red <= bound:
        return (RESULT_PASS, with_measure(reason, f"RelErr {red:.3g}, within the {allowed:g} u of {prec} a cast "
                                                  f"allows"), red / bound if bound > 0 else 0.0, ulps) + _NO_DECISION
    return (RESULT_FAIL, with_measure(reason, f"RelErr {red:.3g} > {bound:.3g} allowed: {allowed:g} u of {prec}, "
                                              f"what a cast can do"),
            red / bound if bound > 0 else math.inf, ulps) + ("InputUlps", "RelativeEuclideanDistance", ulps, allowed)


def _range_lost(row: dict, th: Mapping[str, float]) -> str:
    """The underflow clause of a row whose RangeLoss (the golden's values rounded to the
    target's dtype) exceeds the threshold UnderflowLoss, else ''."""
    loss = _num(row.get("RangeLoss"))
    if not 0.0 <= loss <= 1.0 or loss <= th["UnderflowLoss"] * th.get("Tolerance", 1.0):
        return ""       # (NaN, or a loss rounding cannot make, > 100%: an edited csv, not judged)
    u, prec = _unit_roundoff(row)
    if _num(row.get("OwnCancellation")) * u >= 1.0:
        # a sum whose terms cancel to below their rounding (a bias gradient that is 0 in exact
        # arithmetic): rounding noise at this precision, whatever range holds it; not judged
        return ""
    return (f"{UNDERFLOW_CLAUSE} {prec} (max |x| {_num(row.get('GoldenAbsMax')):.2g}, smallest normal "
            f"{S.SMALLEST_NORMAL.get(prec, math.nan):.2g}): rounded to it they lose RelativeEuclideanDistance "
            f"{loss:.3g} > UnderflowLoss {th['UnderflowLoss']:g} (what loss scaling is for)")


def _judge_cast(row: dict, th: Mapping[str, float]) -> tuple:
    """A target-only cast's result against what it was given (MatchedBy MATCHED_BY_CAST,
    rows.cast_source): a correct cast to a coarser dtype moves each element by at most half a
    unit; a cast that turns finite values into Inf overflowed, one that moves them by more than
    the threshold UnderflowLoss lost them below the dtype's normal range (underflow), and the
    difference starts here."""
    red = _num(row.get("RelativeEuclideanDistance"))
    u, prec = _unit_roundoff(row)
    bound = th["UnderflowLoss"] * th.get("Tolerance", 1.0)
    t_bad = _num(row.get("TargetNonFinite"))
    g_bad = _num(row.get("GoldenNonFinite"))
    if not math.isnan(t_bad) and t_bad > (0.0 if math.isnan(g_bad) else g_bad):
        return (RESULT_FAIL, f"a cast to {prec} turns {t_bad - (0 if math.isnan(g_bad) else g_bad):.0f} finite "
                f"element(s) it was given into Inf: the format's range, beyond {prec}'s largest finite "
                f"{S.LARGEST_FINITE.get(prec, math.nan):g} (overflow)", math.inf, math.nan,
                "NonFiniteMismatch", "NonFiniteMismatch", _num(row.get("NonFiniteMismatch")), 0.0)
    if math.isnan(red) or not u:
        return (RESULT_PASS, "", math.nan, math.nan) + _NO_DECISION
    ulps = red / u
    if red <= bound:
        return (RESULT_PASS, "", red / bound, ulps) + _NO_DECISION
    g_max = _num(row.get("GoldenAbsMax"))
    tiny = S.SMALLEST_NORMAL.get(prec, 0.0)
    where = (f": its values (max |x| {g_max:.2g}) lie near or below {prec}'s smallest normal {tiny:.2g}, where it "
             f"keeps fewer bits (underflow; what loss scaling is for)") if tiny and g_max < 64 * tiny else ""
    # (no metric: the headline and the table quote the reason's first clause, the details the rest)
    return (RESULT_FAIL, f"a cast to {prec} moves the values it was given by RelativeEuclideanDistance {red:.3g} "
            f"> {bound:.3g} [{ulps:.3g} u of {prec}, where rounding moves them by at most 0.5 u{where}]",
            red / bound, ulps, "UnderflowLoss", "", red, bound)


INHERITED_NOTE = "inherited"      # FailReason of a passing row whose difference earlier ops made
ARGS_NOTE = "argument"             # FailReason of a row whose op got other arguments than the golden's
ARGS_DECIDED_BY = "ArgsDiffer"     # DecidedBy of a row that fails only on its changed arguments
RANDOM_DECIDED_BY = "RandomDraws"  # DecidedBy of a random op's output whose runs drew other numbers
NOT_PASSED_NOTE = "[not passed as inherited:"
# the RoundingBias failure's sentence: "own rounding one-sided: 100.0% of ... lie nearer zero,
# as a kernel that truncates ... does: RoundingBias |2 share - 1| 1 > 0.9"
ROUNDING_ONE_SIDED, ROUNDING_HOW = "own rounding one-sided", ", as "
# rows with nothing to judge: no data on a side by design, or no metrics computed for them
_SKIPPED_STATUSES = NOT_MEASURED | {STATUS_UNINITIALIZED, STATUS_EMPTY}


def judge_row(row: dict, th: Mapping[str, float], *, fp64: bool) -> tuple:
    """(Result, FailReason, Severity, ErrorUlps, DecidedBy, DecidingMetric, DecidingValue,
    DecidingBound) of one table row.

    Independent runs (two plain dumps, MatchedBy not `seqid`): a row the dumper measured on
    the op's own inputs (OwnErrorVsFp64) is judged by that; when it passes although its
    distance from the golden fails the plain rule, it passes as `inherited` (FailReason says
    both numbers). An input row an earlier op of the step made (MadeBy `op`) is that op's
    output: its difference is inherited, judged at that op. An input no op made (MadeBy
    `leaf`: a parameter, buffer or the batch) is judged at its own precision and, failing,
    is the run's own difference."""
    if _str(row.get("MatchedBy")) == MATCHED_BY_CAST and _status(row) == "compared" \
            and is_cast(_str(row.get("NPUDump"))):
        return _judge_cast(row, th)
    independent = _str(row.get("MatchedBy")) not in ("", "seqid")
    res = _judge(row, th, fp64=fp64, independent=independent)
    lost = _range_lost(row, th) if res[0] == RESULT_PASS and _status(row) == "compared" else ""
    if lost:
        plain = _judge({**row, "OwnErrorVsFp64": math.nan}, th, fp64=fp64, independent=independent)
        if plain[0] == RESULT_FAIL and not _str(row.get("ArgsDiffer")):
            # right on what it got (its own error, measured against float64 rounded to its
            # dtype, underflow included), but its dtype cannot hold the golden's values: the
            # run departs here by the format's range, not by this op (Origin underflow)
            return (RESULT_FAIL, f"{plain[1]} [{lost}; this op's own error vs fp64 on its inputs is "
                    f"{res[3]:.3g} u]") + plain[2:]
    if not independent or _status(row) != "compared":
        return res
    changed, structure = _str(row.get("ArgsDiffer")), _str(row.get("StructureDiffers"))
    if not math.isnan(_num(row.get("OwnErrorVsFp64"))):
        if res[0] == RESULT_PASS:
            plain = _judge({**row, "OwnErrorVsFp64": math.nan}, th, fp64=fp64, independent=independent)
            if plain[0] == RESULT_FAIL and changed:
                # the op computed right what it was given, but not with the golden's arguments
                return (RESULT_FAIL, f"{ARGS_NOTE} {changed}: {plain[1]}") + plain[2:]
            if plain[0] == RESULT_FAIL and structure.startswith(READS_SCALED):
                # it computed right on gradients that still carry the loss scale: the run
                # departs here (compare/rows._unscaled_result)
                return (RESULT_FAIL, f"{plain[1]} [caused here: {structure}; its own error vs fp64 on those "
                        f"inputs is {res[3]:.3g} u]") + plain[2:]
            if plain[0] == RESULT_FAIL and structure:
                # an op one run has and the other lacks may have made the difference: not passed
                return (RESULT_FAIL, f"{plain[1]} {NOT_PASSED_NOTE} the runs' op streams differ ({structure}); "
                        f"this op's own error vs fp64 on its own inputs is {res[3]:.3g} u]") + plain[2:]
            if plain[0] == RESULT_FAIL:
                why = res[1] or f"own error vs fp64 on its own inputs {res[3]:.3g} u"
                return (RESULT_PASS, f"{INHERITED_NOTE}: the golden differs by {plain[1]}, which earlier ops "
                        f"made; this op's {why}", res[2], res[3]) + _NO_DECISION
        return _args_departure(row, res, changed)
    if changed and res[0] == RESULT_FAIL:
        return (RESULT_FAIL, f"{ARGS_NOTE} {changed}: {res[1]}") + res[2:]
    if changed:
        return _args_departure(row, res, changed)
    if res[0] == RESULT_FAIL and structure.startswith(READS_SCALED):
        return (RESULT_FAIL, f"{res[1]} [{structure}]") + res[2:]
    made_by = _str(row.get("MadeBy"))
    if res[0] == RESULT_FAIL and _str(row.get("IO")) == "input" and res[4] != "CompareStatus":
        via = _str(row.get("CastRoundedTo"))
        if made_by == "op" and rounded_by_cast(via, _str(row.get("DataType"))):
            # an earlier op's result that the target rounds by a cast (h.to(bfloat16).float()) to
            # a coarser dtype than the op computes in: no op's precision, a step the golden run
            # does not take (and no row judges the casts: they are unpaired by design)
            return (RESULT_FAIL, f"input {_str(row.get('TensorName'))} went through {via}: the target rounds an "
                    f"earlier op's result by a cast the golden run does not make, and this op computes in "
                    f"{_str(row.get('DataType'))}: {res[1]}") + res[2:]
        if made_by == "op" and not structure:
            return (RESULT_PASS, f"{INHERITED_NOTE}: an earlier op of the step made this input, its row "
                    f"judges it; the golden differs by {res[1]}", res[2], res[3]) + _NO_DECISION
        if made_by == "leaf":
            dtype = _str(row.get("DataType"))
            via = _str(row.get("LeafRoundedTo"))
            if S.UNIT_ROUNDOFF.get(via, 0.0) > S.UNIT_ROUNDOFF.get(dtype, 0.0):
                dtype = via         # a bf16 weight's float32 copy holds values rounded to bf16
            u, sub = S.UNIT_ROUNDOFF.get(dtype, 0.0), S.SMALLEST_SUBNORMAL.get(dtype, 0.0)
            max_abs, g_absmax = _num(row.get("MaxAbsoluteError")), _num(row.get("GoldenAbsMax"))
            if S.UNIT_ROUNDOFF.get(_str(row.get("GoldenDataType")), 1.0) < u \
                    and max_abs <= max(u * g_absmax, sub / 2) * (1 + 1e-6):
                # every element within half a spacing of the golden's: the golden's value
                # rounded to this dtype (a model cast to float16 whose 1e-6 layer scale is
                # subnormal there: 27 u of relative error, no element off by more)
                return (RESULT_PASS, f"input {_str(row.get('TensorName'))}: the golden's value rounded to {dtype} "
                        f"(max abs error {max_abs:.3g} <= half a spacing); {res[1]}", res[2], res[3]) + _NO_DECISION
            return (RESULT_FAIL, f"input {_str(row.get('TensorName'))} differs from the golden's and no op of the "
                    f"step made it (a parameter, a buffer or the data fed in): {res[1]}") + res[2:]
    return res


def _args_departure(row: dict, res: tuple, changed: str) -> tuple:
    """A passing row of an op that ran with other plain arguments than the golden's fails all
    the same: the run departs there, whatever the size of the effect. A weight decay of 0.1
    against 0.01 makes AdamW's `mul_` by 1 - lr * wd differ by 9e-5 relative, under float32's
    1e-4 floor, and 10x the decay passed; a replay fails it as an argument departure
    (npu_dumper/replay/departures.check_arguments). What a precision or device change explains
    (a dtype, a device, a dtype's extreme value) is not in `changed` (rows.args_differ)."""
    if not changed or res[0] != RESULT_PASS:
        return res
    red = _num(row.get("RelativeEuclideanDistance"))
    size = "" if math.isnan(red) else f"; its result is within tolerance of the golden's (RelErr {red:.3g})"
    # (Severity infinite, as a departure's: no bound could pass it)
    return (RESULT_FAIL, f"{ARGS_NOTE} {changed}: {ARGS_DEPARTURE}{size}",
            math.inf, res[3], ARGS_DECIDED_BY, ARGS_DECIDED_BY, math.nan, math.nan)


def _judge(row: dict, th: Mapping[str, float], *, fp64: bool, independent: bool) -> tuple:
    status = _status(row)
    reason = _str(row.get("CompareFailReason"))
    if status == STATUS_DEPARTURE:
        return _judge_departure(row, reason, th)
    if status == STATUS_UNPAIRED_OP:
        if _str(row.get("EndsStep")) == "True":
            # an op only one run has whose result the step ends with (a weight's gradient
            # sum, compare/departures.step_result_departures): nothing after it can differ
            # and show it, so it fails itself
            return (RESULT_FAIL, reason, math.inf, math.nan) + ("Departure", "Departure", math.nan, math.nan)
        return (RESULT_UNMATCHED, reason, math.nan, math.nan) + _NO_DECISION
    if status == "unmatched":
        return (RESULT_UNMATCHED, reason or "no pair in the other dump", math.nan, math.nan) + _NO_DECISION
    if status in _SKIPPED_STATUSES:
        return (RESULT_SKIPPED, reason, math.nan, math.nan) + _NO_DECISION
    if status in ("size_mismatch", "corrupt"):
        return (RESULT_FAIL, reason or status, math.inf, math.nan) + ("CompareStatus", status, math.nan, math.nan)
    if _num(row.get("NonFiniteMismatch")) > 0:
        scale = _num(row.get("LossScale"))
        if scale > 1 and _num(row.get("TargetNonFinite")) > 0:
            # dynamic loss scaling at work, not a kernel's fault: the step differs all the same
            reason = (f"{reason or 'NaN/Inf on one side only'} [the target's gradients overflowed under "
                      f"the loss scale {scale:g}: GradScaler skips this step's update and lowers the scale; "
                      f"compare a step after the scale has settled]")
        return (RESULT_FAIL, reason or "NaN/Inf on one side only", math.inf, math.nan) + (
            "NonFiniteMismatch", "NonFiniteMismatch", _num(row.get("NonFiniteMismatch")), 0.0)

    red = _num(row.get("RelativeEuclideanDistance"))
    red_note = ""
    if math.isnan(red):
        cos = _num(row.get("CosineSimilarity"))
        if not math.isnan(cos):
            red = math.sqrt(max(0.0, 1.0 - min(cos, 1.0) ** 2))   # sin(angle) <= RED
            red_note = " (lower bound from cosine)"
    if status == "stats":
        red_note = " (lower bound from statistics)"
    max_abs = _num(row.get("MaxAbsoluteError"))
    g_absmax = _num(row.get("GoldenAbsMax"))
    failures: list[str] = []
    severity = 0.0
    tol = th.get("Tolerance", 1.0)
    decided: list = []            # (severity, knob, metric, value, bound) of the failing tests
    rel_bound, rel_knob = 0.0, ""  # the relative-error bound in effect (one knob per idea)
    ill = ""                       # own-error rows: the input rounding alone left no correct digit
    at_resolution = ""             # own-error rows: every element within a few subnormal spacings

    def check(value: float, bound: float, what: str, knob: str = "", metric: str = "",
              unit: float = 1.0) -> None:
        nonlocal severity
        if math.isnan(value):
            return
        s = value / bound if bound > 0 else (0.0 if value <= 0 else math.inf)
        severity = max(severity, s)
        if value > bound:
            failures.append(f"{what} {value:.3g} > {bound:.3g}")
            decided.append((s, knob, metric, value / unit, bound / unit))

    dtypes = (_str(row.get("DataType")), _str(row.get("GoldenDataType")))
    exact = all(_is_exact_dtype(d) for d in dtypes if d) and any(dtypes)
    ulps = math.nan
    if exact:
        check(red if not math.isnan(red) else max_abs, th["ExactTolerance"] * tol,
              f"{'/'.join(d for d in dtypes if d)} values differ: RelativeEuclideanDistance{red_note}",
              "ExactTolerance", "RelativeEuclideanDistance" if not math.isnan(red) else "MaxAbsoluteError")
        mism = _num(row.get("ExactMismatches"))
        if not failures and th["ExactTolerance"] <= 0 and mism > 0:
            # counted on the native values: a difference float64 cannot show (int64 above
            # 2**53) or no relative metric can (a bool/int golden that is all zero)
            severity = math.inf
            failures.append(f"{'/'.join(d for d in dtypes if d)} values differ: {mism:.0f} element(s)")
            decided.append((math.inf, "ExactTolerance", "ExactMismatches", mism, 0.0))
    else:
        u, prec = _unit_roundoff(row)
        t64, g64 = _num(row.get("TargetErrorVsFp64")), _num(row.get("GoldenErrorVsFp64"))
        own = _num(row.get("OwnErrorVsFp64"))
        if "RelativeEuclideanDistance" in _user(th):
            rel_bound, rel_knob = th["RelativeEuclideanDistance"], "RelativeEuclideanDistance"
            check(red, rel_bound, f"RelativeEuclideanDistance{red_note}",
                  "RelativeEuclideanDistance", "RelativeEuclideanDistance")
            ulps = red / u
        elif not math.isnan(own):
            # load-replay that rounded the op's inputs: judge what the op added to what it was
            # given (the target vs float64 on the same rounded inputs); the rest of its
            # distance from the golden is the rounding of its inputs, reported, not judged
            # a result whose largest value is subnormal in its dtype has fewer bits: its unit
            # roundoff is half the subnormal spacing relative to that value (Whisper fp16: a
            # flash-attention grad_query of max 5.4e-7, one spacing 6e-8 off, is 11% off)
            ref_max = _num(row.get("OwnRefAbsMax"))
            sub = S.SMALLEST_SUBNORMAL.get(prec)
            sub_txt = ""
            if sub and ref_max > 0 and sub / (2 * ref_max) > u:
                u = sub / (2 * ref_max)
                sub_txt = f" subnormal: max|ref| {ref_max:.2g}, u {u:.2g}"
            # the bound by op class (op_policies.bound_class): a correctly rounded elementwise op
            # may add what rounding its result allows; a sum that cancels, its kappa x u
            cls = bound_class(_str(row.get("NPUDump")), _str(row.get("TensorName")))
            ulps_knob = "PointwiseUlps" if cls == CLASS_POINTWISE else "RelativeEuclideanDistanceUlps"
            by_u, floor = th[ulps_knob] * u, th["RelativeEuclideanDistanceFloor"]
            kappa = _num(row.get("OwnCancellation"))
            kappa_txt = ""
            if cls == CLASS_SUM and not math.isnan(kappa):
                if kappa * u >= 1.0:
                    # (set before `ill` below is: the own-error rule of load-replay may restate it)
                    ill = (f"ill-conditioned: a sum whose terms cancel (sum|terms| / |sum| = {kappa:.3g}): one "
                           f"rounding of a partial sum in {prec} is >= 100% of the result; its own error "
                           f"{own:.3g} ({own / u:.3g} u) is rounding noise, not judged")
                if th["SumCancellationFactor"] * kappa * u > by_u:
                    by_u, ulps_knob = th["SumCancellationFactor"] * kappa * u, "SumCancellationFactor"
                kappa_txt = f", sum|terms|/|sum| {kappa:.3g}"
            rel_bound = max(by_u, floor) * tol
            rel_knob = ulps_knob if by_u >= floor else "RelativeEuclideanDistanceFloor"
            red_txt = "" if math.isnan(red) else (
                f"; vs golden {red:.3g} ({red / u:.3g} u), the rest " +
                ("inherited from earlier ops" if independent else "input rounding"))
            given = "its own inputs" if independent else "its rounded inputs"
            # a compiled golden's node measured (rows.tasks_for_pair golden_own): a failure is
            # the golden's op, and the sentence says so
            whose = "the golden's " if _str(row.get("OwnErrorOf")) == "golden" else ""
            check(own, rel_bound, f"{whose}own error vs fp64 on {given} ({own / u:.3g} u of {prec}{sub_txt}{kappa_txt}"
                  f"{red_txt})", rel_knob, "GoldenOwnErrorVsFp64" if whose else "OwnErrorVsFp64",
                  unit=u if rel_knob.endswith("Ulps") else 1.0)
            ulps = own / u
            if not math.isnan(red) and red - own >= 1.0 and not independent:
                # |ref - golden| >= red - own: rounding the inputs to this dtype alone moved the
                # exact result by more than its size (a cancelling sum that is 0 in exact
                # arithmetic: MobileViT's LayerNorm grad_bias before a BatchNorm); the kernel's
                # internal roundings move it as much: noise, as in the ill-conditioned rule
                ill = (f"ill-conditioned: rounding the inputs to {prec} alone moves the exact result by "
                       f"{red - own:.3g} of its size (vs golden {red:.3g}); the op's own error {own:.3g} "
                       f"({own / u:.3g} u) is rounding noise amplified (cancellation), not judged")
            own_max = _num(row.get("OwnMaxErrorVsFp64"))
            spacing = max(sub, 2 * u * ref_max) if sub and ref_max > 0 else math.nan
            if ref_max < 16 * S.SMALLEST_NORMAL.get(prec, 0.0) and own_max <= SUBNORMAL_SPACINGS * spacing:
                # a result near its dtype's underflow edge (max |ref| below 16x the smallest
                # normal) holds subnormal elements whose last bit is a large relative error;
                # every element within a few spacings of the largest is all the format resolves
                # (MobileViT fp16: BatchNorm outputs of max 3e-4, 6-17 u of relative error from
                # 1-2 spacings off)
                at_resolution = (f"own MaxAbsoluteError {own_max:.3g} <= {SUBNORMAL_SPACINGS:g} spacings "
                                 f"({spacing:.2g}) of {prec} at max|ref| {ref_max:.2g}, near its underflow edge: "
                                 f"at the format's resolution")
            if "MaxAbsoluteError" not in _user(th) and not math.isnan(own_max):
                if ref_max > 0:
                    by_u, floor = th["MaxAbsoluteErrorUlps"] * u, th["MaxAbsoluteErrorFloor"]
                    bound = max(by_u, floor) * tol
                    knob = "MaxAbsoluteErrorUlps" if by_u >= floor else "MaxAbsoluteErrorFloor"
                    if rel_bound > bound:       # one knob per idea, as below
                        bound, knob = rel_bound, rel_knob
                    check(own_max / ref_max, bound, f"{whose}own MaxAbsoluteError/max|ref| (vs fp64 on {given})",
                          knob, f"{'Golden' if whose else ''}OwnMaxErrorVsFp64/OwnRefAbsMax",
                          unit=u if knob.endswith("Ulps") else 1.0)
                else:
                    check(own_max, th["MaxAbsoluteErrorFloor"] * tol,
                          "fp64 reference is all zero; own MaxAbsoluteError", "MaxAbsoluteErrorFloor",
                          "OwnMaxErrorVsFp64")
                max_abs = math.nan      # judged above, against what the op was given
            _check_rounding_sides(row, th, check, whose)
        elif fp64 and not (math.isnan(t64) or math.isnan(g64)):
            g_dtype = _str(row.get("GoldenDataType"))
            u_golden = S.UNIT_ROUNDOFF.get(g_dtype, u)
            if g64 * u / min(u_golden, u) >= 1.0:
                # The golden device's own error, carried to the target's precision (the op's
                # amplification g64/u_golden times u), is >= 100%: the result holds no correct
                # digit at this precision (catastrophic cancellation); nothing to judge.
                return (RESULT_SKIPPED,
                        f"ill-conditioned: the golden's own error vs fp64 is {g64:.3g} ({g_dtype or 'golden dtype'}),"
                        f" i.e. {g64 * u / min(u_golden, u):.3g} at {prec}: the result is rounding noise"
                        f" (cancellation), not judged", math.nan, t64 / u) + _NO_DECISION
            by_golden = th["Fp64Factor"] * g64 + th["Fp64FloorUlps"] * u
            plain = th["RelativeEuclideanDistanceUlps"] * u
            rel_bound = max(by_golden, plain) * tol
            rel_knob = "Fp64Factor" if by_golden >= plain else "RelativeEuclideanDistanceUlps"
            check(t64, rel_bound, f"error vs fp64 (golden's own {g64:.3g}; {prec})", rel_knob,
                  "TargetErrorVsFp64", unit=u if rel_knob.endswith("Ulps") else 1.0)
            ulps = t64 / u
        else:
            by_u, floor = th["RelativeEuclideanDistanceUlps"] * u, th["RelativeEuclideanDistanceFloor"]
            kappa = _num(row.get("RoundedInputCancellation"))
            kappa_txt = ""
            if not math.isnan(kappa):
                # a load-replay (no own error) rounded the terms of this sum to the target's
                # dtype: that alone moves it by up to kappa * u of its size (cancellation.py)
                if kappa * u >= 1.0:
                    # no bound that size means anything: not judged, whatever the difference
                    return (RESULT_SKIPPED,
                            f"ill-conditioned: a sum whose terms the replay rounded to {prec} (sum|terms|/|sum| "
                            f"= {kappa:.3g} in the golden): that rounding alone moves it by up to {kappa * u:.3g} "
                            f"of its size; its difference {red:.3g} ({red / u:.3g} u) is not judged (a replay "
                            f"with own_error=True measures the op itself)", math.nan, red / u) + _NO_DECISION
                by_u += kappa * u
                kappa_txt = f", + {kappa:.3g} u the replay's rounding of its terms moves it by"
            rel_bound = max(by_u, floor) * tol
            rel_knob = "RelativeEuclideanDistanceUlps" if by_u >= floor else "RelativeEuclideanDistanceFloor"
            check(red, rel_bound, f"RelativeEuclideanDistance{red_note} ({red / u:.3g} u of {prec}{kappa_txt})",
                  rel_knob, "RelativeEuclideanDistance", unit=u if rel_knob.endswith("Ulps") else 1.0)
            ulps = red / u
        if "MaxAbsoluteError" in _user(th):
            check(max_abs, th["MaxAbsoluteError"], "MaxAbsoluteError", "MaxAbsoluteError", "MaxAbsoluteError")
        elif not math.isnan(max_abs):
            if g_absmax > 0:
                rel = max_abs / g_absmax
                by_u, floor = th["MaxAbsoluteErrorUlps"] * u, th["MaxAbsoluteErrorFloor"]
                bound = max(by_u, floor) * tol
                # never stricter than the relative-error bound in effect: a user who loosens
                # that one idea is not stopped by a second rule for the same size of error
                knob = "MaxAbsoluteErrorUlps" if by_u >= floor else "MaxAbsoluteErrorFloor"
                if rel_bound > bound:
                    bound, knob = rel_bound, rel_knob
                check(rel, bound, f"MaxAbsoluteError/max|golden|{red_note}", knob,
                      "MaxAbsoluteError/GoldenAbsMax", unit=u if knob.endswith("Ulps") else 1.0)
            elif g_absmax == 0:
                # golden all zero: relative measures are undefined, judge the absolute error
                check(max_abs, th["MaxAbsoluteErrorFloor"] * tol, "golden is all zero; MaxAbsoluteError",
                      "MaxAbsoluteErrorFloor", "MaxAbsoluteError")
    for name, bound in _user(th).items():
        if name in ("RelativeEuclideanDistance", "MaxAbsoluteError"):
            continue
        v = _num(row.get(name))
        if math.isnan(v):
            continue
        if METRICS[name].higher_is_better:
            if v < bound:
                failures.append(f"{name} {v:.6g} < {bound:.6g}")
                s = (1 - v) / (1 - bound) if bound < 1 else math.inf
                severity = max(severity, s)
                decided.append((s, name, name, v, bound))
        else:
            check(v, bound, name, name, name)
    if failures and ill:
        return (RESULT_SKIPPED, ill, math.nan, ulps) + _NO_DECISION
    if failures and at_resolution:
        return (RESULT_PASS, f"{at_resolution}; {'; '.join(failures)}", 0.0, ulps) + _NO_DECISION
    if failures:
        # judged by its own error (vs float64 rounded to its dtype, underflow included): no
        # underflow or cancellation excuse applies, the reference already had both
        own_judged = not exact and not math.isnan(_num(row.get("OwnErrorVsFp64")))
        hint = "" if exact or own_judged else _failure_hint(_unit_roundoff(row)[1], g_absmax, red,
                                              _str(row.get("GoldenDataType")))
        _, knob, metric, value, bound = max(decided, key=lambda d: d[0]) if decided else (0, "", "", math.nan,
                                                                                           math.nan)
        return (RESULT_FAIL, "; ".join(failures) + hint, severity, ulps, knob, metric, value, bound)
    if math.isnan(red) and math.isnan(max_abs) and all(math.isnan(_num(row.get(m))) for m in METRICS
                                                        if METRICS[m].numeric):
        # nothing measurable (e.g. every element NaN on both sides, or stats-only with no bound)
        return (RESULT_SKIPPED if status != "stats" else RESULT_PASS, reason or "no metric", severity,
                ulps) + _NO_DECISION
    return (RESULT_PASS, "", severity, ulps) + _NO_DECISION


def _user(th: Mapping[str, float]) -> dict[str, float]:
    return {k: v for k, v in th.items() if k in METRICS}


def apply_verdict(table: pd.DataFrame, thresholds: Mapping[str, float] | None = None) -> pd.DataFrame:
    """A copy of `table` with Result, FailReason, Severity and ErrorUlps (re-runnable)."""
    if not isinstance(table, pd.DataFrame):
        raise VerdictError("apply_verdict needs a pandas DataFrame")
    th = thresholds_with(thresholds)
    out = table.copy()
    fp64 = "TargetErrorVsFp64" in out.columns and "GoldenErrorVsFp64" in out.columns
    verdicts = [judge_row(r, th, fp64=fp64) for r in out.to_dict(orient="records")]
    cols = list(zip(*verdicts)) if verdicts else [[]] * len(VERDICT_COLUMNS)
    results, reasons, severity, ulps = list(cols[0]), list(cols[1]), list(cols[2]), list(cols[3])
    before = list(results)
    # per-op rules (accucmp/compare/op_policies.py): tie-dependent indices, known kernel accuracy,
    # and which failing op caused its error rather than inherited it
    origin = apply_op_policies(out, results, reasons, severity, ulps, absorbed_at=th["UpdateAbsorbedFraction"])
    for i, (r, why) in enumerate(zip(results, reasons)):
        if r == RESULT_PASS and why.startswith(INHERITED_NOTE + ":"):
            origin[i] = INHERITED_NOTE       # passes, yet differs from the golden: counted by the summary
        elif r == RESULT_FAIL and why.startswith(ARGS_NOTE + " "):
            origin[i] = "caused here"        # the op got other arguments: the difference starts here
        elif r == RESULT_FAIL and NOT_PASSED_NOTE in why:
            origin[i] = INHERITED_NOTE       # within its own error: the difference came from upstream
    out["Result"] = results
    out["FailReason"] = _op_underflow_hints(out, reasons)
    out["Severity"] = np.asarray(severity, dtype=np.float64)
    out["ErrorUlps"] = np.asarray(ulps, dtype=np.float64)
    # which test decided: none where a per-op rule changed the verdict (its reason says why)
    changed = [a != b for a, b in zip(before, results)]
    decided = [list(d) for d in zip(*cols[4:8])] if verdicts else []
    for i, (r, why) in enumerate(zip(results, reasons)):
        if changed[i]:
            decided[i] = ["", "", math.nan, math.nan]
        elif r == RESULT_FAIL and RANDOM_DRAWS in why:
            # no bound: the runs drew other random numbers (op_policies._random_departure)
            decided[i] = [RANDOM_DECIDED_BY, RANDOM_DECIDED_BY, math.nan, math.nan]
    out["DecidedBy"] = [d[0] for d in decided]
    out["DecidingMetric"] = [d[1] for d in decided]
    out["DecidingValue"] = np.asarray([d[2] for d in decided], dtype=np.float64)
    out["DecidingBound"] = np.asarray([d[3] for d in decided], dtype=np.float64)
    out["Origin"] = origin
    return out


@dataclass(frozen=True, slots=True)
class Judged:
    """The verdict stage's result, handed to the outputs (streaming.compare_to_csv, report/):
    a Measured batch's rows with the verdict columns added."""

    table: pd.DataFrame
    first: int                  # the Index of its first row


def judge(batch: "Measured", thresholds: Mapping[str, float] | None = None) -> Judged:
    """The verdict stage: apply_verdict on one batch of the metrics stage."""
    return Judged(apply_verdict(batch.table, thresholds), batch.first)


def _op_underflow_hints(table: pd.DataFrame, reasons: list[str]) -> list[str]:
    """A failing row whose op has another tensor at its precision's underflow edge (a float16
    gradient below 6.1e-5 read by a backward op makes its other outputs wrong too) says so."""
    need = ("Result", "NPUDump", "SeqId", "GoldenAbsMax", "PrecisionDtype")
    if table.empty or any(c not in table.columns for c in need):
        return reasons
    names = [f"{_str(i)}/{_str(n)}".strip("/") for i, n in
             zip(table.get("IO", [""] * len(table)), table.get("TensorName", [""] * len(table)))]
    absmax = pd.to_numeric(table["GoldenAbsMax"], errors="coerce").tolist()
    by_op: dict[tuple, list[int]] = {}
    for i, (op, sq) in enumerate(zip(table["NPUDump"].tolist(), table["SeqId"].tolist())):
        if _str(op) and not pd.isna(sq):
            by_op.setdefault((op, int(sq)), []).append(i)
    out = list(reasons)
    for rows in by_op.values():
        for i in rows:
            if table["Result"].iat[i] != RESULT_FAIL or "underflow" in out[i]:
                continue
            prec = _str(table["PrecisionDtype"].iat[i])
            tiny = S.SMALLEST_NORMAL.get(prec)
            if not tiny:
                continue
            edge = [j for j in rows if j != i and 0 < absmax[j] < 4 * tiny]
            if edge:
                j = edge[0]
                out[i] += (f" [this op's {names[j]} has golden max|x| {absmax[j]:.2g}, near or below {prec}'s "
                           f"smallest normal {tiny:.2g}: the op handles values that underflow in {prec} "
                           f"(what loss scaling is for), not necessarily a kernel bug]")
    return out

