"""Recorded tensors as torch tensors for load-replay: read once, fast, shared.

A tensor the dump stores once (hard links, views of one base) is handed to every op that
recorded it as the same torch tensor, so the replay's own dump stores it once too.
Contiguous datasets are read without h5py: viewed zero-copy in the file mapped
copy-on-write, or read with os.preadv (h5py holds the GIL and its own lock, which the
dump's writer thread wants, for a whole dataset read). A prefetch thread may read ahead
of the model (`prefetch`); the model's thread then finds the tensor by a dict lookup or
waits for the read in flight.
"""

from __future__ import annotations

import mmap
import os
import threading
from typing import Any

import numpy as np
import torch

from dumpfile import schema as S
from dumpfile.read.catalog import stored_at
from dumpfile.read.lowlevel import contiguous_offset
from dumpfile.read.reader import DumpFile, ValueRecord

from .recorded import NotReplayable, _base_storage, non_overlapping, tensor_from_record


class RecordedTensors:
    """The recorded tensors of one load file, cached up to `cache_bytes` (the oldest
    evicted first)."""

    def __init__(self, cache_bytes: int = 1 << 30):
        self.cache_bytes = cache_bytes
        self._file: DumpFile | None = None
        self._cache: dict[Any, torch.Tensor] = {}
        self._by_path: dict[str, torch.Tensor] = {}              # dataset path -> cached tensor
        self._cache_bytes = 0
        self._cache_lock = threading.Lock()
        self._bases: dict[Any, tuple[torch.Tensor, int]] = {}   # view bases: one storage each
        self._inflight: dict[Any, threading.Event] = {}   # idents the prefetch thread is reading
        self._reader_thread: threading.Thread | None = None
        self._fd = -1                       # raw reads of contiguous datasets (GIL-free pread)
        self._map: mmap.mmap | None = None  # the load file mapped copy-on-write (zero-copy reads)

    def open(self, file: DumpFile, path: str) -> None:
        self._file = file
        try:
            self._fd = os.open(path, os.O_RDONLY)
            size = os.fstat(self._fd).st_size
            # ACCESS_COPY: private pages, so a write into a handed-on tensor never reaches the file
            self._map = mmap.mmap(self._fd, size, access=mmap.ACCESS_COPY) if size else None
        except (OSError, ValueError):
            self._map = None
            if self._fd >= 0:
                os.close(self._fd)
            self._fd = -1

    def close(self) -> None:
        self._cache.clear()
        self._by_path.clear()
        self._bases.clear()
        self._cache_bytes = 0
        self._file = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        # not closed: tensors handed to the model (and kept by autograd) may still view it;
        # the mapping goes when the last of them does
        self._map = None

    def prefetch(self, rec: ValueRecord) -> int:
        """Read one recorded tensor into the cache (from the prefetch thread); the bytes read."""
        self._reader_thread = threading.current_thread()
        ident = getattr(rec, "ident", None)
        if ident is None or ident in self._cache:
            return 0
        done = self._inflight[ident] = threading.Event()
        try:
            t = self.load(rec)
            return t.numel() * t.element_size()
        finally:
            done.set()
            self._inflight.pop(ident, None)

    def load(self, rec: ValueRecord) -> torch.Tensor:
        """A recorded tensor (recorded dtype, CPU), cached by its identity: the dump stores a
        tensor used by several ops once (hard links, views of one base), and handing the same
        tensor to each lets the dump of the replay store it once too.

        The prefetch thread calls this ahead of the live stream with records of the index
        (replay_index), which carry the identity and the dataset's place in the file: the
        main thread then finds the tensor with a dict lookup, or waits for the read in
        flight, and makes no h5py call (h5py serialises every call behind one lock, which
        the dump's writer thread holds much of the time)."""
        key = getattr(rec, "ident", None)
        if key is None:
            t = self._by_path.get(rec.path)
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
            t = tensor_from_record(rec, base_cache=self._bases)
        nbytes = t.numel() * t.element_size()
        with self._cache_lock:
            if key in self._cache:
                return self._cache[key]
            while self._cache and self._cache_bytes + nbytes > self.cache_bytes:
                old_key, old = next(iter(self._cache.items()))
                del self._cache[old_key]
                self._cache_bytes -= old.numel() * old.element_size()
                self._by_path = {p: v for p, v in self._by_path.items() if v is not old}
            if nbytes <= self.cache_bytes:
                self._cache[key] = t
                self._cache_bytes += nbytes
                if obj is not None:
                    self._by_path[rec.path] = t
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
                if obj is None:
                    obj = self._file.h5[rec.path]
                dt = obj.dtype
                shape = tuple(obj.shape)
                nbytes = dt.itemsize * int(np.prod(shape, dtype=np.int64))
                offset = contiguous_offset(obj.id, nbytes)
                if offset is None:
                    return None
            except (AttributeError, TypeError, ValueError, RuntimeError, KeyError):
                return None
        stored = _RAW_READ_DTYPES[rec.dtype]
        if dt != stored[0] or not dt.isnative or nbytes < _RAW_READ_MIN_BYTES:
            return None
        mapped = self._map
        if mapped is not None and offset % min(dt.itemsize, 8) == 0 and offset + nbytes <= len(mapped):
            # Zero-copy: the tensor views the page cache (copy-on-write); the bytes are
            # only touched by the op that reads them, GIL-free. WILLNEED starts readahead
            # of a file that is not cached yet, without waiting for it.
            try:
                start = offset - offset % mmap.PAGESIZE
                mapped.madvise(mmap.MADV_WILLNEED, start, offset + nbytes - start)
            except (AttributeError, OSError, ValueError):
                pass
            return torch.frombuffer(mapped, dtype=stored[1], count=nbytes // dt.itemsize,
                                    offset=offset).view(shape)
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
                cached = self._bases[base_key] = _base_storage(rec, base, raw)
            storage, boff = cached
            return storage.as_strided(shape, stride, S.storage_offset(rec.attrs, rec.path) - boff)
        except (NotReplayable, RuntimeError, ValueError, KeyError):
            return None


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
_RAW_READ_MIN_BYTES = 64 << 10      # small ones: h5py's read is as quick
