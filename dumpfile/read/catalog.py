"""Value records from the catalog (`/_npu_dumper/catalog`, format 1.2+), torch-free.

The writer keeps, next to the index, one JSON row per op naming its values with the
attributes readers use and, for plain contiguous tensors, where their bytes are
(docs/FORMAT.md "The catalog"). Records built here are the ones `light.walk_group` reads
from the groups, without opening any op group (~0.05 ms an op instead of ~0.7 ms):

- `read_catalog(f, group)`: every op's records at once, layout included (load-replay);
- `op_values(f, op, eager)`: one op's tensor records, read by row in blocks (compare:
  the catalog of a 333k-op file is ~166 MB of text, never held whole), small tensors'
  bytes read with pread at their recorded offsets when the file's offsets are its own;
- `described_rows(f)`: rows with each entry's placement left out, so that a reader
  parses each distinct row once (listing: a model's ops repeat a few hundred patterns).

The groups stay the truth: a row that is empty, malformed or lacks what a reader needs
gives None for that op (the reader walks it), and a catalog whose offsets are not the
file's (a tool rewrote it: h5repack) is not used for offsets (`offsets_hold`).
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

import numpy as np
from h5py import h5l, h5o

from dumpfile import schema as S
from dumpfile import h5direct
from dumpfile import jsontext
from dumpfile.errors import DumpFormatError
from dumpfile.read import objheader
from dumpfile.read.lowlevel import contiguous_offset
from dumpfile.read.reader import DumpFile, ValueRecord
from dumpfile.read.light import LightValue, suffix_index

_OFFSET_SAMPLES = 8
# a malformed row: the op is walked instead (RecursionError: a row of deeply nested
# brackets, which json.loads cannot parse without recursing past the interpreter's limit)
_CAT_ERRORS = (ValueError, TypeError, KeyError, AttributeError, IndexError, RecursionError, DumpFormatError)


def _row_major(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, step = [], 1
    for d in reversed(shape):
        out.append(step)
        step *= max(int(d), 1)
    return tuple(reversed(out))


def linked_tensor(entry: dict) -> tuple[str, int, str, str] | None:
    """(op, seqid, io, name) of the stored tensor a catalog entry is (its `obj` link,
    `/op/seqid/io/name`) or a view of (its `base`; a local link `_base|op|seqid|io|name`),
    or None when the entry is the tensor's first appearance and no view (or a link that does
    not parse)."""
    base = entry.get("base")
    if isinstance(base, str) and base:
        last = base.rsplit("/", 1)[-1]
        if last.startswith("_base|"):
            parts = last.split("|")
            if len(parts) >= 5 and parts[2].isdigit():
                return parts[1], int(parts[2]), parts[3], "/".join(parts[4:])
            return None
        ref = base
    else:
        ref = entry.get("obj")
    if isinstance(ref, str) and ref:
        parts = ref.strip("/").split("/")
        if len(parts) >= 4 and parts[1].isdigit():
            return parts[0], int(parts[1]), parts[2], "/".join(parts[3:])
    return None


def catalog_attrs(e: dict, code: int) -> dict[str, Any]:
    """An entry's attributes as a layout walk reads them from the object (numpy scalars/arrays)."""
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


def _group_records(f: DumpFile, group_path: str, entries: list, hashed: dict,
                   placed: list) -> dict[str, ValueRecord]:
    """The records of one group from its catalog entries, as a layout walk builds them."""
    top: dict[str, ValueRecord] = {}
    lists: dict[str, LightValue] = {}
    for e in entries:
        n = e[S.CAT_NAME]
        code = int(e[S.CAT_TYPE])
        parent, _, leaf = n.rpartition("/")
        path = f"{group_path}/{n}"
        rec = LightValue(f, path, leaf, code, catalog_attrs(e, code))
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
                # so it takes that identity, as the walk gives it (opened once per dataset)
                ident0 = hashed.get(canonical)
                if ident0 is None:
                    ident0 = hashed[canonical] = hash(h5o.open(f.h5.id, canonical.encode("utf-8", "surrogateescape")))
            else:
                ident0 = ("obj", canonical)
            rec.ident = (ident0, S.storage_offset(e), shape, stride)
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
    path (`OpRecord.path`): what a layout walk (`light.walk_group(layout=True, values=True)`)
    would return for it, or None for an op the catalog does not describe (walk it). None
    when the file has no usable catalog: absent (older files, the original tool's,
    statistics tables), not one row per index row (a crash between the two writes, a tool
    that edited one of them), unreadable, or with offsets that are not the file's."""
    key = S.CAT_INPUTS if group == S.INPUT_GROUP else S.CAT_OUTPUTS
    rows = f.catalog_rows()
    if rows is None:
        return None
    hashed: dict[str, int] = {}
    placed: list[LightValue] = []
    out: dict[str, dict[str, ValueRecord] | None] = {}
    for path, raw in rows.items():
        try:
            out[path] = (_group_records(f, f"{path}/{group}", jsontext.loads(raw)[key], hashed, placed)
                         if raw else None)
        except _CAT_ERRORS:
            out[path] = None        # not described, or malformed: walk this op
    return out if _placed_hold(f, placed) else None


