"""The ops of a dump as a compact index: columns, not one Python object per op (torch-free).

A large model's step has 10^5-10^6 ops per file, and a compare holds both files' op lists
and their pairs for the whole run. As slotted records with their own seqid ints the two
op lists of a 1M-row compare (333k ops a file) came to ~120 B an op, plus what decoding
the index row by row left behind (a bytes object per string field, sets of seqid strings
for the presence check). Here the index is decoded in blocks into columns: per op an
int32 code into a table of distinct op names, one into the modules and one into the
grad_fn names, a phase byte, the seqid and the index row (`array.array`: 8 bytes or less
a field, no object per value). `OpRecord` is a two-field view of one row
(dumpfile.read.reader), made when asked for.

The catalog (`/_npu_dumper/catalog`, one JSON row per index row) is read here by row
number in blocks (`CatalogRows`): a reader that walks the ops in order holds one block,
not the whole catalog (~500 B an op: 166 MB for 333k ops).
"""

from __future__ import annotations

import array
import copy
from typing import Any

import h5py
import numpy as np

from dumpfile import schema as S
from dumpfile.errors import DumpFormatError
from dumpfile.printable import printable
from dumpfile.read import recovery
from dumpfile.read.h5util import READ_ERRORS, _attr_str, existing

# Index rows decoded per block: bounds what the decoding holds at once (a bytes object
# per string field and row) whatever the op count.
INDEX_BLOCK = 1 << 15
CATALOG_BLOCK = 1 << 10


class OpIndex:
    """Columns of the ops of one file, in seqid order. `names`, `modules`, `grad_fns` are
    the distinct strings; `op_code`, `module_code`, `grad_fn_code` index them; `phase` is
    the index's phase code (S.PHASE_BY_CODE); `row` the op's row in the index dataset
    (and so in the catalog), -1 for an op found by walking the groups."""

    def __init__(self, file, names: list[str], op_code, seqid, phase, modules: list[str], module_code,
                 grad_fns: list[str], grad_fn_code, row, record_cls):
        self.file = file
        self.names, self.modules, self.grad_fns = names, modules, grad_fns
        self.op_code, self.seqid, self.phase = op_code, seqid, phase
        self.module_code, self.grad_fn_code, self.row = module_code, grad_fn_code, row
        self.record_cls = record_cls
        self.phases = [S.PHASE_BY_CODE.get(c, "") for c in range(max(S.PHASE_BY_CODE) + 1)]
        self.attrs: dict[int, dict[str, Any]] = {}      # op group attributes read so far, by position

    def __len__(self) -> int:
        return len(self.seqid)

    def bound_to(self, file) -> "OpIndex":
        """This index with `file` as its file (the columns shared), one copy per file."""
        if file is self.file:
            return self
        copies = self.__dict__.setdefault("_copies", {})
        other = copies.get(id(file))
        if other is None or other.file is not file:
            other = copy.copy(self)
            other.file = file
            other.attrs = {}
            other.__dict__.pop("_copies", None)
            copies[id(file)] = other
        return other

    def phase_of(self, i: int) -> str:
        c = self.phase[i]
        return self.phases[c] if 0 <= c < len(self.phases) else ""

    def records(self) -> list:
        cls = self.record_cls
        return [cls(self, i) for i in range(len(self.seqid))]


def _codes(values: list, table: dict, names: list[str]) -> np.ndarray:
    """int32 codes of `values` (raw index fields) in `names`, growing it: each distinct
    string decoded once."""
    out = np.empty(len(values), dtype=np.int32)
    for k, v in enumerate(values):
        c = table.get(v)
        if c is None:
            c = table[v] = len(names)
            names.append(_attr_str(v))
        out[k] = c
    return out


def _index_blocks(ds: h5py.Dataset, complete: bool):
    """The index rows in blocks. In an incomplete file a flush cut short may leave its
    own rows unreadable: then the longest readable prefix (recovery.readable_rows)."""
    n = ds.shape[0] if ds.shape else 0
    if not complete:
        yield recovery.readable_rows(ds)
        return
    for lo in range(0, n, INDEX_BLOCK):
        yield ds[lo:min(n, lo + INDEX_BLOCK)]


