"""Rules of the original Ascend layout (PyTorch 1.5 dumper + CANN msaccucmp), both ways.

Used by `accucmp export` (dumpfile -> original layout and back) and, as small hooks, by
the reader (dtype of an original-layout tensor, phase of an original op) and by compare's
op matching (`addmm` <-> `aten.addmm.default`). Numpy only: no torch, no h5py.

What the real msaccucmp (mindstudio-probe 26.2.0, msaccucmp/pytorch_cmp) requires, read
from its source (docs/FORMAT.md "The original layout"):

* every root member is an op group whose members are all decimal seqids (it calls
  `int()` on them: our `_npu_dumper` group crashed it);
* op names match `[a-zA-Z0-9_]*` (its dataset-path regex; `aten.addmm.default` fails it);
* a group must have *no* attributes (any attribute makes it "a dataset", so it is not
  walked), a value dataset has `Type` (0 = tensor; others are skipped);
* `DataType` one of the original codes (an unknown code raises in `DataType.get_name`);
* the golden side is re-strided with `as_strided(flat_data, Stride)` when its DeviceType
  is CPU/GPU, so `Stride` must describe the stored data;
* the target ("-m") file must have DeviceType 10 (NPU) on its first tensor.
"""

from __future__ import annotations

import re

import numpy as np

from dumpfile import schema as S

# DataType codes of the original (pytorch_dump_data.DataType)
ORIGINAL_DATA_TYPES = {
    "float32": 1, "uint8": 2, "int8": 3, "int16": 5, "int32": 6, "int64": 7,
    "bool": 9, "float16": 10, "float64": 11,
}
DTYPE_BY_ORIGINAL_CODE = {v: k for k, v in ORIGINAL_DATA_TYPES.items()}
# stored as float32 (DataType 1 = Float) with the torch dtype in ATTR_SOURCE_DTYPE
UPCAST_TO_FLOAT32 = frozenset(S.RAW_BIT_DTYPES)
ORIGINAL_DEVICE_TYPES = {"cpu": 0, "cuda": 1, "npu": 10}
# Type codes the original had (0-16); ours (30+) have no meaning to its readers
ORIGINAL_VALUE_TYPES = frozenset({2, 3, 4, 5, 6, 7, 9, 10, 14, 16})

_NAME_OK = re.compile(r"^[A-Za-z0-9_]+$")
_BACKWARD = re.compile(r"Backward\d*$")


def legacy_op_name(op: str) -> str:
    """Our op name -> the original layout's group name (the PyTorch 1.5 wrapper style).

    `aten.NAME.default` -> `NAME`; `aten.NAME.OVERLOAD` -> `NAME_OVERLOAD`
    (`aten.add.Tensor` -> `add_Tensor`, `aten.add_.Tensor` -> `add__Tensor`); another
    namespace keeps it as a prefix: `mylib.fused.default` -> `mylib_fused`. Any other
    character becomes `_`. A name already of `[A-Za-z0-9_]` (an original file's) is kept.
    Distinct ops that still map to one name within a file are told apart by
    `legacy_names` (collision-free by construction of the file).
    """
    if _NAME_OK.match(op):
        return op
    parts = op.split(".")
    if len(parts) >= 3:
        ns, name, overload = parts[0], parts[1], ".".join(parts[2:])
        base = name if ns == "aten" else f"{ns}_{name}"
        out = base if overload == "default" else f"{base}_{overload}"
    else:
        out = op
    return re.sub(r"[^A-Za-z0-9_]", "_", out) or "op"


def legacy_names(ops) -> dict[str, str]:
    """Full op name -> a unique legacy group name, for every distinct name in `ops`.

    The rule: legacy_op_name; where two distinct ops get the same name, the one whose full
    name sorts first keeps it and the others get `_x2`, `_x3`, ... (skipping any name
    already taken). The file keeps the map (root attribute, docs/FORMAT.md), so the reverse
    export restores the full names exactly."""
    out: dict[str, str] = {}
    taken: set[str] = set()
    for op in sorted(set(ops)):
        name = legacy_op_name(op)
        if name in taken:
            k = 2
            while f"{name}_x{k}" in taken:
                k += 1
            name = f"{name}_x{k}"
        taken.add(name)
        out[op] = name
    return out


def phase_of(op: str) -> str:
    """Phase of an op of an original file: autograd node class names (`AddmmBackward`,
    `MulBackward0`) ran in backward; every other recorded op in forward."""
    return S.PHASE_BACKWARD if _BACKWARD.search(op) or "Backward" in op else S.PHASE_FORWARD


def aten_guess(op: str) -> str | None:
    """An original op name's ATen spelling for matching (`addmm` -> `aten.addmm.default`);
    None for backward node names and names that already have a namespace."""
    if "." in op or phase_of(op) == S.PHASE_BACKWARD:
        return None
    return f"aten.{op}.default"


def dtype_of(attrs, stored_dtype) -> str:
    """The torch dtype name of a tensor entry that has no `dtype` attribute (an original
    file, a legacy export): `source_dtype` if present, else the original DataType code
    (Half stored as F32 with DataType 10 is float16; Bool is bool), else the data's own."""
    src = attrs.get(S.ATTR_SOURCE_DTYPE)
    if src is not None:
        return src.decode() if isinstance(src, bytes) else str(src)
    code = attrs.get(S.ATTR_DATA_TYPE)
    try:
        name = DTYPE_BY_ORIGINAL_CODE.get(int(code)) if code is not None else None
    except (TypeError, ValueError):
        name = None
    return name or str(np.dtype(stored_dtype))


def decode_stored(data: np.ndarray, dtype_name: str) -> np.ndarray | None:
    """Values of an array stored wider than its dtype (the original layout's Half as F32,
    a legacy export's bfloat16/float8 as float32, bool as integers): the array to use, or
    None when the usual decoding applies. Float data is already the values: keep it
    (judged at `dtype_name`'s precision by compare, which reads the name)."""
    kind = data.dtype.kind
    if dtype_name == "bool":
        return data if kind == "b" else data.astype(bool)
    if kind == "f" and dtype_name in S.FLOATING_DTYPES and np.dtype(data.dtype).itemsize > 2 \
            and dtype_name not in ("float32", "float64"):
        return data
    return None
