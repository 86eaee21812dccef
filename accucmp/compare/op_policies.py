"""Per-op verdict policy, kept as data (torch-free: `accucmp compare` must not import torch).

Applied by `verdict.apply_verdict` after each row is judged on its own, since each rule needs
an op's rows together:

* TIE_INDICES: integer outputs that say *which* element won a comparison (max-pool indices,
  max/min/topk/sort/kthvalue/... `indices`, argmax). Rounding the inputs to bf16/fp16 creates
  ties, and a tie may pick another index although the op is right: these rows are judged by
  the values they select (the op's values output; fail only if that fails) or, without a
  values output (argmax), skipped with the reason where the op's precision is coarser than
  float32 (else exact, as any integer). The generic rule reads the op's schema
  return names as the dump records them (an integer output named `indices` beside a
  `values` output: max.dim, topk, sort, kthvalue, mode, median, cummax, ...); ops whose
  schema leaves the returns unnamed are listed (tests/test_op_policies.py checks the list
  against torch's schemas).
* KNOWN_KERNEL_ERROR: outputs whose reference kernel is known to be less accurate than the
  default bound at low precision (measured, see docs/COMPARE.md). Within the listed bound
  the row passes with the finding named ("known kernel accuracy: ..."); beyond it, it fails.
* Origin (column): for each failing op, "caused here" when none of its input rows fails
  (every input still agrees: the error starts at this op; a load-replay dump stores no
  inputs, its ops got the golden's) and "inherited" when an input already fails, or when
  EXPLAINED_BY_INPUTS says the inputs' small difference explains the output's; "underflow"
  when the inputs agree and the failing outputs sit at their dtype's underflow edge (float16
  values below ~2.4e-4: the format's range, what loss scaling is for).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pandas as pd

from dumpfile.departures import is_collective_op
from dumpfile.opclass import CASTS, sum_outputs
from dumpfile.schema import LARGEST_FINITE, OVERFLOW_THRESHOLD, SMALLEST_NORMAL, UNIT_ROUNDOFF, coarser

from accucmp.compare.departures import STATUS_DEPARTURE, STATUS_UNPAIRED_OP, leaf_sentence, with_measure
from accucmp.compare.rows import STATUS_UNMATCHED

ORIGIN_CAUSED = "caused here"
ORIGIN_INHERITED = "inherited"
ORIGIN_UNDERFLOW = "underflow"      # inputs agree, output at its dtype's underflow edge
ORIGIN_OVERFLOW = "overflow"        # output (or input) NaN/Inf where the golden's exceeds the dtype's range
ORIGIN_DEPARTURE = "departs"        # the run itself departs here: an op inserted/missing, an argument, an input
ORIGIN_AMPLIFIED = "amplified"      # a correct elementwise op turns its inputs' rounding into a large error
# AMPLIFIED rule (_amplified): an elementwise op (POINTWISE) that computed right on its inputs
# (its row passes: its own error, or no input failing, excuses it) whose inputs differ from the
# golden's by no more than their rounding, while its output differs by at least this many units
# of its precision and this many times its inputs' largest difference: the precision cannot
# carry the computation there (RoPE angles in bfloat16: an angle of 1,000 rad is rounded by up
# to 4 rad, and cos/sin come out 80 u off from inputs 0.4 u off; every op was right on what it
# got, and the run passed while its loss differed by 0.8%). Clean bf16/fp16 runs of the models
# in docs/COMPARE.md amplify by at most ~6x in such ops.
AMPLIFIED_MIN_ULPS = 32.0
AMPLIFIED_FACTOR = 32.0
# the inputs' difference that is their rounding alone (a cast rounds by at most 1 u; 2 allows
# one op's rounding on top)
AMPLIFIED_INPUT_ULPS = 2.0
ORIGIN_ABSORBED = "absorbed"        # an update of state rounded away by the target's dtype
# ABSORBED rule (_absorbed): an in-place update of the state a step starts from (a parameter,
# an optimizer moment, an EMA; op attribute persistent_writes) whose target dtype is coarser
# than the golden's, where at least the threshold UpdateAbsorbedFraction of the elements the
# golden's update changed kept their old value in the target because the change is within a
# spacing of its dtype (column UpdateAbsorbed, compare/absorption.py). Each value is within
# rounding of the golden's and the op computed right on what it got, so the row passed; but
# the target does not learn what the golden learns (pure-bfloat16 AdamW: weight decay and
# every LayerNorm weight's step are rounded away; at lr 1e-5, 97% of a layer's weights).
# dtypes with float32's exponent range: a cast to them rounds by at most a unit (no underflow)
_FULL_RANGE = ("bfloat16",)
# FailReason of an output row that fails only because its op ran with other arguments than the
# golden's (verdict._args_departure): not a size of error, so never explained by its inputs
ARGS_DEPARTURE = "the op ran with other arguments than the golden's"
# FailReason clause of a row right on what it got (its own error) whose golden values its dtype
# cannot hold, below the normal range (verdict.judge_row, column RangeLoss): Origin underflow
UNDERFLOW_CLAUSE = "underflow: the golden's values lie below the normal range of"
# FailReason of a random op's output (column RandomOp: dropout's bernoulli_, randn) that fails
# while the op's inputs agree: the runs drew other numbers, an input no file holds (the
# generator's state); where the runs depart, not the kernel's error nor inherited
RANDOM_DRAWS = "draws other random numbers than the golden run"

# packet -> (indices output, values output or "" when the op returns indices only)
TIE_INDICES: dict[str, tuple[str, str]] = {
    "aten.max_pool1d_with_indices": ("result1", "result0"),
    "aten.max_pool2d_with_indices": ("result1", "result0"),
    "aten.max_pool3d_with_indices": ("result1", "result0"),
    "aten.adaptive_max_pool1d": ("result1", "result0"),
    "aten.adaptive_max_pool2d": ("result1", "result0"),
    "aten.adaptive_max_pool3d": ("result1", "result0"),
    "aten.fractional_max_pool2d": ("result1", "result0"),
    "aten.fractional_max_pool3d": ("result1", "result0"),
    "aten.argmax": ("result", ""),
    "aten.argmin": ("result", ""),
}


@dataclass(frozen=True)
class KnownKernelError:
    ulps: float            # the row passes up to this many unit roundoffs of its precision
    dtypes: tuple[str, ...]
    finding: str


# (packet, output name) -> finding. Measured on clean fp32 -> bf16/fp16 load-replays of
# third-party models (tests/test_real_models.py), against float64 on the same rounded inputs.
KNOWN_KERNEL_ERROR: dict[tuple[str, str], KnownKernelError] = {
    ("aten.native_layer_norm_backward", "result2"): KnownKernelError(
        32.0, ("bfloat16", "float16"),
        "PyTorch's CPU LayerNorm-backward grad_bias at reduced precision (measured 10-17 u vs float64 "
        "on its own inputs; single-threaded it adds the rows one by one in the input's dtype, so the "
        "error grows with the rows summed: 45.7 u on timm Swin's 784 rows, each row's gradient "
        "small against the running sum)"),
    ("aten.native_layer_norm_backward", "result1"): KnownKernelError(
        48.0, ("bfloat16", "float16"),
        "PyTorch's CPU LayerNorm-backward grad_weight at reduced precision (measured up to 17 u vs "
        "float64 on its own inputs; 37 u of a float16 grad_weight of max 4.5e-5, near the underflow "
        "edge, in Swin)"),
    # grad_query/grad_key = (P * (dP - D)) @ K / Q: a difference that cancels, formed from
    # reduced-precision intermediates; grad_value (P^T @ dO) stays within a few u
    ("aten._scaled_dot_product_flash_attention_for_cpu_backward", "grad_query"): KnownKernelError(
        128.0, ("bfloat16", "float16"),
        "PyTorch's CPU flash-attention backward grad_query at reduced precision (measured 57-85 u of "
        "float16 vs float64 on its own inputs)"),
    ("aten._scaled_dot_product_flash_attention_for_cpu_backward", "grad_key"): KnownKernelError(
        128.0, ("bfloat16", "float16"),
        "PyTorch's CPU flash-attention backward grad_key at reduced precision (measured 57-75 u of "
        "float16 vs float64 on its own inputs)"),
}

# Outputs whose error a small input difference explains, for the Origin rule of plain dumps
# (two independent runs: every input differs a little, and these outputs amplify it).
# "statistics": a normalisation's saved mean / inverse std (a mean of values that nearly
# cancel); when the op's main output (result0) passes, their failure is the inputs' difference
# amplified, not an error of the op. "mask": below. "sum": a reduction's output is caused here only when its
# absolute error exceeds what its inputs' errors can add up to (max input error x elements
# summed per output): a bias gradient that is 0 in exact arithmetic is 100% off from rounding
# noise alone.
EXPLAINED_BY_INPUTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "aten.native_layer_norm": ("statistics", ("result1", "result2")),
    "aten.native_batch_norm": ("statistics", ("result1", "result2")),
    "aten._native_batch_norm_legit": ("statistics", ("result1", "result2")),
    "aten._native_batch_norm_legit_functional": ("statistics", ("result1", "result2")),
    "aten.native_group_norm": ("statistics", ("result1", "result2")),
    "aten.sum": ("sum", ()),
    "aten.mean": ("sum", ()),
    # the output keeps or zeroes each element by comparing an input with a threshold: an
    # input element near it flips in the other run (a ReLU mask), and that element is then
    # off by its whole value (max error >= a quarter of max |golden|); a fault that scales
    # the result is off by its few percent everywhere instead
    "aten.threshold_backward": ("mask", ()),
    "aten.hardtanh_backward": ("mask", ()),
}

# Every op, plain dumps: an output whose relative error (ErrorUlps) is within the sum of its
# two worst inputs' plus this many units carries its inputs' error (a product's relative
# error is the sum of its factors', a copy's or a sum's of like signs at most the worst
# input's) plus its own rounding; it failed because its inputs were already near their
# bound, not because of this op (T5 bf16: an mm with an input at 5.97 u gave 6.11 u > 6 u).
# A 5-10% fault is 13-26 u of bfloat16 and 100-200 u of float16 on inputs of a few units.
CARRIED_ERROR_MARGIN_ULPS = 3.0
# ... times this factor: the norm-wise error of an elementwise product is not bounded by the
# sum of its factors' norm-wise errors (the error may sit on the elements the product keeps
# large; Llama fp16: inputs at 64.7 and 0.79 u gave 78.1 u)
CARRIED_ERROR_FACTOR = 1.25
# an input failing by at most this multiple of its bound is accumulated rounding of two
# independent low-precision runs (T5 bf16: 8.99 u against 6 u), not an upstream fault
MARGINAL_SEVERITY = 2.0

# ---- bounds by op class (own-error rows: the op judged against float64 on its own inputs) ----
CLASS_POINTWISE = "pointwise"     # correctly rounded elementwise: PointwiseUlps
CLASS_SUM = "sum"                 # a sum of one input's terms: widened by how much it cancels
CLASS_DEFAULT = ""                # accumulating ops (mm, conv, norms, ...): RelativeEuclideanDistanceUlps

# Elementwise ops whose CPU/GPU kernels compute each element in float32 (or wider) and round it
# once to the output dtype, so against float64 on the same inputs they are off by what rounding
# the result allows (<= 0.5 u, 1 u where rounding float32 then bfloat16 rounds twice). These are
# ops torch tags `pointwise` (torch.Tag.pointwise; the dump does not record tags, so the list is
# data, checked against torch's tags by tests/test_op_policies.py). Left out on purpose: ops a
# kernel may evaluate through a reduced-precision intermediate or a polynomial at the output's
# precision (pow with a tensor exponent, lerp, addcdiv, erfinv, the *_backward of
# non-monotonic functions) and casts (`_to_copy`: exact, judged by the default rule anyway).
POINTWISE: frozenset[str] = frozenset(f"aten.{n}" for n in (
    "abs", "neg", "add", "sub", "mul", "div", "rsub", "reciprocal", "sqrt", "rsqrt", "exp", "exp2",
    "expm1", "log", "log1p", "log2", "sin", "cos", "tanh", "sigmoid", "erf", "gelu", "silu",
    "relu", "leaky_relu", "elu", "softplus", "hardtanh", "hardsigmoid", "mish",
    "clamp", "clamp_min", "clamp_max", "maximum", "minimum", "where", "threshold_backward",
    "gelu_backward", "silu_backward", "sigmoid_backward", "tanh_backward", "square",
))


# ops one of two independent runs may have and the other not, by design: dtype casts that
# autocast or a model cast adds (and the copies a cast makes). Any other op with no partner is
# a difference in what the runs do (an inserted or missing op), so no row passes as inherited
# (verdict.judge_row); the structural headline names it.
BY_DESIGN_UNPAIRED: frozenset[str] = CASTS | frozenset((
    "aten.clone", "aten.copy_", "aten._foreach_copy_", "aten.detach", "aten.alias", "aten.view", "aten._unsafe_view"))


# ops each of whose result elements is computed apart from the others, from its own inputs:
# elementwise ops and the products whose elements are dot products. A correct kernel's
# rounding errors there are independent, as often on one side of the correctly rounded result
# as on the other (verdict's RoundingBias); an op that applies one computed value to many
# elements (a norm's statistics, a softmax's sum) moves them together
INDEPENDENT_ELEMENTS: frozenset[str] = POINTWISE | frozenset(
    f"aten.{n}" for n in ("mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "_grouped_mm",
                          "convolution", "_convolution"))


def independent_elements(op: str) -> bool:
    """Whether each result element of `op` (a row's NPUDump) is computed apart from the others."""
    return packet(op) in INDEPENDENT_ELEMENTS


def bound_class(op: str, output: str) -> str:
    """The bound class of output `output` of `op` (a table row's NPUDump and TensorName)."""
    if output in sum_outputs(op):
        return CLASS_SUM
    if packet(op) in POINTWISE:
        return CLASS_POINTWISE
    return CLASS_DEFAULT


_INT_DTYPES = ("int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64")


def packet(op: str) -> str:
    """'aten.max.dim' -> 'aten.max', 'aten.relu.default' -> 'aten.relu' (namespace.name)."""
    parts = str(op).split(".")
    return ".".join(parts[:2]) if len(parts) >= 3 else str(op)


def tie_values_output(op: str, name: str, row_names: set[str]) -> tuple[bool, str]:
    """(whether output `name` of `op` is tie-dependent indices, the values output or "")."""
    rule = TIE_INDICES.get(packet(op))
    if rule is not None:
        return (name == rule[0], rule[1])
    if name == "indices" and "values" in row_names:       # the schema's own return names
        return True, "values"
    return False, ""


def _s(v: Any) -> str:
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) or v is pd.NA else str(v)