def _check_index_type(path: str, ds) -> None:
    """The index must be a 1-d table with the index's fields, seqid and phase integers (a
    damaged or hostile file's other type surfaced as numpy's IndexError, an internal error)."""
    if not isinstance(ds, h5py.Dataset):
        raise DumpFormatError(f"{path}: {S.INDEX_PATH}: a group where the op index (a table) belongs; refused")
    fields = ds.dtype.names or ()
    if len(ds.shape or ()) != 1 or not set(S.INDEX_FIELDS) <= set(fields) \
            or ds.dtype["seqid"].kind not in "iu" or ds.dtype["phase"].kind not in "iu":
        raise DumpFormatError(f"{path}: {S.INDEX_PATH}: not an op index (a table of "
                              f"{', '.join(S.INDEX_FIELDS)}; found {printable(str(ds.dtype))[:80]}); refused")


def from_index(file, h5: h5py.File, record_cls, complete: bool, is_table: bool) -> OpIndex:
    """The index dataset's ops that have a group (all of them in a table file), in seqid order."""
    ds = h5[S.INDEX_PATH]
    _check_index_type(file.path, ds)
    names: list[str] = []
    modules: list[str] = []
    grad_fns: list[str] = []
    t_op: dict = {}
    t_mod: dict = {}
    t_gf: dict = {}
    parts: dict[str, list[np.ndarray]] = {k: [] for k in ("op", "seqid", "phase", "module", "grad_fn")}
    for rows in _index_blocks(ds, complete):
        if not len(rows):
            continue
        parts["op"].append(_codes(rows["op"].tolist(), t_op, names))
        parts["module"].append(_codes(rows["module"].tolist(), t_mod, modules))
        parts["grad_fn"].append(_codes(rows["grad_fn"].tolist(), t_gf, grad_fns))
        parts["seqid"].append(np.asarray(rows["seqid"], dtype=np.int64))
        parts["phase"].append(np.asarray(rows["phase"], dtype=np.int8))
        del rows
    cols = {k: (np.concatenate(v) if v else np.empty(0, dtype=np.int64)) for k, v in parts.items()}
    del parts
    row = np.arange(len(cols["seqid"]), dtype=np.int64)
    if not is_table and len(row):
        keep, unindexed = _present(h5, names, cols["op"], cols["seqid"], complete)
        _check_agreement(file.path, names, cols, unindexed)     # (unindexed: complete files only)
        if not keep.all():
            cols = {k: v[keep] for k, v in cols.items()}
            row = row[keep]
    elif is_table and len(row):
        _check_unique(file.path, names, cols)
    order = np.argsort(cols["seqid"], kind="stable")
    if not np.array_equal(order, np.arange(len(order))):
        cols = {k: v[order] for k, v in cols.items()}
        row = row[order]
    return OpIndex(file, names, _arr("i", cols["op"]), _arr("q", cols["seqid"]), _arr("b", cols["phase"]),
                   modules, _arr("i", cols["module"]), grad_fns, _arr("i", cols["grad_fn"]),
                   _arr("q", row), record_cls)


def from_walk(file, found: list[tuple[str, int]], record_cls) -> OpIndex:
    """Ops found by walking the root's groups (no index: files cut by h5copy, the original
    tool's), in seqid order; their phase/module/grad_fn are the groups' attributes."""
    found = sorted(found, key=lambda t: t[1])
    names: list[str] = []
    table: dict = {}
    codes = _codes([n for n, _ in found], table, names)
    zeros = np.zeros(len(found), dtype=np.int32)
    return OpIndex(file, names, _arr("i", codes), array.array("q", [q for _, q in found]),
                   _arr("b", np.zeros(len(found), dtype=np.int8)), [""], _arr("i", zeros), [""],
                   _arr("i", zeros), array.array("q", [-1]) * len(found), record_cls)


def _arr(code: str, a: np.ndarray) -> array.array:
    out = array.array(code)
    out.frombytes(np.ascontiguousarray(a, dtype=np.dtype(code)).tobytes())
    return out


def _check_unique(path: str, names: list[str], cols: dict) -> None:
    """Each (op, seqid) once: an index repeated (100k rows over 40 ops) made every reader
    do the work of each op thousands of times, and two rows for one group pair twice."""
    key = cols["seqid"].astype(np.int64)
    if len(np.unique(key)) == len(key):
        return
    both = np.stack([cols["op"].astype(np.int64), key], axis=1)
    uniq, counts = np.unique(both, axis=0, return_counts=True)
    if (counts > 1).any():
        code, q = uniq[np.argmax(counts)]
        raise DumpFormatError(f"{path}: {S.INDEX_PATH} lists {S.op_group_path(names[int(code)], int(q))} "
                              f"{int(counts.max())} times ({int((counts - 1).sum())} repeated rows); refused")


