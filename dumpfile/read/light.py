"""Light value records: the values of an op read through h5py's low-level API (torch-free).

DumpFile.values builds a full record per tensor (every attribute, h5py high-level
objects); compare, which touches thousands of small tensors, reads through these
instead. Anything they do not handle themselves (views, statistics, odd layouts,
empty dataspaces, strings) is handed to DumpFile's own record, so view resolution
and dtype decoding stay in reader.py. The attribute helpers (ll_attr, str_attr,
link_names) are shared with the replay's index.
"""

from __future__ import annotations

import math
from typing import Any

import h5py
import numpy as np
from h5py import h5a, h5d, h5g, h5o, h5s

from dumpfile import schema as S
from dumpfile.read import legacy
from dumpfile.read.lowlevel import UNSUPPORTED, read_open_attr
from dumpfile.read.reader import DumpFile, ValueRecord, chunk_slabs, decode_raw, h5_errors

# Reading every attribute of every dataset (DumpFile.values) costs ~10 HDF5
# attribute reads per tensor, and h5py's high-level objects cost ~50-90 us each to
# create; on thousands of small tensors that dominated the compare. These read only
# what a comparison needs, through h5py's low-level API: one group opened per
# input/output side, members opened relative to it, attributes read only when
# present. Storage dtypes that say the torch dtype by themselves skip the "dtype"
# attribute; ambiguous ones (uint8/uint16 raw bits, float16 pairs) read it.
_UNAMBIGUOUS_STORAGE = {np.dtype(k): k for k in ("float32", "float64", "int8", "int16", "int32", "int64",
                                                 "bool", "complex64", "complex128", "uint32", "uint64")}
_B_TYPE, _B_DTYPE, _B_SHAPE = S.ATTR_TYPE.encode(), S.ATTR_DTYPE.encode(), S.ATTR_SHAPE.encode()
_B_UNINIT, _B_ORDER = S.ATTR_UNINITIALIZED.encode(), b"order"
_FAST_READ_KINDS = frozenset("biufc")


def ll_attr(oid, name: bytes, default=None):
    """An attribute of a low-level object id, as h5py's attrs[name] returns it; `default` when absent."""
    if not h5a.exists(oid, name):
        return default
    value = read_open_attr(h5a.open(oid, name))
    if value is UNSUPPORTED:
        return h5py.AttributeManager(_IdHolder(oid))[name.decode()]
    return value


class _IdHolder:
    """What h5py.AttributeManager needs of its parent: an `id`."""

    def __init__(self, oid):
        self.id = oid


def str_attr(oid, name: bytes, default: str = "") -> str:
    v = ll_attr(oid, name)
    if v is None or isinstance(v, h5py.Empty):
        return default
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


def link_names(gid) -> list[str]:
    names: list[bytes] = []
    gid.links.iterate(names.append)     # name order, as Group.keys()
    return [n.decode("utf-8", "surrogateescape") for n in names]


def suffix_index(key: str) -> tuple[int, str]:
    """Sort key of a list's members (item_0, item_1, ... item_10): by their numeric suffix."""
    tail = key.rsplit("_", 1)[-1]
    return (int(tail) if tail.isdigit() else 1 << 62, key)


def light_record(f: DumpFile, path: str, name: str, eager: int = 0) -> ValueRecord:
    """The record at `path` (opened from the file root)."""
    return light_member(f, f.h5.id, path.encode("utf-8", "surrogateescape"), path, name, eager)


