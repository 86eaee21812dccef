"""The HDF5 dump layout: names, attributes and codes shared by every package.

This module is the single source of truth for docs/FORMAT.md. It imports neither
torch nor h5py so that any reader (accucmp, tests, third-party scripts) can use it.

Layout (compatible with the Ascend PyTorch 1.5 dumper)::

    /{op}/{seqid}/input/{argname}                  one tensor or value
    /{op}/{seqid}/input/{argname}/{argname}_{i}    lists (tensor lists, mixed lists)
    /{op}/{seqid}/output/{retname}[/{retname}_{i}]
    /_npu_dumper/index                             one row per op, in seqid order (ours)
    /_npu_dumper/catalog                           (1.2) row i: JSON description of index row i's values
    /_npu_dumper/stats, /_npu_dumper/op_attrs      statistics-only dumps (1.1): tables, no op groups
"""

from __future__ import annotations

import math

FORMAT_NAME = "npu_dumper.h5"
# 1.1: statistics-only dumps are tables (STATS_TABLE_PATH), no per-op groups.
# 1.2: /_npu_dumper/catalog (CATALOG_PATH), an accelerator next to the index.
# 1.3: root attribute op_filter (a filtered dump names its selection); Type 31 strings for
#      tensors with no values to store (meta device, quantized and sub-byte dtypes).
# 1.4: op attributes `raised` (the op raised) and `recompute` (a forward op re-run in
#      backward by activation checkpointing)
# 1.5: `Stride` describes the stored (contiguous, logical-shape) data, as the original
#      msaccucmp applies it; the live tensor's strides are `live_stride` (absent: equal to
#      Stride, which is also what a file of 1.4 or older means). FormatType follows the
#      memory format (NHWC for channels_last).
# 1.6: tensor attribute `dtensor` (a DTensor's layout, its local shard stored); root
#      attributes `step` and `parallel_layout`; `uninitialized` also marks destination-only
#      inputs (`out=` arguments, collective output buffers)
# 1.7: statistics-only dumps: column `hash` in the stats table (XXH3-64 of each tensor's
#      bytes, npu_dumper.capture.tensor_hash) and root attribute `content_hash` naming the algorithm;
#      column `log2_hist` (histogram of log2|x|, npu_dumper.capture.tensor_hist) filled when the
#      dumper ran with stats_histogram=True (root attribute `log2_histogram`).
# 1.9: op attribute `optimizer` (the optimizer whose step() ran the op).
FORMAT_VERSION = "1.9"
# Readers accept any file whose major version they know.
SUPPORTED_MAJOR_VERSIONS = (1,)

# Reserved root group for our own bookkeeping. Never an op name: op names are
# "namespace.name.overload", and no torch namespace is called "_npu_dumper".
META_GROUP = "_npu_dumper"
INDEX_PATH = f"{META_GROUP}/index"
# 1.2+: one variable-length UTF-8 JSON string per index row (same order): that op's input
# and output entries as written (docs/FORMAT.md "The catalog"). An accelerator only: the
# groups stay the truth; use it only when its length equals the index's.
CATALOG_PATH = f"{META_GROUP}/catalog"
# statistics-only dumps (1.1+): one row per value / per extra op attribute (dumpfile.stats_table)
STATS_TABLE_PATH = f"{META_GROUP}/stats"
OP_ATTRS_PATH = f"{META_GROUP}/op_attrs"
INPUT_GROUP = "input"
# 1.5: /{op}/{seqid}/_base|{path with "|" for "/"}: hard links to the datasets this op's
# views (Type 40) re-stride when those live in another op's group; the views' `base`
# attribute names the link, so `h5copy -s /op/seqid/` of one op carries them
# (dumpfile.write.writer._local_base). Readers of op groups look only at input/ and output/.
OP_BASE_LINK_PREFIX = "_base|"
OUTPUT_GROUP = "output"