def apply_op_policies(table: pd.DataFrame, results: list[str], reasons: list[str],
                      severity: list[float], ulps: list[float], absorbed_at: float = math.inf) -> list[str]:
    """Rewrites results/reasons/severity in place by the rules above; returns the Origin column.
    `absorbed_at`: the ABSORBED rule's share (threshold UpdateAbsorbedFraction; inf: off)."""
    n = len(table)
    origin = [""] * n
    if n == 0 or "NPUDump" not in table.columns:
        return origin
    ops = table["NPUDump"].tolist()
    seq = table["SeqId"].tolist() if "SeqId" in table.columns else [i for i in range(n)]
    io = table["IO"].tolist() if "IO" in table.columns else ["output"] * n
    names = table["TensorName"].tolist() if "TensorName" in table.columns else [""] * n
    dtypes = table["DataType"].tolist() if "DataType" in table.columns else [""] * n
    prec = table["PrecisionDtype"].tolist() if "PrecisionDtype" in table.columns else [""] * n
    status = table["CompareStatus"].tolist() if "CompareStatus" in table.columns else [""] * n
    leaf = table["Leaf"].tolist() if "Leaf" in table.columns else [False] * n
    made_by = [_s(v) for v in table["MadeBy"].tolist()] if "MadeBy" in table.columns else [""] * n
    # (an op whose arguments differ is named by them: verdict.judge_row's "argument ...")
    random_op = [_s(v) == "True" and not _s(a) for v, a in zip(
        table["RandomOp"].tolist(), table["ArgsDiffer"].tolist() if "ArgsDiffer" in table.columns else [""] * n)] \
        if "RandomOp" in table.columns else [False] * n
    groups: dict[tuple, list[int]] = {}
    for i in range(n):
        if str(leaf[i]) == "True" and results[i] == "fail":
            # an input no op of either run made (a parameter, buffer or the batch) differs:
            # the run's own data departs here (independent runs; load-replay records these)
            origin[i] = ORIGIN_DEPARTURE
            reasons[i] = _leaf_departure(table, i, reasons[i])
        if status[i] in (STATUS_DEPARTURE, STATUS_UNPAIRED_OP):
            # a way the run left its recording, or an op only one run has (compare/
            # departures.py): where the run departs, not an op's tensor; never grouped
            # with the op's own rows
            origin[i] = ORIGIN_DEPARTURE if results[i] == "fail" or status[i] == STATUS_UNPAIRED_OP else ""
            continue
        if _s(ops[i]) and not pd.isna(seq[i]):
            groups.setdefault((ops[i], seq[i]), []).append(i)
    for (op, _), rows in groups.items():
        outs = {_s(names[i]): i for i in rows if io[i] == "output"}
        # known kernel accuracy: a bounded finding, not a failure
        for name, i in outs.items():
            known = KNOWN_KERNEL_ERROR.get((packet(op), name))
            if known is None or results[i] != "fail" or _s(prec[i]) not in known.dtypes:
                continue
            if not math.isnan(ulps[i]) and ulps[i] <= known.ulps:
                results[i] = "pass"
                severity[i] = ulps[i] / known.ulps
                reasons[i] = f"known kernel accuracy: {known.finding}; {ulps[i]:.3g} u <= {known.ulps:g} u"
            elif not math.isnan(ulps[i]):
                # still a failure (the finding's bound was measured on smaller sums: ConvNeXt-tiny's
                # first stage, 6,272 terms a channel, 61-81 u), but the reader learns what it is
                reasons[i] += f" [beyond the known kernel accuracy: {known.finding}; bound {known.ulps:g} u]"
        # tie-dependent indices: judged by the values they select
        for name, i in outs.items():
            if results[i] != "fail" or _s(dtypes[i]) not in _INT_DTYPES:
                continue
            is_ties, values = tie_values_output(op, name, set(outs))
            if not is_ties:
                continue
            j = outs.get(values) if values else None
            if j is None:
                if UNIT_ROUNDOFF.get(_s(prec[i]), 0.0) <= UNIT_ROUNDOFF["float32"]:
                    continue        # no rounding to a coarser dtype made ties: exact, as any integer
                results[i] = "skipped"
                reasons[i] = (f"indices of a comparison ({reasons[i]}): rounding makes ties and a tie may pick "
                              f"another index; no values output to judge them by, not judged")
                severity[i] = math.nan
            elif results[j] != "fail":
                results[i] = results[j]
                reasons[i] = (f"judged by the values they select ({values}: {results[j]}); "
                              f"the indices differ where rounding made ties ({reasons[i]})")
                severity[i] = severity[j]
            else:
                reasons[i] = f"the values they select fail ({values}); {reasons[i]}"
        _statistics_at_underflow(op, outs, results, reasons, severity)
        in_rows = [i for i in rows if io[i] == "input"]
        for i in outs.values():
            _amplified(table, op, i, in_rows, results, reasons, severity, origin)
            _absorbed(table, i, absorbed_at, results, reasons, severity, origin)
        # caused here / inherited
        failing = [i for i in rows if results[i] == "fail" and origin[i] not in (ORIGIN_AMPLIFIED, ORIGIN_ABSORBED)]
        if not failing:
            continue
        inputs_fail = any(results[i] == "fail" for i in in_rows)
        out_fails = [i for i in failing if io[i] == "output" and ARGS_DEPARTURE not in reasons[i]]
        drew = [i for i in out_fails if random_op[i]]
        if drew and not inputs_fail:
            for i in drew:
                origin[i] = ORIGIN_DEPARTURE
                reasons[i] = _random_departure(table, i, reasons[i])
            out_fails = [i for i in out_fails if i not in drew]
        tag = ORIGIN_INHERITED if inputs_fail else ORIGIN_CAUSED
        if tag == ORIGIN_CAUSED and out_fails and all(_underflows(table, i, reasons[i]) for i in out_fails):
            tag = ORIGIN_UNDERFLOW
        # failing outputs measured against float64 on the inputs the op got (the dumper's
        # own_error) fail by what is left, the op's own, whatever its inputs carried: what the
        # inputs carry does not explain them (rexnet's bf16 batch norm, whose rounded mean
        # left 32% of max|ref| on one element, read "caused here ... [inherited: 5.86 u is
        # what its inputs carry]")
        own = bool(out_fails) and all(_own_judged(table, i) for i in out_fails)
        explained = not own and bool(in_rows) and bool(out_fails) \
            and all(_explained(table, op, i, outs, in_rows, results) for i in out_fails)
        if explained and tag == ORIGIN_CAUSED:
            tag = ORIGIN_INHERITED
            for i in out_fails:
                reasons[i] += " [inherited: the inputs' small difference, amplified (op_policies.EXPLAINED_BY_INPUTS)]"
        if in_rows and out_fails and not explained and not own:
            before = tag
            tag = _carried(tag, in_rows, out_fails, ulps, reasons, table, results, severity)
            if before == ORIGIN_CAUSED and tag == ORIGIN_INHERITED and is_collective_op(_s(op)):
                # A collective combines every rank's inputs, and only this rank's are in the
                # file: its own arithmetic is not measured (no float64 reference), so an output
                # within what this rank's input already carries passes as inherited, as a
                # measured op's does. (DDP, timm EfficientNet under bf16 autocast: the gradient
                # bucket, 248 u off as its input already was, failed a clean run at its
                # allreduce.) An output off while its inputs agree stays caused here.
                for i in out_fails:
                    results[i] = "pass"
                    severity[i] = math.nan
                    reasons[i] = (f"inherited: a collective's result, within what this rank's input already "
                                  f"carries ({reasons[i]})")
                out_fails = []
            elif tag == ORIGIN_CAUSED and is_collective_op(_s(op)) and not inputs_fail:
                # this rank's contribution agrees: another rank's differs (or the collective)
                for i in out_fails:
                    reasons[i] += (" [this rank's input agrees with the golden's: another rank's "
                                   "contribution differs; compare the ranks' folders to find where]")
        if own and tag != ORIGIN_UNDERFLOW:      # (underflow here: values its dtype cannot hold, RangeLoss)
            tag = ORIGIN_CAUSED
        if tag == ORIGIN_CAUSED and out_fails and all(_nonfinite_only(table, i) for i in out_fails):
            tag = _nonfinite_origin(table, in_rows, out_fails, reasons)
        unpaired = [names[i] for i in in_rows if status[i] == STATUS_UNMATCHED
                    and not _passed_by_one_run(table, out_fails, _s(names[i]))]
        if tag == ORIGIN_CAUSED and unpaired:
            # an input the other run's ops do not read: the difference may come from it (an
            # aligned region of a regrouped sum, (a+b)+c against a+(b+c)), not shown here
            tag = ORIGIN_INHERITED
            for i in out_fails:
                reasons[i] += (f" [not caused here: input {', '.join(map(_s, unpaired))} has no partner "
                               f"in the other run, the difference may come from it]")
        for i in (out_fails if out_fails else failing):
            origin[i] = origin[i] or tag
        for i in failing:
            # an input no op of the step made (MadeBy "leaf": a parameter, a buffer, the batch)
            # that differs is the run's own difference, not an earlier op's
            # that differs is the run's own difference, not an earlier op's: where the run
            # departs from the golden one (named as such, module first: departures.leaf_sentence)
            if io[i] == "input" and made_by[i] == "leaf" and origin[i] != ORIGIN_DEPARTURE:
                origin[i] = ORIGIN_DEPARTURE
                reasons[i] = _leaf_departure(table, i, reasons[i])
            if io[i] == "input" and made_by[i] == "op" and status[i] not in ("size_mismatch", "corrupt") \
                    and rounded_by_cast(_s(table["CastRoundedTo"].iat[i]) if "CastRoundedTo" in table.columns
                                        else "", _s(dtypes[i])):
                origin[i] = ORIGIN_DEPARTURE          # (verdict.judge_row: a cast the golden lacks)
            origin[i] = origin[i] or ORIGIN_INHERITED
    return origin


