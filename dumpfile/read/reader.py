"""Read dump files with h5py and numpy only (no torch).

`DumpFile(path)` validates the file, lists its ops in seqid order (from the index
dataset when present, else by walking links: files cut by `h5copy` have no index)
and returns tensors as numpy arrays in a dtype numpy can compute with:
bfloat16 and float8 come back as exact float32, complex32 as complex64.
The stored dtype is always in `ValueRecord.dtype`.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterator

import h5py
import numpy as np

from dumpfile import schema as S
from dumpfile.read import recovery
from dumpfile.read import safety
from dumpfile.read import legacy
from dumpfile import stats_table as T
from dumpfile.errors import DumpFormatError, raised_by_h5py

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


def decode_raw(data: np.ndarray, dtype_name: str) -> np.ndarray:
    """Stored array -> numpy array with the tensor's values (exact)."""
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


# What h5py raises when HDF5 fails on damaged bytes (a bad B-tree or object header
# signature, a message not aligned, a read that runs off its buffer): RuntimeError,
# KeyError, OSError or ValueError, with a message that does not name the file.
H5_ERRORS = (OSError, RuntimeError, KeyError, ValueError)
READ_ERRORS = recovery.READ_ERRORS


def h5_message(e: BaseException) -> str:
    """The first line of an HDF5 failure's message (without the quotes KeyError's str() adds)."""
    msg = e.args[0] if isinstance(e, KeyError) and e.args else e
    lines = str(msg).strip().splitlines()
    return lines[0].strip() if lines else type(e).__name__


def corrupt_dump_error(path: str, e: BaseException, where: str = "") -> DumpFormatError:
    """`{path}: corrupt or unreadable dump ({first line of the HDF5 message})[ at {where}]`."""
    return DumpFormatError(f"{path}: corrupt or unreadable dump ({h5_message(e)})"
                           + (f" at {where}" if where else ""))


def existing(h5: h5py.File, path: str) -> Any | None:
    """The object at `path`, or None when there is none. Not `h5.get()`: it answers None
    for a damaged object too, which read as "no values"; damage raises here (whether the
    path exists is asked on failure only: a path lookup costs)."""
    try:
        return h5[path]
    except KeyError:
        if path in h5:
            raise
        return None


def members(group: h5py.Group) -> Iterator[tuple[str, Any]]:
    """(name, object) of a group's members, each looked up by name. Not `.items()`: it
    yields None for an object it cannot open, so damage read as absence (a damaged op
    skipped, then dropped from a file rebuilt without it); a lookup raises instead."""
    for name in group.keys():
        yield name, group[name]


@contextlib.contextmanager
def h5_errors(path: str, where: str = "") -> Iterator[None]:
    """Turn an HDF5 failure raised inside the block into a DumpFormatError naming `path`
    (the file the block reads). Errors that h5py did not raise pass unchanged."""
    try:
        yield
    except H5_ERRORS as e:
        if not raised_by_h5py(e):
            raise
        raise corrupt_dump_error(path, e, where) from e