# ---- root attributes -------------------------------------------------------
ROOT_FORMAT = "format"                # FORMAT_NAME
ROOT_FORMAT_VERSION = "format_version"
ROOT_TORCH_VERSION = "torch_version"
ROOT_DEVICE = "device"                # e.g. "cpu", "cuda:0", "npu:0"
ROOT_DEVICE_TYPE = "DeviceType"       # device code below
ROOT_RANK = "rank"
ROOT_WORLD_SIZE = "world_size"
ROOT_STEP = "step"                    # 1.6: the dumper's step= (absent when not given)
ROOT_PARALLEL_LAYOUT = "parallel_layout"  # 1.6: JSON {wrappers, meshes} (docs/FORMAT.md)
ROOT_MODE = "mode"                    # one of MODES
ROOT_DUMP_MODE = "dump_mode"          # input / output / all
ROOT_STATS_ONLY = "stats_only"
ROOT_COMPLETE = "complete"            # False while writing, True after a clean close
# the user's step raised inside the block and the writer closed the file cleanly (every op
# up to then is in it): "TypeName: first line" and the seqid of the last op dispatched
ROOT_STEP_RAISED = "step_raised"
ROOT_STEP_RAISED_AT = "step_raised_at"
ROOT_STEP_RAISED_IN_OP = "step_raised_in_op"   # True: op `step_raised_at` raised it (has `raised`)
ROOT_CREATED = "created"              # ISO-8601 local time
ROOT_NUM_OPS = "num_ops"              # ops written (kept current at every flush)
ROOT_LOAD_FILE = "load_file"          # load/golden modes: the dump that was replayed
ROOT_COMPUTE_DTYPE = "compute_dtype"  # golden replay: the dtype ops were recomputed in
ROOT_DEDUP = "dedup"                  # 1.8: True when data seen again is a link to where it was first stored
ROOT_COMPILED = "compiled"            # 1.8: a torch.compile step; how its graphs were split ("node")
ROOT_OP_FILTER = "op_filter"          # JSON {include, exclude, modules, phases}: only when the dump was filtered

MODE_DUMP = "dump"
MODE_LOAD = "load"          # load-replay: seqids are the golden file's
MODE_OVERFLOW = "overflow"  # only overflowing ops; seqids are sparse
MODE_GOLDEN = "golden"      # every op recomputed from recorded inputs (fp64 by default)
MODES = (MODE_DUMP, MODE_LOAD, MODE_OVERFLOW, MODE_GOLDEN)

DUMP_MODES = ("input", "output", "all")

