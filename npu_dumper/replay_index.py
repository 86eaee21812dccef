"""Load-replay's index of a recording: every op's inputs read in one low-level pass.

The replay's main thread must not call h5py while the model runs: h5py serialises every
call behind one lock, which the dump's writer thread holds much of the time, and its
high-level objects (Group.__getitem__, AttributeManager) cost 0.1-1 ms an entry. So the
prefetch thread reads each recorded op's input group here, through h5py's low-level API
(h5o/h5a/h5d), into plain ValueRecords that carry what replay needs later:

- the attributes replay reads (Type, dtype, shape, Stride, storage_offset, ...), as
  DumpFile's records have them, and non-tensor values already read;
- for tensor entries an identity, `ident`: the HDF5 object (file number and address,
  which hard links to one dataset share) plus the recorded layout, so one stored tensor
  is read once;
- for plain contiguous datasets the file offset and byte size, so its bytes can be read
  with os.preadv without h5py at all.

Records behave as DumpFile's (`read()`, `attrs`, `shape`, `children`); whatever this pass
does not know (views, odd layouts) falls back to the reader through `file`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np
from h5py import h5a, h5g, h5o

from dumpfile import schema as S
from dumpfile.lowlevel import UNSUPPORTED, read_open_attr
from dumpfile.reader import DumpFile, ValueRecord, _attr_str

_NO_VALUE = object()


@dataclass
class IndexedValue(ValueRecord):
    """A ValueRecord read by `read_group`. Tensors: `ident`, and for plain contiguous
    datasets `file_offset` / `stored_nbytes` / `stored_dtype` / `stored_shape`.
    Non-tensors: `value`, already read (what `read()` returns)."""

    value: Any = _NO_VALUE
    ident: tuple | None = None
    file_offset: int | None = None
    stored_nbytes: int = 0
    stored_dtype: Any = None
    stored_shape: tuple | None = None

    def read(self) -> Any:
        if self.value is not _NO_VALUE:
            return self.value
        return super().read()


def _attr(aid) -> Any:
    """An open attribute's value, as h5py's attrs[name] returns it (_NO_VALUE: not readable here)."""
    value = read_open_attr(aid)
    return _NO_VALUE if value is UNSUPPORTED else value


# The attributes replay and the record readers use; the others (DataType, device ...)
# cost ~20 us each to read and are never looked at.
_WANTED = tuple(n.encode() for n in (S.ATTR_TYPE, S.ATTR_DTYPE, S.ATTR_SHAPE, S.ATTR_STRIDE,
                                     S.ATTR_STORAGE_OFFSET, S.ATTR_UNINITIALIZED, S.ATTR_BASE,
                                     S.ATTR_STATS_FIELDS))


def _attrs(oid) -> dict[str, Any] | None:
    """The wanted attributes of a low-level object; None when one is of a kind read here
    does not handle (the caller then asks the reader)."""
    out: dict[str, Any] = {}
    for name in _WANTED:
        if not h5a.exists(oid, name):
            continue
        v = _attr(h5a.open(oid, name))
        if v is _NO_VALUE:
            return None
        out[name.decode()] = _attr_str(v) if isinstance(v, bytes) else v
    return out


def _link_names(gid) -> list[str]:
    names: list[bytes] = []
    gid.links.iterate(names.append)
    return [n.decode("utf-8", "surrogateescape") for n in names]


def _suffix_index(key: str) -> tuple[int, str]:
    tail = key.rsplit("_", 1)[-1]
    return (int(tail) if tail.isdigit() else 1 << 62, key)


def _stride(attrs: dict) -> tuple[int, ...]:
    return tuple(int(s) for s in np.asarray(attrs.get(S.ATTR_STRIDE, ())).reshape(-1))


def _shape(attrs: dict, oid) -> tuple[int, ...]:
    if S.ATTR_SHAPE in attrs:
        return tuple(int(x) for x in np.asarray(attrs[S.ATTR_SHAPE]).reshape(-1))
    shape = getattr(oid, "shape", None)
    return tuple(shape) if shape is not None else ()


def _plain_value(f: DumpFile, oid, code: int, attrs: dict) -> Any:
    """What DumpFile.read_value returns for a non-tensor, non-list entry."""
    if code == S.TYPE_NONE:
        return None
    if code == S.TYPE_SCALAR_TYPE and S.ATTR_DTYPE in attrs:
        return _attr_str(attrs[S.ATTR_DTYPE])
    dtype, shape = oid.dtype, oid.shape
    if shape is None or dtype.kind not in "biuf" or dtype.subdtype is not None:
        return _NO_VALUE                      # strings, empty: the reader's way (rare)
    arr = np.empty(shape, dtype=dtype)
    if arr.size:
        oid.read(h5py.h5s.ALL, h5py.h5s.ALL, arr)
    if code == S.TYPE_SCALAR_TYPE:
        return S.DTYPE_BY_CODE.get(int(arr[()]), "")
    return arr.tolist() if arr.ndim else arr[()].item()


def _member(f: DumpFile, parent_id, link: str, path: str) -> ValueRecord:
    oid = h5o.open(parent_id, link.encode("utf-8", "surrogateescape"))
    is_group = isinstance(oid, h5g.GroupID)
    attrs = _attrs(oid)
    if attrs is None:
        return f._record(path, link)
    code = attrs.get(S.ATTR_TYPE)
    code = int(code) if code is not None else (S.TYPE_LIST if is_group else S.TYPE_TENSOR)
    rec = IndexedValue(f, path, link, code, attrs)
    if is_group:
        rec.children = [_member(f, oid, k, f"{path}/{k}") for k in sorted(_link_names(oid), key=_suffix_index)]
        return rec
    if code in S.TENSOR_TYPES:
        # hash(ObjectID) is h5py's (file number, object address): hard links share it, and
        # it equals hash(h5[path].id), the key of view bases in recorded.tensor_from_record
        rec.ident = (hash(oid), int(attrs.get(S.ATTR_STORAGE_OFFSET, 0)), _shape(attrs, oid), _stride(attrs))
        if code == S.TYPE_TENSOR:
            try:
                off = oid.get_offset()
                dt, shape = oid.dtype, oid.shape
                if off is not None and shape is not None and dt.subdtype is None:
                    nbytes = dt.itemsize * math.prod(int(d) for d in shape)
                    if oid.get_storage_size() == nbytes:
                        rec.file_offset, rec.stored_nbytes = off, nbytes
                        rec.stored_dtype, rec.stored_shape = dt, tuple(shape)
            except (AttributeError, TypeError, ValueError, RuntimeError):
                pass
        return rec
    rec.value = _plain_value(f, oid, code, attrs)
    return rec


def read_group(f: DumpFile, group_path: str) -> dict[str, ValueRecord]:
    """The entries of an op's input/ or output/ group, in argument order (as DumpFile.values)."""
    try:
        gid = h5o.open(f.h5.id, group_path.encode("utf-8", "surrogateescape"))
    except KeyError:
        return {}
    if not isinstance(gid, h5g.GroupID):
        return {}
    names = _link_names(gid)
    if h5a.exists(gid, b"order"):
        order = _attr(h5a.open(gid, b"order"))
        if order is not _NO_VALUE and not isinstance(order, h5py.Empty):
            listed = [_attr_str(n) for n in np.asarray(order).reshape(-1)]
            present = set(names)
            names = [n for n in listed if n in present] + [n for n in names if n not in set(listed)]
    return {n: _member(f, gid, n, f"{group_path}/{n}") for n in names}