def rounded_by_cast(via: str, dtype: str) -> bool:
    """Whether an input an earlier op made, of dtype `dtype`, went through a cast to the
    coarser dtype `via` (column CastRoundedTo): a rounding the golden run does not make where
    the op computes in `dtype` (verdict.judge_row fails the row; its Origin is `departs`)."""
    return coarser(via, dtype)


def _passed_by_one_run(table: pd.DataFrame, outs: list[int], name: str) -> bool:
    """Whether the ArgsDiffer of the op's failing outputs names tensor input `name` as one that
    one run passes and the other does not (rows.tensors_only_one_passes): a changed argument
    of this op, caused here, not an input of a regrouped sum whose difference came from it."""
    if "ArgsDiffer" not in table.columns:
        return False
    said = " ".join(_s(table["ArgsDiffer"].iat[i]) for i in outs)
    return f"{name} a tensor, golden None" in said or f"{name} None, golden a tensor" in said


def _random_departure(table: pd.DataFrame, i: int, reason: str) -> str:
    """A random op's failing output whose inputs agree: the departure's sentence, module
    first, with what was measured and what to do."""
    module = _s(table["Module"].iat[i]) if "Module" in table.columns else ""
    return (f"{module or 'the model top level'} {RANDOM_DRAWS} in {_s(table['NPUDump'].iat[i])} (another seed, "
            f"generator or device's random number generator; or the kernel differs): {reason}; to compare the "
            "rest, seed both runs alike and turn dropout off (p=0), or load-replay, which hands random ops "
            "the recorded outputs")


