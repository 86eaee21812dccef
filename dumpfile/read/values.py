"""Stored values -> numpy values (torch-free): dtype decoding of raw-bit storage
(bfloat16, float8, complex32, the original layout's widened dtypes), strided views rebuilt
from their base's data, and the hyperslabs a tensor is read in by chunks. Pure numpy: no
HDF5 object is touched here; dumpfile.read.reader and .light hand these the stored arrays."""

from __future__ import annotations

import itertools
import math
from typing import Iterator

import numpy as np

from dumpfile import schema as S
from dumpfile.errors import DumpFormatError
from dumpfile.read import legacy

# numpy dtype a raw-bit dtype decodes to
DECODED_NUMPY_DTYPE = {name: np.float32 for name in S.RAW_BIT_DTYPES}
DECODED_NUMPY_DTYPE["complex32"] = np.complex64


def _float8_table(exp_bits: int, man_bits: int, bias: int, *, ieee_inf: bool, fnuz: bool) -> np.ndarray:
    """Value of every byte of an 8-bit float format, as float32 (exact)."""
    codes = np.arange(256, dtype=np.int64)
    sign = np.where(codes >> 7, -1.0, 1.0)
    exp = (codes >> man_bits) & ((1 << exp_bits) - 1)
    man = codes & ((1 << man_bits) - 1)
    normal = sign * (1.0 + man / (1 << man_bits)) * np.exp2(exp.astype(np.float64) - bias)
    subnormal = sign * (man / (1 << man_bits)) * np.exp2(1.0 - bias)
    vals = np.where(exp == 0, subnormal, normal)
    max_exp = (1 << exp_bits) - 1
    if fnuz:
        vals[0x80] = np.nan              # the only NaN; no negative zero, no inf
    elif ieee_inf:
        top = exp == max_exp
        vals[top & (man == 0)] = sign[top & (man == 0)] * np.inf
        vals[top & (man != 0)] = np.nan
    else:                                # e4m3fn: only S.1111.111 is NaN
        vals[(exp == max_exp) & (man == (1 << man_bits) - 1)] = np.nan
    return vals.astype(np.float32)


def _e8m0_table() -> np.ndarray:
    vals = np.exp2(np.arange(256, dtype=np.float64) - 127)
    vals[255] = np.nan
    return vals.astype(np.float32)


_FLOAT8_TABLES = {
    "float8_e4m3fn": lambda: _float8_table(4, 3, 7, ieee_inf=False, fnuz=False),
    "float8_e5m2": lambda: _float8_table(5, 2, 15, ieee_inf=True, fnuz=False),
    "float8_e4m3fnuz": lambda: _float8_table(4, 3, 8, ieee_inf=False, fnuz=True),
    "float8_e5m2fnuz": lambda: _float8_table(5, 2, 16, ieee_inf=False, fnuz=True),
    "float8_e8m0fnu": _e8m0_table,
}
_table_cache: dict[str, np.ndarray] = {}


_WIDE_OK = frozenset({"bool", "float16", *S.RAW_BIT_DTYPES})


# numpy kinds a tensor is stored as (bool, ints, floats incl. raw-bit codes, complex)
_NUMERIC_KINDS = frozenset("biufc")


def check_stored_dtype(dtype: np.dtype, where: str) -> None:
    """Floats of at most 8 bytes, complex of at most 16: no tensor dtype is stored wider
    (numpy's longdouble, float128, reached torch.from_numpy as a raw TypeError)."""
    if dtype.kind == "f" and dtype.itemsize > 8 or dtype.kind == "c" and dtype.itemsize > 16:
        raise DumpFormatError(f"{where}: stored as {dtype} ({dtype.itemsize} bytes), wider than any tensor "
                              "dtype; refused")