def stored_at(f: DumpFile, path: str, off: int, nbytes: int) -> bool:
    """Whether the dataset at `path` stores exactly its `nbytes` bytes, contiguously, at
    file offset `off` (a catalog's): checked before any read at a catalog offset. A dump
    edited with h5py (a tensor deleted and written again under its name) keeps its catalog
    while the new bytes lie elsewhere and the old ones stay at the old offset: a per-file
    sample cannot see one such tensor. One H5Oopen, through the C library where h5direct
    reaches it (~5 us; h5py's wrapper costs ~25)."""
    raw = path.encode("utf-8", "surrogateescape")
    if b"\0" in raw:
        return False            # (a C string would end there: another object's path)
    fast = h5direct.stored_at(f.h5.id, raw, off, nbytes)
    if fast is not None:
        return fast
    try:
        return contiguous_offset(h5o.open(f.h5.id, raw), nbytes) == off
    except (KeyError, AttributeError, TypeError, ValueError, RuntimeError):
        return False


def _placed_hold(f: DumpFile, placed: list[LightValue]) -> bool:
    """Whether the catalog's file offsets are this file's: a tool that rewrites the file
    (h5repack, a copy of every group) copies the catalog as it is while the datasets move,
    and readers read bytes at those offsets. Checked on a few datasets spread over the file
    (first and last included; a rewrite moves nearly all of them)."""
    if not placed:
        return True
    n = len(placed)
    k = min(n, _OFFSET_SAMPLES)
    picks = sorted({round(i * (n - 1) / max(k - 1, 1)) for i in range(k)})
    return all(stored_at(f, placed[i].path, placed[i].file_offset, placed[i].stored_nbytes) for i in picks)


# ---- compare: one op at a time ------------------------------------------------------
class _FileState:
    """Per file: whether its catalog's offsets hold (checked once, on rows spread over
    the catalog) and the descriptor small tensors are read through."""

    def __init__(self, f: DumpFile):
        self.fd = -1
        self.size = 0
        self.offsets = False
        self.headers = False        # the offset checks may read object headers (objheader)
        cat = f.catalog
        if cat is None or getattr(f, "_source", None) is not None:
            return          # (a file recovered after a kill is read through a copy: HDF5's reads only)
        n = len(cat)
        placed: list[LightValue] = []
        try:
            for r in sorted({round(i * (n - 1) / max(_OFFSET_SAMPLES - 1, 1)) for i in range(_OFFSET_SAMPLES)}):
                d = parse_row(cat.get(r) or b"null")
                if d is None:
                    continue
                path = _op_path_of_row(f, r)
                if path is None:
                    continue
                for side, key in ((S.INPUT_GROUP, S.CAT_INPUTS), (S.OUTPUT_GROUP, S.CAT_OUTPUTS)):
                    _group_records(f, f"{path}/{side}", d.get(key, []), {}, placed)
        except _CAT_ERRORS:
            return
        if not _placed_hold(f, placed):
            return
        try:
            self.fd = f.h5.id.get_vfd_handle()      # the descriptor HDF5 reads this file through
            self.size = os.fstat(self.fd).st_size
            self.offsets = True
        except (AttributeError, TypeError, ValueError, OSError, RuntimeError):
            self.fd = -1
            return
        try:
            fcpl = f.h5.id.get_create_plist()
            self.headers = tuple(fcpl.get_sizes()) == (8, 8) and fcpl.get_userblock() == 0
        except (AttributeError, TypeError, ValueError, RuntimeError):
            self.headers = False


def _op_path_of_row(f: DumpFile, row: int) -> str | None:
    ix = f.op_index
    hit = np.flatnonzero(np.frombuffer(ix.row, dtype=np.int64) == row) if len(ix) else ()
    if not len(hit):
        return None
    i = int(hit[0])
    return S.op_group_path(ix.names[ix.op_code[i]], ix.seqid[i])


