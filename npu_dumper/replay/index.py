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

Files of format 1.2+ carry the same facts in one dataset, /_npu_dumper/catalog (a JSON row
per index row, written with the op): `read_catalog` builds these records from it without
opening any op group (~0.05 ms an op instead of ~0.7 ms), and says None where it cannot be
used (older files, a catalog whose length is not the index's, offsets that are not the
file's); ops it does not describe are walked with `read_group`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np
from h5py import h5a, h5g, h5o

from dumpfile import schema as S
from dumpfile.read.light import link_names, suffix_index
from dumpfile.read.lowlevel import UNSUPPORTED, contiguous_offset, read_open_attr
from dumpfile.read.reader import DumpFile, ValueRecord, _attr_str

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
# (the catalog repeats the same ones: schema.CATALOG_ATTRS)
_WANTED = tuple(n.encode() for n in (S.ATTR_TYPE, *S.CATALOG_ATTRS))


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


def _stride(attrs: dict) -> tuple[int, ...]:
    return S.live_stride(attrs)


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
        rec.children = [_member(f, oid, k, f"{path}/{k}") for k in sorted(link_names(oid), key=suffix_index)]
        return rec
    if code in S.TENSOR_TYPES:
        # hash(ObjectID) is h5py's (file number, object address): hard links share it, and
        # it equals hash(h5[path].id), the key of view bases in recorded.tensor_from_record
        rec.ident = (hash(oid), int(attrs.get(S.ATTR_STORAGE_OFFSET, 0)), _shape(attrs, oid), _stride(attrs))
        if code == S.TYPE_TENSOR:
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
    names = link_names(gid)
    if h5a.exists(gid, b"order"):
        order = _attr(h5a.open(gid, b"order"))
        if order is not _NO_VALUE and not isinstance(order, h5py.Empty):
            listed = [_attr_str(n) for n in np.asarray(order).reshape(-1)]
            present = set(names)
            names = [n for n in listed if n in present] + [n for n in names if n not in set(listed)]
    return {n: _member(f, gid, n, f"{group_path}/{n}") for n in names}


# ---- the catalog (format 1.2+) ------------------------------------------------------------
def _row_major(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, step = [], 1
    for d in reversed(shape):
        out.append(step)
        step *= max(int(d), 1)
    return tuple(reversed(out))


def _catalog_attrs(e: dict, code: int) -> dict[str, Any]:
    """An entry's attributes as `_attrs` reads them from the object (numpy scalars/arrays)."""
    attrs: dict[str, Any] = {S.ATTR_TYPE: np.int64(code)}
    for k in S.CATALOG_ATTRS:
        if k not in e:
            continue
        v = e[k]
        if k in (S.ATTR_SHAPE, S.ATTR_STRIDE, S.ATTR_LIVE_STRIDE):
            attrs[k] = np.array(v, dtype=np.int64)
        elif k == S.ATTR_STORAGE_OFFSET:
            attrs[k] = np.int64(v)
        elif k == S.ATTR_UNINITIALIZED:
            attrs[k] = np.bool_(v)
        elif isinstance(v, str):
            attrs[k] = v
        else:
            raise TypeError(f"attribute {k} is not a string")
    return attrs


def _catalog_group(f: DumpFile, group_path: str, entries: list, hashed: dict,
                   placed: list) -> dict[str, ValueRecord]:
    """The records of one group from its catalog entries, as `read_group` builds them."""
    top: dict[str, ValueRecord] = {}
    lists: dict[str, IndexedValue] = {}
    for e in entries:
        n = e[S.CAT_NAME]
        code = int(e[S.CAT_TYPE])
        parent, _, leaf = n.rpartition("/")
        path = f"{group_path}/{n}"
        rec = IndexedValue(f, path, leaf, code, _catalog_attrs(e, code))
        if S.CAT_LENGTH in e:
            lists[n] = rec
        elif code in S.TENSOR_TYPES:
            shape = tuple(int(x) for x in e[S.ATTR_SHAPE])
            stride = S.live_stride(e)
            canonical = e.get(S.CAT_OBJECT, path)
            if code == S.TYPE_TENSOR and len(shape) >= 2 and len(stride) == len(shape) \
                    and stride != _row_major(shape):
                # a stored tensor that replay may lay out as recorded (ReplayPolicy._strided_base):
                # views of it key their base by hash(h5[path].id) (recorded.tensor_from_record),
                # so it takes that identity, as read_group gives it (opened once per dataset)
                ident0 = hashed.get(canonical)
                if ident0 is None:
                    ident0 = hashed[canonical] = hash(h5o.open(f.h5.id, canonical.encode("utf-8", "surrogateescape")))
            else:
                ident0 = ("obj", canonical)
            rec.ident = (ident0, int(e.get(S.ATTR_STORAGE_OFFSET, 0)), shape, stride)
            if code == S.TYPE_TENSOR and S.CAT_OFFSET in e:
                rec.file_offset = int(e[S.CAT_OFFSET])
                rec.stored_nbytes = int(e[S.CAT_NBYTES])
                rec.stored_dtype = np.dtype(e[S.CAT_STORED_DTYPE])
                rec.stored_shape = tuple(int(x) for x in e.get(S.CAT_STORED_SHAPE, shape))
                placed.append(rec)
        elif S.CAT_VALUE in e:
            rec.value = e[S.CAT_VALUE]
        if parent:
            lists[parent].children.append(rec)     # KeyError: malformed, the caller walks
        else:
            top[n] = rec
    for rec in lists.values():
        rec.children.sort(key=lambda c: suffix_index(c.name))
    return top


def read_catalog(f: DumpFile, group: str = S.INPUT_GROUP) -> dict[str, dict[str, ValueRecord] | None] | None:
    """Every op's `group` (input/ or output/) records from the file's catalog, by op group
    path (`OpRecord.path`): what `read_group` would return for it, or None for an op the
    catalog does not describe (walk it). None when the file has no usable catalog: absent
    (older files, the original tool's, statistics tables), not one row per index row (a
    crash between the two writes, a tool that edited one of them), or unreadable."""
    key = S.CAT_INPUTS if group == S.INPUT_GROUP else S.CAT_OUTPUTS
    rows = f.catalog_rows()
    if rows is None:
        return None
    hashed: dict[str, int] = {}
    placed: list[IndexedValue] = []
    out: dict[str, dict[str, ValueRecord] | None] = {}
    for path, raw in rows.items():
        try:
            out[path] = (_catalog_group(f, f"{path}/{group}", json.loads(raw)[key], hashed, placed)
                         if raw else None)
        except (ValueError, TypeError, KeyError, AttributeError, IndexError):
            out[path] = None        # not described, or malformed: walk this op
    return out if _offsets_hold(f, placed) else None


_OFFSET_SAMPLES = 8


def _offsets_hold(f: DumpFile, placed: list[IndexedValue]) -> bool:
    """Whether the catalog's file offsets are this file's: a tool that rewrites the file
    (h5repack, a copy of every group) copies the catalog as it is while the datasets move,
    and replay reads bytes at those offsets. Checked on a few datasets spread over the file
    (first and last included; a rewrite moves nearly all of them)."""
    if not placed:
        return True
    n = len(placed)
    k = min(n, _OFFSET_SAMPLES)
    picks = sorted({round(i * (n - 1) / max(k - 1, 1)) for i in range(k)})
    try:
        for i in picks:
            rec = placed[i]
            oid = h5o.open(f.h5.id, rec.path.encode("utf-8", "surrogateescape"))
            if contiguous_offset(oid, rec.stored_nbytes) != rec.file_offset:
                return False
    except (KeyError, AttributeError, TypeError, ValueError, RuntimeError):
        return False
    return True