# ---- per-op group attributes (on /{op}/{seqid}) -----------------------------
OP_SEQID = "seqid"
OP_NAME = "op"                  # full overload name, e.g. "aten.addmm.default"
OP_PHASE = "phase"              # "forward" / "backward"
OP_GRAD_FN = "grad_fn"          # autograd node running a backward op, e.g. "AddmmBackward0"
OP_MODULE = "module"            # innermost nn.Module path, e.g. "layers.3"; "" at top level
OP_STACK = "stack"              # user source line, when record_stack=True
OP_COMPUTE_DTYPE = "compute_dtype"  # dtype the kernel computed in, when known (emulation)
# dtypes of the op's tensor inputs ("bfloat16,float32"), written where the dump does not
# store inputs (dump_mode="output", the load-replay default): compare's precision for the
# op's outputs must still see a bfloat16 input that the golden had in float32
OP_INPUT_DTYPES = "input_dtypes"
# ... and beside it, JSON {argument: dtype} of the op's top-level tensor arguments: which of
# them a load-replay rounded (compare: a sum whose terms were rounded, compare/cancellation.py)
OP_INPUT_ARG_DTYPES = "input_arg_dtypes"
OP_RAISED = "raised"            # the op raised: "TypeName: first line"; inputs only, no outputs
OP_RECOMPUTE = "recompute"      # a forward op re-run during backward (activation checkpointing)
# the class name of the torch.optim.Optimizer whose step() ran the op ("AdamW"), outside any
# module: the parameter update, whose phase attribute says "forward" (no autograd node ran
# it). Absent elsewhere and in dumps before format 1.7. Compare shows such rows with Phase
# "optimizer" and Module "AdamW.step"
OP_OPTIMIZER = "optimizer"
OP_OVERFLOW = "overflow"        # overflow mode: why this op was flagged
OP_REPLAYED = "replayed"        # load mode: True when recorded inputs replaced live ones
OP_SOURCE_SEQID = "source_seqid"  # load mode: the live stream's own seqid
# load mode: a random op (dropout, bernoulli, randn...) ran, then was given the recorded
# outputs, since no device reproduces another's random numbers. Compare skips its outputs.
OP_RANDOM_OUTPUTS_REPLAYED = "random_outputs_replayed"
# the op's own error, JSON {output: [RED, max abs error, max |ref|(, kappa)]} against the op
# re-run in float64 on the same inputs it got: load mode, when the replay rounded its inputs to
# a less precise live dtype; plain dumps of a run in reduced precision, every op from the first
# reduced-precision one on (npu_dumper/replay/own_error.py). kappa, for outputs that are sums
# (dumpfile/opclass.py): ||sum of |terms| || / ||sum||, how much the sum cancels
OP_OWN_ERROR = "own_error"
# ... and in it, under this key (no output's name), JSON {output: [inexact, toward zero,
# upward]}: how many elements of the output (those whose rounded reference is in the dtype's
# normal range) differ from the float64 reference rounded to the output's dtype, and how many
# of those lie nearer zero than it and above it (compare's RoundingBias: a kernel that
# truncates puts them all nearer zero). Absent: none differs, or a dump before format 1.9
OWN_ERROR_ROUNDING_KEY = "#rounding"
# plain dumps of a run that computes in reduced precision (npu_dumper/replay/own_error.py,
# PlainOwnError): JSON list of the op's tensor inputs (compare's TensorName: `self`,
# `tensors/tensors_0`) that an earlier op of the dumped block wrote; the op's other tensor
# inputs are leaves (parameters, buffers, the batch). Compare: a difference in the former is
# inherited, in the latter it is the run's own input
OP_MADE_INPUTS = "made_inputs"
# the same plain dumps: JSON {input: dtype} of the op's leaf inputs (not in made_inputs) that
# are a cast of a leaf back from a coarser floating dtype (a bfloat16 model's weight that a
# module computing in float32 copies with `weight.float()`: Gemma's RMSNorm, an MoE router).
# They hold the golden's values rounded to that dtype by design; compare judges them there
OP_LEAF_ROUNDED = "leaf_rounded"
# plain dumps of a reduced-precision run: JSON {input: dtype} of the op's tensor inputs that an
# earlier op made and that reach it through a cast to that coarser floating dtype (and back):
# an activation the run rounds by a cast (`h.to(bfloat16).float()`). Where the op itself
# computes in a finer dtype, the rounding is not the op's precision but a departure of the run
# (compare: the input row is judged at the op's precision, Origin `departs`)
OP_CAST_ROUNDED = "cast_rounded"
# plain dumps: JSON list of the tensors (compare's TensorName: `self`, `self/self_3`) an in-place
# update (`mul_`, `_foreach_addcdiv_`) writes that no op of the dumped block allocated:
# parameters, optimizer state, buffers, which the next step starts from. Compare: where the
# target's dtype is coarser than the golden's, the share of the golden's changed elements that
# the target's rounding left unchanged (column UpdateAbsorbed)
OP_PERSISTENT_WRITES = "persistent_writes"
# load-replay: JSON {input: max |recorded value|} of the op's recorded inputs whose cast to the
# live dtype overflowed (Inf where the recording is finite: an fp32 gradient of 7.1e4 handed
# to a float16 op). Compare: the op's Inf is the format's range there, not its kernel's
OP_INPUT_OVERFLOW = "input_overflow"
# plain dumps (own_error=True, the default): JSON {argument: value} of the op's number, bool,
# string and short number-list arguments (eps, scale, approximate, dims), so compare tells two
# independent runs whose op got different arguments
OP_SCALAR_ARGS = "scalar_args"
# plain dumps (own_error=True, the default): True on an op that drew random numbers (torch's
# tag nondeterministic_seeded, less the calls that draw none: dropout with p=0 or train=False).
# Its result depends on the generator's state, an input no file holds: compare tells two
# independent runs whose draws differ from a kernel's error (docs/COMPARE.md, "Random ops")
OP_RANDOM = "random"
# plain dumps (own_error=True): True on an op that reads no value of the run: no tensor
# argument, or only tensors such ops made (`arange`, `zeros`, a causal mask built from them).
# It computes from shapes and numbers only; an implementation that builds its mask or
# positions elsewhere (eager attention against SDPA) lacks such ops by design, and whatever
# they make differently shows where their result is read (docs/COMPARE.md, "Departures")
OP_CONSTANT = "constant"
# a step with a loss scaler (torch.amp.GradScaler; npu_dumper/capture/loss_scale.py): the
# scaler's own ops carry their role, OP_LOSS_SCALER: "state" (the scale, its inverse, the inf
# flag, the growth tracker: not the model's values), "apply" (the multiplication of the loss,
# or of the backward's seed gradient, by the scale), "unscale" (the division of the gradients
# by it). Compare leaves them out of the departures by design (docs/COMPARE.md, "Loss scaling").
OP_LOSS_SCALER = "loss_scaler"
LOSS_SCALER_ROLES = ("state", "apply", "unscale")
# the scale an op's tensors carry where it is not 1: JSON {"input": {argument: factor},
# "output": factor} (every floating output carries the one factor). A gradient computed from
# the scaled loss is the golden's times the scale; compare divides the factor out. A
# load-replay's matched op (computed on the recording's unscaled values) has only
# {"carried": factor}: what its results would carry in the live run (compare's RangeLoss
# takes float16's range at that scale).
OP_LOSS_SCALE = "loss_scale"
# compiled dumps (torch.compile, npu_dumper/compiled/): the FX node of the compiled graph
# whose output the op's record holds, and that graph ("forward 0", "backward 0")
OP_FX_NODE = "fx_node"
OP_COMPILED_GRAPH = "compiled_graph"

