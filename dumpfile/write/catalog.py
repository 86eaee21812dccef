"""The catalog of a dump file being written (`/_npu_dumper/catalog`, docs/FORMAT.md).

One JSON row per index row describing the op's values and the file places of its
tensors, so load-replay reads ~0.05-0.1 ms an op instead of walking the groups. The
writer (writer.py) tells `Catalog` what it created, as it creates it; the catalog keeps
the open op's entries, the descriptions of stored datasets (for links to them), and
appends its rows at the flush that appends the index rows. An accelerator only: any
value it cannot describe leaves that op's row empty (readers then read the groups),
and a catalog out of step with the index is no longer kept.
"""

from __future__ import annotations

import json
from typing import Any

import h5py
import numpy as np

from .. import schema as S
from dumpfile.read.lowlevel import contiguous_offset
from .h5objects import new_table

_STR = h5py.string_dtype("utf-8")

# Descriptions of stored tensors kept for links to them, at most this many (oldest
# forgotten first; a link to a forgotten one reads the file instead).
CATALOG_MAX_DESCRIPTIONS = 1 << 16
NO_VALUE = object()     # (an entry whose value the catalog does not hold)

# compact, and strict JSON: NaN/inf raise ValueError (values holding them are left out)
_cat_json = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode


def _cat_attrs(attrs: dict[str, Any]) -> dict[str, Any] | None:
    """The catalog's copy of an entry's attributes ("T" and schema.CATALOG_ATTRS, JSON
    types), as written; None when one is of a kind the catalog does not describe."""
    code = attrs.get(S.ATTR_TYPE)
    if isinstance(code, (bool, np.bool_)) or not isinstance(code, (int, np.integer)):
        return None
    out: dict[str, Any] = {S.CAT_TYPE: int(code)}
    for k in S.CATALOG_ATTRS:
        v = attrs.get(k)
        if v is None:
            continue
        if k in (S.ATTR_SHAPE, S.ATTR_STRIDE, S.ATTR_LIVE_STRIDE):
            a = np.asarray(v)
            if a.ndim != 1 or a.dtype.kind not in "iu":
                return None
            out[k] = a.tolist()
        elif k == S.ATTR_STORAGE_OFFSET:
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                return None
            out[k] = int(v)
        elif k == S.ATTR_UNINITIALIZED:
            if not isinstance(v, (bool, np.bool_)):
                return None
            out[k] = bool(v)
        else:
            if isinstance(v, bytes):
                v = v.decode("utf-8", "replace")
            if not isinstance(v, str):
                return None
            out[k] = v
    return out


def _tensor_fragment(attrs: dict[str, Any], offset: int | None = None, nbytes: int = 0,
                     dtype: Any = None, shape: Any = None) -> str | None:
    """A stored tensor's catalog description, JSON members without braces (entries add
    "n" and, for links, "obj"); None when it cannot be described."""
    d = _cat_attrs(attrs)
    if d is None:
        return None
    if offset is not None and d[S.CAT_TYPE] == S.TYPE_TENSOR:
        d[S.CAT_OFFSET] = int(offset)
        d[S.CAT_NBYTES] = int(nbytes)
        d[S.CAT_STORED_DTYPE] = np.dtype(dtype).str
        ss = [int(x) for x in shape]
        if ss != d.get(S.ATTR_SHAPE):
            d[S.CAT_STORED_SHAPE] = ss
    return _cat_json(d)[1:-1]