def _leaf_departure(table: pd.DataFrame, i: int, reason: str) -> str:
    """A failing leaf input's FailReason: the departure's sentence, module first, with what
    was measured (the verdict's own leaf wording, verdict.py, replaced by it)."""
    measured = reason.split("made it (a parameter, a buffer or the data fed in): ", 1)[-1]
    return with_measure(leaf_sentence(table.iloc[i]), measured)


def _num_at(table: pd.DataFrame, column: str, i: int) -> float:
    """Row i's number in `column`; NaN when the column is absent or holds no number."""
    if column not in table.columns:
        return math.nan
    v = pd.to_numeric(pd.Series([table[column].iat[i]]), errors="coerce").iat[0]
    return math.nan if pd.isna(v) else float(v)


def _nonfinite_origin(table: pd.DataFrame, in_rows: list[int], out_fails: list[int], reasons: list[str]) -> str:
    """Origin of an op whose inputs agree (so far: caused here) and whose failing outputs all
    hold NaN/Inf where the golden's are finite; its reasons get what decided it."""
    overflowed = _input_overflow(table, in_rows, out_fails)
    if overflowed is not None:
        # an input Inf where the golden's value is beyond the dtype's range (a load-replay's
        # cast of a recorded fp32 gradient of 7.1e4 to float16 for efficientnet_b0's
        # convolution_backward; a plain run's autocast cast): the op's Inf is that input's,
        # where the run departs by the format's range
        for i in out_fails:
            reasons[i] += (f" [overflow: input {overflowed}, beyond the dtype's largest finite number: the "
                           "format's range (the cast or op that made the input), not this op's kernel]")
        return ORIGIN_OVERFLOW
    lost = _input_without_a_correct_digit(table, in_rows)
    if lost is not None:
        # NaN/Inf from an input that already holds no correct digit: whatever the op did, its
        # inputs decided its values (timm's densenet121 under fp16 autocast: a batch norm over
        # 2 values a channel, invstd 316, amplified fp16 rounding until a gradient 3.4e3 times
        # the golden's overflowed in the next batch norm backward, which was blamed "caused here")
        for i in out_fails:
            reasons[i] += (f" [inherited: input {lost} (no correct digit): the non-finite values "
                           "come with it, not from this op]")
        return ORIGIN_INHERITED
    if all(_overflows(table, i) for i in out_fails):
        # NaN/Inf where the golden's value is beyond the dtype's largest finite number: any
        # kernel returns Inf there (efficientnet_b0 replayed under fp16 autocast: a weight
        # gradient of 2.8e5); where the run departs, by the format's range
        for i in out_fails:
            dtype = _dtype_of(table, i)
            reasons[i] += (f" [overflow: the golden's values there reach "
                           f"{_num_at(table, 'GoldenAbsMaxWhereTargetNonFinite', i):.4g}, beyond {dtype}'s largest "
                           f"finite {LARGEST_FINITE[dtype]:.6g}: the format's range, not the kernel; values "
                           "this large need a wider format or scaling down]")
        return ORIGIN_OVERFLOW
    return ORIGIN_CAUSED