def _guarded(method):
    """h5_errors around a method of a DumpFile (self.path) or of a record (self.file.path)."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:      # a plain try, not h5_errors: free when nothing fails, and shapes are read often
            return method(self, *args, **kwargs)
        except H5_ERRORS as e:
            if not raised_by_h5py(e):
                raise
            owner = self if isinstance(self, DumpFile) else self.file
            raise corrupt_dump_error(owner.path, e) from e
    return wrapper


def _attr_str(v: Any) -> str:
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    return "" if v is None else str(v)


@dataclass
class ValueRecord:
    """One input or output entry: a tensor, a view, statistics, a value, or a list."""

    file: "DumpFile"
    path: str
    name: str
    type: int
    attrs: dict[str, Any]
    children: list["ValueRecord"] = field(default_factory=list)

    @property
    def is_tensor(self) -> bool:
        return self.type in S.TENSOR_TYPES

    @property
    def is_list(self) -> bool:
        return self.type in S.LIST_TYPES

    @property
    def is_stats(self) -> bool:
        return self.type == S.TYPE_TENSOR_STATS

    @property
    def dtype(self) -> str:
        d = _attr_str(self.attrs.get(S.ATTR_DTYPE, ""))
        if d or self.type != S.TYPE_TENSOR:
            return d
        # no dtype attribute (the original dumper's files, hand-written ones): the original's
        # DataType (Half stored as F32 is float16, Bool is bool), else the data's own dtype
        try:
            ds = self.file.h5[self.path]
        except (KeyError, TypeError, ValueError, OSError):
            return ""
        return legacy.dtype_of(self.attrs, ds.dtype) if isinstance(ds, h5py.Dataset) else ""

    @property
    @_guarded
    def shape(self) -> tuple[int, ...]:
        if S.ATTR_SHAPE in self.attrs:
            return tuple(int(x) for x in np.asarray(self.attrs[S.ATTR_SHAPE]).reshape(-1))
        ds = self.file.h5[self.path]
        return tuple(ds.shape) if isinstance(ds, h5py.Dataset) and ds.shape is not None else ()

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def uninitialized(self) -> bool:
        return bool(self.attrs.get(S.ATTR_UNINITIALIZED, False))

    def read(self) -> Any:
        """Tensor -> numpy array (decoded); stats -> dict; value -> Python value; list -> list."""
        return self.file.read_value(self)

    def stats(self) -> dict[str, float]:
        if not self.is_stats:
            raise DumpFormatError(f"{self.file.path}: {self.path} holds no statistics")
        return self.file.read_value(self)

    def iter_chunks(self, chunk_elements: int = 1 << 22) -> Iterator[np.ndarray]:
        """Flattened (C-order) decoded values in pieces of about `chunk_elements`."""
        yield from self.file.iter_chunks(self, chunk_elements)


@dataclass(slots=True)
class OpRecord:
    # One per op of a dump, all held for a whole compare (a large model's step has 10^5-10^6
    # ops per file): slotted (no per-instance dict), its strings shared (DumpFile._ops)
    file: "DumpFile"
    op: str
    seqid: int
    phase: str = ""
    module: str = ""
    grad_fn: str = ""
    _attrs: dict | None = field(default=None, repr=False, compare=False)

    @property
    def path(self) -> str:
        return S.op_group_path(self.op, self.seqid)

    @property
    def attrs(self) -> dict[str, Any]:
        """The op group's attributes (read once, when first asked)."""
        if self._attrs is None:
            self._attrs = self._read_attrs()
        return self._attrs

    @_guarded
    def _read_attrs(self) -> dict[str, Any]:
        return {k: (_attr_str(v) if isinstance(v, bytes) else v)
                for k, v in self.file.h5[self.path].attrs.items()}

    def inputs(self) -> dict[str, ValueRecord]:
        return self.file.values(f"{self.path}/{S.INPUT_GROUP}")

    def outputs(self) -> dict[str, ValueRecord]:
        return self.file.values(f"{self.path}/{S.OUTPUT_GROUP}")


@dataclass
class TableValueRecord(ValueRecord):
    """A value of a table-backed statistics file (format 1.1): no HDF5 object of its own;
    `path` is where the tree layout would have put it (for messages and matching)."""

    value: Any = None

    @property
    def shape(self) -> tuple[int, ...]:
        if S.ATTR_SHAPE in self.attrs:
            return tuple(int(x) for x in np.asarray(self.attrs[S.ATTR_SHAPE]).reshape(-1))
        return ()


