"""Write dump files: numpy arrays and Python values in, the documented layout out.

Torch-free on purpose: the dumper's background thread, golden replay, `accucmp
extract` and the tests all write through this one class, so the layout lives in
one place. The file is written through (never held in RAM) and flushed at least
every `flush_interval` seconds, so a crash leaves it readable up to the last flush.
"""

from __future__ import annotations

import datetime as _dt
import os
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import h5py
import numpy as np
from h5py import h5a, h5d, h5g, h5p, h5s, h5t

from . import schema as S
from .errors import DumpWriteError

_STR = h5py.string_dtype("utf-8")
_INDEX_DTYPE = np.dtype([
    ("seqid", np.int64), ("op", _STR), ("phase", np.int8), ("module", _STR), ("grad_fn", _STR),
])


_SCALAR_SPACE = h5s.create(h5s.SCALAR)
_STATS_FIELDS = ",".join(S.STATS_FIELDS)
# Arrays at least this big are written with os.pwrite (see DumpWriter.write_tensor).
DIRECT_WRITE_MIN_BYTES = 64 << 10
_FILE_TYPES: dict[np.dtype, Any] = {}
_MEM_TYPES: dict[np.dtype, Any] = {}


_STR_ARRAYS: dict[str, np.ndarray] = {}     # interned string attribute values (names, dtypes)
_SIMPLE_SPACES: dict[tuple, Any] = {}


def pwrite_all(fd: int, data: Any, offset: int, path: str) -> None:
    """All of a C-contiguous buffer at `offset` (os.pwrite may write less than asked)."""
    view = memoryview(data).cast("B")
    written = 0
    try:
        while written < len(view):
            written += os.pwrite(fd, view[written:], offset + written)
    except OSError as e:    # disk full surfaces here
        raise DumpWriteError(f"{path}: write failed ({e})") from e


def set_attrs(obj: h5py.HLObject, attrs: dict[str, Any], *, fresh: bool = False) -> None:
    """Create new attributes on a fresh object through h5py's low-level API.

    h5py's `attrs[k] = v` creates each attribute under a temporary name and renames
    it (safe for overwriting); on a new object that is pure overhead and made
    attribute writes the dumper's largest cost. Values: str, bool, int, float, arrays.
    Existing names fall back to the high-level path (overwrite semantics); `fresh=True`
    promises the object was just created by this writer and skips that check.
    """
    oid = obj.id
    for k, v in attrs.items():
        if v is None:
            continue
        if isinstance(v, str):
            arr = _STR_ARRAYS.get(v)
            if arr is None:
                arr = np.array(v, dtype=_STR)
                if len(_STR_ARRAYS) < 4096:
                    _STR_ARRAYS[v] = arr
        else:
            arr = np.asarray(v)
            if arr.dtype.kind == "U" or (arr.dtype.kind == "O"
                                         and h5py.check_string_dtype(arr.dtype) is None):
                obj.attrs[k] = v
                continue
        name = k.encode()
        if not fresh and h5a.exists(oid, name):
            obj.attrs[k] = v
            continue
        dt = arr.dtype
        ftype = _FILE_TYPES.get(dt)
        if ftype is None:
            ftype = _FILE_TYPES[dt] = h5t.py_create(dt, logical=True)
            _MEM_TYPES[dt] = h5t.py_create(dt)
        if arr.ndim == 0:
            space = _SCALAR_SPACE
        else:
            space = _SIMPLE_SPACES.get(arr.shape)
            if space is None:
                space = _SIMPLE_SPACES[arr.shape] = h5s.create_simple(arr.shape)
        aid = h5a.create(oid, name, ftype, space)
        if arr.size:
            aid.write(np.asarray(arr, order="C"), mtype=_MEM_TYPES[dt])


def rewrite_scalar_attr(obj: h5py.HLObject, key: str, value: Any) -> None:
    """`obj.attrs[key] = value` for an int or bool scalar. An attribute of that name,
    shape and type is written in place: h5py's `attrs[k] = v` re-creates it under a
    temporary name and renames it, ~4x the time (root counters rewritten at every flush
    and close). Anything else takes the high-level path."""
    arr = np.asarray(value)
    name = key.encode()
    oid = obj.id
    if arr.ndim == 0 and arr.dtype.kind in "bi" and h5a.exists(oid, name):
        aid = h5a.open(oid, name)
        if aid.shape == () and aid.dtype == arr.dtype:
            aid.write(np.ascontiguousarray(arr))
            return
    obj.attrs[key] = value


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