def light_member(f: DumpFile, parent_id, link: bytes, path: str, name: str, eager: int) -> ValueRecord:
    """The record of `link` in the open group `parent_id`; tensors of at most `eager`
    elements are read now, while their dataset is open (reopening one by path costs
    as much as reading it)."""
    oid = h5o.open(parent_id, link)
    is_group = isinstance(oid, h5g.GroupID)
    code = ll_attr(oid, _B_TYPE)
    if code is None:
        code = S.TYPE_LIST if is_group else S.TYPE_TENSOR
    code = int(code)
    if code in S.LIST_TYPES:
        rec = ValueRecord(f, path, name, code, {S.ATTR_TYPE: code})
        kids = sorted(link_names(oid) if is_group else [], key=suffix_index)
        rec.children = [light_member(f, oid, k.encode("utf-8", "surrogateescape"), f"{path}/{k}", k, eager)
                        for k in kids]
        return rec
    if code not in S.TENSOR_TYPES:
        # a plain value (int, None, dtype...): compare skips it, so its other attributes are not read
        return ValueRecord(f, path, name, code, {S.ATTR_TYPE: code})
    if code != S.TYPE_TENSOR or is_group:
        return f._record(path, name)          # views, statistics, odd layouts: the reader's full record
    stored_shape, stored_dtype = oid.shape, oid.dtype
    fast = stored_shape is not None and stored_dtype.kind in _FAST_READ_KINDS and stored_dtype.subdtype is None
    attrs: dict[str, Any] = {S.ATTR_TYPE: code}
    if f.attrs.get(S.ROOT_FORMAT) is None:
        # an original-layout file (or a legacy export): the dtype is the original's DataType
        # (Half stored as F32) or source_dtype (bfloat16 as float32), not the storage's
        attrs[S.ATTR_DTYPE] = legacy.dtype_of(
            {k: v for k in (S.ATTR_DATA_TYPE, S.ATTR_SOURCE_DTYPE)
             if (v := ll_attr(oid, k.encode())) is not None}, stored_dtype)
    else:
        dtype = _UNAMBIGUOUS_STORAGE.get(stored_dtype)
        attrs[S.ATTR_DTYPE] = dtype or str_attr(oid, _B_DTYPE, str(stored_dtype))
    shape = ll_attr(oid, _B_SHAPE)
    if shape is not None:
        attrs[S.ATTR_SHAPE] = shape
    uninit = ll_attr(oid, _B_UNINIT)
    if uninit is not None:
        attrs[S.ATTR_UNINITIALIZED] = uninit
    rec = LightTensor(f, path, name, code, attrs)
    rec.stored_shape = stored_shape
    rec.stored_dtype = stored_dtype
    rec.fast = fast
    if fast and rec.stored_size <= eager:
        arr = np.empty(stored_shape, dtype=stored_dtype)
        try:
            if arr.size:
                oid.read(h5s.ALL, h5s.ALL, arr)
            rec.data = arr
        except (OSError, ValueError, TypeError, KeyError):
            pass                              # read() tries again and reports the error on the row
    return rec


class LightTensor(ValueRecord):
    """A plain tensor record that reads through the low-level API.

    It holds no open HDF5 object: HDF5 scans every object open in a file when an
    attribute is opened, so keeping thousands of datasets open (as h5py objects
    cached per record did) made each attribute read cost 50-200 us.
    """

    stored_shape: tuple[int, ...] | None = None
    stored_dtype: Any = None
    fast: bool = False
    data: np.ndarray | None = None            # the stored array, when read eagerly

    @property
    def stored_size(self) -> int:
        if self.stored_shape is None:
            return 0
        return math.prod(int(d) for d in self.stored_shape)

    def read(self):
        if self.data is not None:
            return decode_raw(self.data, self.dtype)
        if not self.fast:
            return super().read()             # empty dataspace, strings, compounds: the reader's way
        arr = np.empty(self.stored_shape, dtype=self.stored_dtype)
        if arr.size:
            with h5_errors(self.file.path, self.path):
                h5d.open(self.file.h5.id, self.path.encode("utf-8", "surrogateescape")).read(h5s.ALL, h5s.ALL, arr)
        return decode_raw(arr, self.dtype)

    def iter_chunks_into(self, chunk_elements: int):
        """As DumpFile.iter_chunks (same pieces: the metrics' summation order depends on
        them), read into one reused buffer: a fresh 16 MiB array per piece costs page
        faults comparable to the read. A piece is valid until the next is asked for."""
        shape = tuple(int(d) for d in self.stored_shape)
        slabs = list(chunk_slabs(shape, chunk_elements))
        with h5_errors(self.file.path, self.path):
            dsid = h5d.open(self.file.h5.id, self.path.encode("utf-8", "surrogateescape"))
            fspace = dsid.get_space()
            buf = np.empty(max((math.prod(c) for _, c in slabs), default=1), dtype=self.stored_dtype)
        for start, count in slabs:
            out = buf[:math.prod(count)].reshape(count)
            # a generator: the guard goes around each read, not around the consumer's code
            with h5_errors(self.file.path, self.path):
                fspace.select_hyperslab(start, count)
                dsid.read(h5s.create_simple(out.shape), fspace, out)
            yield decode_raw(out, self.dtype).reshape(-1)


def light_values(f: DumpFile, group_path: str, op_id=None, side: str = "", eager: int = 0
                  ) -> dict[str, ValueRecord]:
    try:
        gid = h5o.open(op_id, side.encode()) if op_id is not None else h5o.open(f.h5.id, group_path.encode())
    except KeyError:
        # a side the op has no group for has no values; any other failure to open it is
        # damage and must raise (read as "absent", it hid a damaged op's tensors)
        exists = op_id.links.exists(side.encode()) if op_id is not None else group_path in f.h5
        if exists:
            raise
        return {}
    if not isinstance(gid, h5g.GroupID):
        return {}
    names = link_names(gid)
    order = ll_attr(gid, _B_ORDER)
    if order is not None:
        present = set(names)
        listed = [n.decode() if isinstance(n, bytes) else str(n) for n in np.asarray(order).reshape(-1)]
        names = [n for n in listed if n in present] + [n for n in names if n not in set(listed)]
    return {n: light_member(f, gid, n.encode("utf-8", "surrogateescape"), f"{group_path}/{n}", n, eager)
            for n in names}