def decode_raw(data: np.ndarray, dtype_name: str, where: str = "a tensor") -> np.ndarray:
    """Stored array -> numpy array with the tensor's values (exact). `where` ("FILE: /path")
    names it in the refusal of a stored type that holds no numbers: a compound, enum,
    reference, opaque, string or vlen dataset where a tensor is expected (a hostile or
    damaged file) raised numpy's TypeError deep inside a caller (an internal error)."""
    if getattr(data, "shape", ()) is None:
        # h5py.Empty: a null dataspace holds no elements and no shape (the writers store a
        # tensor of no elements with its zero-size shape; None-like values are not tensors)
        raise DumpFormatError(f"{where}: stored with a null dataspace (no shape, no elements) where a "
                              "tensor is expected; refused")
    kind = getattr(data, "dtype", np.dtype(object)).kind
    if kind not in _NUMERIC_KINDS or getattr(data.dtype, "fields", None) or data.dtype.subdtype:
        raise DumpFormatError(f"{where}: stored as {data.dtype if hasattr(data, 'dtype') else type(data).__name__}, "
                              "not numbers (a tensor is stored as bool, integers, floats or complex); refused")
    check_stored_dtype(data.dtype, where)
    if data.dtype.kind in "fiu" and dtype_name in _WIDE_OK:
        # original layout / legacy export: Half, bfloat16, float8 stored as float32, bool as ints
        wide = legacy.decode_stored(data, dtype_name)
        if wide is not None:
            return wide
    if dtype_name == "bfloat16":
        return (data.astype(np.uint32) << 16).view(np.float32)
    if dtype_name in _FLOAT8_TABLES:
        table = _table_cache.get(dtype_name)
        if table is None:
            table = _table_cache[dtype_name] = _FLOAT8_TABLES[dtype_name]()
        return table[data]
    if dtype_name == "complex32":
        pairs = data.astype(np.float32)
        return pairs[..., 0] + 1j * pairs[..., 1]
    return data


def chunk_slabs(shape: tuple[int, ...], chunk_elements: int
                ) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(start, count) hyperslabs covering `shape` in C order, each at most
    max(chunk_elements, 1) elements and contiguous once flattened. Rows of the first dim
    when a row fits (the pieces the metrics' summation order was fixed on); otherwise
    the split moves to the first dim whose trailing block fits: a (1, 2^26) tensor was
    read whole (1.1 GB resident for a 64 K-element chunk)."""
    shape = tuple(int(d) for d in shape)
    chunk = max(1, int(chunk_elements))
    k = 0
    while k < len(shape) - 1 and math.prod(shape[k + 1:]) > chunk:
        k += 1
    inner = math.prod(shape[k + 1:])
    step = max(1, chunk // max(1, inner))
    rest = (0,) * (len(shape) - k - 1)
    for outer in itertools.product(*(range(d) for d in shape[:k])):
        for i in range(0, shape[k], step):
            yield (outer + (i,) + rest,
                   (1,) * k + (min(step, shape[k] - i),) + shape[k + 1:])


def _strides_are_dense(shape, strides) -> bool:
    """True when the strides are a permutation of a contiguous layout's (dims of size 1
    aside): then every storage index is hit exactly once, without sorting the indices
    (np.unique cost 0.5 s per million elements). False only means "check otherwise"."""
    expect = 1
    for stride, size in sorted((int(st), int(sz)) for sz, st in zip(shape, strides) if int(sz) > 1):
        if stride != expect:
            return False
        expect *= size
    return True


def view_of(base: np.ndarray, base_stride: np.ndarray, base_offset: int, shape: tuple[int, ...],
            stride: np.ndarray, offset: int, *, where: str = "") -> np.ndarray:
    """Rebuild a strided view from the logical data of a dense, non-overlapping base.

    The base's elements are scattered back into the storage range they occupied
    (using its strides), then the view is read from that range with its own strides.
    Every index is bounds-checked: these attributes come from files.
    """
    n = base.size
    if base_stride.size != base.ndim:
        raise DumpFormatError(f"{where}: base Stride has {base_stride.size} entries for {base.ndim} dims")
    storage = np.empty(n, dtype=base.dtype)
    if n:
        idx = np.zeros(base.shape, dtype=np.int64)
        for d, s in enumerate(base_stride):
            shp = [1] * base.ndim
            shp[d] = base.shape[d]
            idx = idx + np.arange(base.shape[d], dtype=np.int64).reshape(shp) * int(s)
        idx = idx.reshape(-1)
        if idx.min() < 0 or idx.max() >= n or not (_strides_are_dense(base.shape, base_stride)
                                                   or np.unique(idx).size == n):
            raise DumpFormatError(f"{where}: base tensor is not dense, cannot rebuild a view of it")
        storage[idx] = base.reshape(-1)
    rel = offset - base_offset
    if len(stride) != len(shape):
        raise DumpFormatError(f"{where}: view Stride has {len(stride)} entries for {len(shape)} dims")
    if any(s < 0 for s in shape) or any(st < 0 for st in stride):
        raise DumpFormatError(f"{where}: negative shape or stride")
    numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if numel == 0:
        return np.empty(shape, dtype=base.dtype)
    last = rel + sum((d - 1) * st for d, st in zip(shape, stride))
    if rel < 0 or last >= n:
        raise DumpFormatError(f"{where}: view reaches outside the data of its base")
    item = storage.itemsize
    return np.lib.stride_tricks.as_strided(
        storage[rel:], shape=tuple(shape), strides=tuple(int(s) * item for s in stride)).copy()