def _check_agreement(path: str, names: list[str], cols: dict, unindexed: list[str]) -> None:
    """A complete file's op groups must each have their index row, once. Reading on with
    the index alone hid ops: the rows of the planted fault's op renamed, its groups were
    in no row and `compare -p` printed PASS with the fault gone. A row whose group is
    gone stays allowed (a tool dropped that op: it is left out, as documented)."""
    _check_unique(path, names, cols)
    if unindexed:
        raise DumpFormatError(
            f"{path}: {S.INDEX_PATH} and the op groups disagree: {len(unindexed)} op group(s) are in no index "
            f"row (first: {printable(unindexed[0])}); refused (the index lists every op group of a complete dump)")


def _present(h5: h5py.File, names: list[str], op_code: np.ndarray, seqid: np.ndarray,
             complete: bool) -> tuple[np.ndarray, list[str]]:
    """Which index rows have their op group, and the op groups no row names (a tool may
    have dropped some groups; an edit may have renamed rows): one link listing per op
    name, no group opened per row, the names parsed into an int array as they are listed
    (not a set of strings)."""
    keep = np.zeros(len(seqid), dtype=bool)
    unindexed: list[str] = []
    known = set(names)
    if complete:
        for name in h5.keys():
            if name != S.META_GROUP and name not in known:
                grp = existing(h5, name)
                if isinstance(grp, h5py.Group) and any(S.is_seqid_name(k) for k in grp.keys()):
                    unindexed.append(f"/{name}/")
    for c, name in enumerate(names):
        sel = np.flatnonzero(op_code == c)
        grp = existing(h5, name)          # (a damaged op's rows must not vanish: raises)
        if not isinstance(grp, h5py.Group):
            continue
        found = array.array("q")

        def take(link: bytes, _found=found) -> None:
            # ("07" is not /op/7; past 18 digits no int64 seqid: a 23-digit name overflowed)
            if S.is_seqid_name(link) and (link[:1] != b"0" or link == b"0"):
                _found.append(int(link))
        try:
            grp.id.links.iterate(take)
        except READ_ERRORS:
            if complete:
                raise
            # a flush cut short may have left the link table half written: each seqid
            # looked up on its own, those that cannot be reached left out
            found = array.array("q")
            for q in seqid[sel].tolist():
                try:
                    if str(q) in grp:
                        found.append(q)
                except READ_ERRORS:
                    pass
        have = np.frombuffer(found, dtype=np.int64) if len(found) else np.empty(0, dtype=np.int64)
        keep[sel] = np.isin(seqid[sel], have)
        if complete:
            extra = have[~np.isin(have, seqid[sel])]
            if len(extra):
                unindexed.append(S.op_group_path(name, int(extra[0])))
    return keep, unindexed


class CatalogRows:
    """The catalog's raw rows (JSON text as bytes, b"" for an op it does not describe) by
    index row number, read in blocks of CATALOG_BLOCK rows, the last two kept (ops are in
    seqid order, index rows in publication order: near a block's edge they may alternate)."""

    def __init__(self, ds: h5py.Dataset):
        self._ds = ds
        self._blocks: dict[int, Any] = {}

    def __len__(self) -> int:
        return self._ds.shape[0]

    def get(self, row: int) -> Any:
        if row < 0:
            return None
        lo = row - row % CATALOG_BLOCK
        block = self._blocks.get(lo)
        if block is None:
            if len(self._blocks) >= 2:
                self._blocks.pop(next(iter(self._blocks)))
            block = self._blocks[lo] = self._ds[lo:min(len(self), lo + CATALOG_BLOCK)]
        return block[row - lo]

    def get_range(self, lo: int, hi: int) -> Any:
        """Rows [lo, hi) (not cached)."""
        return self._ds[lo:hi]

    def all(self) -> Any:
        return self._ds[()]


def open_catalog(h5: h5py.File, is_table: bool) -> CatalogRows | None:
    """The catalog when the file has a usable one: one string row per index row (docs/
    FORMAT.md "The catalog"). None when it is absent (older files, the original tool's,
    statistics tables), out of step with the index (a crash between the two writes, a
    tool that edited one of them) or unreadable: readers then walk the op groups."""
    if is_table:
        return None
    try:
        cat = h5.get(S.CATALOG_PATH)
        index = h5.get(S.INDEX_PATH)
        if not isinstance(cat, h5py.Dataset) or not isinstance(index, h5py.Dataset) \
                or cat.ndim != 1 or cat.shape != index.shape \
                or h5py.check_string_dtype(cat.dtype) is None:
            return None
    except (OSError, KeyError, ValueError, TypeError, RuntimeError):
        return None
    return CatalogRows(cat)
