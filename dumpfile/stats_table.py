"""Statistics-only dumps as tables (format 1.1): one row per value, no per-op groups.

A statistics dump stores a few numbers per tensor. Written as the tree layout, each
op costs ~3 HDF5 groups, ~2 datasets and ~20 attributes (~0.5 ms of h5py work holding
the GIL per op), which made a statistics dump slower than a full one. Here the writer
appends rows to two chunked, resizable compound datasets at flush time instead:

    /_npu_dumper/stats      one row per recorded value (tensor statistics, list headers,
                            non-tensor arguments), grouped by seqid, in argument order
    /_npu_dumper/op_attrs   extra per-op attributes (compute_dtype, stack, ...): seqid, name, JSON

The op rows stay in /_npu_dumper/index. Readers (dumpfile.read.reader.DumpFile) present such
files through the same API as tree-layout ones. Torch-free.
"""

from __future__ import annotations

import json
import math
from typing import Any

import h5py
import numpy as np
from h5py import h5s, h5t

from . import schema as S
from . import jsontext
from .errors import DumpFormatError
from dumpfile.read.recovery import readable_rows
from .write.writer import new_table

_STR = h5py.string_dtype("utf-8")
_SHAPE = h5py.vlen_dtype(np.int64)

IO_INPUT, IO_OUTPUT = 0, 1
IO_GROUPS = {IO_INPUT: S.INPUT_GROUP, IO_OUTPUT: S.OUTPUT_GROUP}

STATS_ROW_DTYPE = np.dtype(
    [("seqid", np.int64), ("io", np.int8), ("name", _STR), ("Type", np.int16), ("dtype", _STR),
     ("shape", _SHAPE), ("DataType", np.int16), ("DeviceType", np.int16), ("uninitialized", np.bool_)]
    + [(f, np.float64) for f in S.STATS_FIELDS]
    # 1.7: XXH3-64 of the tensor's bytes (npu_dumper.capture.tensor_hash; 0 for non-tensor rows)
    + [(S.STATS_HASH_FIELD, np.uint64)]
    # 1.7: histogram of log2|x| (npu_dumper.capture.tensor_hist), empty unless stats_histogram=True
    + [(S.STATS_HIST_FIELD, _SHAPE)]
    + [("value", _STR)])
OP_ATTR_DTYPE = np.dtype([("seqid", np.int64), ("name", _STR), ("value", _STR)])

_NAN_STATS = (math.nan,) * len(S.STATS_FIELDS)
_EMPTY_SHAPE = np.zeros(0, dtype=np.int64)
_SHAPES: dict[tuple, np.ndarray] = {}


def _shape_array(shape) -> np.ndarray:
    key = tuple(shape)
    arr = _SHAPES.get(key)
    if arr is None:
        arr = np.asarray(key, dtype=np.int64).reshape(-1)
        if len(_SHAPES) < 4096:
            _SHAPES[key] = arr
    return arr


def tensor_row(seqid: int, io: int, name: str, dtype: str, shape, device_type: int,
               stats, uninitialized: bool = False, content_hash: int = 0,
               log2_hist: np.ndarray = _EMPTY_SHAPE) -> tuple:
    """A Type 41 row: statistics (schema.STATS_FIELDS order), content hash and (optional)
    log2 histogram of one tensor."""
    return (seqid, io, name, *tensor_cells(dtype, shape, device_type, uninitialized), *stats,
            content_hash, log2_hist, "")


def tensor_cells(dtype: str, shape, device_type: int, uninitialized: bool = False) -> tuple:
    """The cells of a Type 41 row between its name and its statistics: what the tensor's
    description (dtype, shape, device, uninitialized) alone decides. A writer of many rows
    keeps them per description (tensor_row spelled out: seqid, io, name, *cells, *stats,
    content hash, histogram, "")."""
    return (S.TYPE_TENSOR_STATS, dtype, _shape_array(shape), S.data_type_code(dtype), device_type,
            uninitialized)


def value_row(seqid: int, io: int, name: str, type_code: int, value: Any) -> tuple:
    """A non-tensor argument (JSON value) or a list header (value: its length)."""
    if isinstance(value, complex):
        value = [value.real, value.imag]
    return (seqid, io, name, type_code, "", _EMPTY_SHAPE, 0, S.DEVICE_TYPE_UNKNOWN, False,
            *_NAN_STATS, 0, _EMPTY_SHAPE, json.dumps(value))


def op_attr_row(seqid: int, name: str, value: Any) -> tuple:
    if isinstance(value, np.generic):
        value = value.item()
    return (seqid, name, json.dumps(value))


def table(f: h5py.File, path: str, dtype: np.dtype) -> h5py.Dataset:
    """The table at `path`, created (empty, chunked, resizable) when absent."""
    if path in f:
        return f[path]
    return new_table(f, path, dtype)


_MEM_TYPES: dict[np.dtype, Any] = {}


