"""Recorded tensors as torch tensors for load-replay: read when needed, shared, let go.

A tensor the dump stores once (hard links, views of one base) is handed to every op that
recorded it as the same torch tensor, so the replay's own dump stores it once too.
Contiguous datasets are read without h5py: each one viewed zero-copy in its own
copy-on-write mapping of its bytes in the load file (unmapped when the last tensor viewing
it goes), or read with os.preadv (h5py holds the GIL and its own lock, which the dump's
writer thread wants, for a whole dataset read). A prefetch thread may read ahead of the
model (`prefetch`); the model's thread then finds the tensor by a dict lookup or waits for
the read in flight.

Memory is bounded by the ops in flight, not by the recording: `plan` counts, from the
index, which recorded ops read each stored tensor; the cache keeps a tensor only while a
recorded op still to come reads it (`release` after each matched op), and holds at most
`budget` bytes (read ahead, and kept for a later op: a weight read in the forward and
again in the backward). Over the budget, the tensor whose next reader is farthest away goes
first (it is read again from the file, the page cache, if that op comes).
"""

from __future__ import annotations

import bisect
import mmap
import os
import threading
from typing import Any, Iterable

import numpy as np
import torch

from dumpfile import schema as S
from dumpfile.read.catalog import stored_at
from dumpfile.read.lowlevel import contiguous_offset
from dumpfile.read.reader import DumpFile, ValueRecord

from .recorded import NotReplayable, _base_storage, non_overlapping, tensor_from_record

DEFAULT_BUDGET = 128 << 20


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def tensor_leaves(inputs: dict[str, ValueRecord]) -> Iterable[ValueRecord]:
    """The tensor records of an op's inputs (lists one level deep)."""
    for rec in inputs.values():
        for leaf in (rec.children if rec.is_list else (rec,)):
            if leaf.is_tensor:
                yield leaf


