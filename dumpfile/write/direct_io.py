"""Large tensors' bytes written around the page cache (O_DIRECT), where the file system allows.

A full dump writes every large tensor's bytes with os.pwrite at the offset HDF5 reserved
for its dataset (DumpWriter.reserve_tensor; the dumper's data thread, with no GIL held).
Through the page cache, each of those writes first takes fresh page-cache pages and copies
the bytes into them: a dump of gigabytes costs that much kernel CPU in the writing thread,
and on a VM whose free memory was handed back to the host (virtio-balloon free page
reporting) every new page is a host fault too. Measured on the reference 2-core VM
(ext4 on virtio-blk), 2.96 GB (one GPT-2 small training step's dump): 6.95-7.3 s of CPU
buffered into such pages (2.0 s into pages the VM had just freed), 0.19 s with O_DIRECT
(1.6 s of wall time, the device's DMA; docs/PERFORMANCE.md, "Dump of GPT-2 small").

`TensorBytes.write(offset, data)` writes the page-aligned middle of a range with O_DIRECT,
from a reused page-aligned staging buffer (O_DIRECT needs the memory, the offset and the
length aligned; a tensor's own memory rarely is), and its unaligned head and tail through
the ordinary descriptor: the bytes and offsets are those pwrite would write, the file is
the same. The page cache stays coherent: a direct write flushes and drops the cached pages
of its range first, and no buffered writer (HDF5's metadata, the head and tail pieces)
touches the page-aligned middle of a dataset's reserved range. The bytes are on the device
when the call returns (more durable than a page-cache write, never less).

Where the file system refuses O_DIRECT (tmpfs, some FUSE and network file systems: EINVAL
at open or at the first write), everything goes through the page cache as before, for the
rest of the file. Small ranges (under DIRECT_MIN_BYTES) always do: a direct write is a
device round trip, and they are few of the bytes.

The trade-off: the bytes are not left in the page cache, so a reader right after the dump
(a load-replay of it on the same machine, a compare) reads them from the device and pays
the page-cache pages itself (on the reference VM about what the dump saved: 512 MB read
back in 1.03 s, 0.95 s of it system CPU; 0.07 s when cached). A dump is written inside the
user's step and read later, often elsewhere and in part. On a device slower than the page
cache (a network file system), direct writes make the dump wait for it: the environment
variable DUMPFILE_DIRECT_IO=0 sends everything through the page cache.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from typing import Any

import numpy as np

from ..errors import DumpWriteError
from .h5objects import pwrite_all

# O_DIRECT alignment of memory, file offset and length: 4 KiB covers the logical block
# size of the devices in use (512 B or 4 KiB; statx's STATX_DIOALIGN is not in Python).
ALIGN = 4096
# bytes copied into the staging buffer and written per direct write
CHUNK = 8 << 20
# ranges smaller than this go through the page cache
DIRECT_MIN_BYTES = 256 << 10
# O_DIRECT is Linux's (and a few others'); where the os module has no such flag, never
_O_DIRECT = getattr(os, "O_DIRECT", 0)
# ctypes.memmove releases the GIL (a CFUNCTYPE call): the copy into the staging buffer
# overlaps the model's Python, as the pwrite does
_memmove = ctypes.memmove


class TensorBytes:
    """Writes raw tensor bytes at file offsets: direct where possible (see module doc).

    `fd`: the file's ordinary write descriptor (heads, tails, small ranges, the fallback);
    the O_DIRECT one is opened here at the first large write; `close()` closes only that.
    Thread-safe: the staging buffer is taken under a lock (the dumper's data thread writes
    nearly everything; the thread writer's metadata thread, rarely, a large tensor the
    data thread does not take).
    """

    def __init__(self, path: str, fd: int, *, direct: bool = True):
        self.path = path
        self.fd = fd
        self._direct = bool(direct and _O_DIRECT) and os.environ.get("DUMPFILE_DIRECT_IO", "1") != "0"
        self._dfd = -1
        self._staging: np.ndarray | None = None     # CHUNK bytes, page-aligned
        self._lock = threading.Lock()
        self.direct_bytes = 0       # written with O_DIRECT (the rest through the page cache)

    @property
    def direct_fd(self) -> int:
        """The O_DIRECT descriptor, or -1 (not opened yet, or refused)."""
        return self._dfd

    def write(self, offset: int, data: Any) -> None:
        view = memoryview(data).cast("B")
        n = len(view)
        if self._direct and n >= DIRECT_MIN_BYTES:
            lo = -(-offset // ALIGN) * ALIGN            # the aligned middle [lo, hi)
            hi = (offset + n) // ALIGN * ALIGN
            head = lo - offset
            with self._lock:
                direct = hi > lo and self._open_direct() and self._write_direct(lo, view[head:head + hi - lo])
            if direct:
                if head:
                    pwrite_all(self.fd, view[:head], offset, self.path)
                if hi < offset + n:
                    pwrite_all(self.fd, view[hi - offset:], hi, self.path)
                return
        pwrite_all(self.fd, view, offset, self.path)

    def _open_direct(self) -> bool:
        if self._dfd >= 0:
            return True
        try:
            # the file the ordinary descriptor has open, not whatever the path names now (a
            # symlink put in its place is never written through): Linux reopens it through
            # /proc/self/fd as a new open file (O_DIRECT is a property of the open file, so
            # the ordinary descriptor stays buffered)
            self._dfd = os.open(f"/proc/self/fd/{self.fd}", os.O_WRONLY | _O_DIRECT)
        except OSError:         # (EINVAL: the file system has no O_DIRECT; no /proc)
            self._direct = False
            return False
        raw = np.empty(CHUNK + ALIGN, dtype=np.uint8)
        skip = -raw.ctypes.data % ALIGN
        self._staging = raw[skip:skip + CHUNK]
        return True

    def _write_direct(self, offset: int, view: memoryview) -> bool:
        """The aligned range through the staging buffer; False (nothing written) when the
        file system refuses O_DIRECT writes, which are then never tried again here."""
        src = np.frombuffer(view, dtype=np.uint8)
        src_addr = src.ctypes.data
        staging = self._staging
        dst = staging.ctypes.data
        n = len(view)
        done = 0
        try:
            while done < n:
                k = min(CHUNK, n - done)
                _memmove(dst, src_addr + done, k)
                w = 0
                while w < k:
                    got = os.pwrite(self._dfd, staging[w:k], offset + done + w)
                    if got <= 0:
                        raise OSError(errno.EIO, "direct write wrote nothing")
                    w += got
                    if w < k and w % ALIGN:     # short and unaligned: the rest buffered
                        pwrite_all(self.fd, view[done + w:done + k], offset + done + w, self.path)
                        break
                done += k
        except OSError as e:
            if e.errno == errno.EINVAL and done == 0:
                self._direct = False        # refused by the file system: the page cache
                self._close()
                return False
            raise DumpWriteError(f"{self.path}: write failed ({e})") from e
        self.direct_bytes += n
        return True

    def freeze(self, null_fd: int) -> None:
        """The file failed (DurableFile._freeze, which points the ordinary descriptor at
        /dev/null): no direct write reaches the file from now on. Waits for a direct write
        in progress (one chunk at most)."""
        with self._lock:
            self._direct = False
            if self._dfd >= 0:
                os.dup2(null_fd, self._dfd)     # (not closed: close() closes it)

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._dfd >= 0:
            try:
                os.close(self._dfd)
            except OSError:
                pass
            self._dfd = -1
        self._staging = None
