"""Write dump files: numpy arrays and Python values in, the documented layout out.

Torch-free on purpose: the dumper's background thread, golden replay, `accucmp
extract` and the tests all write through this one class, so the layout lives in
one place. The file is written through (never held in RAM) and flushed at least
every `flush_interval` seconds, so a crash leaves it readable up to the last flush.

The concerns around it have their own modules: the HDF5 objects it makes
(h5objects.py), the catalog it keeps next to the index (catalog.py), what keeps the file
openable after a failed write or a kill (durability.py, its base class).

Why ~460 lines: DumpWriter is one state machine over one open file (the op being
written, its deferred ops whose bytes another thread writes, the index rows not yet
published); its methods share that state and an order (begin_op, values, end_op,
release_ops, flush), and the value writers are the format's layout, each a few lines
that only make sense next to the others.
"""

from __future__ import annotations

import datetime as _dt
import os
import time
from typing import Any, Sequence

import h5py
import numpy as np
from h5py import h5g, h5r, h5s

from .. import schema as S
from ..errors import DumpWriteError
from dumpfile.read.lowlevel import contiguous_offset
from .catalog import NO_VALUE, Catalog
from .direct_io import TensorBytes
from .durability import DurableFile
from .h5objects import (  # noqa: F401 - claim_blocks, pwrite_all: also imported from here
    DIRECT_WRITE_MIN_BYTES, TensorMeta, _STATS_FIELDS, _clear_for_create, _keep_dirty_metadata,
    _new_dataset, _new_ref_dataset, _scalar_type_code, _types, cached_attrs, claim_blocks,
    new_table, pwrite_all, set_attrs)

_STR = h5py.string_dtype("utf-8")
_INDEX_DTYPE = np.dtype([
    ("seqid", np.int64), ("op", _STR), ("phase", np.int8), ("module", _STR), ("grad_fn", _STR),
])


_INPUT_B, _OUTPUT_B = S.INPUT_GROUP.encode(), S.OUTPUT_GROUP.encode()


def _type_attrs(ds, code: int, schema_type: str | None) -> None:
    """A value's Type and schema_type attributes on its new dataset (the same few pairs
    value after value: their attribute items are made once)."""
    st = schema_type or None
    attrs, items = cached_attrs(("type", int(code), st),
                                lambda: {S.ATTR_TYPE: code, S.ATTR_SCHEMA_TYPE: st})
    set_attrs(ds, attrs, fresh=True, items=items)


# Under a file-size limit (RLIMIT_FSIZE: EFBIG, as a full disk), the last flush after a
# failed claim writes the index, catalog and object headers of the ops already written
# past the file's end: a tensor is refused when it would leave less than this below the
# limit, so that flush fits (for ENOSPC the durability reserve file plays that part).
LAST_FLUSH_ROOM = 1 << 20


def _leave_room_for_the_last_flush(end: int) -> None:
    import errno
    import resource

    from .h5objects import SpaceClaimError
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and end + LAST_FLUSH_ROOM > limit:
        raise SpaceClaimError(errno.EFBIG, os.strerror(errno.EFBIG))


