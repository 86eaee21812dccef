"""Light value records: an op's values read through h5py's low-level API (torch-free).

The one place where compare, listing and load-replay get an op's values from its groups
(`walk_group`) or, in files of format 1.2+, from the catalog (dumpfile.read.catalog, which
builds the same records). `DumpFile.values` builds a full record per entry (every
attribute, h5py's high-level objects, 50-90 us each); on thousands of small tensors that
dominated. These open one group per input/output side, its members relative to it, and
read only the attributes asked for:

- `layout=False` (compare, listing): Type, dtype (skipped when the storage dtype says it),
  shape, uninitialized;
- `layout=True` (load-replay): every attribute the catalog repeats (schema.CATALOG_ATTRS),
  each tensor's identity (`ident`: the HDF5 object, which hard links share, plus its
  recorded layout) and, for plain contiguous datasets, the file offset and size of the
  stored bytes (read with pread, without h5py).

Non-tensor values are read now when `values=True`. Whatever a record does not handle
itself (views, statistics, odd layouts, empty dataspaces, strings) goes to DumpFile's own
record, so view resolution and dtype decoding stay in one place (reader.py, values.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np
from h5py import h5a, h5d, h5g, h5o, h5s

from dumpfile import schema as S
from dumpfile.errors import DumpFormatError
from dumpfile.read import legacy, safety
from dumpfile.read.h5util import _attr_str, h5_errors, ordered_names, suffix_index  # noqa: F401
from dumpfile.read.lowlevel import UNSUPPORTED, contiguous_offset, read_open_attr
from dumpfile.read.reader import DumpFile, ValueRecord
from dumpfile.read.records import check_kind, type_code
from dumpfile.read.values import chunk_slabs, decode_raw

NO_VALUE = object()        # a record whose value is not read yet (read() asks the file)

# Storage dtypes that say the torch dtype by themselves: their "dtype" attribute is not
# read; ambiguous ones (uint8/uint16 raw bits, float16 pairs) read it.
_UNAMBIGUOUS_STORAGE = {np.dtype(k): k for k in ("float32", "float64", "int8", "int16", "int32", "int64",
                                                 "bool", "complex64", "complex128", "uint32", "uint64")}
_B_TYPE, _B_DTYPE, _B_SHAPE = S.ATTR_TYPE.encode(), S.ATTR_DTYPE.encode(), S.ATTR_SHAPE.encode()
_B_UNINIT, _B_ORDER = S.ATTR_UNINITIALIZED.encode(), b"order"
_FAST_READ_KINDS = frozenset("biufc")
# The attributes a layout walk reads (the catalog repeats the same ones); the others
# (DataType, device ...) cost ~20 us each to read and no reader of these records uses them.
_WANTED = tuple(n.encode() for n in (S.ATTR_TYPE, *S.CATALOG_ATTRS))


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


@dataclass
class LightValue(ValueRecord):
    """A record read by `walk_group` or from the catalog. Tensors: `stored_shape` /
    `stored_dtype` (`fast`: plain numeric storage, read with the low-level API), `data`
    when read eagerly, and from a layout walk or the catalog `ident` and, for plain
    contiguous datasets, `file_offset` / `stored_nbytes`. Non-tensors: `value` when read
    (what `read()` returns).

    It holds no open HDF5 object: HDF5 scans every object open in a file when an
    attribute is opened, so keeping thousands of datasets open made each attribute read
    cost 50-200 us."""

    value: Any = NO_VALUE
    ident: tuple | None = None
    file_offset: int | None = None
    stored_nbytes: int = 0
    stored_dtype: Any = None
    stored_shape: tuple | None = None
    fast: bool = False
    data: np.ndarray | None = None            # the stored array, when read eagerly

    @property
    def stored_size(self) -> int:
        if self.stored_shape is None:
            return 0
        return math.prod(int(d) for d in self.stored_shape)

    def read(self) -> Any:
        if self.value is not NO_VALUE:
            return self.value
        if self.data is not None:
            return decode_raw(self.data, self.dtype, f"{self.file.path}: {self.path}")
        if not self.fast or self.type != S.TYPE_TENSOR:
            return super().read()             # views, empty dataspaces, strings: the reader's way
        arr = np.empty(self.stored_shape, dtype=self.stored_dtype)
        if arr.size:
            with h5_errors(self.file.path, self.path):
                dsid = self._dataset()
                dsid.read(h5s.create_simple(arr.shape), dsid.get_space(), arr)
        return decode_raw(arr, self.dtype, f"{self.file.path}: {self.path}")

    def _dataset(self):
        """The dataset, opened by path, checked to hold what the record says it stores (a
        record from the catalog says what the writer wrote; a file edited since may differ,
        and a read sized by a wrong shape must not happen)."""
        dsid = h5d.open(self.file.h5.id, self.path.encode("utf-8", "surrogateescape"))
        if dsid.shape != tuple(self.stored_shape) or dsid.dtype != self.stored_dtype:
            raise DumpFormatError(f"{self.file.path}: {self.path}: stored as {dsid.dtype}{list(dsid.shape or ())}, "
                                  f"the catalog says {self.stored_dtype}{list(self.stored_shape)} (edited in place? "
                                  "delete /_npu_dumper/catalog)")
        return dsid

    def iter_chunks_into(self, chunk_elements: int):
        """As DumpFile.iter_chunks (same pieces: the metrics' summation order depends on
        them), read into one reused buffer: a fresh 16 MiB array per piece costs page
        faults comparable to the read. A piece is valid until the next is asked for."""
        shape = tuple(int(d) for d in self.stored_shape)
        slabs = list(chunk_slabs(shape, chunk_elements))
        with h5_errors(self.file.path, self.path):
            dsid = self._dataset()
            fspace = dsid.get_space()
            buf = np.empty(max((math.prod(c) for _, c in slabs), default=1), dtype=self.stored_dtype)
        for start, count in slabs:
            out = buf[:math.prod(count)].reshape(count)
            # a generator: the guard goes around each read, not around the consumer's code
            with h5_errors(self.file.path, self.path):
                fspace.select_hyperslab(start, count)
                dsid.read(h5s.create_simple(out.shape), fspace, out)
            yield decode_raw(out, self.dtype, f"{self.file.path}: {self.path}").reshape(-1)


LightTensor = LightValue        # (compare's name for the tensor records)


def some_attrs(oid, names: frozenset) -> dict[bytes, Any]:
    """Those of `names` (bytes) the object has, read: one listing of its attribute names
    instead of an existence check per name (rare attributes are usually all absent)."""
    found: list[bytes] = []
    h5a.iterate(oid, lambda name: found.append(name) if name in names else None)
    return {n: ll_attr(oid, n) for n in found}


def _wanted_attrs(oid) -> dict[str, Any] | None:
    """The layout walk's attributes of an object; None when one is of a kind the low-level
    read does not handle (the caller then asks the reader)."""
    out: dict[str, Any] = {}
    for name in _WANTED:
        if not h5a.exists(oid, name):
            continue
        v = read_open_attr(h5a.open(oid, name))
        if v is UNSUPPORTED:
            return None
        out[name.decode()] = _attr_str(v) if isinstance(v, bytes) else v
    return out


def _tensor_attrs(f: DumpFile, oid, code: int) -> dict[str, Any]:
    """The few attributes compare and listing read of a plain tensor."""
    stored_dtype = oid.dtype
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
    return attrs


def _plain_value(oid, code: int, attrs: dict) -> Any:
    """What DumpFile.read_value returns for a non-tensor, non-list entry; NO_VALUE for
    what this read does not handle (strings, empty dataspaces: the reader's way)."""
    if code == S.TYPE_NONE:
        return None
    if code == S.TYPE_SCALAR_TYPE and S.ATTR_DTYPE in attrs:
        return _attr_str(attrs[S.ATTR_DTYPE])
    if not isinstance(oid, h5d.DatasetID):
        return NO_VALUE
    dtype, shape = oid.dtype, oid.shape
    if shape is None or dtype.kind not in "biuf" or dtype.subdtype is not None:
        return NO_VALUE
    arr = np.empty(shape, dtype=dtype)
    if arr.size:
        oid.read(h5s.ALL, h5s.ALL, arr)
    if code == S.TYPE_SCALAR_TYPE:
        return S.DTYPE_BY_CODE.get(int(arr[()]), "")
    return arr.tolist() if arr.ndim else arr[()].item()


def _layout_shape(attrs: dict, oid) -> tuple[int, ...]:
    if S.ATTR_SHAPE in attrs:
        return tuple(int(x) for x in np.asarray(attrs[S.ATTR_SHAPE]).reshape(-1))
    shape = getattr(oid, "shape", None)
    return tuple(shape) if shape is not None else ()


def member(f: DumpFile, parent_id, link: str, path: str, *, eager: int = 0, layout: bool = False,
           values: bool = False, name: str | None = None) -> ValueRecord:
    """The record of `link` in the open group `parent_id` (see the module's docstring for
    `layout` and `values`); tensors of at most `eager` elements are read now, while their
    dataset is open (reopening one by path costs as much as reading it)."""
    safety.check_levels(f.path, path.count("/"), path)
    oid = h5o.open(parent_id, link.encode("utf-8", "surrogateescape"))
    is_group = isinstance(oid, h5g.GroupID)
    link = link if name is None else name
    if layout:
        attrs = _wanted_attrs(oid)
        if attrs is None:
            return f._record(path, link)
        code = attrs.get(S.ATTR_TYPE)
    else:
        code = ll_attr(oid, _B_TYPE)
    code = type_code(code, f"{f.path}: {path}") if code is not None else \
        (S.TYPE_LIST if is_group else S.TYPE_TENSOR)
    check_kind(f.path, path, code, is_group)
    if code in S.LIST_TYPES or (layout and is_group):
        rec = LightValue(f, path, link, code, attrs if layout else {S.ATTR_TYPE: code})
        kids = link_names(oid) if is_group else []
        safety.check_members(f.path, len(kids), path)
        kids = sorted(kids, key=suffix_index)
        rec.children = [member(f, oid, k, f"{path}/{k}", eager=eager, layout=layout, values=values)
                        for k in kids]
        return rec
    if code not in S.TENSOR_TYPES:
        if not layout:
            attrs = {S.ATTR_TYPE: code}
            if values and code == S.TYPE_SCALAR_TYPE:
                dt = ll_attr(oid, _B_DTYPE)
                if dt is not None:
                    attrs[S.ATTR_DTYPE] = _attr_str(dt)
        rec = LightValue(f, path, link, code, attrs)
        if values or layout:
            rec.value = _plain_value(oid, code, attrs)
        return rec
    if layout:
        rec = LightValue(f, path, link, code, attrs)
        # hash(ObjectID) is h5py's (file number, object address): hard links share it, and
        # it equals hash(h5[path].id), the key of view bases in replay's recorded tensors
        rec.ident = (hash(oid), S.storage_offset(attrs, f"{f.path}: {path}"), _layout_shape(attrs, oid),
                     S.live_stride(attrs))
        if code == S.TYPE_TENSOR and not is_group:
            try:
                dt, shape = oid.dtype, oid.shape
            except (AttributeError, TypeError, ValueError, RuntimeError):
                dt = shape = None
            if shape is not None and dt.subdtype is None:
                nbytes = dt.itemsize * math.prod(int(d) for d in shape)
                off = contiguous_offset(oid, nbytes)
                if off is not None:
                    rec.file_offset, rec.stored_nbytes = off, nbytes
                    rec.stored_dtype, rec.stored_shape = dt, tuple(shape)
        return rec
    if code != S.TYPE_TENSOR or is_group:
        return f._record(path, link)          # views, statistics, odd layouts: the reader's full record
    rec = LightValue(f, path, link, code, _tensor_attrs(f, oid, code))
    stored_shape, stored_dtype = oid.shape, oid.dtype
    rec.stored_shape, rec.stored_dtype = stored_shape, stored_dtype
    rec.fast = fast = (stored_shape is not None and stored_dtype.kind in _FAST_READ_KINDS
                       and stored_dtype.subdtype is None)
    if fast and rec.stored_size <= eager:
        arr = np.empty(stored_shape, dtype=stored_dtype)
        try:
            if arr.size:
                oid.read(h5s.ALL, h5s.ALL, arr)
            rec.data = arr
        except (OSError, ValueError, TypeError, KeyError):
            pass                              # read() tries again and reports the error on the row
    return rec


def walk_group(f: DumpFile, group_path: str, op_id=None, side: str = "", *, eager: int = 0,
               layout: bool = False, values: bool = False) -> dict[str, ValueRecord]:
    """The entries of an op's input/ or output/ group, in argument order (as
    DumpFile.values). `op_id`/`side`: the op group already open and the side's name."""
    try:
        gid = h5o.open(op_id, side.encode()) if op_id is not None else \
            h5o.open(f.h5.id, group_path.encode("utf-8", "surrogateescape"))
    except KeyError:
        # a side the op has no group for has no values; any other failure to open it is
        # damage and must raise (read as "absent", it hid a damaged op's tensors)
        exists = op_id.links.exists(side.encode()) if op_id is not None else group_path in f.h5
        if exists:
            raise
        return {}
    if not isinstance(gid, h5g.GroupID):
        raise DumpFormatError(f"{f.path}: {group_path} is a dataset where an op's input/output group belongs; "
                              "refused")
    order = ll_attr(gid, _B_ORDER)
    names = link_names(gid)
    safety.check_members(f.path, len(names), group_path)
    names = ordered_names(names, order)
    return {n: member(f, gid, n, f"{group_path}/{n}", eager=eager, layout=layout, values=values)
            for n in names}


def light_record(f: DumpFile, path: str, name: str, eager: int = 0) -> ValueRecord:
    """The record at `path` (opened from the file root)."""
    return member(f, f.h5.id, path, path, eager=eager, name=name)


def light_values(f: DumpFile, group_path: str, op_id=None, side: str = "", eager: int = 0
                 ) -> dict[str, ValueRecord]:
    """compare's walk of one side (walk_group with its defaults)."""
    return walk_group(f, group_path, op_id, side, eager=eager)