def _dtype_of(table: pd.DataFrame, i: int) -> str:
    """Row i's precision (PrecisionDtype, else DataType)."""
    dtype = _s(table["PrecisionDtype"].iat[i]) if "PrecisionDtype" in table.columns else ""
    return dtype or (_s(table["DataType"].iat[i]) if "DataType" in table.columns else "")


def _overflows(table: pd.DataFrame, i: int) -> bool:
    """Row i fails for NaN/Inf in the target where the golden's values round beyond the
    largest finite number of the row's dtype (PrecisionDtype; OVERFLOW_THRESHOLD: float16's
    65510 rounds to 65504, 65520 to Inf): the format overflows there (Inf, or the NaN of
    Inf - Inf after it), whatever the kernel."""
    threshold = OVERFLOW_THRESHOLD.get(_dtype_of(table, i))
    gmax = _num_at(table, "GoldenAbsMaxWhereTargetNonFinite", i)
    return _nonfinite_only(table, i) and threshold is not None and not math.isnan(gmax) and gmax >= threshold


def _nonfinite_only(table: pd.DataFrame, i: int) -> bool:
    """Row i fails for NaN/Inf on one side only (no metric could be taken)."""
    return _num_at(table, "NonFiniteMismatch", i) > 0


def _input_overflow(table: pd.DataFrame, in_rows: list[int], out_rows: list[int]) -> str | None:
    """Which input of the op is Inf in the target where the golden's values exceed the input's
    dtype range, as a clause ("grad_output is Inf where the golden's values reach 2.218e+05";
    "grad_output 7.124e+04 (its largest recorded value) is Inf cast to float16"): an input
    row that overflows (_overflows),
    or a load-replay's recorded input whose cast overflowed (column InputOverflow of its
    output rows); None when none is."""
    for i in in_rows:
        if _overflows(table, i):
            name = _s(table["TensorName"].iat[i]) if "TensorName" in table.columns else "?"
            return (f"{name} is NaN/Inf where the golden's values reach "
                    f"{_num_at(table, 'GoldenAbsMaxWhereTargetNonFinite', i):.4g}")
    if "InputOverflow" in table.columns:
        for i in out_rows:
            text = _s(table["InputOverflow"].iat[i])
            if text:
                return (f"{text} (its largest recorded value) is Inf cast to "
                        f"{_s(table['DataType'].iat[i]) or 'the live dtype'}")
    return None