class DumpWriter(DurableFile):
    """One open dump file. Not thread-safe: one thread writes (the dumper's writer thread)."""

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
        self._lcpl = f._lcpl       # (h5py's: UTF-8 names, intermediate groups made)
        self._claim_blocks = True      # (reserve_tensor) until the file system says it cannot
        # A second descriptor for raw tensor bytes: os.pwrite releases the GIL, h5py does not,
        # so large writes overlap the user's Python (see write_tensor).
        self._fd = -1
        if direct_write and f.driver == "sec2" and f.userblock_size == 0:
            try:
                self._fd = os.open(self.path, os.O_WRONLY)
            except OSError:
                self._fd = -1
        # large tensors' bytes around the page cache where the file system allows (direct_io.py)
        self._bytes = TensorBytes(self.path, self._fd) if self._fd >= 0 else None
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
        self._cat = Catalog(f, self._index.shape)   # (its table is made at the first flush with rows)
        self._io_ids: tuple = ()       # begin_op's input/ and output/ group ids
        self._op_gid = None            # ... and its op group's
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
            # low level, as create_group(path) makes it (its link creation list makes the
            # /{op} group when missing), without the high-level wrapper's checks
            # (a name that is not ASCII: h5py's own path, which marks it UTF-8)
            g = h5py.Group(h5g.create(self._f.id, path.encode(), lcpl=self._lcpl)) \
                if path.isascii() else self._f.create_group(path)
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
        gid, lcpl = g.id, self._lcpl
        ids = (h5g.create(gid, _INPUT_B, lcpl=lcpl), h5g.create(gid, _OUTPUT_B, lcpl=lcpl))
        self._op_gid = gid
        self._io_ids = ids
        row = (int(seqid), op, S.PHASE_CODES.get(phase, -1), module or "", grad_fn or "", "")
        self._pending_index.append(row)
        self._open_path = path
        self._open_row = row
        self._cat.begin(path)
        return g

    def close(self, complete: bool = True) -> None:
        # after a failed write: the op it was writing is not published by the last flush
        # (its index row was pending since begin_op; the file listed it without its data)
        if self._failed is not None and self._open_path is not None:
            self.abort_op()
        super().close(complete)

    def io_groups(self) -> tuple[h5py.Group, h5py.Group]:
        """The input/ and output/ groups of the op begun last, from the ids begin_op made
        (looking them up by name, `g["input"]`, costs ~30 us each through h5py)."""
        return h5py.Group(self._io_ids[0]), h5py.Group(self._io_ids[1])

    def abort_op(self) -> None:
        """Drop the op begun last and not ended (its write failed): no half-written op remains."""
        path, self._open_path = self._open_path, None
        row, self._open_row = self._open_row, None
        self._cat.reset()
        if path is None:
            return
        # its own row, not the last one: deferred ops released since it began follow it
        for i in range(len(self._pending_index) - 1, -1, -1):
            if self._pending_index[i] is row:
                del self._pending_index[i]
                break
        try:
            if path in self._f:
                del self._f[path]
        except (OSError, RuntimeError, KeyError):
            pass

    def set_order(self, parent: h5py.Group, names: Sequence[str]) -> None:
        """Record argument order: HDF5 lists members alphabetically."""
        # (the same few name lists op after op: their attribute item made once)
        names = tuple(names)
        attrs, items = cached_attrs(("order", names), lambda: {
            "order": np.array(list(names), dtype=object).astype(_STR)})
        set_attrs(parent, attrs, items=items)
        if self._cat.prefix is not None:
            self._cat.set_order(parent.name, names)

    def end_op(self, *, deferred: bool = False) -> None:
        """Finish the op begun last. `deferred`: some of its tensors were reserved with
        reserve_tensor and are written later; the op is published (index row, num_ops)
        only by release_ops, once the caller has written them."""
        path, self._open_path = self._open_path, None
        row, self._open_row = self._open_row, None
        cat = self._cat.finish(self._io_ids)
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
        attrs, items = meta.cached_attrs(S.TYPE_TENSOR)
        set_attrs(ds, attrs, fresh=True, items=items)
        self.bytes_written += data.nbytes
        path = ds.name
        if self._cat.prefix is not None:
            if offset is None and not kw:
                offset = contiguous_offset(ds.id, data.nbytes)
            self._cat.tensor(path, attrs, offset, data.nbytes, data.dtype, data.shape)
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
                _leave_room_for_the_last_flush(offset + nbytes)
                self._claim_blocks = claim_blocks(self._fd, offset, nbytes)
            except OSError as e:
                # the dataset given back: HDF5 allocated its space at the end of the file,
                # past what the disk (or the file-size limit) allows, and the last flush of
                # the ops already written allocates its metadata after it: it failed too
                # and the file kept 0 ops of 17 MB written under a 20 MB limit (issue 32)
                try:
                    del parent[name]
                except (KeyError, OSError, RuntimeError):
                    pass
                raise DumpWriteError(f"{self.path}: write failed ({e})") from e
        attrs, items = meta.cached_attrs(S.TYPE_TENSOR)
        set_attrs(ds, attrs, fresh=True, items=items)
        self.bytes_written += nbytes
        path = ds.name
        if self._cat.prefix is not None:
            self._cat.tensor(path, attrs, offset, nbytes, dtype, shape)
        return path, offset, nbytes

    def write_at(self, offset: int, data: Any) -> None:
        """Write raw bytes (a C-contiguous buffer) at a file offset given by reserve_tensor.
        Thread-safe and GIL-free (os.pwrite on descriptors of its own, O_DIRECT where the
        file system allows: direct_io.py); never touches h5py."""
        self._bytes.write(offset, data)

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
        self._bytes.write(offset, data.reshape(-1).view(np.uint8))
        return ds, offset

    def write_stats(self, parent: h5py.Group, name: str, stats: Sequence[float],
                    meta: TensorMeta) -> str:
        ds = parent.create_dataset(name, data=np.asarray(stats, dtype=np.float64))
        a = meta.attrs(S.TYPE_TENSOR_STATS)
        a[S.ATTR_STATS_FIELDS] = _STATS_FIELDS
        set_attrs(ds, a, fresh=True)
        path = ds.name
        if self._cat.prefix is not None:
            self._cat.tensor(path, a)
        return path

    def write_view(self, parent: h5py.Group, name: str, base_path: str, meta: TensorMeta) -> str:
        """A tensor whose data is (a re-striding of) the stored dataset `base_path`.

        `meta.stride`/`storage_offset` are the view's own; the base dataset's Stride and
        storage_offset attributes say where its elements live in the shared storage.
        """
        # low level: what create_dataset(name, data=f[base_path].ref, dtype=ref_dtype)
        # makes, without opening the base or h5py's wrappers (~0.2 ms a view)
        ref = np.array(h5r.create(self._f.id, base_path.encode("utf-8", "surrogateescape"),
                                  h5r.OBJECT), dtype=h5py.ref_dtype)
        ds = _new_ref_dataset(parent, name, ref)
        attrs, items = meta.cached_attrs(S.TYPE_TENSOR_VIEW)
        set_attrs(ds, attrs, fresh=True, items=items)
        local = self._local_base(parent, base_path)
        set_attrs(ds, {S.ATTR_BASE: local}, fresh=True)
        path = ds.name
        if self._cat.prefix is not None:
            self._cat.tensor(path, {**attrs, S.ATTR_BASE: local})
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
        # (the op being written: its group id from begin_op, no lookup by path)
        gid = self._op_gid if own == self._open_path and self._op_gid is not None \
            else self._f[own].id
        # one link per base, named after its path ("/" is not allowed in a link name)
        link = S.OP_BASE_LINK_PREFIX + base_path.strip("/").replace("/", "|")
        if link.encode() not in gid:
            gid.links.create_hard(link.encode(), self._f.id, base_path.encode(),
                                  lcpl=self._lcpl, lapl=parent._lapl)
        return f"{own}/{link}"

    def link(self, parent: h5py.Group, name: str, existing_path: str) -> str:
        """Hard link: the same stored tensor under a second path (written once)."""
        # low level: the high-level `parent[name] = f[path]` opens the target object first
        parent.id.links.create_hard(name.encode(), self._f.id, existing_path.encode(),
                                    lcpl=parent._lcpl, lapl=parent._lapl)
        path = f"{parent.name}/{name}"
        if self._cat.prefix is not None:
            self._cat.link(path, existing_path)
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
        _type_attrs(ds, code, schema_type)
        path = ds.name
        if self._cat.prefix is not None:
            # what DumpFile.read_value gives back: None, the string, or the number as stored
            try:
                v = None if code == S.TYPE_NONE else value if code == S.TYPE_STRING \
                    else np.asarray(value)[()].item()
            except (TypeError, ValueError, OverflowError):
                v = NO_VALUE
            self._cat.entry(path, {S.CAT_TYPE: code}, v)
        return path

    def write_named(self, parent: h5py.Group, name: str, value: str, type_code: int,
                    extra: dict[str, Any] | None = None, schema_type: str | None = None) -> str:
        """dtype / device / layout / memory_format values, stored by name."""
        if type_code == S.TYPE_SCALAR_TYPE:
            ds = _new_dataset(parent, name, np.asarray(np.int64(S.data_type_code(value))))
            set_attrs(ds, {S.ATTR_DTYPE: value}, fresh=True)
        else:
            ds = _new_dataset(parent, name, np.array(value, dtype=_STR))
        _type_attrs(ds, type_code, schema_type)
        if extra:
            set_attrs(ds, extra)
        path = ds.name
        if self._cat.prefix is not None:
            self._cat.named(path, type_code, value, extra)
        return path

    def create_list(self, parent: h5py.Group, name: str, type_code: int = S.TYPE_TENSOR_LIST,
                    length: int = 0, schema_type: str | None = None) -> h5py.Group:
        """A group whose entries are `{name}_{i}`; the caller fills them."""
        g = parent.create_group(name)
        g.attrs[S.ATTR_TYPE] = type_code
        g.attrs["length"] = int(length)
        if schema_type:
            g.attrs[S.ATTR_SCHEMA_TYPE] = schema_type
        if self._cat.prefix is not None:
            self._cat.entry(g.name, {S.CAT_TYPE: int(type_code), S.CAT_LENGTH: int(length)})
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
        _type_attrs(ds, code, schema_type)
        path = ds.name
        if self._cat.prefix is not None:
            self._cat.entry(path, {S.CAT_TYPE: code}, arr.tolist())
        return path

    # ---- publishing (durability.py flushes) -------------------------------------------
    def _publish_rows(self) -> None:
        """The index rows of the ops finished since the last flush, and their catalog rows,
        into the tables (the flush that follows makes them durable)."""
        if not self._pending_index:
            return
        pending = self._pending_index
        n = self._index.shape[0]
        rows = np.array([r[:5] for r in pending], dtype=_INDEX_DTYPE)
        cat = [r[5] if len(r) > 5 else "" for r in pending] if self._cat.on else None
        self._index.resize((n + len(rows),))
        self._index[n:] = rows
        pending.clear()
        self._unflushed = True
        if cat is not None:
            try:
                self._cat.append(n, cat)
            except (OSError, RuntimeError, ValueError):
                # an accelerator only: stop keeping it (readers then walk the groups);
                # a disk-full condition is reported by the flush after this
                self._cat.on = False

    def _tables(self) -> list:
        """The chunked tables this writer appends to (their new chunks are allocated when
        HDF5 flushes them)."""
        return [self._index, self._cat.table]

    @property
    def file(self) -> h5py.File:
        return self._f