@dataclass
class TensorMeta:
    """What the file says about a tensor besides its values."""

    dtype: str                       # torch dtype name ("bfloat16")
    shape: tuple[int, ...]
    stride: tuple[int, ...] = ()
    storage_offset: int = 0
    device: str = "cpu"
    format_type: int = S.FORMAT_ND
    uninitialized: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def attrs(self, type_code: int) -> dict[str, Any]:
        a = {
            S.ATTR_TYPE: type_code,
            S.ATTR_DATA_TYPE: S.data_type_code(self.dtype),
            S.ATTR_DEVICE_TYPE: S.device_type_code(self.device),
            S.ATTR_FORMAT_TYPE: int(self.format_type),
            S.ATTR_STRIDE: np.asarray(self.stride, dtype=np.int64),
            S.ATTR_SHAPE: np.asarray(self.shape, dtype=np.int64),
            S.ATTR_DTYPE: self.dtype,
            S.ATTR_DEVICE: self.device,
        }
        if self.storage_offset:        # absent means 0
            a[S.ATTR_STORAGE_OFFSET] = int(self.storage_offset)
        if self.uninitialized:
            a[S.ATTR_UNINITIALIZED] = True
        a.update(self.extra)
        return a


def _scalar_type_code(value: Any, schema_type: str | None) -> int:
    """The original's Type code for a non-tensor value, refined by the schema type."""
    st = (schema_type or "").replace(" ", "")
    if value is None:
        return S.TYPE_NONE
    if isinstance(value, bool):
        return S.TYPE_BOOL
    if isinstance(value, int):
        if st == "Scalar":
            return S.TYPE_SCALAR
        if st == "Scalar?":
            return S.TYPE_OPTIONAL_SCALAR
        return S.TYPE_OPTIONAL_INT if st.endswith("?") else S.TYPE_INT
    if isinstance(value, float):
        if st == "Scalar":
            return S.TYPE_SCALAR
        if st == "Scalar?":
            return S.TYPE_OPTIONAL_SCALAR
        return S.TYPE_OPTIONAL_DOUBLE if st.endswith("?") else S.TYPE_DOUBLE
    if isinstance(value, complex):
        return S.TYPE_COMPLEX
    if isinstance(value, str):
        return S.TYPE_STRING
    raise TypeError(f"no Type code for {type(value).__name__}")