class RecordedTensors:
    """The recorded tensors of one load file: read on demand (or ahead), kept while a
    recorded op still to come reads them, at most `budget` bytes at once (module doc)."""

    def __init__(self, budget: int = DEFAULT_BUDGET):
        self.budget = budget
        self._file: DumpFile | None = None
        self._cache: dict[Any, torch.Tensor] = {}
        self._by_path: dict[str, Any] = {}              # dataset path -> its key (records without ident)
        self._held = 0                                   # bytes in _cache
        self._peak_held = 0
        self._cache_lock = threading.RLock()
        self._bases: dict[Any, tuple[torch.Tensor, int]] = {}   # view bases: one storage each
        self._base_bytes = 0
        self._uses: dict[Any, list[int]] = {}   # ident -> indices of the recorded ops still to read it
        self._base_users: dict[Any, int] = {}   # dataset identity (ident[0]) -> idents in _uses
        self._planned = False
        self._frontier = 0                      # the index of the last recorded op matched
        self._inflight: dict[Any, threading.Event] = {}   # idents the prefetch thread is reading
        self._reader_thread: threading.Thread | None = None
        self._fd = -1                           # raw reads of contiguous datasets (GIL-free pread)
        self._size = 0
        self._mapping = False                   # contiguous datasets are mapped (zero-copy)

    def open(self, file: DumpFile, path: str) -> None:
        self._file = file
        try:
            self._fd = os.open(path, os.O_RDONLY)
            self._size = os.fstat(self._fd).st_size
            self._mapping = self._size > 0 and hasattr(mmap, "ACCESS_COPY")
        except (OSError, ValueError):
            self._mapping = False
            if self._fd >= 0:
                os.close(self._fd)
            self._fd = -1

    def close(self) -> None:
        with self._cache_lock:
            self._cache.clear()
            self._by_path.clear()
            self._bases.clear()
            self._uses.clear()
            self._base_users.clear()
            self._held = self._base_bytes = 0
        self._file = None
        if self._fd >= 0:
            # tensors handed to the model (and kept by autograd) keep their own mappings
            os.close(self._fd)
            self._fd = -1
        self._mapping = False

    # ---- lifetimes -----------------------------------------------------------------
    def plan(self, entries: Iterable[tuple[int, dict[str, ValueRecord]]]) -> None:
        """Which recorded ops read each stored tensor: (op index, its input records), in
        index order. Without a plan every tensor read is cached (up to the budget)."""
        uses: dict[Any, list[int]] = {}
        for index, inputs in entries:
            for leaf in tensor_leaves(inputs):
                ident = getattr(leaf, "ident", None)
                if ident is not None:
                    lst = uses.setdefault(ident, [])
                    if not lst or lst[-1] != index:
                        lst.append(index)
        base_users: dict[Any, int] = {}
        for ident in uses:
            base_users[ident[0]] = base_users.get(ident[0], 0) + 1
        with self._cache_lock:
            self._uses = uses
            self._base_users = base_users
            self._planned = True

    def release(self, index: int, inputs: dict[str, ValueRecord]) -> None:
        """Recorded op `index` has taken its inputs: a tensor no later recorded op reads is
        dropped (the op's arguments hold it while it runs)."""
        with self._cache_lock:
            self._frontier = max(self._frontier, index)
            for leaf in tensor_leaves(inputs):
                ident = getattr(leaf, "ident", None)
                lst = self._uses.get(ident)
                if lst is None:
                    continue
                i = bisect.bisect_left(lst, index)
                if i < len(lst) and lst[i] == index:
                    del lst[i]
                if not lst:
                    del self._uses[ident]
                    self._drop(ident)
                    n = self._base_users.get(ident[0], 1) - 1
                    self._base_users[ident[0]] = n
                    if n <= 0:
                        self._drop_base(ident[0])

    def _next_use(self, key: Any) -> float:
        """The index of the next recorded op (at or after the frontier) that reads `key`;
        inf when none does (an op the live run skipped, or none at all)."""
        lst = self._uses.get(key)
        if not lst:
            return float("inf")
        i = bisect.bisect_left(lst, self._frontier)
        return lst[i] if i < len(lst) else float("inf")

    def _drop(self, key: Any) -> None:
        t = self._cache.pop(key, None)
        if t is not None:
            self._held -= _nbytes(t)

    def _drop_base(self, base_key: Any) -> None:
        """A view base no recorded tensor still to come shares (its dataset's identity)."""
        got = self._bases.pop(base_key, None)
        if got is not None:
            self._base_bytes -= _nbytes(got[0])

    def _keep(self, key: Any, t: torch.Tensor) -> torch.Tensor:
        """Cache `t` under `key` when a recorded op still to come reads it, within the
        budget (the farthest next reader's tensor goes first, possibly `t` itself)."""
        with self._cache_lock:
            old = self._cache.get(key)
            if old is not None:
                return old
            if self._planned and key not in self._uses:
                return t                                 # no later op reads it
            nbytes = _nbytes(t)
            if nbytes > self.budget:
                return t
            mine = self._next_use(key)
            while self._held + nbytes > self.budget and self._cache:
                victim = max(self._cache, key=self._next_use)
                if self._next_use(victim) <= mine:
                    return t                             # everything held is needed sooner
                self._drop(victim)
            self._cache[key] = t
            self._held += nbytes
            self._peak_held = max(self._peak_held, self._held)
            return t

    @property
    def held_bytes(self) -> int:
        return self._held

    @property
    def peak_held_bytes(self) -> int:
        return self._peak_held

    def prefetch(self, rec: ValueRecord) -> int:
        """Read one recorded tensor into the cache (from the prefetch thread); the bytes read."""
        self._reader_thread = threading.current_thread()
        ident = getattr(rec, "ident", None)
        if ident is None or ident in self._cache:
            return 0
        if self._planned and ident not in self._uses:
            return 0
        done = self._inflight[ident] = threading.Event()
        try:
            t = self.load(rec)
            return _nbytes(t)
        finally:
            done.set()
            self._inflight.pop(ident, None)

    def load(self, rec: ValueRecord) -> torch.Tensor:
        """A recorded tensor (recorded dtype, CPU), cached by its identity while a later
        recorded op reads it: the dump stores a tensor used by several ops once (hard links,
        views of one base), and handing the same tensor to each lets the dump of the replay
        store it once too.

        The prefetch thread calls this ahead of the live stream with records of the index
        (replay_index), which carry the identity and the dataset's place in the file: the
        main thread then finds the tensor with a dict lookup, or waits for the read in
        flight, and makes no h5py call (h5py serialises every call behind one lock, which
        the dump's writer thread holds much of the time)."""
        key = getattr(rec, "ident", None)
        if key is None:
            key = self._by_path.get(rec.path)
            t = self._cache.get(key) if key is not None else None
            if t is not None:
                return t
            try:
                obj = self._file.h5[rec.path]
                stride = S.live_stride(rec.attrs)
                key = (hash(obj.id), S.storage_offset(rec.attrs, rec.path), rec.shape, stride)
            except (KeyError, ValueError, TypeError):
                return tensor_from_record(rec)
        else:
            obj = None
            stride = key[3]
        t = self._cache.get(key)
        if t is not None:
            return t
        pending = self._inflight.get(key)
        if pending is not None and threading.current_thread() is not self._reader_thread:
            pending.wait()
            t = self._cache.get(key)
            if t is not None:
                return t
        t = self._strided_base(rec, obj, stride, key[0])
        if t is None:
            t = self._raw_read(rec, obj)
            if t is not None and tuple(t.shape) != tuple(rec.shape):
                t = None
        if t is None:
            t = self._from_h5py(rec)
        kept = self._keep(key, t)
        if kept is t and obj is not None and key in self._cache:
            self._by_path[rec.path] = key
        return kept

    def _from_h5py(self, rec: ValueRecord) -> torch.Tensor:
        """Through h5py (small datasets, views, chunked or converted storage); view bases
        are shared while their dataset has readers to come, at most `budget` bytes."""
        with self._cache_lock:
            n_before = len(self._bases)
        t = tensor_from_record(rec, base_cache=self._bases, read_base=self._raw_base)
        with self._cache_lock:
            if len(self._bases) != n_before:
                self._base_bytes = sum(_nbytes(s) for s, _ in self._bases.values())
                while self._base_bytes > self.budget and self._bases:
                    self._drop_base(next(iter(self._bases)))
        return t

    def _raw_read(self, rec: ValueRecord, obj: Any = None) -> torch.Tensor | None:
        """A plain stored tensor read with os.preadv straight into a torch buffer: h5py holds
        the GIL (and its own lock, which the dump's writer thread wants) for the whole copy
        of a dataset read, pread holds neither. Only for contiguous datasets whose bytes are
        the array as stored (what DumpWriter writes for large tensors); else None and the
        h5py path applies. Same values: the stored bytes, viewed in the recorded dtype.
        The dataset's place comes from an index record, else from `obj`."""
        if self._fd < 0 or rec.type != S.TYPE_TENSOR or rec.dtype not in _RAW_READ_DTYPES:
            return None
        offset = getattr(rec, "file_offset", None)
        if offset is not None:
            dt, shape, nbytes = rec.stored_dtype, rec.stored_shape, rec.stored_nbytes
            if nbytes < _RAW_READ_MIN_BYTES:
                return None
            # the index's offset is checked against the dataset itself (one open): a dump
            # edited with h5py keeps its catalog while a rewritten tensor's bytes move
            if not stored_at(self._file, rec.path, offset, nbytes):
                return None
        else:
            try:
                place = _stored_place(self._file.h5[rec.path] if obj is None else obj)
            except (AttributeError, TypeError, ValueError, RuntimeError, KeyError):
                return None
            if place is None:
                return None
            dt, shape, nbytes, offset = place
        return self._read_stored(rec.dtype, dt, shape, offset, nbytes)

    def _raw_base(self, ds: Any) -> torch.Tensor | None:
        """A view's base dataset (already checked by h5util.view_base: a plain stored tensor
        of this file) read as _raw_read reads a tensor, or None for the h5py read. Through
        h5py the bases cost most of the prefetch thread's time (GPT-2 small: ~1.4 of its
        2 s in a step; a base a view, rarely shared)."""
        if self._fd < 0:
            return None
        try:
            name = ds.attrs.get(S.ATTR_DTYPE, "")
        except (AttributeError, TypeError, ValueError, RuntimeError, KeyError):
            return None
        name = name.decode() if isinstance(name, bytes) else str(name)
        place = _stored_place(ds) if name in _RAW_READ_DTYPES else None
        if place is None:
            return None
        dt, shape, nbytes, offset = place
        return self._read_stored(name, dt, shape, offset, nbytes)

    def _read_stored(self, name: str, dt: np.dtype, shape: tuple, offset: int, nbytes: int) -> torch.Tensor | None:
        """`nbytes` stored bytes at `offset` of the load file as a tensor of recorded dtype
        `name` and `shape`: mapped (large ones) or read with preadv; None when they cannot
        be (another stored dtype than `name`'s, outside the file)."""
        stored = _RAW_READ_DTYPES[name]
        if dt != stored[0] or not dt.isnative or nbytes < _RAW_READ_MIN_BYTES:
            return None
        if self._mapping and nbytes >= _MAP_MIN_BYTES and offset % min(dt.itemsize, 8) == 0 \
                and offset + nbytes <= self._size:
            # Zero-copy: the tensor views its own mapping of the page cache (copy-on-write, so
            # a write into it never reaches the file); the bytes are only touched by the op that
            # reads them, GIL-free, and the mapping (its resident pages) goes with the last
            # tensor viewing it. WILLNEED starts readahead of a file not cached yet.
            start = offset - offset % mmap.ALLOCATIONGRANULARITY
            try:
                mapped = mmap.mmap(self._fd, offset + nbytes - start, access=mmap.ACCESS_COPY, offset=start)
            except (OSError, ValueError):
                mapped = None
            if mapped is not None:
                try:
                    mapped.madvise(mmap.MADV_WILLNEED)
                except (AttributeError, OSError, ValueError):
                    pass
                if threading.current_thread() is self._reader_thread:
                    # read ahead: its pages faulted in here (one byte a page, in a torch op:
                    # no GIL held), not in the model's thread by the op that reads them. A
                    # golden not in the page cache (dumped with O_DIRECT, or elsewhere) is read
                    # from the device here: 2.96 GB cost the model's thread ~1 s of faults
                    # and the wait for the device
                    torch.frombuffer(mapped, dtype=torch.uint8)[::mmap.PAGESIZE].sum()
                return torch.frombuffer(mapped, dtype=stored[1], count=nbytes // dt.itemsize,
                                        offset=offset - start).view(shape)
        buf = torch.empty(nbytes, dtype=torch.uint8)
        view = memoryview(buf.numpy())
        got = 0
        try:
            while got < nbytes:
                n = os.preadv(self._fd, [view[got:]], offset + got)
                if n <= 0:
                    return None
                got += n
        except OSError:
            return None
        return buf.view(stored[1]).view(shape)

    def _strided_base(self, rec: ValueRecord, obj: Any, stride: tuple, base_key: Any) -> torch.Tensor | None:
        """A stored tensor whose recorded layout is dense but not row-major (`W.t()` as addmm's
        mat2), laid out in storage as it was recorded: the live op gets it without a
        re-striding copy, and views recorded against it (`W` in the backward mm) share it.
        None when the plain path applies. `base_key`: the dataset's identity (hash of its id)."""
        if rec.type != S.TYPE_TENSOR or rec.dtype in ("complex32",):
            return None
        shape = rec.shape
        if len(stride) != len(shape) or any(s < 0 for s in stride) or len(shape) < 2 \
                or tuple(torch.empty(shape, device="meta").stride()) == stride \
                or not non_overlapping(shape, stride):
            return None
        cached = self._bases.get(base_key)
        try:
            if cached is None:
                raw = self._raw_read(rec, obj)
                if raw is not None and tuple(raw.shape) != tuple(shape):
                    raw = None
                if raw is not None:
                    base = _AttrsOnly(rec.attrs)      # _base_storage reads only its attributes
                else:
                    base = obj if obj is not None else self._file.h5[rec.path]
                cached = _base_storage(rec, base, raw)
                with self._cache_lock:
                    if self._planned and self._base_users.get(base_key, 0) < 2:
                        pass                       # no other recorded tensor to come shares it
                    elif _nbytes(cached[0]) <= self.budget:
                        self._bases[base_key] = cached
                        self._base_bytes += _nbytes(cached[0])
                        while self._base_bytes > self.budget:
                            self._drop_base(next(iter(self._bases)))
            storage, boff = cached
            return storage.as_strided(shape, stride, S.storage_offset(rec.attrs, rec.path) - boff)
        except (NotReplayable, RuntimeError, ValueError, KeyError):
            return None