def append_rows(ds: h5py.Dataset, rows: list[tuple], dtype: np.dtype) -> None:
    """Append `rows` (tuples in `dtype`'s field order) to a 1-d resizable dataset.

    Low-level h5py with the memory type made once per dtype: the high-level
    resize + __setitem__ rebuilt it and the selection each call (~2x slower).
    """
    if not rows:
        return
    arr = np.empty(len(rows), dtype=dtype)
    arr[:] = rows
    mtype = _MEM_TYPES.get(dtype)
    if mtype is None:
        mtype = _MEM_TYPES[dtype] = h5t.py_create(dtype)
    did = ds.id
    n = did.shape[0]
    did.set_extent((n + len(rows),))
    fspace = did.get_space()
    fspace.select_hyperslab((n,), (len(rows),))
    did.write(h5s.create_simple((len(rows),)), fspace, arr, mtype=mtype)


def is_table_file(h5: h5py.File) -> bool:
    return S.STATS_TABLE_PATH in h5


def _s(v: Any) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


def decode_value(type_code: int, text: str) -> Any:
    v = jsontext.loads(text) if text else None
    if type_code == S.TYPE_COMPLEX and isinstance(v, list) and len(v) == 2:
        return complex(v[0], v[1])
    return v


# the columns every statistics table has (1.7 adds the hash and histogram columns)
_REQUIRED = tuple(n for n in STATS_ROW_DTYPE.names if n not in (S.STATS_HASH_FIELD, S.STATS_HIST_FIELD))
# the Types a row may have: statistics, lists, plain values (a tensor or a view has no row)
_ROW_TYPES = frozenset(c for c in S.TYPE_NAMES if c not in (S.TYPE_TENSOR, S.TYPE_TENSOR_VIEW))
# a log2|x| histogram's (exponent, count) pairs: float64's exponents span -1074..1023
_MAX_HIST = 2 * 2200


def check_table(ds: Any, path: str) -> None:
    """The statistics table's type, checked before any row is read: a 1-d table with the
    columns its readers take, integers and floats where they belong. A 2-d table, a
    missing column or a retyped one surfaced as numpy's IndexError/ValueError (internal
    errors) in whatif, ls and ir2tbe."""
    where = f"{path}: /{S.STATS_TABLE_PATH}"
    names = getattr(getattr(ds, "dtype", None), "names", None) or ()
    if not isinstance(ds, h5py.Dataset) or len(ds.shape or ()) != 1 or not set(_REQUIRED) <= set(names):
        missing = [n for n in _REQUIRED if n not in names]
        raise DumpFormatError(f"{where}: not a statistics table (a 1-d table of {', '.join(_REQUIRED)}"
                              + (f"; missing {', '.join(missing)}" if missing and names else "") + "); refused")
    dt = ds.dtype
    ints = ("seqid", "io", "Type", "DataType", "DeviceType")
    bad = [n for n in ints if dt[n].kind not in "iu"] + [f for f in S.STATS_FIELDS if dt[f].kind not in "fiu"]
    bad += [n for n in ("shape", S.STATS_HIST_FIELD) if n in names
            and (h5py.check_vlen_dtype(dt[n]) is None or h5py.check_vlen_dtype(dt[n]).kind not in "iu")]
    bad += [n for n in ("name", "dtype", "value") if h5py.check_string_dtype(dt[n]) is None]
    if S.STATS_HASH_FIELD in names and dt[S.STATS_HASH_FIELD].kind not in "iu":
        bad.append(S.STATS_HASH_FIELD)
    if bad:
        raise DumpFormatError(f"{where}: column(s) {', '.join(bad)} of the wrong type; refused")


def check_rows(rows: np.ndarray, path: str) -> None:
    """What each row holds: a Type a row may have (statistics, a list, a plain value; a
    tensor or a view has no row), io 0 or 1, and on statistics rows a shape of sizes >= 0
    and a histogram of (exponent, count) pairs."""
    where = f"{path}: /{S.STATS_TABLE_PATH}"
    if not len(rows):
        return
    types = np.asarray(rows["Type"])
    odd = ~np.isin(types, np.fromiter(_ROW_TYPES, dtype=np.int64))
    if odd.any():
        raise DumpFormatError(f"{where}: row {int(np.flatnonzero(odd)[0])} has Type {int(types[odd][0])}, which "
                              "no statistics row has; refused")
    io = np.asarray(rows["io"])
    if not np.isin(io, (IO_INPUT, IO_OUTPUT)).all():
        raise DumpFormatError(f"{where}: row {int(np.flatnonzero(~np.isin(io, (IO_INPUT, IO_OUTPUT)))[0])} has io "
                              "other than 0 (input) or 1 (output); refused")
    names = rows.dtype.names or ()
    stats = np.flatnonzero(types == S.TYPE_TENSOR_STATS)
    if "shape" in names and len(stats):
        sizes = [a for a in rows["shape"][stats] if a is not None and len(a)]
        if sizes and int(np.concatenate(sizes).min()) < 0:
            raise DumpFormatError(f"{where}: a statistics row has a negative size in its shape; refused")
    if S.STATS_HIST_FIELD in names and len(stats):
        lengths = np.fromiter((0 if h is None else len(h) for h in rows[S.STATS_HIST_FIELD][stats]),
                              dtype=np.int64, count=len(stats))
        bad = (lengths % 2 == 1) | (lengths > _MAX_HIST)
        if bad.any():
            i = int(stats[np.flatnonzero(bad)[0]])
            raise DumpFormatError(f"{where}: row {i}'s histogram holds {int(lengths[bad][0])} numbers, not "
                                  f"(exponent, count) pairs (at most {_MAX_HIST}); refused")