def _input_without_a_correct_digit(table: pd.DataFrame, in_rows: list[int]) -> str | None:
    """What the first input row that holds no correct digit is (NaN/Inf where the golden's
    are finite, or a RelativeEuclideanDistance from the golden's of 1 or more), or None."""
    for i in in_rows:
        name = _s(table["TensorName"].iat[i]) if "TensorName" in table.columns else "?"
        if _nonfinite_only(table, i):
            return f"{name} already holds NaN/Inf where the golden's is finite"
        red = _num_at(table, "RelativeEuclideanDistance", i)
        if math.isfinite(red) and red >= 1.0:
            return f"{name} already differs from the golden's by RelativeEuclideanDistance {red:.3g}"
    return None


def _own_judged(table: pd.DataFrame, i: int) -> bool:
    return not math.isnan(_num_at(table, "OwnErrorVsFp64", i))


def _carried(tag: str, in_rows: list[int], out_fails: list[int], ulps: list[float], reasons: list[str],
             table: pd.DataFrame, results: list[str], severity: list[float]) -> str:
    """Origin by the error the inputs carry (plain dumps: input rows present): an output within
    the sum of its two worst inputs' ErrorUlps (times CARRIED_ERROR_FACTOR) plus
    CARRIED_ERROR_MARGIN_ULPS is inherited, even
    with every input passing; one beyond it is caused here, even with an input failing (the
    op added a fault on top of an accumulated difference: a 7% fault, 19.5 u of bfloat16, on
    an input at 9 u) when every failing input fails marginally (Severity <= MARGINAL_SEVERITY:
    accumulated rounding, not a fault upstream, whose size functions such as pow or
    gelu_backward multiply). Inputs of unknown error (NaN ulps) leave the tag as it is."""
    ins = [ulps[i] for i in in_rows]
    if any(math.isnan(u) for u in ins) or any(math.isnan(ulps[i]) for i in out_fails):
        return tag
    carried = sorted(ins, reverse=True)[:2]
    budget = sum(carried) * CARRIED_ERROR_FACTOR + CARRIED_ERROR_MARGIN_ULPS
    worst = max(ulps[i] for i in out_fails)
    what = f"its inputs carry {' + '.join(f'{c:.3g}' for c in carried)} u"
    if tag == ORIGIN_CAUSED and worst <= budget:
        for i in out_fails:
            reasons[i] += (f" [inherited: {ulps[i]:.3g} u is what {what} plus its own rounding "
                           f"(op_policies.CARRIED_ERROR_FACTOR, _MARGIN_ULPS)]")
        return ORIGIN_INHERITED
    marginal = all(severity[i] <= MARGINAL_SEVERITY for i in in_rows if results[i] == "fail")
    if tag == ORIGIN_INHERITED and worst > budget and marginal:
        for i in out_fails:
            reasons[i] += f" [caused here: {ulps[i]:.3g} u, beyond what {what} plus its own rounding]"
        return ORIGIN_UNDERFLOW if all(_underflows(table, i, reasons[i]) for i in out_fails) else ORIGIN_CAUSED
    return tag