def _stored_place(ds: Any) -> tuple[np.dtype, tuple, int, int] | None:
    """(stored dtype, shape, bytes, file offset) of a dataset whose stored bytes are its
    array as it is (contiguous, allocated, unfiltered), else None."""
    try:
        dt = ds.dtype
        shape = tuple(ds.shape)
        nbytes = dt.itemsize * int(np.prod(shape, dtype=np.int64))
        offset = contiguous_offset(ds.id, nbytes)
    except (AttributeError, TypeError, ValueError, RuntimeError, KeyError):
        return None
    return None if offset is None else (dt, shape, nbytes, offset)


class _AttrsOnly:
    """Stands for a dataset whose values are already read: what _base_storage asks of it."""

    def __init__(self, attrs: dict):
        self.attrs = attrs


# recorded dtype -> (stored numpy dtype, torch dtype the stored bytes are viewed as): the
# numpy-native ones and raw-bit ones (bfloat16/float8 bits are the tensor's bytes)
_RAW_READ_DTYPES: dict[str, tuple[np.dtype, torch.dtype]] = {}
for _name, _np_name in S.STORAGE_NUMPY_DTYPE.items():
    if _name == "complex32" or not hasattr(torch, _name):
        continue
    _RAW_READ_DTYPES[_name] = (np.dtype(_np_name), getattr(torch, _name))
# every stored tensor with bytes is read raw: through h5py a small one cost ~2.6 ms of the
# prefetch thread (GPT-2, a 1 GB load file: 302 reads, 0.79 s), pread ~0.1 ms; below
# _MAP_MIN_BYTES it is read into a buffer (a mapping of its own per small tensor is waste)
_RAW_READ_MIN_BYTES = 1
_MAP_MIN_BYTES = 64 << 10
