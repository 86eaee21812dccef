"""The read stage: the tasks of one op pair, each a result row with its two value records
(torch-free).

tasks_for_pair reads an op pair's values (dumpfile.read.light records; small tensors
read eagerly), pairs them by input/output name and makes one Task per tensor pair: the
row's identity columns filled, its status set when there is nothing to compute
(unmatched, empty, uninitialised, replayed random op). The pipeline's comparer fills
the metric columns of the Tasks whose both sides are present.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import h5py
from h5py import h5o
import numpy as np
import pandas as pd

from dumpfile import schema as S
from dumpfile import jsontext
from dumpfile.departures import argument_change_is_by_design, attr_is_true, loss_scaler_role
from dumpfile.errors import DumpFormatError
from dumpfile.opclass import is_cast, sum_terms
from dumpfile.read import catalog
from dumpfile.read.light import LightTensor, light_record, light_values, some_attrs
from dumpfile.read.reader import DumpFile, ValueRecord, h5_errors

from accucmp.compare import matching
from accucmp.compare.precision import least_precise

BASE_COLUMNS = ["Index", "NPUDump", "NPUDumpPath", "GroundTruthPath", "DataType", "Shape"]
TAIL_COLUMNS = [
    "CompareFailReason", "SeqId", "Phase", "Module", "GoldenDataType", "GoldenShape", "GoldenSeqId",
    "GoldenOp", "IO", "TensorName", "PrecisionDtype", "ComputeDtype", "Uninitialized", "CompareStatus",
    "MatchedBy", "GoldenAbsMax", "TargetMean", "TargetStd", "GoldenMean", "GoldenStd",
    "NonFiniteMismatch", "TargetNonFinite", "GoldenNonFinite", "GoldenAbsMaxWhereTargetNonFinite", "ExactMismatches",
    "BitIdentical",
    # load-replay with rounded inputs: the target against float64 on the inputs it got
    # (op attribute own_error, npu_dumper/replay/own_error.py): RED, max |x - ref|, max |ref|
    "OwnErrorVsFp64", "OwnMaxErrorVsFp64", "OwnRefAbsMax",
    # ... and on which side of the correctly rounded result the elements lie that differ from
    # it (its normal range; own_error's "#rounding"): how many, the share nearer zero, the
    # share above it (verdict's RoundingBias: a kernel that truncates puts all of them nearer zero)
    "OwnInexact", "OwnTowardZero", "OwnUpward",
    # whose op the Own* columns measure: "target", or "golden" when the golden is a compiled
    # dump (each node's own error, docs/COMPILED.md) and its op's own error is the larger
    "OwnErrorOf",
    # a row for a way the target run left its recording (load-replay; compare/departures.py):
    # inserted / missing / argument / input
    "Departure",
    # independent runs: an input tensor no op of the step made, on both sides (a parameter,
    # buffer or the batch; compare/departures.py input_is_leaf); failing, it is a departure
    "Leaf",
    # outputs that are sums (dumpfile/opclass.py): ||sum of |terms| || / ||sum||, how much it cancels
    "OwnCancellation",
    # input rows of a plain dump that records it (op attribute made_inputs): "op" when an
    # earlier op of the dumped block wrote the tensor (its difference is inherited), "leaf"
    # when none did (a parameter, buffer or the batch: a difference is the run's own input)
    "MadeBy",
    # a leaf input (MadeBy "leaf") that is a cast back from a coarser dtype (op attribute
    # leaf_rounded: a bfloat16 model's weight copied to float32 by `weight.float()`): that
    # dtype; the verdict allows it the golden's value rounded there
    "LeafRoundedTo",
    # an input an earlier op made (MadeBy "op") that reaches the op through a cast to a coarser
    # dtype (op attribute cast_rounded: `h.to(bfloat16).float()`): that dtype; where the op
    # computes in a finer one, the rounding is a departure of the run
    "CastRoundedTo",
    # load-replay: the op's recorded inputs whose cast to the live dtype overflowed, with the
    # largest |recorded value| (op attribute input_overflow): "grad_output 7.124e+04"
    "InputOverflow",
    # a target dtype of narrower range than the golden's (float16 against float32) where the
    # golden's values lie below 16x its smallest normal: RelativeEuclideanDistance of the
    # golden's values rounded to the target's dtype, what the format alone loses there
    # (compare/measure.py); the verdict fails what it cannot hold (threshold UnderflowLoss)
    "RangeLoss",
    # independent runs: the op's plain arguments (eps, scale, dims, ...) where the two runs
    # differ ("eps 0.1, golden 1e-05"; op attribute scalar_args), on its output rows
    "ArgsDiffer",
    # independent runs: an output of an op that drew random numbers (op attribute random:
    # dropout's bernoulli_, randn); failing while the op's inputs agree, the runs drew other
    # numbers there (op_policies.RANDOM_DRAWS), which is where they depart, not a kernel's error
    "RandomOp",
    # independent runs whose op streams differ beyond dtype casts (ops with no partner): a
    # difference then may come from them, so nothing passes as inherited (the count and ops)
    "StructureDiffers",
    # independent runs: an op only one run has (CompareStatus unpaired_op) whose result the
    # step ends with, read by no later op (a weight's gradient sum); it fails
    # (compare/departures.step_result_departures)
    "EndsStep",
    # a run against a single-process reference (compare/reference_runs.py): which part of the
    # reference's tensor the row compares with (a batch slice, a gradient after the all-reduce)
    "ReferencePart",
    # the user's source line the op came from (op attribute stack: compiled dumps always,
    # eager dumps with record_stack=True): "file:line in function: code", the target's
    # (the golden's when the target has none)
    "Source",
    # load-replay without own error: an output that is a sum of one input's terms, whose
    # input the replay rounded to the target's dtype: how much the golden's sum cancels,
    # ||sum |x| || / ||sum x|| (and the same of the largest elements), from the golden's
    # recorded input (compare/cancellation.py); the verdict allows that many u more
    "RoundedInputCancellation",
    # a step with a loss scaler (GradScaler; op attribute loss_scale): the factor the target's
    # tensor carries over the golden's (65536: a gradient of the scaled loss against an
    # unscaled golden), divided out before the metrics; empty where the two carry the same
    "LossScale",
    # an in-place update of state the step starts from (a parameter, an optimizer moment; op
    # attribute persistent_writes) whose target dtype is coarser than the golden's: of the
    # elements the golden's update changed, the share the target left at its old value where
    # the golden's change is within one spacing of the target's dtype there (the update
    # rounded away: compare/absorption.py), and how many elements the golden changed
    "UpdateAbsorbed", "UpdateChanged",
]
FP64_COLUMNS = ["TargetErrorVsFp64", "GoldenErrorVsFp64"]

# CompareStatus values: why a row has (or lacks) metrics; the verdict keys on these.
STATUS_COMPARED = "compared"
STATUS_STATS = "stats"                  # statistics-only: lower bounds / exact std
STATUS_UNMATCHED = "unmatched"
STATUS_UNINITIALIZED = "uninitialized"  # output of an empty-like op
STATUS_EMPTY = "empty"
STATUS_RANDOM_REPLAYED = "random_replayed"  # a random op's outputs were copied from the golden
STATUS_SIZE_MISMATCH = "size_mismatch"
STATUS_CORRUPT = "corrupt"              # unreadable / attributes disagree with data
# a run against a single-process reference (compare/reference_runs.py): not measured
STATUS_PARALLELISM = "parallelism"      # an op only the parallel run has (collective, bucket copy)
STATUS_PARTIAL = "partial"              # a reduction over the rank's part of the batch
STATUS_SHARDED = "sharded"              # a shard of a tensor (shard assembly's part)
# the loss scaler's state (its scale, inverse scale, inf flag: op attribute loss_scaler "state")
STATUS_LOSS_SCALER = "loss_scaler"
# statuses whose rows hold two records but no metrics are computed for
NOT_MEASURED = frozenset((STATUS_RANDOM_REPLAYED, STATUS_PARALLELISM, STATUS_PARTIAL, STATUS_SHARDED,
                          STATUS_LOSS_SCALER))
LOSS_SCALER_REASON = ("the loss scaler's own op (GradScaler's scale, its inverse, the inf check): "
                      "by design, not the model's values")


@dataclass(frozen=True, slots=True)
class Task:
    """The read stage's result, handed to the metrics stage (measure.Comparer.run): one
    tensor pair's row (identity columns filled; the comparer fills the metric columns) and
    its value records (None for a side without a pair)."""

    row: dict[str, Any]
    target: ValueRecord | None
    golden: ValueRecord | None
    fp64: ValueRecord | None = None
    # (the golden's input whose terms the output sums, the kept-axes rule, the op's plain
    # arguments): RoundedInputCancellation is computed from it (rounded_sum_terms)
    sum_terms: tuple[ValueRecord, str, dict | None] | None = None
    # the loss scale the target's tensor carries over the golden's (LossScale): divided out
    scale: float = 1.0
    # the scale at which the target's dtype holds the golden's values (RangeLoss): the loss
    # scale the target's tensor carries (None: `scale`), or in a load-replay the one it would
    # carry live
    range_scale: float | None = None
    # an in-place update of state (persistent_writes): (the target's record of the tensor
    # before the update, None in a load-replay, which handed the op the golden's cast; the
    # golden's record of it before; the target's dtype): UpdateAbsorbed is computed from them
    update_base: tuple[ValueRecord | None, ValueRecord, str] | None = None


def dtype_of(rec: ValueRecord) -> str:
    if rec.dtype:
        return rec.dtype
    try:
        return str(rec.file.h5[rec.path].dtype) if rec.type == S.TYPE_TENSOR else ""
    except (KeyError, TypeError, ValueError):
        return ""


def shape_str(shape) -> str:
    return "(" + ",".join(str(int(s)) for s in shape) + ")"


def check_record(rec: ValueRecord) -> tuple[tuple[int, ...], int]:
    """(shape, numel) from the attributes, checked against the stored data."""
    where = f"{rec.file.path}: {rec.path}"
    try:
        shape = rec.shape
    except (ValueError, TypeError) as e:
        raise DumpFormatError(f"{where}: unreadable shape attribute ({e})") from e
    if any(s < 0 for s in shape):
        raise DumpFormatError(f"{where}: negative dimension in shape attribute {shape}")
    numel = int(math.prod(shape))           # (1 for a scalar; np.prod costs ~20 us a call here)
    if rec.type == S.TYPE_TENSOR:
        if isinstance(rec, LightTensor):
            stored = rec.stored_size
        else:
            stored = int(rec.file.h5[rec.path].size or 0)
        if rec.dtype == "complex32":
            stored //= 2
        if S.ATTR_SHAPE in rec.attrs and stored != numel:
            raise DumpFormatError(f"{where}: shape attribute {shape_str(shape)} ({numel} elements) "
                                  f"disagrees with the stored data ({stored} elements)")
    return shape, numel


_B_COMPUTE = S.OP_COMPUTE_DTYPE.encode()
_B_INPUT_DTYPES = S.OP_INPUT_DTYPES.encode()
_B_INPUT_ARG_DTYPES = S.OP_INPUT_ARG_DTYPES.encode()
_B_OWN_ERROR = S.OP_OWN_ERROR.encode()
_B_MADE_INPUTS = S.OP_MADE_INPUTS.encode()
_B_SCALAR_ARGS = S.OP_SCALAR_ARGS.encode()
_B_RANDOM_REPLAYED = S.OP_RANDOM_OUTPUTS_REPLAYED.encode()
_B_STACK = S.OP_STACK.encode()
_B_LOSS_SCALER = S.OP_LOSS_SCALER.encode()
_B_LOSS_SCALE = S.OP_LOSS_SCALE.encode()
_B_RANDOM = S.OP_RANDOM.encode()
_B_LEAF_ROUNDED = S.OP_LEAF_ROUNDED.encode()
_B_CAST_ROUNDED = S.OP_CAST_ROUNDED.encode()
_B_PERSISTENT_WRITES = S.OP_PERSISTENT_WRITES.encode()
_B_INPUT_OVERFLOW = S.OP_INPUT_OVERFLOW.encode()
# Tensors up to this many elements are read when their record is made (at most a
# few ops' worth are held at a time: see _compare_files).
EAGER_ELEMENTS = 1 << 14


@dataclass
class OpTensors:
    inputs: dict[str, ValueRecord]
    outputs: dict[str, ValueRecord]
    compute_dtype: str
    random_outputs_replayed: bool = False
    input_dtypes: tuple[str, ...] = ()     # when the dump stored no inputs (op attribute)
    own_error: dict = field(default_factory=dict)   # output name -> [RED, max abs, max |ref|(, kappa)]
    made_inputs: frozenset[str] | None = None       # inputs an earlier op wrote; None: not recorded
    scalar_args: dict | None = None                 # the op's plain arguments; None: not recorded
    source: str = ""                                # the user's source line (op attribute stack)
    input_arg_dtypes: dict | None = None            # {argument: dtype} (op attribute input_arg_dtypes)
    loss_scaler: str = ""                           # the op's role in a loss scaler (op attribute)
    loss_scale: dict = field(default_factory=dict)  # (io, name) or io -> scale (op attribute loss_scale)
    random: bool = False                            # the op drew random numbers (op attribute random)
    leaf_rounded: dict | None = None                # leaf input -> coarser dtype it went through
    input_overflow: dict | None = None              # input -> max |recorded| whose cast overflowed
    cast_rounded: dict | None = None                # made input -> coarser dtype a cast rounded it to
    persistent_writes: frozenset[str] = frozenset()  # state an in-place update writes (op attribute)
    own_rounding: dict = field(default_factory=dict)  # output name -> (inexact, toward zero, upward)

    def is_scaler_state(self, name: str) -> bool:
        """The tensor `name` is the loss scaler's (its scale, inverse scale, inf flag)."""
        return name in self.loss_scale.get(_STATE, ())

    def scale_of(self, io: str, name: str) -> float:
        """The loss scale the op's tensor `name` (of group `io`) carries: 1 where none."""
        return _scale_in(self.loss_scale, io, name)


