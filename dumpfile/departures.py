"""How a run departs from the recording it is replayed against (issue 31), torch-free.

Load-replay feeds each live op the recorded inputs, which isolates a kernel's own error but
also erases every difference in what the live run *does*: an op the user inserted, one left
out, a changed argument (eps, scale, approximate), a parameter whose value is not the
golden's. The replay records each of those as a *departure* (npu_dumper/replay/load_replay.py)
in the root attribute `replay_departures` of its dump, and `accucmp compare` turns each into
a failing row (accucmp/compare/departures.py) so the verdict names it by module.

The policy of what is NOT a departure is data here, shared by both sides:
- ops a device or autocast adds by design (`BY_DESIGN_OPS`: dtype/device casts), on either
  side: a bf16 autocast run casts weights and activations the fp32 run never casts;
- arguments that place data rather than compute it (`PLACEMENT_ARGUMENTS`), and a dtype
  argument that names another floating dtype (a factory's dtype under autocast, a cast's
  target): the precision change is what the user asked for.

The attribute is JSON: {"version": 1, "counts": {kind: n}, "omitted": n, "rows": [...]}, rows
in the live run's execution order, each {"kind", "op", "module", "phase", "seqid" (live),
"at" (position on the recording's seqid axis, for ordering against compared rows), ...}
with the kind's own fields (FORMAT.md, "Departures from the recording"). HDF5 keeps an
attribute of the original layout (superblock v0) under 64 KiB, so at most MAX_BYTES of rows
are kept, the first ones in execution order (the first departure is what a verdict names);
`omitted` counts the rest, `counts` counts all.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from dumpfile import schema as S
from dumpfile.errors import DumpFormatError
from dumpfile.opclass import CASTS

ROOT_ATTR = "replay_departures"
VERSION = 1

INSERTED, MISSING, ARGUMENT, INPUT = "inserted", "missing", "argument", "input"
KINDS = (INSERTED, MISSING, ARGUMENT, INPUT)

# op packets (namespace.name) that convert a tensor's dtype or device and nothing else: a
# low-precision or another-device run calls them where the reference does not
BY_DESIGN_OPS = CASTS | frozenset({
    "aten._to_cpu", "aten.lift_fresh", "aten.lift_fresh_copy",
    "aten.detach", "aten.alias",
    # ops that copy or re-view values without computing: a clone the autograd engine makes
    # to accumulate a gradient in one precision and steals in another, a contiguous copy
    # another kernel choice needs. Whatever difference they would carry shows where their
    # result is read (an input departure), so their own presence is never one
    "aten.clone", "aten.contiguous", "aten._unsafe_view", "aten.view", "aten.reshape", "aten._reshape_alias",
    "aten.expand", "aten.copy", "aten.copy_", "aten._foreach_copy_", "aten.t", "aten.transpose", "aten.permute",
    # allocations compute nothing (a warmed-up wrapper or another device's allocator reuses
    # buffers a first iteration allocates)
    "aten.empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty", "aten.new_empty_strided",
})
# in-place ops whose result does not depend on what they overwrite: an inserted one changes
# no state the step ends with by updating it (npu_dumper/replay/departures.py, compare's
# step_result_departures): `zero_grad(set_to_none=False)` against a golden that set None
OVERWRITING_OPS = frozenset({"aten.zero_", "aten.fill_", "aten.random_", "aten.uniform_", "aten.normal_",
                             "aten.bernoulli_", "aten.exponential_", "aten.geometric_", "aten.cauchy_",
                             "aten.log_normal_", "aten.set_", "aten.resize_", "aten.copy_", "aten._foreach_zero_",
                             "aten._foreach_copy_"})


def is_in_place_update(name: str) -> bool:
    """An ATen op that updates its first argument in place from its old value (`mul_`,
    `_foreach_mul_`, `add_`: ATen's trailing underscore), not one that overwrites it."""
    parts = str(name).split(".")
    return len(parts) >= 2 and parts[0] == "aten" and parts[1].endswith("_") \
        and not parts[1].endswith("__") and op_packet(name) not in OVERWRITING_OPS


# namespaces whose ops are not a departure on either side: collectives (replay runs them live by
# design: their result depends on other ranks) and the profiler's bookkeeping (record_function
# markers, e.g. optimizer.zero_grad's: no numerics)
RUN_LIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd",
                                 "profiler"})

