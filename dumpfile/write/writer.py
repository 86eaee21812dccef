"""Write dump files: numpy arrays and Python values in, the documented layout out.

Torch-free on purpose: the dumper's background thread, golden replay, `accucmp
extract` and the tests all write through this one class, so the layout lives in
one place. The file is written through (never held in RAM) and flushed at least
every `flush_interval` seconds, so a crash leaves it readable up to the last flush.

Why one module of ~880 lines: DumpWriter is one state machine over one open file (the
op being written, the catalog rows of its tensors, the rows not yet published, the
reserve of disk space, the first failure); its methods share that state and their
order (begin_op, tensors, end_op, release_ops, flush). The HDF5 objects it makes live
in h5objects.py.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import time
from typing import Any, Sequence

import h5py
import numpy as np
from h5py import h5g, h5s

from .. import schema as S
from ..errors import DumpWriteError
from dumpfile.read.lowlevel import contiguous_offset
from .h5objects import (  # noqa: F401 - also the names others import from dumpfile.write.writer
    DIRECT_WRITE_MIN_BYTES, SpaceClaimError, TensorMeta, _STATS_FIELDS, _TEST_WRITE_DELAY_S,
    _claimed_only, _clear_for_create, _first_line, _keep_dirty_metadata, _new_dataset, _os_error,
    _scalar_type_code, _types, claim_blocks, format_type_of, new_table, pwrite_all,
    rewrite_scalar_attr, set_attrs)

_STR = h5py.string_dtype("utf-8")
_INDEX_DTYPE = np.dtype([
    ("seqid", np.int64), ("op", _STR), ("phase", np.int8), ("module", _STR), ("grad_fn", _STR),
])


# Catalog (/_npu_dumper/catalog, docs/FORMAT.md): descriptions of stored tensors kept for
# links to them, at most this many (oldest forgotten first; a link to a forgotten one reads
# the file instead).
CATALOG_MAX_DESCRIPTIONS = 1 << 16
_NO_VALUE = object()


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


class DumpWriter:
    """One open dump file. Not thread-safe: one thread writes (the dumper's writer thread)."""

    _failed: DumpWriteError | None = None   # (set per instance by fail())
    _frozen = False     # (fail(): HDF5's descriptor points at /dev/null)
    _flushed_rows: dict = {}    # table path -> rows at the last flush (_flush_headroom)
    durable_ops = 0

    def __init__(self, path: str | os.PathLike, *, mode: str = S.MODE_DUMP,
                 root_attrs: dict[str, Any] | None = None, flush_interval: float = 1.0,
                 append: bool = False, direct_write: bool = True,
                 reserve_bytes: int = 4 << 20):
        if mode not in S.MODES:
            raise ValueError(f"mode must be one of {S.MODES}, got {mode!r}")
        self.path = os.fspath(path)
        self.flush_interval = flush_interval
        if not append:
            _clear_for_create(self.path)
        try:
            self._f = h5py.File(self.path, "a" if append else "w")
        except OSError as e:
            raise DumpWriteError(f"{self.path}: cannot create dump file ({e})") from e
        f = self._f
        self._claim_blocks = True      # (reserve_tensor) until the file system says it cannot
        # A second descriptor for raw tensor bytes: os.pwrite releases the GIL, h5py does not,
        # so large writes overlap the user's Python (see write_tensor).
        self._fd = -1
        if direct_write and f.driver == "sec2" and f.userblock_size == 0:
            try:
                self._fd = os.open(self.path, os.O_WRONLY)
            except OSError:
                self._fd = -1
        self._open_path: str | None = None
        self._reserve = self._make_reserve(reserve_bytes)
        root = {k: v for k, v in (root_attrs or {}).items() if v is not None}
        if not append or S.ROOT_FORMAT not in f.attrs:
            root = {S.ROOT_FORMAT: S.FORMAT_NAME, S.ROOT_FORMAT_VERSION: S.FORMAT_VERSION,
                    S.ROOT_MODE: mode,
                    S.ROOT_CREATED: _dt.datetime.now().isoformat(timespec="seconds"),
                    S.ROOT_NUM_OPS: 0, S.ROOT_COMPLETE: False, **root}
        else:
            root = {S.ROOT_COMPLETE: False, **root}
        # a new file has no attributes yet: the low-level path (~0.3 ms less per dump file)
        set_attrs(f, root, fresh=not append)
        if S.INDEX_PATH in f:
            self._index = f[S.INDEX_PATH]
        else:
            self._index = new_table(f, S.INDEX_PATH, _INDEX_DTYPE)
        # catalog: created at the first flush with rows. Not kept up (readers then walk the
        # groups) when an existing file's catalog does not match its index.
        self._catalog = f[S.CATALOG_PATH] if S.CATALOG_PATH in f else None
        self._cat_on = (self._index.shape[0] == 0 if self._catalog is None
                        else self._catalog.shape == self._index.shape)
        self._cat_desc: dict[str, tuple[str, str]] = {}   # dataset path -> (canonical path, fragment)
        self._cat_prefix: str | None = None     # open op's path + "/" while it is described
        self._cat_groups: dict[str, dict[str, list[str]]] = {}   # io -> top name -> entries
        self._cat_order: dict[str, list[str]] = {}
        self._io_ids: tuple = ()       # begin_op's input/ and output/ group ids
        self._cat_bad = False
        self._open_row: tuple | None = None
        # index rows waiting for the next flush: (seqid, op, phase, module, grad_fn, catalog row)
        self._pending_index: list[tuple] = []
        self._unflushed = False       # table rows (index, statistics) appended since the last flush
        # ops ended with end_op(deferred=True): their tensor bytes are still being written
        # (write_at, by another thread); their index rows wait here until release_ops, so
        # a flush never publishes an op whose data is not in the file yet
        self._deferred: list[tuple[tuple, str]] = []
        self.num_ops = int(f.attrs.get(S.ROOT_NUM_OPS, 0))
        self.bytes_written = 0
        self._last_flush = time.monotonic()
        self._failed: DumpWriteError | None = None    # the first failed write (fail())
        _keep_dirty_metadata(f)
        f.flush()
        self.durable_ops = self.num_ops     # ops the last completed flush made durable

    # ---- ops -------------------------------------------------------------
    def begin_op(self, op: str, seqid: int, *, phase: str = S.PHASE_FORWARD, module: str = "",
                 grad_fn: str = "", attrs: dict[str, Any] | None = None) -> h5py.Group:
        """Create /{op}/{seqid} with its input/ and output/ groups and attributes."""
        path = S.op_group_path(op, seqid)
        try:        # (no `path in file` check first: on a big file that lookup costs more)
            g = self._f.create_group(path)
        except ValueError as e:
            if path in self._f:
                raise DumpWriteError(f"{self.path}: op group {path} already exists") from e
            raise
        set_attrs(g, {S.OP_SEQID: int(seqid), S.OP_NAME: op, S.OP_PHASE: phase,
                      S.OP_MODULE: module or "", S.OP_GRAD_FN: grad_fn or ""}, fresh=True)
        if attrs:
            set_attrs(g, {k: v for k, v in attrs.items()
                          if k not in (S.OP_SEQID, S.OP_NAME, S.OP_PHASE, S.OP_MODULE, S.OP_GRAD_FN)},
                      fresh=True)
            set_attrs(g, {k: v for k, v in attrs.items()
                          if k in (S.OP_SEQID, S.OP_NAME, S.OP_PHASE, S.OP_MODULE, S.OP_GRAD_FN)})
        # low level: no h5py object wrappers
        ids = tuple(h5g.create(g.id, sub.encode(), lcpl=g._lcpl) for sub in (S.INPUT_GROUP, S.OUTPUT_GROUP))
        self._io_ids = ids
        row = (int(seqid), op, S.PHASE_CODES.get(phase, -1), module or "", grad_fn or "", "")
        self._pending_index.append(row)
        self._open_path = path
        self._open_row = row
        if self._cat_on:
            self._cat_prefix = path + "/"
            self._cat_groups = {S.INPUT_GROUP: {}, S.OUTPUT_GROUP: {}}
            self._cat_order = {}
            self._cat_bad = False
        return g

    def io_groups(self) -> tuple[h5py.Group, h5py.Group]:
        """The input/ and output/ groups of the op begun last, from the ids begin_op made
        (looking them up by name, `g["input"]`, costs ~30 us each through h5py)."""
        return h5py.Group(self._io_ids[0]), h5py.Group(self._io_ids[1])

    def abort_op(self) -> None:
        """Drop the op begun last and not ended (its write failed): no half-written op remains."""
        path, self._open_path = self._open_path, None
        self._open_row = None
        self._cat_reset()
        if path is None:
            return
        if self._pending_index:
            self._pending_index.pop()
        try:
            if path in self._f:
                del self._f[path]
        except (OSError, RuntimeError, KeyError):
            pass

    def set_order(self, parent: h5py.Group, names: Sequence[str]) -> None:
        """Record argument order: HDF5 lists members alphabetically."""
        set_attrs(parent, {"order": np.array(list(names), dtype=object).astype(_STR)})
        if self._cat_prefix is not None:
            gpath = parent.name
            if gpath.startswith(self._cat_prefix):
                io = gpath[len(self._cat_prefix):]
                if io in self._cat_groups:
                    self._cat_order[io] = [str(n) for n in names]

    def end_op(self, *, deferred: bool = False) -> None:
        """Finish the op begun last. `deferred`: some of its tensors were reserved with
        reserve_tensor and are written later; the op is published (index row, num_ops)
        only by release_ops, once the caller has written them."""
        path, self._open_path = self._open_path, None
        row, self._open_row = self._open_row, None
        cat = self._cat_finish()
        if cat and row is not None and self._pending_index and self._pending_index[-1] is row:
            self._pending_index[-1] = row[:5] + (cat,)
        if deferred:
            self._deferred.append((self._pending_index.pop(), path))
        else:
            self.num_ops += 1
        self.maybe_flush()

    def release_ops(self, n: int) -> None:
        """The first `n` deferred ops have all their bytes written: publish them at the next flush."""
        if n <= 0:
            return
        done, self._deferred = self._deferred[:n], self._deferred[n:]
        self._pending_index.extend(row for row, _ in done)
        self.num_ops += len(done)

    def drop_deferred(self) -> None:
        """Delete the groups of deferred ops never released (writing their bytes failed).
        Call only when no write_at is in flight: HDF5 may reuse the freed space."""
        dropped, self._deferred = self._deferred, []
        for _, path in dropped:
            try:
                if path in self._f:
                    del self._f[path]
            except (OSError, RuntimeError, KeyError):
                pass

    @property
    def num_deferred(self) -> int:
        return len(self._deferred)

    # ---- values ----------------------------------------------------------
    def write_tensor(self, parent: h5py.Group, name: str, data: np.ndarray, meta: TensorMeta,
                     *, compression: str | None = None) -> str:
        """Store `data` (already in the storage dtype of schema.STORAGE_NUMPY_DTYPE)."""
        expected = np.dtype(S.STORAGE_NUMPY_DTYPE.get(meta.dtype, data.dtype))
        if data.dtype != expected:
            raise DumpWriteError(
                f"{self.path}: {parent.name}/{name}: {meta.dtype} must be stored as {expected}, "
                f"got {data.dtype}")
        data = np.asarray(data, order="C")   # (ascontiguousarray would make 0-d arrays 1-d)
        offset = None
        kw: dict[str, Any] = {}
        if self._fd >= 0 and not compression and data.nbytes >= DIRECT_WRITE_MIN_BYTES \
                and data.dtype.isnative:
            ds, offset = self._write_direct(parent, name, data)
        else:
            if compression and data.size:
                kw = {"compression": compression, "chunks": True}
                ds = parent.create_dataset(name, data=data, **kw)
            else:
                ds = _new_dataset(parent, name, data)
        attrs = meta.attrs(S.TYPE_TENSOR)
        set_attrs(ds, attrs, fresh=True)
        self.bytes_written += data.nbytes
        path = ds.name
        if self._cat_prefix is not None:
            if offset is None and not kw:
                offset = contiguous_offset(ds.id, data.nbytes)
            self._cat_tensor(path, attrs, offset, data.nbytes, data.dtype, data.shape)
        return path

    def reserve_tensor(self, parent: h5py.Group, name: str, shape: tuple[int, ...],
                       dtype: np.dtype, meta: TensorMeta) -> tuple[str, int, int] | None:
        """Create a tensor's dataset and attributes now, its bytes to be written later.

        The dataset is contiguous and allocated at creation, so its file offset is known:
        another thread writes the C-order bytes of the stored array (`dtype`, `shape`: what
        write_tensor would be given) with write_at, without the GIL or h5py's lock. The file
        is identical to write_tensor's. Returns (path, offset, nbytes), or None where that
        path does not apply (then call write_tensor). The op holding it must be ended with
        end_op(deferred=True) and released once the bytes are written.
        """
        dtype = np.dtype(dtype)
        expected = np.dtype(S.STORAGE_NUMPY_DTYPE.get(meta.dtype, dtype))
        nbytes = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
        if self._fd < 0 or dtype != expected or not dtype.isnative \
                or nbytes < DIRECT_WRITE_MIN_BYTES:
            return None
        ds = _new_dataset(parent, name, None, dtype=dtype, shape=tuple(shape), early=True)
        offset = ds.id.get_offset()
        if offset is None:      # not contiguous after all: let the caller write it through HDF5
            del parent[name]
            return None
        # Claim the blocks now: otherwise the later write_at is what finds the disk full,
        # after this op's metadata (and that of every op reserved meanwhile) has been made
        # and must still be flushed into space the data took; that flush then failed and
        # left HDF5 unable to flush again, so not even the ops already written were kept.
        if self._claim_blocks:
            try:
                self._claim_blocks = claim_blocks(self._fd, offset, nbytes)
            except OSError as e:
                raise DumpWriteError(f"{self.path}: write failed ({e})") from e
        attrs = meta.attrs(S.TYPE_TENSOR)
        set_attrs(ds, attrs, fresh=True)
        self.bytes_written += nbytes
        path = ds.name
        if self._cat_prefix is not None:
            self._cat_tensor(path, attrs, offset, nbytes, dtype, shape)
        return path, offset, nbytes

    def write_at(self, offset: int, data: Any) -> None:
        """Write raw bytes (a C-contiguous buffer) at a file offset given by reserve_tensor.
        Thread-safe and GIL-free (os.pwrite on a second descriptor); never touches h5py."""
        pwrite_all(self._fd, data, offset, self.path)

    def _write_direct(self, parent: h5py.Group, name: str, data: np.ndarray
                      ) -> tuple[h5py.Dataset, int | None]:
        """Contiguous dataset allocated at creation (no fill), bytes written with os.pwrite.
        Returns it and its file offset (None: HDF5 wrote it).

        The bytes land in the file range HDF5 allocated to the dataset; numpy's native
        layout equals the HDF5 type h5py maps it to, so the file is an ordinary dataset.
        """
        ds = _new_dataset(parent, name, None, dtype=data.dtype, shape=data.shape, early=True)
        offset = ds.id.get_offset()
        if offset is None:      # not contiguous after all: let HDF5 write it
            ds.id.write(h5s.ALL, h5s.ALL, data, mtype=_types(data.dtype)[1])
            return ds, None
        pwrite_all(self._fd, data.reshape(-1).view(np.uint8), offset, self.path)
        return ds, offset

    def write_stats(self, parent: h5py.Group, name: str, stats: Sequence[float],
                    meta: TensorMeta) -> str:
        ds = parent.create_dataset(name, data=np.asarray(stats, dtype=np.float64))
        a = meta.attrs(S.TYPE_TENSOR_STATS)
        a[S.ATTR_STATS_FIELDS] = _STATS_FIELDS
        set_attrs(ds, a, fresh=True)
        path = ds.name
        if self._cat_prefix is not None:
            self._cat_tensor(path, a)
        return path

    def write_view(self, parent: h5py.Group, name: str, base_path: str, meta: TensorMeta) -> str:
        """A tensor whose data is (a re-striding of) the stored dataset `base_path`.

        `meta.stride`/`storage_offset` are the view's own; the base dataset's Stride and
        storage_offset attributes say where its elements live in the shared storage.
        """
        base = self._f[base_path]
        ds = parent.create_dataset(name, data=base.ref, dtype=h5py.ref_dtype)
        a = meta.attrs(S.TYPE_TENSOR_VIEW)
        a[S.ATTR_BASE] = self._local_base(parent, base_path)
        set_attrs(ds, a, fresh=True)
        path = ds.name
        if self._cat_prefix is not None:
            self._cat_tensor(path, a)
        return path

    def _local_base(self, parent: h5py.Group, base_path: str) -> str:
        """The path the view's `base` attribute names: the base itself when it lives in the
        view's own op group, else a hard link to it in that op group, named
        `_base|{base path with "|" for "/"}` (format 1.5).

        Why: the guide's `h5copy -s /op/seqid/` copies one op group, and h5copy turns object
        references into null ones, so the copy's view could only find its base by path, in
        a group that was not copied. The hard link costs no data bytes (one entry in the op
        group's link table; a `_bases/` subgroup cost ~1 KB an op), h5copy copies the linked
        dataset with the group, so the copy holds the op's input values and `base` resolves
        in it. Storing such views' values instead cost +39% (mlp) to +101% (transformer)
        in bytes (benchmarks/bench_view_copy.py)."""
        parts = parent.name.split("/")
        own = "/".join(parts[:3])                  # /{op}/{seqid}
        if len(parts) < 4 or base_path.startswith(own + "/"):
            return base_path
        grp = self._f[own]
        # one link per base, named after its path ("/" is not allowed in a link name)
        link = S.OP_BASE_LINK_PREFIX + base_path.strip("/").replace("/", "|")
        if link.encode() not in grp.id:
            grp.id.links.create_hard(link.encode(), self._f.id, base_path.encode(),
                                     lcpl=grp._lcpl, lapl=grp._lapl)
        return f"{own}/{link}"

    def link(self, parent: h5py.Group, name: str, existing_path: str) -> str:
        """Hard link: the same stored tensor under a second path (written once)."""
        # low level: the high-level `parent[name] = f[path]` opens the target object first
        parent.id.links.create_hard(name.encode(), self._f.id, existing_path.encode(),
                                    lcpl=parent._lcpl, lapl=parent._lapl)
        path = f"{parent.name}/{name}"
        if self._cat_prefix is not None:
            self._cat_link(path, existing_path)
        return path

    def write_value(self, parent: h5py.Group, name: str, value: Any,
                    schema_type: str | None = None) -> str:
        """A non-tensor argument: a small dataset with a Type code."""
        if isinstance(value, (list, tuple)):
            return self._write_list(parent, name, value, schema_type)
        code = _scalar_type_code(value, schema_type)
        if code == S.TYPE_NONE:
            ds = _new_dataset(parent, name, None, dtype=np.dtype("f8"))
        elif code == S.TYPE_STRING:
            ds = _new_dataset(parent, name, np.array(value, dtype=_STR))
        else:
            ds = _new_dataset(parent, name, np.asarray(value))
        set_attrs(ds, {S.ATTR_TYPE: code, S.ATTR_SCHEMA_TYPE: schema_type or None}, fresh=True)
        path = ds.name
        if self._cat_prefix is not None:
            # what DumpFile.read_value gives back: None, the string, or the number as stored
            try:
                v = None if code == S.TYPE_NONE else value if code == S.TYPE_STRING \
                    else np.asarray(value)[()].item()
            except (TypeError, ValueError, OverflowError):
                v = _NO_VALUE
            self._cat_entry(path, {S.CAT_TYPE: code}, v)
        return path

    def write_named(self, parent: h5py.Group, name: str, value: str, type_code: int,
                    extra: dict[str, Any] | None = None, schema_type: str | None = None) -> str:
        """dtype / device / layout / memory_format values, stored by name."""
        if type_code == S.TYPE_SCALAR_TYPE:
            ds = _new_dataset(parent, name, np.asarray(np.int64(S.data_type_code(value))))
            set_attrs(ds, {S.ATTR_DTYPE: value}, fresh=True)
        else:
            ds = _new_dataset(parent, name, np.array(value, dtype=_STR))
        set_attrs(ds, {S.ATTR_TYPE: type_code, S.ATTR_SCHEMA_TYPE: schema_type or None}, fresh=True)
        if extra:
            set_attrs(ds, extra)
        path = ds.name
        if self._cat_prefix is not None:
            attrs = {S.ATTR_TYPE: type_code, **(extra or {})}
            if type_code == S.TYPE_SCALAR_TYPE:
                attrs.setdefault(S.ATTR_DTYPE, value)
            d = _cat_attrs(attrs)
            if d is None:       # never fails the write: the op is left undescribed
                self._cat_bad = True
            else:       # the value as read back: the dtype name, or the string
                v = d.get(S.ATTR_DTYPE, _NO_VALUE) if type_code == S.TYPE_SCALAR_TYPE \
                    else value if isinstance(value, str) else _NO_VALUE
                self._cat_entry(path, d, v)
        return path

    def create_list(self, parent: h5py.Group, name: str, type_code: int = S.TYPE_TENSOR_LIST,
                    length: int = 0, schema_type: str | None = None) -> h5py.Group:
        """A group whose entries are `{name}_{i}`; the caller fills them."""
        g = parent.create_group(name)
        g.attrs[S.ATTR_TYPE] = type_code
        g.attrs["length"] = int(length)
        if schema_type:
            g.attrs[S.ATTR_SCHEMA_TYPE] = schema_type
        if self._cat_prefix is not None:
            self._cat_entry(g.name, {S.CAT_TYPE: int(type_code), S.CAT_LENGTH: int(length)})
        return g

    def _write_list(self, parent, name, value, schema_type):
        items = list(value)
        if all(isinstance(v, bool) for v in items) and items:
            code, arr = S.TYPE_BOOL_LIST, np.asarray(items, dtype=bool)
        elif all(isinstance(v, int) and not isinstance(v, bool) for v in items):
            st = (schema_type or "").replace(" ", "")
            code = S.TYPE_INT_ARRAY_REF if st.startswith(("int[", "SymInt[")) else S.TYPE_INT_LIST
            arr = np.asarray(items, dtype=np.int64)
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in items):
            code, arr = S.TYPE_FLOAT_LIST, np.asarray(items, dtype=np.float64)
        else:
            g = self.create_list(parent, name, S.TYPE_LIST, len(items), schema_type)
            for i, v in enumerate(items):
                self.write_value(g, f"{name}_{i}", v)
            return g.name
        ds = _new_dataset(parent, name, arr)
        set_attrs(ds, {S.ATTR_TYPE: code, S.ATTR_SCHEMA_TYPE: schema_type or None}, fresh=True)
        path = ds.name
        if self._cat_prefix is not None:
            self._cat_entry(path, {S.CAT_TYPE: code}, arr.tolist())
        return path

    # ---- catalog -----------------------------------------------------------
    def _cat_reset(self) -> None:
        self._cat_prefix = None
        self._cat_groups = {}
        self._cat_order = {}
        self._cat_bad = False

    def _cat_place(self, path: str) -> tuple[str, str] | None:
        """(io group, name relative to it) of an entry of the open op, else None."""
        prefix = self._cat_prefix
        if prefix is None or not path.startswith(prefix):
            return None
        io, _, rel = path[len(prefix):].partition("/")
        return (io, rel) if rel and io in self._cat_groups else None

    def _cat_add(self, io: str, rel: str, entry: str) -> None:
        self._cat_groups[io].setdefault(rel.partition("/")[0], []).append(entry)

    def _cat_entry(self, path: str, desc: dict[str, Any], value: Any = _NO_VALUE) -> None:
        """A non-tensor entry (value or list) of the open op."""
        place = self._cat_place(path)
        if place is None:
            return
        d = {S.CAT_NAME: place[1], **desc}
        if value is not _NO_VALUE:
            d[S.CAT_VALUE] = value
        try:
            entry = _cat_json(d)
        except (TypeError, ValueError, OverflowError):   # complex, NaN, inf: readers read the file
            d.pop(S.CAT_VALUE, None)
            try:
                entry = _cat_json(d)
            except (TypeError, ValueError, OverflowError):
                self._cat_bad = True
                return
        self._cat_add(place[0], place[1], entry)

    def _cat_tensor(self, path: str, attrs: dict[str, Any], offset: int | None = None,
                    nbytes: int = 0, dtype: Any = None, shape: Any = None) -> None:
        """A dataset stored at `path` (tensor, view or statistics): remembered for links to
        it, and an entry of the open op when it is one."""
        try:
            frag = _tensor_fragment(attrs, offset, nbytes, dtype, shape)
        except (TypeError, ValueError, OverflowError):
            frag = None
        if frag is None:            # never fails the write: the op is left undescribed
            self._cat_bad = True
            return
        self._cat_remember(path, (path, frag))
        place = self._cat_place(path)
        if place is not None:
            self._cat_add(place[0], place[1], '{"n":' + _cat_json(place[1]) + "," + frag + "}")

    def _cat_remember(self, path: str, desc: tuple[str, str]) -> None:
        known = self._cat_desc
        known[path] = desc
        if len(known) > CATALOG_MAX_DESCRIPTIONS:
            del known[next(iter(known))]

    def _cat_link(self, path: str, existing_path: str) -> None:
        if not existing_path.startswith("/"):
            existing_path = "/" + existing_path
        desc = self._cat_desc.get(existing_path)
        if desc is None:
            desc = self._cat_describe_stored(existing_path)
            if desc is None:
                self._cat_bad = True
                return
        self._cat_remember(path, desc)
        place = self._cat_place(path)
        if place is not None:
            canonical, frag = desc
            self._cat_add(place[0], place[1], '{"n":' + _cat_json(place[1]) + ',"obj":'
                          + _cat_json(canonical) + "," + frag + "}")

    def _cat_describe_stored(self, path: str) -> tuple[str, str] | None:
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

    def _cat_finish(self) -> str:
        """The open op's catalog row ("" when it is not fully described)."""
        prefix, groups, order, ids, bad = (self._cat_prefix, self._cat_groups, self._cat_order,
                                           self._io_ids, self._cat_bad)
        self._cat_reset()
        if prefix is None or bad:
            return ""
        parts = []
        for io, key, gid in zip((S.INPUT_GROUP, S.OUTPUT_GROUP), (S.CAT_INPUTS, S.CAT_OUTPUTS), ids):
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

    # ---- durability --------------------------------------------------------
    def maybe_flush(self) -> None:
        if _TEST_WRITE_DELAY_S:
            time.sleep(_TEST_WRITE_DELAY_S)
        # Half the interval while ops arrive: with the dumper's writers keeping at most
        # 0.4 of it unwritten (WriterThread.max_lag), every op recorded a whole
        # flush_interval before a kill is in the file (docs/FORMAT.md, "Durability").
        # Each flush writes what changed since the last, so twice as many cost little more.
        if time.monotonic() - self._last_flush >= self.flush_interval * 0.5:
            self.flush()

    def flush(self, *, final: bool = False) -> None:
        """Make every finished op durable: index rows, HDF5 flush, then the op count and
        another flush. `num_ops` on disk thus counts only ops a completed flush wrote: a
        SIGKILL inside a flush (writer="thread") can leave that flush's own structures half
        written (dumpfile.read.recovery reads around them), never an op count ahead of them.
        `final` (at close, where `complete` follows): one flush.

        The disk space the flush will write to is claimed first (up to HDF5's end of
        allocation): a full disk or a file-size limit then shows before HDF5 writes
        anything, and the file stays as the last flush left it (see fail())."""
        if self._failed is not None and (self._frozen or not final):
            raise self._failed
        try:
            if self._pending_index:
                pending = self._pending_index
                n = self._index.shape[0]
                rows = np.array([r[:5] for r in pending], dtype=_INDEX_DTYPE)
                cat = [r[5] if len(r) > 5 else "" for r in pending] if self._cat_on else None
                self._index.resize((n + len(rows),))
                self._index[n:] = rows
                pending.clear()
                self._unflushed = True
                if cat is not None:
                    try:
                        self._write_catalog(n, cat)
                    except (OSError, RuntimeError, ValueError):
                        # an accelerator only: stop keeping it (readers then walk the groups);
                        # a disk-full condition is reported by the flush below
                        self._cat_on = False
            self._claim_to_eoa()
            if self._unflushed and not final:
                self._f.flush()
            self._unflushed = False
            rewrite_scalar_attr(self._f, S.ROOT_NUM_OPS, self.num_ops)
            self._f.flush()
        except (OSError, RuntimeError) as e:  # disk full surfaces here (h5py: RuntimeError)
            raise self.fail(e) from e
        self.durable_ops = self.num_ops
        self._note_flushed_rows()
        self._last_flush = time.monotonic()

    def _claim_to_eoa(self) -> None:
        """Allocate the file's blocks up to HDF5's end of allocation (what the coming flush
        writes stays below it). Raises OSError (ENOSPC, EFBIG past a file-size limit)."""
        try:
            fd = self._f.id.get_vfd_handle()
            eoa = self._f.id.get_filesize()     # max(end of file, end of allocation)
        except Exception:  # noqa: BLE001 - not a plain POSIX file: nothing to claim
            return
        if not isinstance(fd, int) or fd < 0:
            return
        # and room past it: a flush also allocates (the chunks of the index and statistics
        # tables that HDF5's chunk cache still holds); a stats flush that failed there had
        # already written a superblock whose end of allocation the file never reached
        want = eoa + self._flush_headroom()
        size = os.fstat(fd).st_size
        if want > size and self._claim_blocks:
            if not claim_blocks(fd, size, want - size):
                self._claim_blocks = False

    def _tables(self) -> list:
        """The chunked tables this writer appends to (their new chunks are allocated when
        HDF5 flushes them)."""
        return [self._index, self._catalog]

    def _flush_headroom(self) -> int:
        """Room a flush may allocate past the end of allocation: the table chunks begun
        since the last flush, plus one (a fixed 2 MB filled a 3 MB disk at once)."""
        n = 0
        flushed = self._flushed_rows
        for ds in self._tables():
            if ds is not None and ds.chunks:
                rows, per = ds.shape[0], ds.chunks[0]
                new = -(-rows // per) - -(-flushed.get(ds.name, 0) // per)
                n += (new + 1) * per * ds.dtype.itemsize
        return n

    def _note_flushed_rows(self) -> None:
        self._flushed_rows = {ds.name: ds.shape[0] for ds in self._tables()
                              if ds is not None and ds.chunks}

    def _trim_headroom(self) -> None:
        """Give back the space claimed past the end of allocation (_claim_to_eoa): HDF5
        truncates a file it closes to that end only when it wrote past it itself."""
        from dumpfile.read.recovery import stored_eoa
        eoa = stored_eoa(self.path)
        try:
            if eoa is not None and os.path.getsize(self.path) > eoa[1]:
                os.truncate(self.path, eoa[1])
        except OSError:
            pass

    # ---- write failures ---------------------------------------------------------------
    def fail(self, e: BaseException) -> DumpWriteError:
        """The first failed write (disk full, file-size limit, I/O error): stop writing
        this file and keep it exactly as the last completed flush left it, then return
        the one line to report (file, error, ops kept); later calls return the same.

        HDF5's descriptor (and the pwrite one) is pointed at /dev/null: nothing HDF5
        does afterwards (the close's flush, h5py's clean-up at interpreter exit) writes
        to the file. Letting HDF5 go on after a failed write left files that plain h5py
        did not open ("addr overflow", "truncated file"), each later call printed an
        "Exception ignored", and the thread writer segfaulted at exit. What was written
        since the last flush lies in space that flush's metadata does not reference.

        When only claiming space failed (SpaceClaimError: nothing was written, HDF5's state
        is intact), the file is not frozen yet: close() gives back the disk-space reserve
        and makes one last flush, space claimed first, of the ops completed so far (on a
        full 3 MB disk the first claim often failed before any op had been flushed)."""
        if self._failed is not None:      # a second failure (e.g. the last flush's claim)
            if not self._frozen:
                self._freeze()
            return self._failed
        ose = _os_error(e)
        code = ose.errno if ose is not None else None
        if code is None:        # HDF5's own message: "... errno = 27, error message = ..."
            m = re.search(r"errno = (\d+)", str(e))
            code = int(m.group(1)) if m else None
        what = f"[Errno {code}] {os.strerror(code)}" if code else _first_line(e)
        if what.startswith(self.path + ": "):
            what = what[len(self.path) + 2:]
        self._failed = DumpWriteError(f"{self.path}: write failed ({what[:300]})")
        if not _claimed_only(e):
            self._freeze()
        return self._failed

    def _freeze(self) -> None:
        self._frozen = True
        null = -1
        try:
            null = os.open(os.devnull, os.O_RDWR)
            fds = [self._fd] if self._fd >= 0 else []
            try:
                fd = self._f.id.get_vfd_handle()
                if isinstance(fd, int) and fd >= 0:
                    fds.append(fd)
            except Exception:  # noqa: BLE001 - not a POSIX file driver: nothing to point away
                pass
            for fd in fds:      # (dup2, not close: another thread may still pwrite to it)
                os.dup2(null, fd)
        except OSError:
            pass
        finally:
            if null >= 0:
                os.close(null)
        self.release_reserve()

    @property
    def failed(self) -> DumpWriteError | None:
        return self._failed

    def _write_catalog(self, n: int, rows: list[str]) -> None:
        """Catalog rows of index rows n, n+1, ... (in the same flush as those)."""
        cat = self._catalog
        if cat is None:
            if n:
                self._cat_on = False
                return
            cat = self._catalog = new_table(self._f, S.CATALOG_PATH, _STR)
        if cat.shape[0] != n:          # out of step: stop (readers then walk the groups)
            self._cat_on = False
            return
        cat.resize((n + len(rows),))
        cat[n:] = np.array(rows, dtype=object)

    # ---- disk full --------------------------------------------------------------------
    def _make_reserve(self, nbytes: int) -> str | None:
        """Hold some disk space in a side file, given back when a write fails with ENOSPC
        so that the final metadata flush can still succeed and the file stays readable."""
        if nbytes <= 0:
            return None
        d, base = os.path.split(os.path.abspath(self.path))
        reserve = os.path.join(d, f".{base}.reserve")
        try:
            st = os.statvfs(d)
            nbytes = min(nbytes, st.f_bavail * st.f_frsize // 8)
            if nbytes <= 0:
                return None
            fd = os.open(reserve, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.posix_fallocate(fd, 0, nbytes)
            finally:
                os.close(fd)
        except (OSError, AttributeError):
            try:
                os.unlink(reserve)
            except OSError:
                pass
            return None
        return reserve

    def release_reserve(self) -> None:
        if self._reserve is not None:
            try:
                os.unlink(self._reserve)
            except OSError:
                pass
            self._reserve = None

    @property
    def file(self) -> h5py.File:
        return self._f

    def close(self, complete: bool = True) -> None:
        """Flush, mark `complete`, close. After a failed write (fail()) the file is left as
        its last good flush wrote it, and this raises that failure's DumpWriteError."""
        if not self._f.id.valid:
            self.release_reserve()
            return
        if not complete:       # after a failure: give the space back first
            self.release_reserve()
        try:
            if not self._frozen:
                if self._failed is not None:
                    self.release_reserve()  # (room for the last flush, claimed first)
                self.flush(final=True)
                try:
                    rewrite_scalar_attr(self._f, S.ROOT_COMPLETE, bool(complete))
                    self._claim_to_eoa()
                except (OSError, RuntimeError) as e:
                    raise self.fail(e) from e
            if self._failed is not None:
                raise self._failed
        finally:
            try:
                self._f.close()
            except (OSError, RuntimeError):
                pass
            if not self._frozen:
                self._trim_headroom()
            self.release_reserve()
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(complete=exc_type is None)