def op_tensors(op, eager: int = 0) -> OpTensors:
    if op is None:
        return OpTensors({}, {}, "")
    f = op.file
    if getattr(f, "is_table", False):      # statistics table file (format 1.1): no op groups
        a = op.attrs
        own_errors, own_rounding = _own_error_attr(a.get(S.OP_OWN_ERROR, ""))
        return OpTensors(matching.tensor_leaves(op.inputs()), matching.tensor_leaves(op.outputs()),
                          str(a.get(S.OP_COMPUTE_DTYPE, "") or ""),
                          bool(a.get(S.OP_RANDOM_OUTPUTS_REPLAYED, False)),
                          _split_dtypes(a.get(S.OP_INPUT_DTYPES, "")), own_errors,
                          _name_set(a.get(S.OP_MADE_INPUTS)), _scalar_args(a.get(S.OP_SCALAR_ARGS)),
                          _text(a.get(S.OP_STACK)), _arg_dtypes(a.get(S.OP_INPUT_ARG_DTYPES)),
                          loss_scaler_role(a.get(S.OP_LOSS_SCALER)), _loss_scale(a.get(S.OP_LOSS_SCALE)),
                          attr_is_true(a.get(S.OP_RANDOM)), _arg_dtypes(a.get(S.OP_LEAF_ROUNDED)),
                          _arg_numbers(a.get(S.OP_INPUT_OVERFLOW)), _arg_dtypes(a.get(S.OP_CAST_ROUNDED)),
                          _name_set(a.get(S.OP_PERSISTENT_WRITES)) or frozenset(), own_rounding)
    path = op.path
    # the low-level reads below bypass DumpFile's guards: name this file on HDF5 failures
    with h5_errors(f.path):
        op_id = h5o.open(f.h5.id, path.encode("utf-8", "surrogateescape"))
        if not isinstance(op_id, h5py.h5g.GroupID):
            # (a damaged file: the op's entry in the index names a dataset)
            raise DumpFormatError(f"{f.path}: {path} is a dataset where an op's group belongs; "
                                  "the file is damaged")
        # the tensors' names, dtypes, shapes (and small tensors' bytes) from the catalog
        # where it describes the op: no attribute read per member (a third of the time)
        cat = catalog.op_values(f, op, eager, op_id)
        if cat is not None:
            ins, outs = cat
        else:
            ins = matching.tensor_leaves(light_values(f, f"{path}/{S.INPUT_GROUP}", op_id, S.INPUT_GROUP, eager))
            outs = matching.tensor_leaves(light_values(f, f"{path}/{S.OUTPUT_GROUP}", op_id, S.OUTPUT_GROUP, eager))
        a = some_attrs(op_id, _OP_ATTRS)
        cd = _text(a.get(_B_COMPUTE))
        own_errors, own_rounding = _own_error_attr(_text(a.get(_B_OWN_ERROR)))
        return OpTensors(ins, outs, cd, bool(a.get(_B_RANDOM_REPLAYED, False)),
                          _split_dtypes(_text(a.get(_B_INPUT_DTYPES))), own_errors,
                          _name_set(a.get(_B_MADE_INPUTS)), _scalar_args(a.get(_B_SCALAR_ARGS)),
                          _text(a.get(_B_STACK)), _arg_dtypes(a.get(_B_INPUT_ARG_DTYPES)),
                          loss_scaler_role(a.get(_B_LOSS_SCALER)), _loss_scale(a.get(_B_LOSS_SCALE)),
                          attr_is_true(a.get(_B_RANDOM)), _arg_dtypes(_text(a.get(_B_LEAF_ROUNDED))),
                          _arg_numbers(_text(a.get(_B_INPUT_OVERFLOW))), _arg_dtypes(_text(a.get(_B_CAST_ROUNDED))),
                          _name_set(a.get(_B_PERSISTENT_WRITES)) or frozenset(), own_rounding)