# arguments that say where or how data is laid out, not what is computed
PLACEMENT_ARGUMENTS = frozenset({"device", "layout", "pin_memory", "memory_format", "non_blocking", "copy",
                                 "generator"})

FLOATING = frozenset({"float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2",
                      "float8_e4m3fnuz", "float8_e5m2fnuz", "half", "float", "double"})

MAX_BYTES = 56_000          # the attribute's JSON, under HDF5's 64 KiB compact attribute limit
MAX_TEXT = 1 << 20          # what a reader accepts from a file (a hostile file may declare more)


# module-path components a wrapper adds (DDP/DataParallel's `module`, torch.compile's
# `_orig_mod`, FSDP1's and activation checkpointing's wrapped modules): a wrapped run and an
# unwrapped one name the same module differently
WRAPPER_COMPONENTS = frozenset({"module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


def unwrapped_module(path: str) -> str:
    """'module.block.ln2' -> 'block.ln2' (the path without wrapper components)."""
    if not path:
        return ""
    return ".".join(p for p in str(path).split(".") if p not in WRAPPER_COMPONENTS)


def op_packet(name: str) -> str:
    """'aten.mul.Tensor' -> 'aten.mul' (the overload packet's name)."""
    parts = str(name).split(".")
    return ".".join(parts[:2]) if len(parts) >= 3 else str(name)


def is_collective_op(name: str) -> bool:
    """An op of the collectives' namespaces (c10d and the functional collectives)."""
    return str(name).split(".", 1)[0] in RUN_LIVE_NAMESPACES - {"profiler"}


def loss_scaler_role(value: Any) -> str:
    """An op's attribute loss_scaler (schema.OP_LOSS_SCALER) as one of its roles
    (schema.LOSS_SCALER_ROLES), or '' for none or a value that is no role: a file is input
    from outside, and only a known role makes an op a loss scaler's, by design."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    return value if isinstance(value, str) and value in S.LOSS_SCALER_ROLES else ""


# ops whose result takes a tensor argument's shape and dtype, not its values
VALUE_FREE = frozenset(f"aten.{n}" for n in (
    "ones_like", "zeros_like", "full_like", "empty_like", "rand_like", "randn_like", "randint_like",
    "new_ones", "new_zeros", "new_full", "new_empty", "new_empty_strided", "empty_strided"))
RESTRIDES = frozenset({"aten.as_strided", "aten.as_strided_"})


def restride_moves_no_element(name: str, shape, stride, new_shape, new_stride, offset, new_offset) -> bool:
    """An `as_strided(_)` that keeps the shape, the storage offset and the stride of every
    dimension holding more than one element: each element stays where it was, only unit
    dimensions' strides change. A channels_last run's pooled (N, C, 1, 1) result is restrided
    so by adaptive_avg_pool2d, which a contiguous run does not do: a layout's choice, as a
    contiguous copy is, never a departure."""
    try:
        shape, new_shape = tuple(int(n) for n in shape), tuple(int(n) for n in new_shape)
        stride, new_stride = tuple(int(n) for n in stride), tuple(int(n) for n in new_stride)
        return op_packet(name) in RESTRIDES and shape == new_shape and len(stride) == len(new_stride) == len(shape) \
            and int(offset) == int(new_offset) and all(a == b for n, a, b in zip(shape, stride, new_stride) if n > 1)
    except (TypeError, ValueError):
        return False


def attr_is_true(v: Any) -> bool:
    """A boolean op attribute (random, constant): True only for a true bool (numpy's too); a
    file is input from outside, and a string or array there means nothing."""
    return isinstance(v, (bool, np.bool_)) and bool(v)


def is_constant_op(attrs: Any) -> bool:
    """An op's attribute constant (schema.OP_CONSTANT): it read no value of the run."""
    try:
        return attr_is_true(attrs.get(S.OP_CONSTANT))
    except Exception:  # noqa: BLE001 - unreadable attributes: an op like any other
        return False


def is_by_design_op(name: str) -> bool:
    """An op a device/precision change adds or drops on its own: never a departure."""
    return op_packet(name) in BY_DESIGN_OPS or str(name).split(".", 1)[0] in RUN_LIVE_NAMESPACES


# the largest finite value of each floating dtype: a model that fills a mask with
# torch.finfo(dtype).min (Falcon, T5, ...) passes another number in another precision
_DTYPE_MAX = frozenset(S.LARGEST_FINITE.values())


def _dtype_extreme(v: Any) -> bool:
    return isinstance(v, float) and abs(v) in _DTYPE_MAX


def argument_change_is_by_design(name: str, live: Any, recorded: Any) -> bool:
    """A changed argument that a precision or device change explains (not the user's bug)."""
    if name in PLACEMENT_ARGUMENTS:
        return True
    if _dtype_extreme(live) and _dtype_extreme(recorded) and (live > 0) == (recorded > 0):
        return True
    return isinstance(live, str) and isinstance(recorded, str) and live in FLOATING and recorded in FLOATING \
        and name.endswith("dtype")


def value_text(v: Any) -> str:
    """An argument's value as the headline shows it (Python's repr, floats as %g)."""
    if isinstance(v, bool) or v is None:
        return repr(v)
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(value_text(x) for x in v) + "]"
    return str(v)


def source_of(attrs) -> dict[str, Any]:
    """What identifies a recording (its root `created` and `num_ops`): departures describe the
    live run against that file, and compare judges them only against it."""
    out = {}
    for k in ("created", "num_ops"):
        v = attrs.get(k)
        if isinstance(v, bytes):
            v = v.decode("utf-8", "replace")
        if isinstance(v, (str, int)) or hasattr(v, "item"):
            out[k] = v.item() if hasattr(v, "item") else v
    return out


def encode(rows: list[dict[str, Any]], counts: dict[str, int], source: dict | None = None) -> str:
    """The attribute's text: rows kept in execution order while they fit MAX_BYTES."""
    kept, size = [], 200
    for row in rows:
        text = json.dumps(row, separators=(",", ":"), default=str)
        if size + len(text) + 1 > MAX_BYTES:
            break
        kept.append(row)
        size += len(text) + 1
    return json.dumps({"version": VERSION, "source": source or {},
                       "counts": {k: int(v) for k, v in counts.items() if v},
                       "omitted": len(rows) - len(kept), "rows": kept}, separators=(",", ":"), default=str)


_STR_FIELDS = ("kind", "op", "module", "phase", "argument", "live", "golden", "dtype", "made_by", "reason",
               "detail", "optimizer")
_NUM_FIELDS = ("seqid", "at", "golden_seqid", "rel_err", "max_abs_err", "golden_abs_max")


def decode(text: Any, path: str = "") -> dict[str, Any]:
    """The attribute read back, checked: a file is input from outside, so a value that is not
    this shape is refused in one line (DumpFormatError naming the file), whatever it holds."""
    where = f"{path}: " if path else ""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    if not isinstance(text, str) or len(text) > MAX_TEXT:
        raise DumpFormatError(f"{where}root attribute {ROOT_ATTR} is not JSON text of at most {MAX_TEXT} bytes")
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise DumpFormatError(f"{where}root attribute {ROOT_ATTR} is not valid JSON ({type(e).__name__})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("rows", []), list):
        raise DumpFormatError(f"{where}root attribute {ROOT_ATTR} is not an object with a list of rows")
    rows = []
    for i, raw in enumerate(doc.get("rows", [])):
        if not isinstance(raw, dict) or raw.get("kind") not in KINDS:
            raise DumpFormatError(f"{where}root attribute {ROOT_ATTR}: row {i} is not a departure")
        row: dict[str, Any] = {}
        for k in _STR_FIELDS:
            v = raw.get(k)
            if v is not None:
                row[k] = str(v)[:500]
        for k in _NUM_FIELDS:
            v = raw.get(k)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isinf(v):
                raise DumpFormatError(f"{where}root attribute {ROOT_ATTR}: row {i}: {k} is not a number")
            row[k] = float(v)
        rows.append(row)
    counts = doc.get("counts", {})
    counts = {k: int(v) for k, v in counts.items() if k in KINDS and isinstance(v, int) and not isinstance(v, bool)} \
        if isinstance(counts, dict) else {}
    omitted = doc.get("omitted", 0)
    omitted = int(omitted) if isinstance(omitted, int) and not isinstance(omitted, bool) and omitted >= 0 else 0
    source = doc.get("source", {})
    source = {k: v for k, v in source.items() if k in ("created", "num_ops") and isinstance(v, (str, int))} \
        if isinstance(source, dict) else {}
    return {"rows": rows, "counts": counts, "omitted": omitted, "source": source}
