"""Read dump files with h5py and numpy only (no torch).

`DumpFile(path)` validates the file, lists its ops in seqid order (from the index
dataset when present, else by walking links: files cut by `h5copy` have no index)
and returns tensors as numpy arrays in a dtype numpy can compute with:
bfloat16 and float8 come back as exact float32, complex32 as complex64.
The stored dtype is always in `ValueRecord.dtype`.

The reader is split by concern: this module opens and validates a file and holds the
value access every record goes back to (values, read_value, views, chunks); the op index
is dumpfile.read.opindex, the records dumpfile.read.records, decoding and views
dumpfile.read.values, the fast per-op reads dumpfile.read.light and .catalog. It stays
~430 lines because DumpFile is one class whose parts (open, ops, values) share its state.
"""

from __future__ import annotations

import os
from functools import cached_property
from typing import Any, Iterator

import h5py
import numpy as np

from dumpfile import schema as S
from dumpfile.read import opindex, recovery
from dumpfile.read import safety
from dumpfile import watchdog
from dumpfile import stats_table as T
from dumpfile.errors import DumpFormatError, raised_by_h5py

from dumpfile.read.values import (  # noqa: F401  (public here too: DumpFile's helpers)
    DECODED_NUMPY_DTYPE, _WIDE_OK, _strides_are_dense, chunk_slabs, decode_raw, view_of)
from dumpfile.read.h5util import (  # noqa: F401
    H5_ERRORS, READ_ERRORS, _attr_str, corrupt_dump_error, existing, h5_errors, h5_message, members,
    ordered_names, suffix_index, view_base)
from dumpfile.read.records import (  # noqa: F401  (public here too)
    OpRecord, TableValueRecord, ValueRecord, _LazyOpRecord, _TableOpRecord, _guarded, check_kind, type_code)