def _near_underflow(table: pd.DataFrame, i: int, prec: str, within: float = 16.0) -> bool:
    """Whether row i's golden values are within `within` x of `prec`'s smallest normal number
    (max |golden| below it; no number: no)."""
    tiny = SMALLEST_NORMAL.get(prec)
    gmax = _num_at(table, "GoldenAbsMax", i)
    return bool(tiny and not math.isnan(gmax) and gmax < within * tiny)


def _statistics_at_underflow(op: str, outs: dict[str, int], results: list[str], reasons: list[str],
                             severity: list[float]) -> None:
    """A normalisation's saved mean / inverse std failing only because its dtype cannot hold
    the golden's values (verdict's RangeLoss rule) while its normalised output passes: the
    mean of values that cancel (MobileNet's batch norms in float16: 1e-9 means of inputs ~1,
    which normalising subtracts from values ~1) passes, as EXPLAINED_BY_INPUTS passes such
    statistics' other differences."""
    rule = EXPLAINED_BY_INPUTS.get(packet(op))
    main = outs.get("result0")
    if rule is None or rule[0] != "statistics" or main is None or results[main] == "fail":
        return
    for name in rule[1]:
        i = outs.get(name)
        if i is not None and results[i] == "fail" and UNDERFLOW_CLAUSE in reasons[i]:
            results[i] = "pass"
            severity[i] = math.nan
            reasons[i] = (f"a normalisation's statistic below its dtype's normal range (the mean of values that "
                          f"cancel), its normalised output passes: not judged ({reasons[i]})")


def _underflows(table: pd.DataFrame, i: int, reason: str = "") -> bool:
    """Whether output row i's golden values sit at its precision's underflow edge (max |x|
    within 4x of the smallest normal number: float16 gradients below 6.1e-5 lose relative
    precision in any run; what loss scaling is for), so its failure is the format's range,
    not something this op added."""
    if UNDERFLOW_CLAUSE in reason:
        return True     # (its dtype cannot hold the golden's values: verdict.judge_row, RangeLoss)
    if "GoldenAbsMax" not in table.columns or "PrecisionDtype" not in table.columns:
        return False
    if _own_judged(table, i):
        # judged by its own error: the float64 reference was rounded to this dtype, underflow
        # included, so whatever error is left is the op's (a load-replay fault on a gradient
        # at 8e-6 in float16 measured 7% own error, and is caused there)
        return False
    return _num_at(table, "GoldenAbsMax", i) > 0 and _near_underflow(table, i, _s(table["PrecisionDtype"].iat[i]), 4.0)


def _numel(shape: Any) -> int:
    text = _s(shape).strip("()[] ")
    n = 1
    for part in text.split(","):
        part = part.strip()
        if part:
            try:
                n *= int(part)
            except ValueError:
                return 0
    return n