PHASE_FORWARD = "forward"
PHASE_BACKWARD = "backward"
PHASES = (PHASE_FORWARD, PHASE_BACKWARD)
PHASE_CODES = {PHASE_FORWARD: 0, PHASE_BACKWARD: 1}
PHASE_BY_CODE = {v: k for k, v in PHASE_CODES.items()}
# what reports show as the Phase of an op an optimizer's step ran (op attribute `optimizer`);
# no recorded phase: such an op is recorded as forward
PHASE_OPTIMIZER = "optimizer"

# ---- per-value attributes ---------------------------------------------------
ATTR_TYPE = "Type"
ATTR_DATA_TYPE = "DataType"
ATTR_DEVICE_TYPE = "DeviceType"
ATTR_FORMAT_TYPE = "FormatType"
ATTR_STRIDE = "Stride"            # 1.5+: element strides of the stored data (C order); <=1.4: live
ATTR_LIVE_STRIDE = "live_stride"  # 1.5+: the live tensor's strides, when they differ from Stride
# legacy-layout export (dumpfile.read.legacy): the torch dtype of a tensor the original layout
# has no DataType for (bfloat16, float8...), stored there as float32 with DataType 1
ATTR_SOURCE_DTYPE = "source_dtype"
ATTR_SHAPE = "shape"              # logical shape of the live tensor
ATTR_DTYPE = "dtype"              # torch dtype name without "torch.", e.g. "bfloat16"
ATTR_DEVICE = "device"            # e.g. "cuda:0"
ATTR_STORAGE_OFFSET = "storage_offset"
ATTR_UNINITIALIZED = "uninitialized"  # output of an empty-like op: values are garbage
ATTR_DTENSOR = "dtensor"          # 1.6: JSON layout of a DTensor whose local shard is stored
ATTR_BASE = "base"                # Type VIEW: path of the dataset holding the data
ATTR_SCHEMA_TYPE = "schema_type"  # the schema's type string, e.g. "int[]", "Scalar?"
ATTR_STATS_FIELDS = "fields"      # Type STATS: names of the stored values

# ---- Type codes (attribute "Type") ------------------------------------------
# Codes 0-16 are the original dumper's; 30+ are this project's extensions.
TYPE_TENSOR = 0
TYPE_TENSOR_LIST = 1          # a group of {name}_{i} entries
TYPE_INT_LIST = 2
TYPE_INT = 3
TYPE_BOOL = 4
TYPE_DOUBLE = 5
TYPE_OPTIONAL_DOUBLE = 6
TYPE_SCALAR = 7
TYPE_OPTIONAL_INT = 9
TYPE_OPTIONAL_SCALAR = 10
TYPE_SCALAR_TYPE = 14         # a dtype: value is the DataType code, attr dtype the name
TYPE_INT_ARRAY_REF = 16
TYPE_NONE = 30                # None; empty dataset
TYPE_STRING = 31
TYPE_DEVICE = 32              # value: device string ("cuda:0")
TYPE_LAYOUT = 33              # value: layout name ("strided")
TYPE_MEMORY_FORMAT = 34       # value: memory format name ("channels_last")
TYPE_FLOAT_LIST = 35
TYPE_BOOL_LIST = 36
TYPE_LIST = 37                # a group of {name}_{i} entries of mixed kinds
TYPE_COMPLEX = 38
TYPE_TENSOR_VIEW = 40         # object reference to the dataset holding the data + layout attrs
TYPE_TENSOR_STATS = 41        # statistics instead of data (stats-only dumps)