def _state(f: DumpFile) -> _FileState:
    st = f.__dict__.get("_catalog_state")
    if st is None:
        st = f.__dict__["_catalog_state"] = _FileState(f)
    return st


def op_values(f: DumpFile, op, eager: int = 0, op_id=None) -> tuple[dict, dict] | None:
    """(inputs, outputs) of `op` as tensor records from its catalog row, lists flattened
    to "name/name_i" (as matching.tensor_leaves); None when the catalog cannot stand in for
    the op's groups: no usable catalog, an empty or malformed row, or an entry it does not
    place well enough (a tensor stored other than contiguously: views, statistics and
    compressed or empty datasets are read from the groups). `op_id`: the op group, opened
    (an h5py ObjectID): the offset checks look names up from it, not from the root."""
    raw = _catalog_row(f, op)
    if not raw:
        return None
    try:
        d = jsontext.loads(raw)
        st = _state(f)
        base = op.path
        with _SideGroup(f, op_id, base, S.INPUT_GROUP) as ins, _SideGroup(f, op_id, base, S.OUTPUT_GROUP) as outs:
            return (_tensors(f, st, ins, d[S.CAT_INPUTS], eager),
                    _tensors(f, st, outs, d[S.CAT_OUTPUTS], eager))
    except (*_CAT_ERRORS, _NotPlaced):
        return None


def _catalog_row(f: DumpFile, op):
    """The op's catalog row as stored (JSON text), or None: no usable catalog, no row."""
    cat = f.catalog
    row = getattr(op, "index_row", -1)
    if cat is None or row < 0:
        return None
    try:
        return cat.get(row)
    except (OSError, ValueError, KeyError, RuntimeError, IndexError):
        return None


def row_entries(f: DumpFile, op) -> tuple[list[dict], list[dict]] | None:
    """(input entries, output entries) of the op's catalog row, each a dict with a string
    name `n` (shape, links `obj`/`base`, ...); None when the file has no usable catalog or
    row, or the row is not the JSON object a writer stores (parse_row: nesting bounded)."""
    d = parse_row(_catalog_row(f, op) or "")
    if d is None:
        return None
    sides = d.get("i", []), d.get("o", [])
    if not all(isinstance(x, list) for x in sides):
        return None
    return tuple([e for e in x if isinstance(e, dict) and isinstance(e.get("n"), str)] for x in sides)


def op_shapes(f: DumpFile, op) -> tuple[tuple[str, str, tuple[int, ...]], ...] | None:
    """The shapes of an op's tensors, ((io, name, shape), ...) with io "input"/"output" and
    list members named "name/name_i", from its catalog row alone: no group opened, no
    placement checked (compare's pairing reads them for every op: accucmp/compare/
    matching.OpSignature). None when the catalog cannot say (no usable catalog, an empty or
    malformed row): the caller reads the groups."""
    raw = _catalog_row(f, op)
    if not raw:
        return None
    try:
        d = jsontext.loads(raw)
        out = []
        for io, key in ((S.INPUT_GROUP, S.CAT_INPUTS), (S.OUTPUT_GROUP, S.CAT_OUTPUTS)):
            for e in d[key]:
                code = e[S.CAT_TYPE]
                if type(code) is not int or code not in S.TENSOR_TYPES:
                    continue
                n, shape = e[S.CAT_NAME], e[S.ATTR_SHAPE]
                if type(n) is not str or type(shape) is not list or not all(type(x) is int for x in shape):
                    return None
                out.append((io, n, tuple(shape)))
        return tuple(out)
    except (*_CAT_ERRORS, OSError, RuntimeError):
        return None


class _SideGroup:
    """An op's input/ or output/ group for the offset checks of its tensors: opened at the
    first check (through the C library, from the op group) and closed with the op, so a
    check looks up the tensor's name in it instead of the whole path from the root (a
    check opens the dataset, ~35 us on the 2-core VM, and the path walk cost as much
    again). The same test: the dataset the name holds now, its storage place."""

    def __init__(self, f: DumpFile, op_id, op_path: str, side: str):
        self.f, self.op_id, self.side = f, op_id, side
        self.path = f"{op_path}/{side}"
        self.hid: int | None = None if op_id is not None and h5direct.available() else -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.hid is not None and self.hid >= 0:
            h5direct.close_object(self.hid)
        self.hid = -1

    def stored_at(self, st: _FileState, name: str, off: int, nbytes: int) -> bool:
        if st.headers and self.op_id is not None:
            # the header the name links to now, read directly (objheader): ~2x cheaper
            # than opening the dataset; None: ask HDF5 below
            raw = f"{self.side}/{name}".encode("utf-8", "surrogateescape")
            if b"\0" in raw:
                return False
            try:
                link = self.op_id.links.get_info(raw)
            except (KeyError, ValueError, TypeError, RuntimeError, AttributeError):
                link = None
            if link is not None and link.type == h5l.TYPE_HARD:
                place = objheader.contiguous_place(st.fd, link.u)
                if place is not None:
                    return place == (off, nbytes)
        if self.hid is None:
            self.hid = h5direct.open_object(self.op_id, self.side.encode())
        if self.hid >= 0:
            raw = name.encode("utf-8", "surrogateescape")
            if b"\0" in raw:
                return False
            fast = h5direct.stored_at(self.hid, raw, off, nbytes)
            if fast is not None:
                return fast
        return stored_at(self.f, f"{self.path}/{name}", off, nbytes)