class _TableOpRecord(OpRecord):
    """An op of a table-backed statistics file: attributes from the index and op_attrs rows."""

    __slots__ = ()

    def _read_attrs(self) -> dict[str, Any]:
        a = {S.OP_SEQID: self.seqid, S.OP_NAME: self.op, S.OP_PHASE: self.phase,
             S.OP_MODULE: self.module, S.OP_GRAD_FN: self.grad_fn}
        a.update(self.file._table.op_attrs.get(self.seqid, {}))
        return a

    def inputs(self) -> dict[str, ValueRecord]:
        return self.file._table_values(self, T.IO_INPUT)

    def outputs(self) -> dict[str, ValueRecord]:
        return self.file._table_values(self, T.IO_OUTPUT)


class DumpFile:
    """A dump opened for reading. Use as a context manager or call close()."""

    def __init__(self, path: str | os.PathLike, *, require_dump: bool = True, check: str = "full"):
        """`check="listing"`: only what a listing from the catalog reads is checked
        (safety.check_listing); call check_all() before reading anything else."""
        self.path = os.fspath(path)
        self._checked = False
        # before anything opens it (h5py.is_hdf5 too): a FIFO would block forever
        safety.check_regular(self.path)
        try:
            if not h5py.is_hdf5(self.path):
                raise DumpFormatError(f"{self.path}: not an HDF5 file")
            self._source = None
            self.h5 = self._open()
        except DumpFormatError:
            raise
        except (OSError, ValueError) as e:
            if "unable to lock file" in str(e):
                # HDF5's file lock: a writer (a dumper block still running, another tool)
                # holds the file; it is not damaged
                raise DumpFormatError(f"{self.path}: is open for writing by another process (a dumper "
                                      "block still running?); read it once the writer has closed it") from e
            raise DumpFormatError(f"{self.path}: cannot open as HDF5 (truncated or corrupt?): {e}") from e
        try:
            with h5_errors(self.path):
                # links and dataset layouts: nothing read may come from outside this file
                if check != "listing" or not safety.check_listing(self.h5, self.path):
                    safety.check_file(self.h5, self.path)
                    self._checked = True
                self._validate(require_dump)
        except BaseException:
            self.close()
            raise

    def check_all(self) -> None:
        """The whole file's check (safety.check_file), when the file was opened with
        check="listing": before reading anything but the catalog, index and op attributes."""
        if not self._checked:
            with h5_errors(self.path):
                safety.check_file(self.h5, self.path)
            self._checked = True

    def _open(self) -> h5py.File:
        """The file, read-only. One whose writer died after its last flush, maybe inside the
        next, is read with its recorded end of allocation raised to the file's size
        (dumpfile.read.recovery); HDF5 may refuse to open it otherwise ("addr overflow")."""
        try:
            h5 = h5py.File(self.path, "r")       # (HDF5's lock: refuses a file being written)
        except OSError as e:
            cut = recovery.is_cut_short(self.path) if "lock" not in str(e) else None
            if cut is None:
                raise
            h5, self._source = recovery.open_cut_short(self.path, *cut)
            return h5
        cut = recovery.is_cut_short(self.path) if not h5.attrs.get(S.ROOT_COMPLETE, False) else None
        if cut is not None:
            h5.close()
            h5, self._source = recovery.open_cut_short(self.path, *cut)
        return h5

    def _validate(self, require_dump: bool) -> None:
        self.attrs = {k: (_attr_str(v) if isinstance(v, bytes) else v) for k, v in self.h5.attrs.items()}
        fmt = self.attrs.get(S.ROOT_FORMAT)
        if fmt is not None and fmt != S.FORMAT_NAME:
            raise DumpFormatError(f"{self.path}: format {fmt!r} is not {S.FORMAT_NAME!r}")
        version = str(self.attrs.get(S.ROOT_FORMAT_VERSION, "1.0"))
        try:
            major = int(version.split(".")[0])
        except ValueError:
            major = -1
        if major not in S.SUPPORTED_MAJOR_VERSIONS:
            raise DumpFormatError(f"{self.path}: format version {version} is not supported by this reader")
        # statistics-only dumps of format 1.1+: tables instead of op groups
        self.is_table = T.is_table_file(self.h5)
        if require_dump and fmt is None and not self._looks_like_dump():
            raise DumpFormatError(f"{self.path}: not a dump (no /op/seqid/ groups)")

    # ---- file-level --------------------------------------------------------
    @property
    def mode(self) -> str:
        return str(self.attrs.get(S.ROOT_MODE, S.MODE_DUMP))

    @property
    def recorded_io(self) -> tuple[str, ...]:
        """The io groups this dump holds values for (root `dump_mode`: input, output or
        all; files without it hold both)."""
        mode = _attr_str(self.attrs.get(S.ROOT_DUMP_MODE, "all"))
        if mode == "input":
            return (S.INPUT_GROUP,)
        if mode == "output":
            return (S.OUTPUT_GROUP,)
        return (S.INPUT_GROUP, S.OUTPUT_GROUP)

    def require_inputs(self) -> None:
        """Raise DumpFormatError unless the dump holds its ops' inputs, which replaying an
        op (load-replay, golden replay, ir2tbe) needs."""
        if S.INPUT_GROUP not in self.recorded_io:
            raise DumpFormatError(
                f"{self.path}: holds no op inputs to replay (dump_mode="
                f"{_attr_str(self.attrs.get(S.ROOT_DUMP_MODE, ''))!r}; a load-replay dump stores "
                "outputs only): use the dump it was replayed from, or dump with dump_mode='all'")

    @property
    def op_filter(self):
        """The dumper's op selection (dumpfile.opfilter.OpSelection) when the dump was
        filtered (include/exclude/modules/phases), else None."""
        text = self.attrs.get(S.ROOT_OP_FILTER)
        if text is None:
            return None
        from dumpfile.opfilter import OpSelection
        try:
            return OpSelection.from_json(_attr_str(text))
        except ValueError as e:
            raise DumpFormatError(f"{self.path}: unreadable root attribute {S.ROOT_OP_FILTER!r} ({e})") from e

    @property
    def complete(self) -> bool:
        return bool(self.attrs.get(S.ROOT_COMPLETE, True))

    @property
    def stats_only(self) -> bool:
        return bool(self.attrs.get(S.ROOT_STATS_ONLY, False))

    def close(self) -> None:
        h5 = getattr(self, "h5", None)
        if h5 is not None and h5.id.valid:
            h5.close()
        source = getattr(self, "_source", None)
        if source is not None:
            source.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _looks_like_dump(self) -> bool:
        """An original-layout file without our root attributes: /op/<digits>/input|output."""
        for op_name, link in members(self.h5):
            if op_name == S.META_GROUP or not isinstance(link, h5py.Group):
                continue
            for seq in link.keys():
                if seq.isdigit():
                    return True
        return False

    # ---- ops -------------------------------------------------------------
    @cached_property
    def _table(self) -> T.StatsTable:
        try:
            return T.StatsTable(self.h5, complete=self.complete)
        except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
            if raised_by_h5py(e):
                raise corrupt_dump_error(self.path, e, "the statistics table") from e
            raise DumpFormatError(f"{self.path}: cannot read the statistics table: {e}") from e

    @_guarded
    def _table_values(self, op: OpRecord, io: int) -> dict[str, ValueRecord]:
        """An op's input or output values from the stats table, lists rebuilt from
        `{name}/{name}_{i}` row names, in argument (row) order."""
        base = f"{op.path}/{T.IO_GROUPS[io]}"
        out: dict[str, ValueRecord] = {}
        by_name: dict[str, TableValueRecord] = {}
        for r in self._table.rows_of(op.seqid):
            if int(r["io"]) != io:
                continue
            name = _attr_str(r["name"])
            code = int(r["Type"])
            if code == S.TYPE_TENSOR_STATS:
                value = T.row_stats(r)
            elif code in S.LIST_TYPES:
                value = None
            else:
                try:
                    value = T.decode_value(code, _attr_str(r["value"]))
                except ValueError as e:
                    raise DumpFormatError(f"{self.path}: {base}/{name}: bad value ({e})") from e
            parent, _, leaf = name.rpartition("/")
            rec = TableValueRecord(self, f"{base}/{name}", leaf, code, T.row_attrs(r), value=value)
            by_name[name] = rec
            holder = by_name.get(parent) if parent else None
            if holder is not None:
                holder.children.append(rec)
            else:
                out[name] = rec
        return out

    def _index_rows(self) -> np.ndarray:
        ds = self.h5[S.INDEX_PATH]
        if self.complete:
            return ds[()]
        # a writer killed inside a flush: that flush's rows may not read back (recovery)
        return recovery.readable_rows(ds)

    def _group_names(self, grp, seqids: list[int]) -> set[str]:
        """The member names of an op's group. In an incomplete file a flush cut short may
        have left the group's link table half written: then each seqid is looked up on
        its own, and those that cannot be reached are left out."""
        if not isinstance(grp, h5py.Group):
            return set()
        try:
            return set(grp.keys())
        except READ_ERRORS:
            if self.complete:
                raise
        found = set()
        for q in seqids:
            try:
                if str(q) in grp:
                    found.add(str(q))
            except READ_ERRORS:
                pass
        return found

    @cached_property
    @_guarded
    def _ops(self) -> list[OpRecord]:
        if S.INDEX_PATH in self.h5:
            rows = self._index_rows()
            # columns at once (a field read per numpy row costs ~1 us; 50k-op files), and
            # each distinct string decoded once
            cls = _TableOpRecord if self.is_table else OpRecord
            text: dict[Any, str] = {}

            def col(name: str) -> list[str]:
                return [text[v] if v in text else text.setdefault(v, _attr_str(v))
                        for v in rows[name].tolist()]
            phases = [S.PHASE_BY_CODE.get(int(c), "") for c in rows["phase"].tolist()]
            ops = [cls(self, op, int(q), ph, mod, gf) for op, q, ph, mod, gf in
                   zip(col("op"), rows["seqid"].tolist(), phases, col("module"), col("grad_fn"))]
            if not self.is_table:
                # keep only rows whose group exists (a tool may have dropped some groups): one
                # link listing per op name, no group opened per row
                by_name: dict[str, list[int]] = {}
                for o in ops:
                    by_name.setdefault(o.op, []).append(o.seqid)
                present: dict[str, set[str]] = {}
                for name, seqids in by_name.items():
                    grp = existing(self.h5, name)     # (a damaged op's rows must not vanish)
                    present[name] = self._group_names(grp, seqids)
                ops = [o for o in ops if str(o.seqid) in present[o.op]]
        else:
            ops = []
            for op_name in self.h5.keys():
                if op_name == S.META_GROUP:
                    continue
                grp = self.h5[op_name]
                if not isinstance(grp, h5py.Group):
                    continue
                for seq in grp.keys():
                    if seq.isdigit():
                        ops.append(_LazyOpRecord(self, op_name, int(seq)))
        ops.sort(key=lambda o: o.seqid)
        return ops

    def catalog_rows(self) -> dict[str, Any] | None:
        """Op group path -> its raw catalog row (JSON text), when the file has a usable
        catalog: one string row per index row (docs/FORMAT.md "The catalog"). None when it
        is absent (older files, the original tool's, statistics tables), out of step with
        the index (a crash between the two writes, a tool that edited one of them) or
        unreadable: readers then walk the op groups."""
        if self.is_table:
            return None
        try:
            cat = self.h5.get(S.CATALOG_PATH)
            index = self.h5.get(S.INDEX_PATH)
            if not isinstance(cat, h5py.Dataset) or not isinstance(index, h5py.Dataset) \
                    or cat.ndim != 1 or cat.shape != index.shape \
                    or h5py.check_string_dtype(cat.dtype) is None:
                return None
            rows = cat[()]
            ops = index.fields(["op", "seqid"])[()]
        except (OSError, KeyError, ValueError, TypeError, RuntimeError):
            return None
        return {S.op_group_path(_attr_str(r["op"]), int(r["seqid"])): raw for r, raw in zip(ops, rows)}

    def ops(self) -> list[OpRecord]:
        """Every op, in seqid (execution) order."""
        return list(self._ops)

    def __len__(self) -> int:
        return len(self._ops)

    @_guarded
    def op(self, op: str, seqid: int) -> OpRecord:
        path = S.op_group_path(op, seqid)
        if self.is_table:
            hit = next((o for o in self._ops if o.op == op and o.seqid == int(seqid)), None)
            if hit is None:
                raise DumpFormatError(f"{self.path}: no op {path}")
            return hit
        if path not in self.h5:
            raise DumpFormatError(f"{self.path}: no op group {path}")
        return _LazyOpRecord(self, op, int(seqid))

    # ---- values ----------------------------------------------------------
    @_guarded
    def values(self, group_path: str) -> dict[str, ValueRecord]:
        """Entries of an input/ or output/ group, in argument order when known."""
        grp = existing(self.h5, group_path)
        if grp is None:
            return {}
        out = {name: self._record(f"{group_path}/{name}", name) for name in grp.keys()}
        order = grp.attrs.get("order")
        if order is not None:
            names = [_attr_str(n) for n in np.asarray(order).reshape(-1)]
            out = {n: out[n] for n in names if n in out} | {n: v for n, v in out.items() if n not in names}
        return out

    @_guarded
    def _record(self, path: str, name: str) -> ValueRecord:
        obj = self.h5[path]
        attrs = dict(obj.attrs)
        code = attrs.get(S.ATTR_TYPE)
        if code is None:
            code = S.TYPE_LIST if isinstance(obj, h5py.Group) else S.TYPE_TENSOR
        code = int(code)
        rec = ValueRecord(self, path, name, code, attrs)
        if isinstance(obj, h5py.Group):
            kids = sorted(obj.keys(), key=lambda k: _suffix_index(k))
            rec.children = [self._record(f"{path}/{k}", k) for k in kids]
        return rec

    def read_value(self, rec: ValueRecord) -> Any:
        if rec.is_list:
            return [c.read() for c in rec.children]
        if isinstance(rec, TableValueRecord):
            v = rec.value
            return dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v
        t = rec.type
        try:
            obj = self.h5[rec.path]
            if t == S.TYPE_TENSOR:
                return decode_raw(obj[()], rec.dtype or str(obj.dtype))
            if t == S.TYPE_TENSOR_VIEW:
                return self._read_view(rec)
            if t == S.TYPE_TENSOR_STATS:
                vals = obj[()]
                names = _attr_str(rec.attrs.get(S.ATTR_STATS_FIELDS, ",".join(S.STATS_FIELDS))).split(",")
                return dict(zip(names, (float(v) for v in vals)))
            if t == S.TYPE_NONE:
                return None
            if t == S.TYPE_SCALAR_TYPE:
                return _attr_str(rec.attrs.get(S.ATTR_DTYPE, S.DTYPE_BY_CODE.get(int(obj[()]), "")))
            val = obj[()]
        except (OSError, ValueError, TypeError, KeyError, RuntimeError) as e:
            if raised_by_h5py(e):
                raise corrupt_dump_error(self.path, e, rec.path) from e
            raise DumpFormatError(f"{self.path}: cannot read {rec.path}: {e}") from e
        if isinstance(val, bytes):
            return val.decode("utf-8", "replace")
        if isinstance(val, np.ndarray):
            return val.tolist()
        if isinstance(val, np.generic):
            return val.item()
        return val

    @_guarded
    def _resolve_base(self, rec: ValueRecord) -> h5py.Dataset:
        obj = self.h5[rec.path]
        ref = obj[()]
        if isinstance(ref, h5py.Reference) and ref:
            try:
                base = self.h5[ref]
            except (ValueError, KeyError):
                base = None
            if isinstance(base, h5py.Dataset):
                # a reference may reach a dataset no link names: check_file did not see it
                safety.check_dataset(base.id, self.path, f"{rec.path} (its base)")
                return base
        base_path = _attr_str(rec.attrs.get(S.ATTR_BASE, ""))
        if base_path and base_path in self.h5:
            return self.h5[base_path]
        raise DumpFormatError(
            f"{self.path}: {rec.path} is a view of {base_path or 'a dataset'} that is not in this file "
            "(copy with `accucmp extract` or `h5copy -f ref`)")

    @_guarded
    def _read_view(self, rec: ValueRecord) -> np.ndarray:
        base = self._resolve_base(rec)
        battrs = base.attrs
        dtype_name = _attr_str(battrs.get(S.ATTR_DTYPE, "")) or str(base.dtype)
        raw = base[()]
        # the view is cut from the stored bits and only its own elements are decoded: every
        # bit of a bfloat16/float8 value (NaN payloads) reaches decode_raw as stored, and
        # the rebuilt storage holds 1-2 byte codes, not float32. complex32's stored pairs
        # add a trailing dim the strides do not describe: decoded first.
        early = dtype_name == "complex32" or raw.dtype.kind == "f" and dtype_name in _WIDE_OK
        data = view_of(decode_raw(raw, dtype_name) if early else raw,
                       np.asarray(S.live_stride(battrs), dtype=np.int64),
                       int(battrs.get(S.ATTR_STORAGE_OFFSET, 0)), rec.shape,
                       np.asarray(S.live_stride(rec.attrs), dtype=np.int64),
                       int(rec.attrs.get(S.ATTR_STORAGE_OFFSET, 0)), where=f"{self.path}: {rec.path}")
        return data if early else decode_raw(data, dtype_name)

    def iter_chunks(self, rec: ValueRecord, chunk_elements: int) -> Iterator[np.ndarray]:
        if rec.type != S.TYPE_TENSOR:
            yield np.asarray(self.read_value(rec)).reshape(-1)
            return
        # a generator: the guard goes around each read, not around the consumer's code
        with h5_errors(self.path, rec.path):
            ds = self.h5[rec.path]
            dtype_name = rec.dtype or str(ds.dtype)
            whole = ds.ndim == 0 or ds.size == 0
            if whole:
                data = np.asarray(ds[()])
        if whole:
            yield decode_raw(data, dtype_name).reshape(-1)
            return
        for start, count in chunk_slabs(ds.shape, chunk_elements):
            with h5_errors(self.path, rec.path):
                piece = ds[tuple(slice(a, a + c) for a, c in zip(start, count))]
            yield decode_raw(piece, dtype_name).reshape(-1)


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


class _LazyOpRecord(OpRecord):
    """OpRecord whose phase/module/grad_fn are read from the group only when asked."""

    __slots__ = ()

    def __init__(self, file: DumpFile, op: str, seqid: int):
        super().__init__(file, op, seqid)

    def __getattribute__(self, name):
        if name in ("phase", "module", "grad_fn"):
            attrs = object.__getattribute__(self, "attrs")
            if name == "phase" and S.OP_PHASE not in attrs:
                # an original file: its ops carry no attributes; backward ops are autograd
                # node names (AddmmBackward)
                return legacy.phase_of(object.__getattribute__(self, "op"))
            return _attr_str(attrs.get(name, ""))
        return object.__getattribute__(self, name)


def _suffix_index(key: str) -> tuple[int, str]:
    tail = key.rsplit("_", 1)[-1]
    return (int(tail), key) if tail.isdigit() else (1 << 62, key)


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