class StatsTable:
    """The rows of a table-backed statistics file, grouped by seqid (read once)."""

    def __init__(self, h5: h5py.File, *, complete: bool = True, path: str = ""):
        ds = h5[S.STATS_TABLE_PATH]
        check_table(ds, path or h5.filename)
        # an incomplete file (its writer killed, maybe inside a flush): the rows that read
        # back; the index decides which ops are listed
        self.rows = ds[()] if complete else readable_rows(ds)
        check_rows(self.rows, path or h5.filename)
        seqids = self.rows["seqid"]
        order = np.argsort(seqids, kind="stable")
        self._order = order
        sorted_ids = seqids[order]
        self._ids, self._starts = np.unique(sorted_ids, return_index=True)
        self._ends = np.append(self._starts[1:], len(sorted_ids))
        self.op_attrs: dict[int, dict[str, Any]] = {}
        if S.OP_ATTRS_PATH in h5:
            for r in h5[S.OP_ATTRS_PATH][()]:
                try:
                    val = jsontext.loads(_s(r["value"]))
                except ValueError:
                    val = _s(r["value"])
                self.op_attrs.setdefault(int(r["seqid"]), {})[_s(r["name"])] = val

    def rows_of(self, seqid: int) -> np.ndarray:
        i = np.searchsorted(self._ids, seqid)
        if i >= len(self._ids) or self._ids[i] != seqid:
            return self.rows[:0]
        return self.rows[self._order[self._starts[i]:self._ends[i]]]


def row_attrs(row) -> dict[str, Any]:
    """The tree layout's attributes of a row (what a Type 41 dataset would carry)."""
    code = int(row["Type"])
    attrs: dict[str, Any] = {S.ATTR_TYPE: code}
    if code == S.TYPE_TENSOR_STATS:
        attrs.update({S.ATTR_DATA_TYPE: int(row["DataType"]), S.ATTR_DEVICE_TYPE: int(row["DeviceType"]),
                      S.ATTR_SHAPE: np.asarray(row["shape"], dtype=np.int64),
                      S.ATTR_DTYPE: _s(row["dtype"]), S.ATTR_STATS_FIELDS: ",".join(S.STATS_FIELDS)})
        if bool(row["uninitialized"]):
            attrs[S.ATTR_UNINITIALIZED] = True
        if S.STATS_HIST_FIELD in (row.dtype.names or ()) and len(row[S.STATS_HIST_FIELD]):
            attrs[S.STATS_HIST_FIELD] = np.asarray(row[S.STATS_HIST_FIELD], dtype=np.int64)
    return attrs


def row_stats(row) -> dict[str, float]:
    """The statistics of a Type 41 row; with the content hash under "hash" (an int) when the
    file has the column (1.7+) and the row is not uninitialized memory."""
    out: dict = {f: float(row[f]) for f in S.STATS_FIELDS}
    names = row.dtype.names or ()
    if S.STATS_HASH_FIELD in names and not bool(row["uninitialized"]):
        out[S.STATS_HASH_FIELD] = int(row[S.STATS_HASH_FIELD])
    return out


def read_fields(h5: h5py.File, names, *, complete: bool = True) -> np.ndarray:
    """Only the fields `names` of every row, in one read, grouped by seqid (written order
    kept within an op) — for readers of every row at once (accucmp ls).

    One read of the fields together: HDF5 converts the compound row by row whatever the
    number of fields taken, so a read per field costs about a whole-row read each (measured:
    0.25-0.45 s a field for 200k rows, 0.9 s for the eight ls needs, 1.2-1.6 s for every
    field). Leaving out the histogram and hash columns (variable length / unused) is the
    saving. An incomplete file: the rows that read back (dumpfile.read.recovery)."""
    ds = h5[S.STATS_TABLE_PATH]
    check_table(ds, h5.filename)
    names = list(names)
    rows = ds.fields(names)[()] if complete else readable_rows(ds)[names]
    if "Type" in names and "io" in names:
        check_rows(rows, h5.filename)
    seqids = rows["seqid"]
    if len(seqids) > 1 and not bool((seqids[1:] >= seqids[:-1]).all()):
        rows = rows[np.argsort(seqids, kind="stable")]
    return rows