def _amplified(table: pd.DataFrame, op: str, i: int, in_rows: list[int], results: list[str],
               reasons: list[str], severity: list[float], origin: list[str]) -> None:
    """Output row i of an elementwise op fails as `amplified` by the AMPLIFIED rule (above).
    Its inputs' difference: the largest RelativeEuclideanDistance of its floating input rows
    (a plain compare), or, where the file holds no inputs (a load-replay: the op got the
    golden's, cast), one unit of its precision, the most a cast rounds."""
    name = _s(table["TensorName"].iat[i]) if "TensorName" in table.columns else ""
    if results[i] != "pass" or bound_class(op, name) != CLASS_POINTWISE:
        return
    prec = _s(table["PrecisionDtype"].iat[i]) if "PrecisionDtype" in table.columns else ""
    u = UNIT_ROUNDOFF.get(prec, 0.0)
    red = _num_at(table, "RelativeEuclideanDistance", i)
    if not u or u <= UNIT_ROUNDOFF["float32"] or math.isnan(red) or red < AMPLIFIED_MIN_ULPS * u:
        return
    if _near_underflow(table, i, prec):
        return          # (its values lose digits to the format's range: `underflow`'s rule)
    if in_rows:
        if any(results[j] == "fail" for j in in_rows):
            return
        ins = [_num_at(table, "RelativeEuclideanDistance", j) for j in in_rows]
        ins = [v for v in ins if not math.isnan(v)]
        if not ins or max(ins) > AMPLIFIED_INPUT_ULPS * u:
            # an input further off than its rounding (ConvNeXt's float16 layer scale of 1e-6,
            # subnormal there, 27 u off): not rounding amplified, but what that input carries
            return
        given, what = max(ins), "its inputs differ from the golden's by at most"
    elif not math.isnan(_num_at(table, "OwnErrorVsFp64", i)) and prec in _FULL_RANGE \
            and "MatchedBy" in table.columns and _s(table["MatchedBy"].iat[i]) == "seqid":
        # (a load-replay's row: its op got the golden's inputs, cast; a plain dump written
        # without inputs says nothing of what its inputs carried from earlier ops)
        # (float16: a recorded value below its normal range is rounded by more than a unit,
        # and a replay's file holds no inputs to tell: GPT-2's gelu_new backward multiplies
        # gradients of 1e-6, 56 u off after the cast alone)
        given, what = u, "the golden's inputs, rounded to it, differ by at most"
    else:
        return
    if red < AMPLIFIED_FACTOR * given:
        return
    results[i] = "fail"
    origin[i] = ORIGIN_AMPLIFIED
    severity[i] = red / (AMPLIFIED_MIN_ULPS * u)
    ratio = f"{red / given:.3g}x" if given > 0 else "from exact inputs"
    measured = _measured_part(reasons[i])
    reasons[i] = (f"amplified rounding: {what} {given / u:.2g} u of {prec}, and this op, computing right on "
                  f"them, turns that into {red:.3g} ({red / u:.3g} u; {ratio}): {prec} cannot carry this "
                  f"computation here (cos/sin of large arguments, log near 1, the difference of near-equal "
                  f"values); compute it in a wider dtype" + (f" [{measured}]" if measured else ""))


def _measured_part(reason: str) -> str:
    """A passing row's text without its attribution: it said the difference was inherited
    "which earlier ops made"; a rule that fails the row as its own (amplified, absorbed) keeps
    what was measured and replaces that attribution."""
    return reason.replace("inherited: ", "", 1).replace(", which earlier ops made", "")


def _absorbed(table: pd.DataFrame, i: int, share: float, results: list[str], reasons: list[str],
              severity: list[float], origin: list[str]) -> None:
    """Output row i, passing, fails as `absorbed` by the ABSORBED rule (above)."""
    absorbed = _num_at(table, "UpdateAbsorbed", i)
    changed = _num_at(table, "UpdateChanged", i)
    if results[i] != "pass" or not 0.0 <= absorbed <= 1.0 or absorbed < share or not 1.0 <= changed < math.inf:
        return          # (NaN, or a share or count no comparison writes: an edited csv, not judged)
    dtype = _s(table["DataType"].iat[i]) if "DataType" in table.columns else ""
    golden = _s(table["GoldenDataType"].iat[i]) if "GoldenDataType" in table.columns else ""
    results[i] = "fail"
    origin[i] = ORIGIN_ABSORBED
    severity[i] = absorbed / share if share > 0 else math.inf
    measured = _measured_part(reasons[i])
    # (the first clause is the headline's and the table's; the brackets, the details line's)
    reasons[i] = (f"update absorbed: {absorbed:.1%} of the {changed:.0f} elements the golden's update changed keep "
                  f"their old {dtype} value [the change is under half a spacing of {dtype} there, so the target "
                  f"does not learn what the golden ({golden}) learns; keep this state in float32 (master weights, "
                  f"an fp32 optimizer state) or update it with compensated/stochastic rounding]"
                  + (f" [{measured}]" if measured else ""))


def _explained(table: pd.DataFrame, op: str, i: int, outs: dict[str, int], in_rows: list[int],
               results: list[str]) -> bool:
    """Whether output row i's failure is the inputs' difference amplified (EXPLAINED_BY_INPUTS)."""
    rule = EXPLAINED_BY_INPUTS.get(packet(op))
    if rule is None:
        return False
    kind, names = rule
    name = _s(table["TensorName"].iat[i]) if "TensorName" in table.columns else ""
    if kind == "statistics":
        main = outs.get("result0")
        return name in names and main is not None and results[main] != "fail"
    if kind == "mask" and "MaxAbsoluteError" in table.columns and "GoldenAbsMax" in table.columns:
        err = pd.to_numeric(pd.Series([table["MaxAbsoluteError"].iat[i]]), errors="coerce").iat[0]
        gmax = pd.to_numeric(pd.Series([table["GoldenAbsMax"].iat[i]]), errors="coerce").iat[0]
        return bool(gmax > 0 and err >= 0.25 * gmax)
    if kind == "sum" and "MaxAbsoluteError" in table.columns and "Shape" in table.columns:
        out_err = pd.to_numeric(pd.Series([table["MaxAbsoluteError"].iat[i]]), errors="coerce").iat[0]
        n_out = _numel(table["Shape"].iat[i])
        ins = [(pd.to_numeric(pd.Series([table["MaxAbsoluteError"].iat[j]]), errors="coerce").iat[0],
                _numel(table["Shape"].iat[j])) for j in in_rows]
        ins = [(e, n) for e, n in ins if not math.isnan(e) and n > 0]
        if math.isnan(out_err) or n_out <= 0 or not ins:
            return False
        bound = max(e for e, _ in ins) * max(n for _, n in ins) / n_out
        return out_err <= bound
    return False
