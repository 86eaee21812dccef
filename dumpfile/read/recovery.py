"""Reading a dump whose writer was killed in the middle of an HDF5 flush.

HDF5 (without SWMR, which cannot create groups) writes a flush's metadata in no fixed
order and the superblock, which holds the end-of-allocation address (EOA), last. A
SIGKILL inside a flush (~10 ms every `flush_interval` on the reference machine, so ~5%
of kills) can leave a B-tree node on disk that points at a chunk allocated since the
previous flush: beyond the EOA the superblock still records. The library then refuses
to read it ("address of object past end of allocation") although its bytes are in the
file. Measured: the killed-dump test failed 3 of 30 runs that way.

`open_cut_short(path)` opens such a file read-only with the recorded EOA raised to the
file's size, in memory (the file is never modified): everything written before the kill
is then readable. Only superblock versions 0 and 1 (what the dumper writes: h5py's
default `libver="earliest"`) with 8-byte addresses at offset 0 are handled; others are
opened as they are.
"""

from __future__ import annotations

import io
import os
import struct

import h5py
import numpy as np

_SIGNATURE = b"\x89HDF\r\n\x1a\n"
# byte offset of the "end of file address" (the EOA) in superblock versions 0 and 1;
# the base address is 16 bytes before it
_EOA_OFFSET = {0: 40, 1: 44}


def stored_eoa(path: str) -> tuple[int, int] | None:
    """(offset, value) of the EOA recorded in the file's superblock, or None when the
    superblock is not one this module handles."""
    try:
        with open(path, "rb") as fh:
            sb = fh.read(56)
    except OSError:
        return None
    if len(sb) < 56 or sb[:8] != _SIGNATURE or sb[13] != 8:
        return None
    off = _EOA_OFFSET.get(sb[8])
    if off is None or struct.unpack_from("<Q", sb, off - 16)[0] != 0:
        return None
    return off, struct.unpack_from("<Q", sb, off)[0]


def is_cut_short(path: str) -> tuple[int, int] | None:
    """(EOA offset, file size) when the file extends past its recorded EOA (a writer
    appended since its last flush, and may have died inside the next one); else None."""
    eoa = stored_eoa(path)
    if eoa is None:
        return None
    size = os.path.getsize(path)
    return (eoa[0], size) if size > eoa[1] else None


class _RaisedEOA(io.RawIOBase):
    """The file read-only, its superblock's EOA reading as the file's size.

    The size as it is when HDF5 reads the superblock, not as is_cut_short saw it: a file
    can change in between (a writer process closing it; until issue 15's fix the dump
    writer cut the disk space it had claimed past the EOA just after its close). A size
    taken earlier then became an EOA past the file's end, and HDF5 refused the file
    ("truncated file: eof = N, stored_eof = N + the space cut"). Never below the EOA
    recorded: a file no longer cut short opens as it is."""

    def __init__(self, path: str, eoa_offset: int, size: int):
        super().__init__()
        self._f = open(path, "rb")
        self._lo = eoa_offset

    def _patch(self) -> bytes:
        fd = self._f.fileno()
        recorded = struct.unpack("<Q", os.pread(fd, 8, self._lo))[0]
        return struct.pack("<Q", max(recorded, os.fstat(fd).st_size))

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        return self._f.seek(pos, whence)

    def tell(self) -> int:
        return self._f.tell()

    def readinto(self, b) -> int:
        pos = self._f.tell()
        n = self._f.readinto(b)
        lo, hi = self._lo, self._lo + 8
        if n and pos < hi and pos + n > lo:
            patch = self._patch()
            mv = memoryview(b).cast("B")
            for i in range(max(lo, pos), min(hi, pos + n)):
                mv[i - pos] = patch[i - lo]
        return n

    def close(self) -> None:
        self._f.close()
        super().close()


def open_cut_short(path: str, eoa_offset: int, size: int) -> tuple[h5py.File, io.RawIOBase]:
    """h5py.File of `path`, read-only, with the recorded EOA raised to the file's size
    (`size`, what is_cut_short saw, may be out of date: the size when HDF5 reads the
    superblock is used), and the file object under it (close it after the h5py.File:
    h5py does not)."""
    raw = _RaisedEOA(path, eoa_offset, size)
    try:
        return h5py.File(raw, "r"), raw
    except BaseException:
        raw.close()
        raise


# what h5py raises when a dataset's data (or what it points at) cannot be read
READ_ERRORS = (OSError, RuntimeError)


def readable_rows(ds: h5py.Dataset) -> np.ndarray:
    """The rows of a 1-d table of an incomplete file: all of them, or, when some cannot be
    read, the longest prefix that can. A flush cut short by a kill can leave its own rows
    (the last ones) pointing at variable-length strings or chunks it never wrote ("bad
    global heap collection signature", "past end of allocation"); rows of earlier,
    completed flushes read back."""
    try:
        return ds[()]
    except READ_ERRORS:
        pass
    good, bad = 0, ds.shape[0]         # ds[:good] reads, ds[:bad] does not
    while bad - good > 1:
        mid = (good + bad) // 2
        try:
            ds[:mid]
            good = mid
        except READ_ERRORS:
            bad = mid
    return ds[:good]
