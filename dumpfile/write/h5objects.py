"""The HDF5 objects a dump is made of, as DumpWriter makes them: property lists, datasets
and attributes through h5py's low-level API (about 3x fewer calls than the high-level
one), TensorMeta and the attributes it becomes, the disk-space claims behind the
flush promise, and the metadata-cache setting that keeps a killed file openable.
Split from writer.py so that DumpWriter holds the file's structure and this module
the objects; the names are re-exported from dumpfile.write.writer.
(~410 lines: each part is a small low-level HDF5 object maker with its error handling;
splitting them further would scatter what one file's objects look like.)
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import resource
import stat
from dataclasses import dataclass, field
from typing import Any, Sequence

import h5py
import numpy as np
from h5py import h5a, h5d, h5p, h5s, h5t

from .. import h5direct
from .. import schema as S
from ..errors import DumpWriteError

_STR = h5py.string_dtype("utf-8")


_SCALAR_SPACE = h5s.create(h5s.SCALAR)
_STATS_FIELDS = ",".join(S.STATS_FIELDS)
# Arrays at least this big are written with os.pwrite (see DumpWriter.write_tensor).
DIRECT_WRITE_MIN_BYTES = 64 << 10
_FILE_TYPES: dict[np.dtype, Any] = {}
_MEM_TYPES: dict[np.dtype, Any] = {}


_STR_ARRAYS: dict[str, np.ndarray] = {}     # interned string attribute values (names, dtypes)
_STR_ITEMS: dict[tuple[str, str], tuple] = {}   # (name, str value) -> its h5direct.attr_item
_SIMPLE_SPACES: dict[tuple, Any] = {}
_NULL_SPACE = h5s.create(h5s.NULL)

def _dcpl(*, early: bool = False):
    """A dataset creation property list as h5py's create_dataset makes it (no time
    stamps; contiguous), or allocated at creation without a fill.

    Not compact, although small datasets are created faster so: compact data lives in
    the object header, a metadata entry, and the larger headers made HDF5's metadata
    cache write entries between flushes; a SIGKILL then left group link tables that
    could not be iterated (measured: the killed-dump test failed 2 of 2 runs)."""
    dcpl = h5p.create(h5p.DATASET_CREATE)
    dcpl.set_obj_track_times(False)
    if early:
        dcpl.set_alloc_time(h5d.ALLOC_TIME_EARLY)
        dcpl.set_fill_time(h5d.FILL_TIME_NEVER)
    return dcpl


_DCPL_PLAIN = _dcpl()
_DCPL_EARLY = _dcpl(early=True)
_TABLE_SPACE = h5s.create_simple((0,), (h5s.UNLIMITED,))

# A table's chunk: about TABLE_CHUNK_BYTES of rows as stored (a power of two, 64-1,024
# rows). HDF5 allocates a chunk whole, at the flush after its first row: the flush claims
# that space first (DurableFile._flush_headroom), so a chunk is also the step by which a
# table's file grows. Chunks of 1,024 statistics rows (168 bytes each: 172 KB) made the
# first flush of a statistics dump claim more than a 256 KB file-size limit allowed, and
# the file kept 0 of the 42 ops that fit (issue 32). Now: statistics rows 128 a chunk
# (21 KB), index rows (57 bytes) 512, catalog rows (16-byte references) 1,024 as before.
TABLE_CHUNK_BYTES = 16 << 10
_TABLE_DCPLS: dict[int, Any] = {}


def stored_row_bytes(tid) -> int:
    """Bytes a row of HDF5 type `tid` takes in the file: a variable-length string or
    sequence is stored as a 16-byte reference to the global heap (its in-memory size,
    what get_size() says, is a pointer's)."""
    cls = tid.get_class()
    if cls == h5t.COMPOUND:
        return sum(stored_row_bytes(tid.get_member_type(i)) for i in range(tid.get_nmembers()))
    if cls == h5t.VLEN or (cls == h5t.STRING and tid.is_variable_str()):
        return 16
    return tid.get_size()


def table_chunk_rows(row_bytes: int) -> int:
    rows = 64
    while rows < 1024 and (rows * 2) * row_bytes <= TABLE_CHUNK_BYTES:
        rows *= 2
    return rows


def new_table(f: h5py.File, path: str, dtype: np.dtype) -> h5py.Dataset:
    """An empty, resizable, chunked (table_chunk_rows) 1-d dataset at `path`, intermediate
    groups made: what create_dataset(path, shape=(0,), maxshape=(None,), chunks=...) makes,
    through the low-level API (~0.2 ms less; each dump file creates two or three)."""
    ftype, _ = _types(np.dtype(dtype))
    rows = table_chunk_rows(stored_row_bytes(ftype))
    dcpl = _TABLE_DCPLS.get(rows)
    if dcpl is None:
        dcpl = _TABLE_DCPLS[rows] = _dcpl()
        dcpl.set_chunk((rows,))
    dsid = h5d.create(f.id, path.encode("utf-8"), ftype, _TABLE_SPACE, dcpl=dcpl, lcpl=f._lcpl)
    return h5py.Dataset(dsid)


def _types(dt: np.dtype) -> tuple[Any, Any]:
    """(file type, memory type) of a numpy dtype, made once."""
    ftype = _FILE_TYPES.get(dt)
    if ftype is None:
        ftype = _FILE_TYPES[dt] = h5t.py_create(dt, logical=True)
        _MEM_TYPES[dt] = h5t.py_create(dt)
    return ftype, _MEM_TYPES[dt]


def _space(shape: tuple) -> Any:
    if not shape:
        return _SCALAR_SPACE
    space = _SIMPLE_SPACES.get(shape)
    if space is None:
        space = _SIMPLE_SPACES[shape] = h5s.create_simple(shape)
    return space


class _NewDataset:
    """A dataset this writer just created through the low-level API: its id and path, and
    h5py's attribute manager only when set_attrs needs the high-level path (rare values)."""

    __slots__ = ("id", "name")

    def __init__(self, dsid: Any, name: str):
        self.id = dsid
        self.name = name

    @property
    def attrs(self) -> h5py.AttributeManager:
        return h5py.Dataset(self.id).attrs


def _new_dataset(parent: h5py.Group, name: str, arr: np.ndarray | None, *,
                 dtype: np.dtype | None = None, shape: tuple | None = None,
                 early: bool = False) -> _NewDataset:
    """Create `parent/name` and write `arr` (None with `dtype`/`shape`: leave it unwritten,
    `early`: allocated now, unfilled) with h5py's low-level API: the high-level
    create_dataset costs ~40 us of Python per dataset, a fifth of an op's writing.
    Same file objects as create_dataset makes; `arr` None without `shape` means
    h5py.Empty (a null dataspace) of `dtype`."""
    dt = np.dtype(dtype if dtype is not None else arr.dtype)
    ftype, mtype = _types(dt)
    if arr is None and shape is None:
        space, dcpl = _NULL_SPACE, _DCPL_PLAIN
    else:
        space = _space(tuple(shape if shape is not None else arr.shape))
        dcpl = _DCPL_EARLY if early else _DCPL_PLAIN
    dsid = h5d.create(parent.id, name.encode("utf-8", "surrogateescape"), ftype, space,
                      dcpl=dcpl, lcpl=parent._lcpl)
    if arr is not None and arr.size:
        dsid.write(h5s.ALL, h5s.ALL, np.asarray(arr, order="C"), mtype=mtype)
    return _NewDataset(dsid, f"{parent.name}/{name}")


# an object reference (a view's dataset): its file and memory types, made once (not
# through _types: numpy dtypes compare equal without their metadata, so h5py's ref_dtype
# and its string dtype are one key there)
_REF_FTYPE = h5t.py_create(h5py.ref_dtype, logical=True)
_REF_MTYPE = h5t.py_create(h5py.ref_dtype)


def _new_ref_dataset(parent: h5py.Group, name: str, ref: np.ndarray) -> _NewDataset:
    """`parent/name` holding one object reference (a 0-d h5py.ref_dtype array): what
    create_dataset(name, data=ref, dtype=h5py.ref_dtype) makes, through the low-level API."""
    dsid = h5d.create(parent.id, name.encode("utf-8", "surrogateescape"), _REF_FTYPE,
                      _SCALAR_SPACE, dcpl=_DCPL_PLAIN, lcpl=parent._lcpl)
    dsid.write(h5s.ALL, h5s.ALL, ref, mtype=_REF_MTYPE)
    return _NewDataset(dsid, f"{parent.name}/{name}")


def pwrite_all(fd: int, data: Any, offset: int, path: str) -> None:
    """All of a C-contiguous buffer at `offset` (os.pwrite may write less than asked)."""
    view = memoryview(data).cast("B")
    written = 0
    try:
        while written < len(view):
            written += os.pwrite(fd, view[written:], offset + written)
    except OSError as e:    # disk full surfaces here
        raise DumpWriteError(f"{path}: write failed ({e})") from e


def _attr_items(attrs: dict[str, Any]) -> tuple[list, list[str], list[str]]:
    """What h5direct.create_attrs takes for the attributes of `attrs` it can write (str,
    native numbers and arrays of them; None values skipped), and the others: (key, array)
    for h5py's low-level create, (key, None) for its high-level `attrs[k] = v`.
    Returns (items, their keys, the others)."""
    fast: list[tuple] = []
    keys: list[str] = []
    slow: list[tuple[str, Any]] = []
    for k, v in attrs.items():
        if v is None:
            continue
        if type(v) is str:
            # (an op's name, phase, module path...: the same few (name, value) pairs)
            item = _STR_ITEMS.get((k, v))
            if item is not None:
                fast.append(item)
                keys.append(k)
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
                slow.append((k, None))
                continue
        ftype, mtype = _types(arr.dtype)
        if arr.dtype.kind == "O":
            text = h5direct.string_value(arr)
            if text is not None:
                item = h5direct.attr_item(k.encode(), ftype, None, _space(arr.shape), text)
                if type(v) is str:
                    if len(_STR_ITEMS) >= 8192:
                        _STR_ITEMS.clear()
                    _STR_ITEMS[(k, v)] = item
                fast.append(item)
                keys.append(k)
                continue
        elif arr.dtype.isnative and arr.dtype.kind in "biuf":
            fast.append(h5direct.attr_item(k.encode(), ftype, mtype, _space(arr.shape),
                                           np.asarray(arr, order="C")))
            keys.append(k)
            continue
        slow.append((k, np.asarray(arr, order="C")))
    return fast, keys, slow


def set_attrs(obj: h5py.HLObject, attrs: dict[str, Any], *, fresh: bool = False,
              items: tuple | None = None) -> None:
    """Create new attributes on a fresh object through h5py's low-level API.

    h5py's `attrs[k] = v` creates each attribute under a temporary name and renames
    it (safe for overwriting); on a new object that is pure overhead and made
    attribute writes the dumper's largest cost. Values: str, bool, int, float, arrays.
    Existing names fall back to the high-level path (overwrite semantics); `fresh=True`
    promises the object was just created by this writer and skips that check.
    `items`: _attr_items(attrs), made earlier (cached_attrs: the same attributes on
    object after object); only with `fresh`.
    """
    oid = obj.id
    if items is None:
        items = _attr_items(attrs)
    fast, keys, slow = items
    if not fresh:
        old = {i for i, (name, *_) in enumerate(fast) if h5a.exists(oid, name)}
        if old:
            fast = [it for i, it in enumerate(fast) if i not in old]
            keys, old_keys = [k for i, k in enumerate(keys) if i not in old], \
                [k for i, k in enumerate(keys) if i in old]
            slow = [(k, None) for k in old_keys] + list(slow)
    for k, arr in slow:
        name = k.encode()
        if arr is None or (not fresh and h5a.exists(oid, name)):
            obj.attrs[k] = attrs[k]         # (overwrite semantics, or a value h5py converts)
            continue
        ftype, mtype = _types(arr.dtype)
        aid = h5a.create(oid, name, ftype, _space(arr.shape))
        if arr.size:
            aid.write(arr, mtype=mtype)
    if fast:
        # (h5py's low-level calls cost about twice HDF5's own work per attribute)
        for i in h5direct.create_attrs(oid, fast):
            obj.attrs[keys[i]] = attrs[keys[i]]   # h5py: overwrites a half-made one, or raises


# attributes written object after object (a tensor's eight, a value's Type and
# schema_type): their h5direct items made once per distinct set
_CACHED_ATTRS: dict[tuple, tuple[dict, tuple]] = {}
_MAX_CACHED_ATTRS = 8192


def cached_attrs(key: tuple, make) -> tuple[dict, tuple]:
    """(attrs, set_attrs items) for `key`, `make()` giving the attrs the first time.
    The dict is shared: callers must not change it."""
    got = _CACHED_ATTRS.get(key)
    if got is None:
        attrs = make()
        if len(_CACHED_ATTRS) >= _MAX_CACHED_ATTRS:
            _CACHED_ATTRS.clear()
        got = _CACHED_ATTRS[key] = (attrs, _attr_items(attrs))
    return got


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
    format_type: int | None = None   # None: from the strides (format_type_of)
    uninitialized: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def cached_attrs(self, type_code: int) -> tuple[dict[str, Any], tuple | None]:
        """attrs(type_code) and its set_attrs items, made once per distinct tensor
        description (a step's tensors repeat a few shapes and dtypes, and every step
        repeats them). The dict is shared: do not change it."""
        if self.extra:
            return self.attrs(type_code), None
        key = ("tensor", type_code, self.dtype, tuple(self.shape), tuple(self.stride),
               self.storage_offset, self.device, self.format_type, bool(self.uninitialized))
        return cached_attrs(key, lambda: self.attrs(type_code))

    def attrs(self, type_code: int) -> dict[str, Any]:
        # Stride describes the stored data (C order, logical shape): the original msaccucmp
        # applies as_strided(data, Stride) to golden tensors, so live strides there gave
        # garbage for W.t() and channels_last tensors. The live strides, needed to rebuild
        # views and for replay, go into live_stride when they differ (format 1.5).
        stored = S.contiguous_strides(self.shape) if self.stride else ()
        fmt = self.format_type if self.format_type is not None else format_type_of(self.shape, self.stride)
        a = {
            S.ATTR_TYPE: type_code,
            S.ATTR_DATA_TYPE: S.data_type_code(self.dtype),
            S.ATTR_DEVICE_TYPE: S.device_type_code(self.device),
            S.ATTR_FORMAT_TYPE: int(fmt),
            S.ATTR_STRIDE: np.asarray(stored, dtype=np.int64),
            S.ATTR_SHAPE: np.asarray(self.shape, dtype=np.int64),
            S.ATTR_DTYPE: self.dtype,
            S.ATTR_DEVICE: self.device,
        }
        if self.stride and tuple(self.stride) != stored:
            a[S.ATTR_LIVE_STRIDE] = np.asarray(self.stride, dtype=np.int64)
        if self.storage_offset:        # absent means 0
            a[S.ATTR_STORAGE_OFFSET] = int(self.storage_offset)
        if self.uninitialized:
            a[S.ATTR_UNINITIALIZED] = True
        a.update(self.extra)
        return a


def format_type_of(shape: Sequence[int], stride: Sequence[int]) -> int:
    """The ACL FormatType a tensor's memory format resembles: NHWC for a 4-d channels_last
    tensor that is not also row-major (torch's own test: dims of size 1 do not count),
    ND otherwise. NPU private formats are not visible from here."""
    if len(shape) != 4 or len(stride) != 4:
        return S.FORMAT_ND
    n, c, h, w = (int(x) for x in shape)
    want = {0: h * w * c, 1: 1, 2: w * c, 3: c}        # channels_last strides, NHWC order

    def matches(expect: dict[int, int]) -> bool:
        return all(int(shape[d]) == 1 or int(stride[d]) == expect[d] for d in range(4))

    if not matches(want):
        return S.FORMAT_ND
    rowmajor = dict(enumerate(S.contiguous_strides(shape)))
    return S.FORMAT_ND if matches(rowmajor) else S.FORMAT_NHWC


def _scalar_type_code(value: Any, schema_type: str | None) -> int:
    """The original's Type code for a non-tensor value, refined by the schema type."""
    st = (schema_type or "").replace(" ", "")
    if value is None:
        return S.TYPE_NONE
    if isinstance(value, bool):
        return S.TYPE_BOOL
    if isinstance(value, (int, float)):
        if st == "Scalar":
            return S.TYPE_SCALAR
        if st == "Scalar?":
            return S.TYPE_OPTIONAL_SCALAR
        if isinstance(value, int):
            return S.TYPE_OPTIONAL_INT if st.endswith("?") else S.TYPE_INT
        return S.TYPE_OPTIONAL_DOUBLE if st.endswith("?") else S.TYPE_DOUBLE
    if isinstance(value, complex):
        return S.TYPE_COMPLEX
    if isinstance(value, str):
        return S.TYPE_STRING
    raise TypeError(f"no Type code for {type(value).__name__}")


_libc_fallocate: Any = None
_FALLOC_FL_KEEP_SIZE = 1

# Fault injection for the durability tests (a slow disk, without root or strace): seconds
# slept at every maybe_flush (once per op) by whatever writes the file, thread or child
# process. Read when the module is imported.
try:
    _TEST_WRITE_DELAY_S = float(os.environ.get("DUMPFILE_TEST_WRITE_DELAY_S") or 0)
except ValueError:
    _TEST_WRITE_DELAY_S = 0.0


def claim_blocks(fd: int, offset: int, nbytes: int, *, keep_size: bool = False) -> bool:
    """Allocate the file's blocks for [offset, offset + nbytes) now (Linux fallocate(2),
    mode 0: no data written, an unwritten extent on ext4/xfs). Raises OSError (ENOSPC:
    disk full). Returns False where the platform or file system has no such call (then
    nothing was claimed and the caller need not ask again). Not posix_fallocate: glibc
    emulates that by writing a byte per block where the file system cannot allocate.
    `keep_size`: FALLOC_FL_KEEP_SIZE, the blocks without the file growing (DurableFile.
    close: see there why)."""
    global _libc_fallocate
    if _libc_fallocate is None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fn = libc.fallocate64 if hasattr(libc, "fallocate64") else libc.fallocate
            fn.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
            fn.restype = ctypes.c_int
            _libc_fallocate = fn
        except (OSError, AttributeError):
            _libc_fallocate = False
    if _libc_fallocate is False or nbytes <= 0:
        return _libc_fallocate is not False
    if keep_size:
        # (KEEP_SIZE skips the kernel's check of the file-size limit that mode 0 makes)
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY and offset + nbytes > limit:
            raise SpaceClaimError(errno.EFBIG, os.strerror(errno.EFBIG))
    if _libc_fallocate(fd, _FALLOC_FL_KEEP_SIZE if keep_size else 0, offset, nbytes) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.ENODEV):
        return False
    raise SpaceClaimError(err, os.strerror(err))