LIST_TYPES = (TYPE_TENSOR_LIST, TYPE_LIST)
TENSOR_TYPES = (TYPE_TENSOR, TYPE_TENSOR_VIEW, TYPE_TENSOR_STATS)

TYPE_NAMES = {
    TYPE_TENSOR: "Tensor", TYPE_TENSOR_LIST: "Tensor[]", TYPE_INT_LIST: "int[]",
    TYPE_INT: "int", TYPE_BOOL: "bool", TYPE_DOUBLE: "float",
    TYPE_OPTIONAL_DOUBLE: "float?", TYPE_SCALAR: "Scalar", TYPE_OPTIONAL_INT: "int?",
    TYPE_OPTIONAL_SCALAR: "Scalar?", TYPE_SCALAR_TYPE: "ScalarType",
    TYPE_INT_ARRAY_REF: "IntArrayRef", TYPE_NONE: "None", TYPE_STRING: "str",
    TYPE_DEVICE: "Device", TYPE_LAYOUT: "Layout", TYPE_MEMORY_FORMAT: "MemoryFormat",
    TYPE_FLOAT_LIST: "float[]", TYPE_BOOL_LIST: "bool[]", TYPE_LIST: "list",
    TYPE_COMPLEX: "complex", TYPE_TENSOR_VIEW: "Tensor(view)",
    TYPE_TENSOR_STATS: "Tensor(stats)",
}

# ---- DataType codes ---------------------------------------------------------
# 1-11 are the original's; 12+ are ours (the original could not store them).
# The attribute "dtype" (torch name) is authoritative; DataType is for old tools.
DATA_TYPE_CODES = {
    "float32": 1, "uint8": 2, "int8": 3, "int16": 5, "int32": 6, "int64": 7,
    "bool": 9, "float16": 10, "float64": 11,
    "bfloat16": 12, "complex32": 13, "complex64": 14, "complex128": 15,
    "uint16": 16, "uint32": 17, "uint64": 18,
    "float8_e4m3fn": 19, "float8_e5m2": 20, "float8_e4m3fnuz": 21, "float8_e5m2fnuz": 22,
    "float8_e8m0fnu": 23,
}
DATA_TYPE_UNKNOWN = 0
DTYPE_BY_CODE = {v: k for k, v in DATA_TYPE_CODES.items()}

# How each torch dtype is stored in HDF5: the numpy dtype of the dataset.
# Dtypes numpy lacks are stored as their raw bits; the reader converts back.
STORAGE_NUMPY_DTYPE = {
    "float32": "float32", "float64": "float64", "float16": "float16",
    "uint8": "uint8", "int8": "int8", "int16": "int16", "int32": "int32", "int64": "int64",
    "uint16": "uint16", "uint32": "uint32", "uint64": "uint64",
    "bool": "bool", "complex64": "complex64", "complex128": "complex128",
    "bfloat16": "uint16",          # raw bits
    "complex32": "float16",        # (..., 2) real/imag pairs: numpy has no complex32
    "float8_e4m3fn": "uint8", "float8_e5m2": "uint8",
    "float8_e4m3fnuz": "uint8", "float8_e5m2fnuz": "uint8", "float8_e8m0fnu": "uint8",
}
# Dtypes stored as raw bits (same width, unsigned int) with the "dtype" attribute.
RAW_BIT_DTYPES = frozenset({
    "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
    "float8_e8m0fnu",
})
FLOATING_DTYPES = frozenset({
    "float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2",
    "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
})
COMPLEX_DTYPES = frozenset({"complex32", "complex64", "complex128"})