class DumpWriter:
    """One open dump file. Not thread-safe: one thread writes (the dumper's writer thread)."""

    def __init__(self, path: str | os.PathLike, *, mode: str = S.MODE_DUMP,
                 root_attrs: dict[str, Any] | None = None, flush_interval: float = 1.0,
                 append: bool = False, direct_write: bool = True,
                 reserve_bytes: int = 4 << 20):
        if mode not in S.MODES:
            raise ValueError(f"mode must be one of {S.MODES}, got {mode!r}")
        self.path = os.fspath(path)
        self.flush_interval = flush_interval
        try:
            self._f = h5py.File(self.path, "a" if append else "w")
        except OSError as e:
            raise DumpWriteError(f"{self.path}: cannot create dump file ({e})") from e
        f = self._f
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
        if not append or S.ROOT_FORMAT not in f.attrs:
            f.attrs[S.ROOT_FORMAT] = S.FORMAT_NAME
            f.attrs[S.ROOT_FORMAT_VERSION] = S.FORMAT_VERSION
            f.attrs[S.ROOT_MODE] = mode
            f.attrs[S.ROOT_CREATED] = _dt.datetime.now().isoformat(timespec="seconds")
            f.attrs[S.ROOT_NUM_OPS] = 0
        f.attrs[S.ROOT_COMPLETE] = False
        for k, v in (root_attrs or {}).items():
            if v is not None:
                f.attrs[k] = v
        if S.INDEX_PATH in f:
            self._index = f[S.INDEX_PATH]
        else:
            self._index = f.create_dataset(S.INDEX_PATH, shape=(0,), maxshape=(None,),
                                           dtype=_INDEX_DTYPE, chunks=(1024,))
        self._pending_index: list[tuple] = []
        # ops ended with end_op(deferred=True): their tensor bytes are still being written
        # (write_at, by another thread); their index rows wait here until release_ops, so
        # a flush never publishes an op whose data is not in the file yet
        self._deferred: list[tuple[tuple, str]] = []
        self.num_ops = int(f.attrs.get(S.ROOT_NUM_OPS, 0))
        self.bytes_written = 0
        self._last_flush = time.monotonic()
        f.flush()

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
        for sub in (S.INPUT_GROUP, S.OUTPUT_GROUP):   # low level: no h5py object wrappers
            h5g.create(g.id, sub.encode(), lcpl=g._lcpl)
        self._pending_index.append(
            (int(seqid), op, S.PHASE_CODES.get(phase, -1), module or "", grad_fn or ""))
        self._open_path = path
        return g

    def abort_op(self) -> None:
        """Drop the op begun last and not ended (its write failed): no half-written op remains."""
        path, self._open_path = self._open_path, None
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

    def end_op(self, *, deferred: bool = False) -> None:
        """Finish the op begun last. `deferred`: some of its tensors were reserved with
        reserve_tensor and are written later; the op is published (index row, num_ops)
        only by release_ops, once the caller has written them."""
        path, self._open_path = self._open_path, None
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
        if self._fd >= 0 and not compression and data.nbytes >= DIRECT_WRITE_MIN_BYTES \
                and data.dtype.isnative:
            ds = self._write_direct(parent, name, data)
        else:
            kw: dict[str, Any] = {}
            if compression and data.size:
                kw = {"compression": compression, "chunks": True}
            ds = parent.create_dataset(name, data=data, **kw)
        set_attrs(ds, meta.attrs(S.TYPE_TENSOR), fresh=True)
        self.bytes_written += data.nbytes
        return ds.name

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
        dcpl = h5p.create(h5p.DATASET_CREATE)
        dcpl.set_alloc_time(h5d.ALLOC_TIME_EARLY)
        dcpl.set_fill_time(h5d.FILL_TIME_NEVER)
        ds = parent.create_dataset(name, shape=shape, dtype=dtype, dcpl=dcpl)
        offset = ds.id.get_offset()
        if offset is None:      # not contiguous after all: let the caller write it through HDF5
            del parent[name]
            return None
        set_attrs(ds, meta.attrs(S.TYPE_TENSOR), fresh=True)
        self.bytes_written += nbytes
        return ds.name, offset, nbytes

    def write_at(self, offset: int, data: Any) -> None:
        """Write raw bytes (a C-contiguous buffer) at a file offset given by reserve_tensor.
        Thread-safe and GIL-free (os.pwrite on a second descriptor); never touches h5py."""
        pwrite_all(self._fd, data, offset, self.path)

    def _write_direct(self, parent: h5py.Group, name: str, data: np.ndarray) -> h5py.Dataset:
        """Contiguous dataset allocated at creation (no fill), bytes written with os.pwrite.

        The bytes land in the file range HDF5 allocated to the dataset; numpy's native
        layout equals the HDF5 type h5py maps it to, so the file is an ordinary dataset.
        """
        dcpl = h5p.create(h5p.DATASET_CREATE)
        dcpl.set_alloc_time(h5d.ALLOC_TIME_EARLY)
        dcpl.set_fill_time(h5d.FILL_TIME_NEVER)
        ds = parent.create_dataset(name, shape=data.shape, dtype=data.dtype, dcpl=dcpl)
        offset = ds.id.get_offset()
        if offset is None:      # not contiguous after all: let HDF5 write it
            ds[...] = data
            return ds
        pwrite_all(self._fd, data.reshape(-1).view(np.uint8), offset, self.path)
        return ds

    def write_stats(self, parent: h5py.Group, name: str, stats: Sequence[float],
                    meta: TensorMeta) -> str:
        ds = parent.create_dataset(name, data=np.asarray(stats, dtype=np.float64))
        a = meta.attrs(S.TYPE_TENSOR_STATS)
        a[S.ATTR_STATS_FIELDS] = _STATS_FIELDS
        set_attrs(ds, a, fresh=True)
        return ds.name

    def write_view(self, parent: h5py.Group, name: str, base_path: str, meta: TensorMeta) -> str:
        """A tensor whose data is (a re-striding of) the stored dataset `base_path`.

        `meta.stride`/`storage_offset` are the view's own; the base dataset's Stride and
        storage_offset attributes say where its elements live in the shared storage.
        """
        base = self._f[base_path]
        ds = parent.create_dataset(name, data=base.ref, dtype=h5py.ref_dtype)
        a = meta.attrs(S.TYPE_TENSOR_VIEW)
        a[S.ATTR_BASE] = base.name
        set_attrs(ds, a, fresh=True)
        return ds.name

    def link(self, parent: h5py.Group, name: str, existing_path: str) -> str:
        """Hard link: the same stored tensor under a second path (written once)."""
        # low level: the high-level `parent[name] = f[path]` opens the target object first
        parent.id.links.create_hard(name.encode(), self._f.id, existing_path.encode(),
                                    lcpl=parent._lcpl, lapl=parent._lapl)
        return f"{parent.name}/{name}"

    def write_value(self, parent: h5py.Group, name: str, value: Any,
                    schema_type: str | None = None) -> str:
        """A non-tensor argument: a small dataset with a Type code."""
        if isinstance(value, (list, tuple)):
            return self._write_list(parent, name, value, schema_type)
        code = _scalar_type_code(value, schema_type)
        if code == S.TYPE_NONE:
            ds = parent.create_dataset(name, data=h5py.Empty("f8"))
        elif code == S.TYPE_STRING:
            ds = parent.create_dataset(name, data=value, dtype=_STR)
        else:
            ds = parent.create_dataset(name, data=value)
        set_attrs(ds, {S.ATTR_TYPE: code, S.ATTR_SCHEMA_TYPE: schema_type or None}, fresh=True)
        return ds.name

    def write_named(self, parent: h5py.Group, name: str, value: str, type_code: int,
                    extra: dict[str, Any] | None = None, schema_type: str | None = None) -> str:
        """dtype / device / layout / memory_format values, stored by name."""
        if type_code == S.TYPE_SCALAR_TYPE:
            ds = parent.create_dataset(name, data=np.int64(S.data_type_code(value)))
            ds.attrs[S.ATTR_DTYPE] = value
        else:
            ds = parent.create_dataset(name, data=value, dtype=_STR)
        ds.attrs[S.ATTR_TYPE] = type_code
        if schema_type:
            ds.attrs[S.ATTR_SCHEMA_TYPE] = schema_type
        for k, v in (extra or {}).items():
            ds.attrs[k] = v
        return ds.name

    def create_list(self, parent: h5py.Group, name: str, type_code: int = S.TYPE_TENSOR_LIST,
                    length: int = 0, schema_type: str | None = None) -> h5py.Group:
        """A group whose entries are `{name}_{i}`; the caller fills them."""
        g = parent.create_group(name)
        g.attrs[S.ATTR_TYPE] = type_code
        g.attrs["length"] = int(length)
        if schema_type:
            g.attrs[S.ATTR_SCHEMA_TYPE] = schema_type
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
        ds = parent.create_dataset(name, data=arr)
        set_attrs(ds, {S.ATTR_TYPE: code, S.ATTR_SCHEMA_TYPE: schema_type or None}, fresh=True)
        return ds.name

    # ---- durability --------------------------------------------------------
    def maybe_flush(self) -> None:
        if time.monotonic() - self._last_flush >= self.flush_interval:
            self.flush()

    def flush(self) -> None:
        """Make every finished op durable: index rows, op count, then HDF5 flush."""
        if self._pending_index:
            n = self._index.shape[0]
            rows = np.array(self._pending_index, dtype=_INDEX_DTYPE)
            self._index.resize((n + len(rows),))
            self._index[n:] = rows
            self._pending_index.clear()
        rewrite_scalar_attr(self._f, S.ROOT_NUM_OPS, self.num_ops)
        try:
            self._f.flush()
        except (OSError, RuntimeError) as e:  # disk full surfaces here (h5py: RuntimeError)
            raise DumpWriteError(f"{self.path}: write failed ({_first_line(e)})") from e
        self._last_flush = time.monotonic()

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
        if not self._f.id.valid:
            self.release_reserve()
            return
        if not complete:       # after a failure: give the space back first
            self.release_reserve()
        try:
            self.flush()
            rewrite_scalar_attr(self._f, S.ROOT_COMPLETE, bool(complete))
        except (OSError, RuntimeError) as e:
            raise DumpWriteError(f"{self.path}: write failed ({_first_line(e)})") from e
        finally:
            try:
                self._f.close()
            except (OSError, RuntimeError):
                pass
            self.release_reserve()
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(complete=exc_type is None)