_OP_ATTRS = frozenset((_B_COMPUTE, _B_RANDOM_REPLAYED, _B_INPUT_DTYPES, _B_OWN_ERROR, _B_MADE_INPUTS,
                       _B_SCALAR_ARGS, _B_STACK, _B_INPUT_ARG_DTYPES, _B_LOSS_SCALER, _B_LOSS_SCALE, _B_RANDOM,
                       _B_LEAF_ROUNDED, _B_INPUT_OVERFLOW, _B_CAST_ROUNDED, _B_PERSISTENT_WRITES))


def _arg_numbers(text: Any) -> dict | None:
    """{argument: number} from an op attribute's JSON (input_overflow); None when absent or
    not that shape (a damaged or hostile file: nothing is trusted beyond finite numbers)."""
    raw = _json_attr(text)
    if not isinstance(raw, dict):
        return None
    out = {str(k)[:200]: float(v) for k, v in list(raw.items())[:64]
           if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
    return out or None


def _text(v: Any) -> str:
    if v is None or isinstance(v, h5py.Empty):
        return ""
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


def _own_error_attr(text: Any) -> tuple[dict, dict]:
    """The op attribute own_error, parsed once: ({output: [RED, max abs, max |ref|(, kappa)]},
    {output: (inexact, toward zero, upward)} from its "#rounding" key). A damaged attribute
    only loses the refinement (the row is judged against the golden); counts that cannot be
    (a side above the whole, negative, not integers: a damaged or hostile file) are left out,
    and so is their column."""
    text = text.decode("utf-8", "replace") if isinstance(text, bytes) else str(text or "")
    if not text:
        return {}, {}
    try:
        d = jsontext.loads(text)
    except ValueError:
        return {}, {}
    if not isinstance(d, dict):
        return {}, {}
    errors = {str(k): v for k, v in d.items() if isinstance(v, list) and len(v) in (3, 4)}
    raw = d.get(S.OWN_ERROR_ROUNDING_KEY)
    rounding = {}
    if isinstance(raw, dict):
        for k, v in list(raw.items())[:64]:
            if isinstance(v, list) and len(v) == 3 and all(isinstance(x, int) and not isinstance(x, bool) for x in v) \
                    and v[0] > 0 and 0 <= v[1] <= v[0] and 0 <= v[2] <= v[0]:
                rounding[str(k)] = (v[0], v[1], v[2])
    return errors, rounding


def _own_errors(text: Any) -> dict:
    """own_error's lists ({output: [RED, max abs, max |ref|(, kappa)]}); {} when absent or bad."""
    return _own_error_attr(text)[0]


def _json_attr(text: Any) -> Any:
    """An op attribute holding JSON, decoded (depth-bounded: a file is input from outside);
    None when absent or not JSON."""
    if text is None or isinstance(text, h5py.Empty):
        return None
    try:
        return jsontext.loads(text if isinstance(text, bytes) else str(text))
    except ValueError:
        return None


def _name_set(text: Any) -> frozenset[str] | None:
    """An op attribute that is a JSON list of tensor names (made_inputs, persistent_writes);
    None when absent or bad."""
    d = _json_attr(text)
    return frozenset(map(str, d)) if isinstance(d, list) else None


def _arg_dtypes(text: Any) -> dict | None:
    """The op attribute input_arg_dtypes ({argument: dtype name}); None when absent or bad."""
    d = _json_attr(text)
    if not isinstance(d, dict) or not all(isinstance(v, str) for v in d.values()):
        return None
    return {str(k): v for k, v in d.items()}


def _loss_scale(text: Any) -> dict:
    """The op attribute loss_scale as {(input, name): scale, output: scale}; {} when absent
    or bad. A scale is a finite positive number: anything else would make a division of the
    file's choosing, so a damaged attribute compares the tensors as they are."""
    d = _json_attr(text)
    if not isinstance(d, dict):
        return {}

    def ok(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf

    out: dict = {}
    ins = d.get("input")
    if isinstance(ins, dict):
        out.update({(S.INPUT_GROUP, str(k)): float(v) for k, v in ins.items() if ok(v)})
    if ok(d.get("output")):
        out[S.OUTPUT_GROUP] = float(d["output"])
    state = d.get("state")
    if isinstance(state, list):
        out[_STATE] = frozenset(str(k) for k in state)
    if ok(d.get("carried")):
        out[_CARRIED] = float(d["carried"])
    return out


def tensor_scale(op, io: str, name: str) -> float:
    """The loss scale tensor `name` (group `io`) of `op` carries, from its op attribute alone
    (a rank's gradient re-paired with a reference's: compare/reference_runs.py)."""
    try:
        d = _loss_scale(op.attrs.get(S.OP_LOSS_SCALE))
    except Exception:  # noqa: BLE001 - unreadable attributes: no scale, compared as it is
        return 1.0
    return _scale_in(d, io, name)


def _scale_in(d: dict, io: str, name: str) -> float:
    """The scale tensor `name` of group `io` carries in a parsed loss_scale attribute (_loss_scale):
    its own entry (an input), else the group's (every floating output carries one), else 1."""
    return d.get((io, name), d.get(io, 1.0))


# the loss_scale key of the scaler's own tensors among an op's arguments (inputs, and the
# outputs an in-place op writes under the same names)
_STATE = "state"
# the loss_scale key of the scale a load-replay's results would carry in the live run (the
# replay computed them on the recording's unscaled values)
_CARRIED = "carried"


def _scalar_args(text: Any) -> dict | None:
    """The op attribute scalar_args ({argument: value}); None when absent or bad."""
    d = _json_attr(text)
    return d if isinstance(d, dict) else None


def args_differ(t: dict | None, g: dict | None) -> str:
    """'eps 0.1, golden 1e-05' for the plain arguments two runs' op got differently ('' when
    they agree or either run did not record them)."""
    if t is None or g is None:
        return ""
    # an argument one run records and the other does not was None there (the dumper records
    # defaults too, except None): SDPA's scale=1.0 against the default scale=None differs.
    # What a precision or device change explains is not a difference (dumpfile.departures).
    out = []
    for k in sorted(set(t) | set(g)):
        tv, gv = t.get(k), g.get(k)
        if tv != gv and not argument_change_is_by_design(k, tv, gv):
            if isinstance(tv, list) and isinstance(gv, list) and len(tv) == len(gv) and len(tv) > 4:
                # a long list (an optimizer's per-parameter step sizes): its first difference
                at = [i for i, (a, b) in enumerate(zip(tv, gv)) if a != b]
                out.append(f"{k}[{at[0]}] {tv[at[0]]!r}, golden {gv[at[0]]!r}"
                           + (f" ({len(at)} of {len(tv)} differ)" if len(at) > 1 else ""))
            else:
                out.append(f"{k} {tv!r}, golden {gv!r}")
    return ", ".join(out)


def tensors_only_one_passes(t: dict[str, ValueRecord], g: dict[str, ValueRecord],
                            scaler_state=lambda name: False) -> str:
    """'bias a tensor, golden None' for the tensor arguments of one op that one run passes and
    the other does not (the dumper records no None argument): a convolution given a bias the
    golden's lacks computed with another input, which its own error on its inputs cannot show;
    the verdict had passed its output as inherited from earlier ops whose outputs agreed. ''
    when either run recorded no input (an outputs-only dump), and for list items (a list of
    other length is another call, judged by its rows), and for the loss scaler's own tensors
    (`scaler_state`: a fused optimizer step given grad_scale and found_inf by GradScaler)."""
    if not t or not g:
        return ""
    out = []
    for name, tv, gv in matching.pair_tensors(t, g):
        if "/" in name or (tv is None) == (gv is None) or scaler_state(name):
            continue
        present = tv if tv is not None else gv
        if not present.is_tensor:
            continue
        out.append(f"{name} a tensor, golden None" if tv is not None else f"{name} None, golden a tensor")
    return ", ".join(out)


def _region_own_error(region) -> dict:
    """An aligned region's own error, when the dumper measured every op of its target side
    (plain dumps of a reduced-precision run): {"": [worst RED, max abs, max |ref|]} of the
    entry with the largest RED, its max abs ratio raised to the worst entry's, so the region
    passes only when each of its ops did what it was given. {} when any op is unmeasured."""
    if not region.unpaired_inputs:
        # ops of different streams that should compute the same (gelu against silu would
        # align too): each target op right on its inputs says nothing of the golden's ops, so
        # the region is judged against the golden. Only a regrouped sum (an input without a
        # partner next to the region: the runs split one sum differently) is within its own error
        return {}
    entries = []
    for op in region.target_ops:
        own = _own_errors(op.attrs.get(S.OP_OWN_ERROR, ""))
        if not own:
            return {}
        entries += [[float(x) for x in v[:3]] for v in own.values()]
    if not entries:
        return {}
    red, _, ref = max(entries, key=lambda e: e[0])
    ratio = max((e[1] / e[2] if e[2] > 0 else (0.0 if e[1] == 0 else math.inf)) for e in entries)
    ref = ref if ref > 0 else 1.0
    return {"": [red, ratio * ref, ref]}


def _region_made_inputs(region) -> frozenset[str] | None:
    """The region's input names (`k.OP:name`, align.py) whose tensor an earlier op made: its
    k-th target op's `made_inputs`. None when an op of the region does not record it."""
    made = []
    for k, op in enumerate(region.target_ops):
        names = _name_set(op.attrs.get(S.OP_MADE_INPUTS))
        if names is None:
            return None
        made.append(names)
    out = set()
    for t, _ in region.inputs:
        head, _, arg = t.name.partition(":")
        k = head.split(".", 1)[0]
        if k.isdigit() and int(k) < len(made) and arg in made[int(k)]:
            out.add(t.name)
    # an external input of op k that an earlier op of the same region made is internal, so
    # every external input either came from before the region or is a leaf
    return frozenset(out)


def _split_dtypes(text: Any) -> tuple[str, ...]:
    text = text.decode("utf-8", "replace") if isinstance(text, bytes) else str(text or "")
    return tuple(d for d in text.split(",") if d)


def op_dtypes(ot: OpTensors) -> list[str]:
    """Every dtype the op touched: stored tensors, the inputs' dtypes when only those were
    recorded (a load-replay dump), and the compute dtype."""
    out = [dtype_of(r) for r in (*ot.inputs.values(), *ot.outputs.values())]
    return out + list(ot.input_dtypes) + ([ot.compute_dtype] if ot.compute_dtype else [])


def tasks_for_pair(pair: matching.OpPair, ff: DumpFile | None, metric_cols,
                    replay: bool, eager: int = 0,
                    ios: tuple[str, ...] = (S.INPUT_GROUP, S.OUTPUT_GROUP),
                    golden_own: bool = False) -> list[Task]:
    """The rows of one op pair. `golden_own`: the golden is a compiled dump against an eager
    target, so the golden's ops carry their own error too (every compiled node's): an output
    row is judged by the larger of the two sides' own errors (OwnErrorOf says whose), and an
    input row's MadeBy comes from the golden's op where the target's did not record it. A
    compile-only fault is then named whichever role the compiled dump has."""
    t_op, g_op = pair.target, pair.golden
    any_op = t_op or g_op
    phase, module = any_op.shown_place
    t_ts, g_ts = op_tensors(t_op, eager), op_tensors(g_op, eager)
    source_line = t_ts.source or g_ts.source
    region = pair.region
    if region is not None:      # an aligned region: its external inputs and final outputs
        t_ts = OpTensors(region.tensors(0, "input"), region.tensors(0, "output"), t_ts.compute_dtype,
                         own_error=_region_own_error(region), made_inputs=_region_made_inputs(region))
        g_ts = OpTensors(region.tensors(1, "input"), region.tensors(1, "output"), g_ts.compute_dtype)
    scaler_state = S.LOSS_SCALER_ROLES[0] in (t_ts.loss_scaler, g_ts.loss_scaler)
    unscaled_result = _unscaled_result(t_ts, g_ts)
    precision = least_precise(op_dtypes(t_ts) + op_dtypes(g_ts))
    changed = args_differ(t_ts.scalar_args, g_ts.scalar_args) if not replay and region is None else ""
    if not replay and region is None and t_op is not None and g_op is not None and t_op.op == g_op.op:
        changed = ", ".join(c for c in (changed, tensors_only_one_passes(
            t_ts.inputs, g_ts.inputs, lambda n: t_ts.is_scaler_state(n) or g_ts.is_scaler_state(n))) if c)
    compute = t_ts.compute_dtype or g_ts.compute_dtype
    cast_src = cast_source(t_op, g_op, t_ts, replay or region is not None)
    tasks = []
    for io in ios:
        t_vals = t_ts.inputs if io == S.INPUT_GROUP else t_ts.outputs
        g_vals = g_ts.inputs if io == S.INPUT_GROUP else g_ts.outputs
        for name, t, g in matching.pair_tensors(t_vals, g_vals):
            # (not a tensor that carries a loss scale: its Inf is the scaler's, said at the op
            # that reads it, verdict's "overflowed under the loss scale")
            by_cast = cast_src is not None and io == S.OUTPUT_GROUP and t is not None and g is None \
                and t_ts.scale_of(io, name) == 1.0
            if by_cast:
                g = cast_src        # (the cast's result measured against what it was given)
            row: dict[str, Any] = {c: math.nan for c in metric_cols}
            row.update({
                "NPUDump": t_op.op if t_op else g_op.op,
                "NPUDumpPath": t.path if t else "",
                "GroundTruthPath": g.path if g else "",
                "DataType": dtype_of(t) if t else "",
                "Shape": safe_shape(t) if t else "",
                "CompareFailReason": "",
                # golden-only rows keep a SeqId only where both files share the numbering
                "SeqId": t_op.seqid if t_op else (g_op.seqid if replay else pd.NA),
                "Phase": phase, "Module": module,
                "GoldenDataType": dtype_of(g) if g else "",
                "GoldenShape": safe_shape(g) if g else "",
                "GoldenSeqId": g_op.seqid if g_op else pd.NA,
                "GoldenOp": g_op.op if g_op else "",
                "IO": io, "TensorName": name,
                "PrecisionDtype": precision, "ComputeDtype": compute,
                "Uninitialized": bool((t is not None and t.uninitialized) or (g is not None and g.uninitialized)),
                "CompareStatus": "", "MatchedBy": pair.matched_by,
                "NonFiniteMismatch": 0, "TargetNonFinite": 0, "GoldenNonFinite": 0,
                "Source": source_line,
            })
            if by_cast:
                row.update(MatchedBy=MATCHED_BY_CAST, GoldenOp=t_op.op, GoldenSeqId=t_op.seqid)
            if t is None or g is None:
                row["CompareStatus"] = STATUS_UNMATCHED
                row["CompareFailReason"] = (
                    f"{region.description}: an input of the region's "
                    f"{'target' if t is not None else 'golden'} ops with no partner among the other's"
                    if region is not None else None) or pair.reason or (
                    f"No data match with {t.path} in golden dump data." if t is not None
                    else f"No data match with {g.path} in my dump data.")
                row["MatchedBy"] = "unmatched"
            elif io == S.OUTPUT_GROUP and (t_ts.random_outputs_replayed or g_ts.random_outputs_replayed):
                row["CompareStatus"] = STATUS_RANDOM_REPLAYED
                row["CompareFailReason"] = ("random op: load-replay handed on the golden's outputs "
                                            "(no device reproduces another's random numbers): not compared")
            elif scaler_state or t_ts.is_scaler_state(name) or g_ts.is_scaler_state(name):
                row["CompareStatus"] = STATUS_LOSS_SCALER
                row["CompareFailReason"] = LOSS_SCALER_REASON
            elif pair.reason and not by_cast:
                row["CompareFailReason"] = pair.reason
            if (t_ts.loss_scaler or g_ts.loss_scaler) and row["CompareStatus"] == STATUS_UNMATCHED:
                row["CompareFailReason"] = LOSS_SCALER_REASON
            if io == S.OUTPUT_GROUP and t is not None and unscaled_result:
                # the first op that reads a gradient the scaler did not unscale is where the
                # run departs: what it computes differs from the golden's by design of its
                # inputs, which its own error (measured on those inputs) cannot excuse
                row["StructureDiffers"] = unscaled_result
            scale = 1.0
            # (a load-replay's op computed on the recording's inputs: it carries their scale)
            if t is not None and g is not None and region is None and not replay and not by_cast:
                # (a cast's result against its own input: the same run's, the same scale)
                scale = t_ts.scale_of(io, name) / g_ts.scale_of(io, name)
                if scale != 1.0 and _floating(t) and _floating(g):
                    row["LossScale"] = scale
                else:
                    scale = 1.0
            own = t_ts.own_error.get(name) if io == S.OUTPUT_GROUP and t is not None and not by_cast else None
            if own is not None:
                row["OwnErrorOf"] = "target"
            g_own = g_ts.own_error.get(name) if golden_own and io == S.OUTPUT_GROUP and g is not None else None
            if g_own is not None and (own is None or float(g_own[0]) > float(own[0])):
                own = g_own
                row["OwnErrorOf"] = "golden"
            if own is not None:
                row["OwnErrorVsFp64"], row["OwnMaxErrorVsFp64"], row["OwnRefAbsMax"] = (float(v) for v in own[:3])
                if len(own) > 3:
                    row["OwnCancellation"] = float(own[3])
                sides = (t_ts if row["OwnErrorOf"] == "target" else g_ts).own_rounding.get(name)
                if sides is not None:
                    n, toward_zero, upward = sides
                    row["OwnInexact"], row["OwnTowardZero"], row["OwnUpward"] = n, toward_zero / n, upward / n
            if own is None and region is not None and io == S.OUTPUT_GROUP and t is not None:
                own = t_ts.own_error.get("")            # the region's: its worst op's
                if own is not None:
                    row["OwnErrorVsFp64"], row["OwnMaxErrorVsFp64"], row["OwnRefAbsMax"] = (float(v) for v in own[:3])
            if changed and io == S.OUTPUT_GROUP:
                row["ArgsDiffer"] = changed
            if io == S.OUTPUT_GROUP and not replay and region is None and (t_ts.random or g_ts.random):
                row["RandomOp"] = True
            if io == S.OUTPUT_GROUP and t_ts.input_overflow:
                # (load-replay: recorded inputs that overflowed in the cast to the live dtype)
                row["InputOverflow"] = ", ".join(f"{k} {v:.4g}" for k, v in t_ts.input_overflow.items())
            made = t_ts.made_inputs if t_ts.made_inputs is not None or not golden_own else g_ts.made_inputs
            if io == S.INPUT_GROUP and t is not None and made is not None:
                row["MadeBy"] = "op" if name in made else "leaf"
                via = (t_ts.leaf_rounded or {}).get(name) if row["MadeBy"] == "leaf" else None
                if via in S.UNIT_ROUNDOFF:
                    row["LeafRoundedTo"] = via
                via = (t_ts.cast_rounded or {}).get(name) if row["MadeBy"] == "op" else None
                if via in S.UNIT_ROUNDOFF:
                    row["CastRoundedTo"] = via
            fp = None
            if ff is not None and g is not None:
                with h5_errors(ff.path):     # damage in the fp64 file stops the compare
                    fp = light_record(ff, g.path, g.name, eager) if g.path in ff.h5 else None
                fp = fp if fp is not None and fp.is_tensor else None
            if region is not None:
                row["NPUDump"], row["GoldenOp"] = region.target_label, region.golden_label
            terms = None
            if replay and own is None and region is None and io == S.OUTPUT_GROUP and t is not None \
                    and g is not None and g_op is not None:
                terms = rounded_sum_terms(g_op.op, name, t_ts, g_ts)
            base = None
            if io == S.OUTPUT_GROUP and region is None and t is not None and g is not None \
                    and name in (t_ts.persistent_writes | g_ts.persistent_writes):
                base = update_base(name, t, g, t_ts, g_ts, replay)
            range_scale = t_ts.loss_scale.get(_CARRIED, 1.0) if replay and io == S.OUTPUT_GROUP else scale
            tasks.append(Task(row, t, g, fp, terms, scale, update_base=base, range_scale=range_scale))
    return tasks


# MatchedBy of a target-only cast's result measured against the cast's own input (cast_source)
MATCHED_BY_CAST = "its input (a cast)"


def cast_source(t_op, g_op, t_ts: OpTensors, skip: bool) -> ValueRecord | None:
    """The input record a target-only cast to a coarser floating dtype is measured against
    (its result's row: MatchedBy MATCHED_BY_CAST), or None. Such a cast is unpaired by design
    (autocast's, a port's `.half()`), and its rounding is the run's precision: at most half a
    unit of its dtype an element. Where its values lie below that dtype's normal range it loses
    far more (float16 gradients of 3e-7 without a loss scaler: 26%), and the op that reads the
    result got it from an op of the step, so its row passed the difference on as inherited:
    no row judged it. Only a cast of what an op made (made_inputs: a leaf's cast stays a leaf,
    judged where it is read) in a plain dump (`skip`: a load-replay, an aligned region)."""
    if skip or t_op is None or g_op is not None or not is_cast(t_op.op):
        return None
    src = t_ts.inputs.get("self")
    outs = list(t_ts.outputs.values())
    if src is None or not src.is_tensor or len(outs) != 1 or not outs[0].is_tensor:
        return None
    if t_ts.made_inputs is None or "self" not in t_ts.made_inputs:
        return None
    return src if S.coarser(dtype_of(outs[0]), dtype_of(src)) else None


def update_base(name: str, t: ValueRecord, g: ValueRecord, t_ts: OpTensors, g_ts: OpTensors,
                replay: bool) -> tuple[ValueRecord | None, ValueRecord, str] | None:
    """What UpdateAbsorbed of an in-place update's output `name` is computed from (Task.
    update_base), or None: only where the target's dtype is coarser than the golden's (a
    precision the golden's update fits in and the target's may not), and both records of the
    tensor before the update are at hand (a load-replay's is the golden's, cast)."""
    t_dtype = dtype_of(t)
    if not S.coarser(t_dtype, dtype_of(g)):
        return None
    g_in = g_ts.inputs.get(name)
    t_in = None if replay else t_ts.inputs.get(name)
    if g_in is None or not g_in.is_tensor or (not replay and (t_in is None or not t_in.is_tensor)):
        return None
    return t_in, g_in, t_dtype


# StructureDiffers of an op that read gradients the loss scaler had not unscaled (the verdict
# fails it as caused there)
READS_SCALED = "it reads tensors that carry the loss scale"


def _unscaled_result(t_ts: OpTensors, g_ts: OpTensors) -> str:
    """What an output row says of a target op outside the backward that read a tensor still
    carrying the loss scale (an optimizer step or clipping before the scaler unscaled the
    gradients): its result is compared as it is. '' otherwise."""
    ins = [f for k, f in t_ts.loss_scale.items() if isinstance(k, tuple) and f != g_ts.scale_of(*k)]
    if not ins or t_ts.scale_of(S.OUTPUT_GROUP, "") != 1.0 or t_ts.loss_scaler == S.LOSS_SCALER_ROLES[2]:
        return ""
    return (f"{READS_SCALED} {max(ins):g}: gradients the loss scaler "
            f"had not unscaled (an optimizer step or clipping before scaler.unscale_/scaler.step)")


def _floating(rec: ValueRecord) -> bool:
    return dtype_of(rec).startswith(("float", "bfloat", "complex"))


def rounded_sum_terms(op: str, output: str, t_ts: OpTensors, g_ts: OpTensors
                      ) -> tuple[ValueRecord, str, dict | None] | None:
    """For a load-replay's output that is a sum of one input's terms (opclass.SUM_TERMS),
    when the replay rounded that input (its dtype in the target coarser than the golden's
    recorded one: from the target's record of it, its op attribute input_arg_dtypes, or, in
    a dump older than that attribute, when every floating input of the target is coarser):
    what RoundedInputCancellation is computed from; else None."""
    found = sum_terms(op, output)
    if found is None:
        return None
    arg, rule = found
    rec = g_ts.inputs.get(arg)
    if rec is None or not rec.is_tensor:
        return None
    t_rec = t_ts.inputs.get(arg)
    if t_rec is not None:
        target = [dtype_of(t_rec)]
    elif t_ts.input_arg_dtypes is not None:
        target = [t_ts.input_arg_dtypes.get(arg, "")]
    else:
        # (a dump older than input_arg_dtypes: only when every input was rounded is this one)
        target = [d for d in t_ts.input_dtypes if d in S.UNIT_ROUNDOFF]
    if not target or not all(S.coarser(d, dtype_of(rec)) for d in target):
        return None
    return rec, rule, g_ts.scalar_args


def safe_shape(rec: ValueRecord) -> str:
    try:
        return shape_str(rec.shape)
    except (ValueError, TypeError):
        return "?"