# Unit roundoff (half the machine epsilon) of each floating dtype: the scale of
# error a correct kernel in that dtype makes. Verdicts are expressed in it.
UNIT_ROUNDOFF = {
    "float64": 2.0 ** -53, "complex128": 2.0 ** -53,
    "float32": 2.0 ** -24, "complex64": 2.0 ** -24,
    "float16": 2.0 ** -11, "complex32": 2.0 ** -11,
    "bfloat16": 2.0 ** -8,
    "float8_e4m3fn": 2.0 ** -4, "float8_e4m3fnuz": 2.0 ** -4,
    "float8_e5m2": 2.0 ** -3, "float8_e5m2fnuz": 2.0 ** -3,
    "float8_e8m0fnu": 2.0 ** -1,
}


def coarser(dtype: str, than: str) -> bool:
    """Whether floating dtype `dtype` rounds more coarsely than `than` (a larger unit
    roundoff): a value of `than` may not fit in `dtype`. False where either is not a
    floating dtype of UNIT_ROUNDOFF (an integer, an unknown or empty name)."""
    u, u_than = UNIT_ROUNDOFF.get(dtype), UNIT_ROUNDOFF.get(than)
    return u is not None and u_than is not None and u > u_than

# The largest finite value of each floating dtype (torch.finfo(dtype).max): a mask filled with
# finfo(dtype).min holds another number in each precision (dumpfile/departures.py), and a
# golden value beyond it is one the dtype cannot hold (compare's Origin `overflow`)
LARGEST_FINITE = {
    "float64": 1.7976931348623157e308, "float32": 3.4028234663852886e38,
    "bfloat16": 3.3895313892515355e38, "float16": 65504.0,
    "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0,
}
# the smallest normal number of each floating dtype: below it values lose relative precision
# (underflow), and the spacing of its subnormals: that number times the mantissa's last bit (2u)
SMALLEST_NORMAL = {
    "float64": 2.0 ** -1022, "float32": 2.0 ** -126, "bfloat16": 2.0 ** -126, "float16": 2.0 ** -14,
    "float8_e4m3fn": 2.0 ** -6, "float8_e5m2": 2.0 ** -14,
}
SMALLEST_SUBNORMAL = {d: tiny * 2 * UNIT_ROUNDOFF[d] for d, tiny in SMALLEST_NORMAL.items()}
# The smallest magnitude that rounds beyond it (to Inf, or float8_e4m3fn's NaN): the largest
# finite value plus half its last spacing (float16: 65520; 65510 rounds to 65504)
OVERFLOW_THRESHOLD = {d: m + math.ldexp(UNIT_ROUNDOFF[d], math.frexp(m)[1] - 1) for d, m in LARGEST_FINITE.items()}

# ---- DeviceType codes -------------------------------------------------------
# The original: CPU 0, CUDA 1, NPU 10. Other devices use c10::DeviceType's value.
DEVICE_TYPE_CODES = {
    "cpu": 0, "cuda": 1, "npu": 10, "xpu": 12, "mps": 13, "meta": 14, "hpu": 15,
    "privateuseone": 20,
}
DEVICE_TYPE_UNKNOWN = -1

# ---- FormatType codes (ACL formats; what a non-NPU tensor's layout resembles) ---
FORMAT_NCHW = 0
FORMAT_NHWC = 1
FORMAT_ND = 2
FORMAT_NC1HWC0 = 3
FORMAT_FRACTAL_Z = 4
FORMAT_NAMES = {0: "NCHW", 1: "NHWC", 2: "ND", 3: "NC1HWC0", 4: "FRACTAL_Z", 29: "FRACTAL_NZ"}

# ---- statistics-only tensors ------------------------------------------------
STATS_FIELDS = ("min", "max", "mean", "std", "norm", "nan_count", "inf_count", "numel")
STATS_HASH_FIELD = "hash"          # 1.7: stats table column (uint64), see ROOT_CONTENT_HASH
ROOT_CONTENT_HASH = "content_hash"  # 1.7: the hash algorithm of the stats table's `hash` ("xxh3_64")
STATS_HIST_FIELD = "log2_hist"     # 1.7: stats table column: int64 pairs [e, count, ...] of floor(log2|x|)
ROOT_STATS_HISTOGRAM = "log2_histogram"  # 1.7: True when the stats table's log2_hist is filled

# ---- index dataset ----------------------------------------------------------
# Compound rows; the op group of row r is f"/{op}/{seqid}".
INDEX_FIELDS = ("seqid", "op", "phase", "module", "grad_fn")