class SpaceClaimError(OSError):
    """claim_blocks found no room: nothing was written, HDF5's state is intact."""


def _clear_for_create(path: str) -> None:
    """Make way for a new file at `path`.

    Refuses when an existing file there is open in HDF5 (a reader here or in another
    process holds its lock): HDF5 opens with O_TRUNC and only then finds the lock taken,
    so the reader's file would be lost, not kept. Otherwise an existing regular file with
    no other name is unlinked rather than truncated: truncating a freshly written file
    waits for its dirty pages (ext4: ~16 ms per 20 MB, seconds for a dump of gigabytes,
    paid at block entry by every re-run that dumps to the same path), unlinking does not.
    A symlink or a file with other hard links is truncated through, as before."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return                      # absent (or unreadable: h5py reports that below)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
    except BlockingIOError:
        raise DumpWriteError(f"{path}: cannot create dump file (it is open elsewhere, "
                             "e.g. by a reader; close it first)") from None
    except OSError:
        pass                        # no flock on this file system: nothing to tell
    finally:
        os.close(fd)
    try:
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
            os.unlink(path)
    except OSError:
        pass                        # (e.g. a read-only directory): HDF5 truncates it


# HDF5's metadata cache, fixed at this size: dirty metadata is written at flushes only.
# With the default (2 MB, grown on demand, 30% kept clean) HDF5 wrote dirty entries
# between flushes to make room; on disk they then pointed at objects, or past the end of
# allocation the superblock records, that only the next flush would write, and a file
# killed or failed between two flushes did not open ("addr overflow", "Link iteration
# failed"). Clean entries are still evicted, least recently used first; the entries made
# dirty since the last flush are the most recently used.
METADATA_CACHE_BYTES = 32 << 20


def _keep_dirty_metadata(f: h5py.File) -> None:
    try:
        c = f.id.get_mdc_config()
        c.set_initial_size = True
        c.initial_size = c.max_size = METADATA_CACHE_BYTES
        c.min_size = min(c.min_size, METADATA_CACHE_BYTES)
        c.min_clean_fraction = 0.0
        c.incr_mode = 0             # H5C_incr__off
        c.flash_incr_mode = 0       # H5C_flash_incr__off
        c.decr_mode = 0             # H5C_decr__off
        f.id.set_mdc_config(c)
    except Exception:  # noqa: BLE001 - an older HDF5: its defaults (files open after a clean close)
        pass


def _claimed_only(e: BaseException) -> bool:
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, SpaceClaimError):
            return True
        e = e.__cause__ or e.__context__
    return False


def _os_error(e: BaseException) -> OSError | None:
    """The OSError with an errno in `e`'s chain (h5py and our pwrite wrap them)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno:
            return e
        e = e.__cause__ or e.__context__
    return None