class DumpFile:
    """A dump opened for reading. Use as a context manager or call close()."""

    def __init__(self, path: str | os.PathLike, *, require_dump: bool = True, check: str = "full"):
        """`check="listing"`: only what a listing from the catalog reads is checked
        (safety.check_listing); call check_all() before reading anything else."""
        self.path = os.fspath(path)
        self._checked = False
        watchdog.reading(self.path)            # named if HDF5 stalls on it (dumpfile.watchdog)
        # before anything opens it (h5py.is_hdf5 too): a FIFO would block forever
        safety.check_regular(self.path)
        try:
            if not h5py.is_hdf5(self.path):
                raise DumpFormatError(f"{self.path}: not an HDF5 file")
            self._source = None
            self.h5 = self._open()
        except DumpFormatError:
            raise
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            if isinstance(e, (KeyError, RuntimeError)) and not raised_by_h5py(e):
                raise
            # (KeyError: a damaged root object header, met reading the root's attributes;
            # the API raised it as it was, the fuzzer's seed 8)
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
    def step_raised(self) -> tuple[str, int | None, bool] | None:
        """(what the user's step raised, the seqid it had reached, whether that op raised it)
        when the block ended in an exception and the writer closed cleanly (every op up to it
        is in the file); None otherwise (a clean exit, or a file the writer did not close:
        see `complete`)."""
        text = self.attrs.get(S.ROOT_STEP_RAISED)
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        if not isinstance(text, str) or self.complete:
            return None
        at = self.attrs.get(S.ROOT_STEP_RAISED_AT)
        try:
            at = int(at) if at is not None else None
        except (TypeError, ValueError):
            at = None
        return text, at, bool(self.attrs.get(S.ROOT_STEP_RAISED_IN_OP, False))

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
                if S.is_seqid_name(seq):
                    return True
        return False

    # ---- ops -------------------------------------------------------------
    @cached_property
    def _table(self) -> T.StatsTable:
        try:
            return T.StatsTable(self.h5, complete=self.complete, path=self.path)
        except DumpFormatError:
            raise
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

    @cached_property
    @_guarded
    def op_index(self) -> opindex.OpIndex:
        """The ops as columns (dumpfile.read.opindex), in seqid order: from the index when
        there is one (rows whose group a tool dropped left out), else by walking the root."""
        if S.INDEX_PATH in self.h5:
            cls = _TableOpRecord if self.is_table else OpRecord
            return opindex.from_index(self, self.h5, cls, self.complete, self.is_table)
        found = []
        for op_name in self.h5.keys():
            if op_name == S.META_GROUP:
                continue
            grp = self.h5[op_name]
            if not isinstance(grp, h5py.Group):
                continue
            for seq in grp.keys():
                if S.is_seqid_name(seq):
                    found.append((op_name, int(seq)))
        return opindex.from_walk(self, found, _LazyOpRecord)

    @cached_property
    def _ops(self) -> list[OpRecord]:
        return self.op_index.records()

    @cached_property
    def catalog(self) -> opindex.CatalogRows | None:
        """The catalog's rows by index row (OpRecord.index_row), read in blocks; None when
        the file has no usable catalog (opindex.open_catalog)."""
        return opindex.open_catalog(self.h5, self.is_table)

    def catalog_rows(self) -> dict[str, Any] | None:
        """Op group path -> its raw catalog row (JSON text), every row at once (replay's
        index reads them all); None when the file has no usable catalog."""
        cat = self.catalog
        if cat is None:
            return None
        try:
            rows = cat.all()
            ops = self.h5[S.INDEX_PATH].fields(["op", "seqid"])[()]
        except (OSError, KeyError, ValueError, TypeError, RuntimeError):
            return None
        return {S.op_group_path(_attr_str(r["op"]), int(r["seqid"])): raw for r, raw in zip(ops, rows)}

    def ops(self) -> list[OpRecord]:
        """Every op, in seqid (execution) order."""
        return list(self._ops)

    def __len__(self) -> int:
        return len(self.op_index)

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
        return opindex.from_walk(self, [(op, int(seqid))], _LazyOpRecord).records()[0]

    # ---- values ----------------------------------------------------------
    @_guarded
    def values(self, group_path: str) -> dict[str, ValueRecord]:
        """Entries of an input/ or output/ group, in argument order when known."""
        grp = existing(self.h5, group_path)
        if grp is None:
            return {}
        if not isinstance(grp, h5py.Group):
            raise DumpFormatError(f"{self.path}: {group_path} is a dataset where an op's input/output group "
                                  "belongs; refused")
        names = list(grp.keys())
        safety.check_members(self.path, len(names), group_path)
        names = ordered_names(names, grp.attrs.get("order"))
        return {name: self._record(f"{group_path}/{name}", name) for name in names}

    @_guarded
    def _record(self, path: str, name: str) -> ValueRecord:
        safety.check_levels(self.path, path.count("/"), path)
        obj = self.h5[path]
        safety.check_attributes(self.path, len(obj.attrs), path)
        attrs = dict(obj.attrs)
        is_group = isinstance(obj, h5py.Group)
        code = attrs.get(S.ATTR_TYPE)
        if code is None:
            code = S.TYPE_LIST if is_group else S.TYPE_TENSOR
        else:
            code = type_code(code, f"{self.path}: {path}")
        check_kind(self.path, path, code, is_group)
        rec = ValueRecord(self, path, name, code, attrs)
        if is_group:
            kids = list(obj.keys())
            safety.check_members(self.path, len(kids), path)
            rec.children = [self._record(f"{path}/{k}", k) for k in sorted(kids, key=suffix_index)]
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
            # (a record from the catalog, not from its object: the file may have been edited
            # since, a group now where the catalog says tensor)
            check_kind(self.path, rec.path, t, isinstance(obj, h5py.Group))
            if t == S.TYPE_TENSOR:
                return decode_raw(obj[()], rec.dtype or str(obj.dtype), f"{self.path}: {rec.path}")
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
        return view_base(self.h5, self.path, self.h5[rec.path], rec.attrs.get(S.ATTR_BASE), rec.path)

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

        def named(fn, *args):
            # the base named only in a refusal: h5py's .name makes HDF5 search the file for
            # the object's path (~5-15 ms in a GPT-2 small dump; h5util.view_base)
            try:
                return fn(*args, "")
            except DumpFormatError:
                return fn(*args, f"{self.path}: {base.name}")
        data = view_of(named(decode_raw, raw, dtype_name) if early else raw,
                       np.asarray(S.live_stride(battrs), dtype=np.int64),
                       named(S.storage_offset, battrs), rec.shape,
                       np.asarray(S.live_stride(rec.attrs), dtype=np.int64),
                       S.storage_offset(rec.attrs, f"{self.path}: {rec.path}"), where=f"{self.path}: {rec.path}")
        return data if early else named(decode_raw, data, dtype_name)

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
            yield decode_raw(data, dtype_name, f"{self.path}: {rec.path}").reshape(-1)
            return
        for start, count in chunk_slabs(ds.shape, chunk_elements):
            with h5_errors(self.path, rec.path):
                piece = ds[tuple(slice(a, a + c) for a, c in zip(start, count))]
            yield decode_raw(piece, dtype_name, f"{self.path}: {rec.path}").reshape(-1)


def ending_text(f: "DumpFile") -> str:
    """How a file that is not complete ended, in a few words ('' when it is complete)."""
    if f.complete:
        return ""
    raised = f.step_raised
    if raised is None:
        return "INCOMPLETE (writer did not close cleanly)"
    text, at, in_op = raised
    where = (f" at op {at}" if in_op else f" after op {at}") if at else " before its first op"
    return f"the step raised{where} ({text}); the writer closed cleanly"