# ---- catalog rows (CATALOG_PATH) -------------------------------------------------
# Row: {"i": [entries of input/], "o": [entries of output/]}, or "" when the op is not
# described (read its groups). Entry keys (short: one row per op):
CAT_INPUTS, CAT_OUTPUTS = "i", "o"
CAT_NAME = "n"            # path relative to input/ or output/ ("self", "tensors/tensors_0")
CAT_TYPE = "T"            # the Type attribute
CAT_VALUE = "v"           # non-tensors: the value DumpFile.read_value returns (absent: read the file)
CAT_LENGTH = "len"        # lists (Types 1, 37): number of children (which follow as entries)
CAT_OBJECT = "obj"        # tensors: path of the dataset (hard links: the linked one); absent: own path
CAT_OFFSET = "off"        # plain contiguous tensors: file offset of the stored bytes ...
CAT_NBYTES = "nb"         # ... their size ...
CAT_STORED_DTYPE = "sd"   # ... the dataset's numpy dtype (str, e.g. "<f4") ...
CAT_STORED_SHAPE = "ss"   # ... and its shape (absent: equal to "shape")
# the value attributes a row repeats, under their own names (when the entry has them)
CATALOG_ATTRS = (ATTR_DTYPE, ATTR_SHAPE, ATTR_STRIDE, ATTR_STORAGE_OFFSET, ATTR_UNINITIALIZED,
                 ATTR_BASE, ATTR_STATS_FIELDS, ATTR_LIVE_STRIDE)


def contiguous_strides(shape) -> tuple[int, ...]:
    """Element strides of a C-order array of `shape` (what `Stride` says of stored data)."""
    out, acc = [], 1
    for n in reversed(tuple(int(x) for x in shape)):
        out.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(out))


def live_stride(attrs) -> tuple[int, ...]:
    """The live tensor's element strides from a value's attributes (or catalog entry):
    `live_stride` when present, else `Stride` (format <= 1.4 wrote the live strides there;
    1.5+ omits live_stride when the live tensor was contiguous, so Stride is right too)."""
    v = attrs.get(ATTR_LIVE_STRIDE)
    if v is None:
        v = attrs.get(ATTR_STRIDE, ())
    try:
        return tuple(int(x) for x in v)
    except TypeError:           # a 0-d array or a scalar
        import numpy as _np     # (only for this odd case: the module stays numpy-free otherwise)
        return tuple(int(x) for x in _np.asarray(v).reshape(-1))


def storage_offset(attrs, where: str = "") -> int:
    """A value's `storage_offset` attribute (0 when absent) as one integer; a file's other
    value (an array, a string, a float) raised TypeError/ValueError deep in the readers
    and in load-replay's step. Refused (DumpFormatError) naming `where`."""
    v = attrs.get(ATTR_STORAGE_OFFSET, 0)
    try:
        import numpy as _np
        a = _np.asarray(v)
        if a.dtype.kind in "iu" and a.size == 1 and a.ndim <= 1:
            return int(a.reshape(()))
    except (TypeError, ValueError):
        pass
    from .errors import DumpFormatError
    raise DumpFormatError(f"{where + ': ' if where else ''}its {ATTR_STORAGE_OFFSET} attribute "
                          f"{str(v)[:40]!r} is not one integer; refused")


def data_type_code(dtype_name: str) -> int:
    return DATA_TYPE_CODES.get(dtype_name, DATA_TYPE_UNKNOWN)


def device_type_code(device: str) -> int:
    return DEVICE_TYPE_CODES.get(device.split(":", 1)[0], DEVICE_TYPE_UNKNOWN)


def op_group_path(op: str, seqid: int) -> str:
    return f"/{op}/{int(seqid)}"


# a seqid group's name: ASCII digits, an int64 (str.isdigit() also takes "²" and "１２",
# which int() refuses, and a 23-digit name overflowed numpy's int64 deep in a reader)
MAX_SEQID_DIGITS = 18


def is_seqid_name(name: str | bytes) -> bool:
    """True when `name` is the name of a seqid group (/{op}/{seqid}): 1-18 ASCII digits."""
    return 0 < len(name) <= MAX_SEQID_DIGITS and name.isascii() and name.isdigit()