class Catalog:
    """The catalog state of one open file: the open op's entries, the descriptions of
    stored datasets, and the `/_npu_dumper/catalog` table (made at its first rows).

    `prefix` is the open op's path + "/" while that op is described (None otherwise):
    the writer checks it before describing anything, so an undescribed dump pays nothing.
    """

    def __init__(self, f: h5py.File, index_shape: tuple):
        self._f = f
        self.table = f[S.CATALOG_PATH] if S.CATALOG_PATH in f else None
        # not kept up (readers then walk the groups) when an existing file's catalog does
        # not match its index
        self.on = index_shape[0] == 0 if self.table is None else self.table.shape == index_shape
        self._desc: dict[str, tuple[str, str]] = {}   # dataset path -> (canonical path, fragment)
        self.prefix: str | None = None
        self._groups: dict[str, dict[str, list[str]]] = {}   # io -> top name -> entries
        self._order: dict[str, list[str]] = {}
        self._bad = False
        self._frags: dict[int, tuple] = {}    # (Catalog._fragment)

    # ---- the open op ---------------------------------------------------------------
    def begin(self, path: str) -> None:
        if self.on:
            self.prefix = path + "/"
            self._groups = {S.INPUT_GROUP: {}, S.OUTPUT_GROUP: {}}
            self._order = {}
            self._bad = False

    def reset(self) -> None:
        self.prefix = None
        self._groups = {}
        self._order = {}
        self._bad = False

    def mark_bad(self) -> None:
        """Something of the open op cannot be described: its row stays empty."""
        self._bad = True

    def set_order(self, gpath: str, names) -> None:
        if self.prefix is not None and gpath.startswith(self.prefix):
            io = gpath[len(self.prefix):]
            if io in self._groups:
                self._order[io] = [str(n) for n in names]

    def _place(self, path: str) -> tuple[str, str] | None:
        """(io group, name relative to it) of an entry of the open op, else None."""
        prefix = self.prefix
        if prefix is None or not path.startswith(prefix):
            return None
        io, _, rel = path[len(prefix):].partition("/")
        return (io, rel) if rel and io in self._groups else None

    def _add(self, io: str, rel: str, entry: str) -> None:
        self._groups[io].setdefault(rel.partition("/")[0], []).append(entry)

    def entry(self, path: str, desc: dict[str, Any], value: Any = NO_VALUE) -> None:
        """A non-tensor entry (value or list) of the open op."""
        place = self._place(path)
        if place is None:
            return
        d = {S.CAT_NAME: place[1], **desc}
        if value is not NO_VALUE:
            d[S.CAT_VALUE] = value
        try:
            entry = _cat_json(d)
        except (TypeError, ValueError, OverflowError):   # complex, NaN, inf: readers read the file
            d.pop(S.CAT_VALUE, None)
            try:
                entry = _cat_json(d)
            except (TypeError, ValueError, OverflowError):
                self._bad = True
                return
        self._add(place[0], place[1], entry)

    def named(self, path: str, type_code: int, value: str, extra: dict[str, Any] | None) -> None:
        """A dtype / device / layout / memory_format entry (DumpWriter.write_named)."""
        attrs = {S.ATTR_TYPE: type_code, **(extra or {})}
        if type_code == S.TYPE_SCALAR_TYPE:
            attrs.setdefault(S.ATTR_DTYPE, value)
        d = _cat_attrs(attrs)
        if d is None:       # never fails the write: the op is left undescribed
            self._bad = True
            return
        # the value as read back: the dtype name, or the string
        v = d.get(S.ATTR_DTYPE, NO_VALUE) if type_code == S.TYPE_SCALAR_TYPE \
            else value if isinstance(value, str) else NO_VALUE
        self.entry(path, d, v)

    def tensor(self, path: str, attrs: dict[str, Any], offset: int | None = None,
               nbytes: int = 0, dtype: Any = None, shape: Any = None) -> None:
        """A dataset stored at `path` (tensor, view or statistics): remembered for links to
        it, and an entry of the open op when it is one."""
        try:
            frag = self._fragment(attrs, offset, nbytes, dtype, shape)
        except (TypeError, ValueError, OverflowError):
            frag = None
        if frag is None:            # never fails the write: the op is left undescribed
            self._bad = True
            return
        self._remember(path, (path, frag))
        place = self._place(path)
        if place is not None:
            self._add(place[0], place[1], '{"n":' + _cat_json(place[1]) + "," + frag + "}")

    def _fragment(self, attrs: dict[str, Any], offset: int | None, nbytes: int, dtype: Any,
                  shape: Any) -> str | None:
        """_tensor_fragment's string. A plain tensor's attributes (a dict the writer
        reuses for every tensor of that description, h5objects.cached_attrs) are encoded
        once; only its place is added per tensor."""
        if offset is None:
            return _tensor_fragment(attrs, offset, nbytes, dtype, shape)
        got = self._frags.get(id(attrs))
        if got is None or got[0] is not attrs:
            d = _cat_attrs(attrs)
            if d is None or d[S.CAT_TYPE] != S.TYPE_TENSOR:
                return _tensor_fragment(attrs, offset, nbytes, dtype, shape)
            if len(self._frags) >= CATALOG_MAX_DESCRIPTIONS:
                self._frags.clear()
            # (the dict is held here, so its id is not reused while the entry lives)
            got = self._frags[id(attrs)] = (attrs, _cat_json(d)[1:-1], d.get(S.ATTR_SHAPE))
        ss = [int(x) for x in shape]
        return (f'{got[1]},"{S.CAT_OFFSET}":{int(offset)},"{S.CAT_NBYTES}":{int(nbytes)},'
                f'"{S.CAT_STORED_DTYPE}":{_cat_json(np.dtype(dtype).str)}'
                + ("" if ss == got[2] else f',"{S.CAT_STORED_SHAPE}":{_cat_json(ss)}'))

    def link(self, path: str, existing_path: str) -> None:
        if not existing_path.startswith("/"):
            existing_path = "/" + existing_path
        desc = self._desc.get(existing_path)
        if desc is None:
            desc = self._describe_stored(existing_path)
            if desc is None:
                self._bad = True
                return
        self._remember(path, desc)
        place = self._place(path)
        if place is not None:
            canonical, frag = desc
            self._add(place[0], place[1], '{"n":' + _cat_json(place[1]) + ',"obj":'
                      + _cat_json(canonical) + "," + frag + "}")

    def _remember(self, path: str, desc: tuple[str, str]) -> None:
        known = self._desc
        known[path] = desc
        if len(known) > CATALOG_MAX_DESCRIPTIONS:
            del known[next(iter(known))]

    def _describe_stored(self, path: str) -> tuple[str, str] | None:
        """A stored tensor's description read back from the file (a link to one written
        so long ago that its description was forgotten, or by an earlier writer)."""
        try:
            obj = self._f[path]
            if not isinstance(obj, h5py.Dataset):
                return None
            attrs = dict(obj.attrs)
            attrs.setdefault(S.ATTR_TYPE, S.TYPE_TENSOR)
            if int(attrs[S.ATTR_TYPE]) not in S.TENSOR_TYPES:
                return None
            offset = nbytes = shape = None
            if int(attrs[S.ATTR_TYPE]) == S.TYPE_TENSOR and obj.shape is not None \
                    and obj.dtype.subdtype is None:
                shape = tuple(obj.shape)
                nbytes = obj.dtype.itemsize * int(np.prod(shape, dtype=np.int64))
                offset = contiguous_offset(obj.id, nbytes)
            frag = _tensor_fragment(attrs, offset, nbytes or 0, obj.dtype, shape)
        except (KeyError, ValueError, TypeError, OSError, RuntimeError):
            return None
        return None if frag is None else (path, frag)

    def finish(self, io_ids: tuple) -> str:
        """The open op's catalog row ("" when it is not fully described). `io_ids`: its
        input/ and output/ group ids (what a reader lists)."""
        prefix, groups, order, bad = self.prefix, self._groups, self._order, self._bad
        self.reset()
        if prefix is None or bad:
            return ""
        parts = []
        for io, key, gid in zip((S.INPUT_GROUP, S.OUTPUT_GROUP), (S.CAT_INPUTS, S.CAT_OUTPUTS), io_ids):
            tops = groups[io]
            try:        # something written around this writer (a raw h5py copy): not described
                if len(gid) != len(tops):
                    return ""
            except (ValueError, RuntimeError, TypeError):
                return ""
            # readers list the names of `order` first, then the others alphabetically
            names = sorted(tops)
            listed = order.get(io)
            if listed:
                first = [n for n in dict.fromkeys(listed) if n in tops]
                names = first + [n for n in names if n not in set(first)]
            parts.append(f'"{key}":[' + ",".join(e for n in names for e in tops[n]) + "]")
        return "{" + ",".join(parts) + "}"

    # ---- the table -----------------------------------------------------------------
    def append(self, n: int, rows: list[str]) -> None:
        """Catalog rows of index rows n, n+1, ... (in the same flush as those)."""
        cat = self.table
        if cat is None:
            if n:
                self.on = False
                return
            cat = self.table = new_table(self._f, S.CATALOG_PATH, _STR)
        if cat.shape[0] != n:          # out of step: stop (readers then walk the groups)
            self.on = False
            return
        cat.resize((n + len(rows),))
        cat[n:] = np.array(rows, dtype=object)