class _NotPlaced(Exception):
    pass


def _tensors(f: DumpFile, st: _FileState, side: _SideGroup, entries: list, eager: int) -> dict:
    group_path = side.path
    out: dict[str, ValueRecord] = {}
    for e in entries:
        code = e[S.CAT_TYPE]
        if type(code) is not int or code not in S.TENSOR_TYPES:
            continue                       # lists (their children follow) and plain values
        if code != S.TYPE_TENSOR or S.CAT_OFFSET not in e:
            raise _NotPlaced
        n = e[S.CAT_NAME]
        dtype, shape = e[S.ATTR_DTYPE], e[S.ATTR_SHAPE]
        if type(n) is not str or type(dtype) is not str or type(shape) is not list \
                or not all(type(x) is int and x >= 0 for x in shape):
            raise _NotPlaced
        shape = tuple(shape)
        sd = np.dtype(e[S.CAT_STORED_DTYPE])
        ss = tuple(int(x) for x in e[S.CAT_STORED_SHAPE]) if S.CAT_STORED_SHAPE in e else shape
        if sd.kind not in "biufc" or sd.subdtype is not None:
            raise _NotPlaced
        attrs: dict[str, Any] = {S.ATTR_TYPE: code, S.ATTR_DTYPE: dtype, S.ATTR_SHAPE: shape}
        if S.ATTR_UNINITIALIZED in e:
            attrs[S.ATTR_UNINITIALIZED] = bool(e[S.ATTR_UNINITIALIZED])
        rec = LightValue(f, f"{group_path}/{n}", n.rpartition("/")[2], code, attrs)
        rec.stored_shape, rec.stored_dtype, rec.fast = ss, sd, True
        size = math.prod(ss)
        off, nb = int(e[S.CAT_OFFSET]), int(e[S.CAT_NBYTES])
        if st.offsets and size <= eager and nb == size * sd.itemsize and 0 <= off and off + nb <= st.size \
                and side.stored_at(st, n, off, nb):
            arr = np.empty(ss, dtype=sd)
            try:
                if not nb or os.preadv(st.fd, [arr], off) == nb:
                    rec.data = arr
            except OSError:
                pass                       # read() reads it through HDF5 and reports a failure on the row
        out[n] = rec
    return out


# ---- listing: what ops show, without where it is ---------------------------------------
# An entry's placement: the file offset and, for hard links, the linked dataset's path.
# (Outside strings only: inside a JSON string every quote is escaped, so `,"off":` cannot
# occur there.)
_PLACEMENT = re.compile(rb',"(?:off|obj)":(?:-?\d+|"(?:[^"\\]|\\.)*")')


class DescribedRows:
    """Catalog rows by index row with each entry's placement left out (bytes; None for a
    row that does not describe its op): what two ops holding the same names, dtypes,
    shapes and values share, so a reader can parse each distinct row once."""

    def __init__(self, rows):
        self._rows = rows          # a CatalogRows

    def get(self, row: int) -> bytes | None:
        if row < 0 or row >= len(self._rows):
            return None
        raw = self._rows.get(row)
        if isinstance(raw, str):
            raw = raw.encode("utf-8", "surrogateescape")
        return _PLACEMENT.sub(b"", raw) if raw else None


def described_rows(f: DumpFile) -> DescribedRows | None:
    """The file's catalog for listing (None: no usable catalog, walk the groups)."""
    return DescribedRows(f.catalog) if f.catalog is not None else None


def parse_row(text) -> dict | None:
    """One row parsed: its dict, None when it is not a JSON object."""
    try:
        d = jsontext.loads(text)
    except (ValueError, RecursionError):
        return None
    return d if isinstance(d, dict) else None
