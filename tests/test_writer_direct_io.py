"""Large tensors' bytes written around the page cache (dumpfile/write/direct_io.py): the same
file as os.pwrite writes, the page cache left alone, the page cache again where the file
system refuses O_DIRECT."""

from __future__ import annotations

import ctypes
import errno
import os

import h5py
import numpy as np
import pytest
import torch

import npu_dumper
from dumpfile.write import direct_io
from dumpfile.write.direct_io import TensorBytes
from dumpfile.write.h5objects import pwrite_all

# (offset, length) pairs: unaligned both ends, aligned both ends, aligned start, a range
# with no aligned page inside, below the direct size, several staging chunks
RANGES = [(12_345, 300_000), (65_536, 262_144), (1_000_000, 131_072 + 77), (5_000, 4_000),
          (2_000_000, 4_096), (3_000_003, 1_000_000)]


@pytest.fixture
def small_chunks(monkeypatch):
    # 64 KiB staging chunks and a 8 KiB direct minimum: every path with small files
    monkeypatch.setattr(direct_io, "CHUNK", 64 << 10)
    monkeypatch.setattr(direct_io, "DIRECT_MIN_BYTES", 8 << 10)


def _direct_allowed(path) -> bool:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0))
    except OSError:
        return False
    os.close(fd)
    return hasattr(os, "O_DIRECT")


def _write_all(path, ranges, data, **kw) -> TensorBytes:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    os.ftruncate(fd, 5 << 20)
    tb = TensorBytes(str(path), fd, **kw)
    try:
        for (offset, n), chunk in zip(ranges, data):
            tb.write(offset, chunk)
    finally:
        tb.close()
        os.close(fd)
    return tb


def _data(ranges):
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, n, dtype=np.uint8) for _, n in ranges]


def test_direct_writes_make_the_file_pwrite_makes(tmp_path, small_chunks):
    if not _direct_allowed(tmp_path / "probe"):
        pytest.skip("this file system refuses O_DIRECT")
    data = _data(RANGES)
    tb = _write_all(tmp_path / "direct", RANGES, data)
    fd = os.open(tmp_path / "plain", os.O_WRONLY | os.O_CREAT)
    os.ftruncate(fd, 5 << 20)
    for (offset, _), chunk in zip(RANGES, data):
        pwrite_all(fd, chunk, offset, "plain")
    os.close(fd)
    assert (tmp_path / "direct").read_bytes() == (tmp_path / "plain").read_bytes()
    assert tb.direct_bytes > 1_000_000      # (most bytes went the direct way)


def test_a_file_system_refusing_o_direct_gets_the_page_cache(tmp_path, small_chunks, monkeypatch):
    data = _data(RANGES)
    expected = _write_all(tmp_path / "plain", RANGES, data, direct=False)
    assert expected.direct_bytes == 0
    real_pwrite, refused = os.pwrite, []

    def pwrite(fd, buf, offset):        # (tmpfs and some FUSE file systems: EINVAL)
        if fd == tb_fd[0]:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, buf, offset)
    tb_fd = [-1]
    real_open = os.open

    def open_(path, flags, *a):
        fd = real_open(path, flags, *a)
        if flags & getattr(os, "O_DIRECT", 0):
            tb_fd[0] = fd
        return fd
    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(os, "open", open_)
    tb = _write_all(tmp_path / "refused", RANGES, data)
    monkeypatch.undo()
    assert (tmp_path / "refused").read_bytes() == (tmp_path / "plain").read_bytes()
    assert tb.direct_bytes == 0 and len(refused) <= 1     # tried once, then never again


def test_an_open_refused_with_o_direct_gets_the_page_cache(tmp_path, small_chunks, monkeypatch):
    data = _data(RANGES)
    _write_all(tmp_path / "plain", RANGES, data, direct=False)
    real_open = os.open

    def open_(path, flags, *a):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)
    monkeypatch.setattr(os, "open", open_)
    tb = _write_all(tmp_path / "refused", RANGES, data)
    monkeypatch.undo()
    assert (tmp_path / "refused").read_bytes() == (tmp_path / "plain").read_bytes()
    assert tb.direct_bytes == 0


# ---- a whole dump ------------------------------------------------------------------------
def _resident_pages(path, ranges) -> tuple[int, int]:
    """(pages in the page cache, pages) of the page-aligned middles of `ranges` (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, 1, 1, fd, 0)      # PROT_READ, MAP_SHARED: faults nothing in
        assert addr not in (None, ctypes.c_void_p(-1).value)
        pages = -(-size // 4096)
        vec = (ctypes.c_ubyte * pages)()
        assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
        libc.munmap(addr, size)
    finally:
        os.close(fd)
    resident = total = 0
    for offset, n in ranges:
        lo, hi = -(-offset // 4096), (offset + n) // 4096
        total += max(hi - lo, 0)
        resident += sum(vec[i] & 1 for i in range(lo, hi))
    return resident, total


def _dump_large(tmp_path, writer):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024))
    x = torch.randn(8, 1024)
    path = tmp_path / "dump.h5"
    with npu_dumper.dumper(use_dump=True, dump_path=str(path), writer=writer):
        model(x).square().mean().backward()
    with h5py.File(path, "r") as f:       # (metadata only: no tensor's pages read)
        names = []
        f.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
        ranges = [(f[n].id.get_offset(), f[n].id.get_storage_size()) for n in names
                  if f[n].id.get_storage_size() >= 1 << 20]
    return model, path, names, ranges


def test_direct_io_0_in_the_environment_keeps_the_page_cache(tmp_path, monkeypatch):
    """DUMPFILE_DIRECT_IO=0 (a device slower than the page cache): every byte through the
    page cache, as before (the dumping process writes the large tensors' bytes)."""
    monkeypatch.setenv("DUMPFILE_DIRECT_IO", "0")
    _, path, _, ranges = _dump_large(tmp_path, "process")
    resident, total = _resident_pages(path, ranges)
    assert total >= 4000 and resident == total


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_a_dump_writes_its_large_tensors_around_the_page_cache(tmp_path, writer):
    """A full dump's large tensors (here 4 MiB weights and their gradients) do not fill the
    page cache: written with O_DIRECT, their pages are not cached after the dump. Through
    the page cache (before), every one of them was."""
    if not _direct_allowed(tmp_path / "probe"):
        pytest.skip("this file system refuses O_DIRECT")
    model, path, names, ranges = _dump_large(tmp_path, writer)
    resident, total = _resident_pages(path, ranges)
    assert total >= 4000       # (the two weights and their two gradients: 16 MiB)
    assert resident <= total // 20, f"{resident} of {total} pages of large tensors cached"
    # and the bytes are the tensors'
    w = model[0].weight.detach().numpy()
    with h5py.File(path, "r") as f:
        stored = [np.asarray(f[n]) for n in names if f[n].shape == (1024, 1024)]
    assert any(np.array_equal(s, w) or np.array_equal(s, w.T) for s in stored)


def test_direct_writes_reach_the_open_file_not_a_symlink_put_at_its_path(tmp_path, small_chunks):
    """The O_DIRECT descriptor is opened at the first large write: it must open the file the
    writer already holds, not whatever the path names by then (never write through a symlink)."""
    path, victim = tmp_path / "dump.bin", tmp_path / "victim.bin"
    if not _direct_allowed(str(tmp_path / "probe.bin")):
        pytest.skip("the file system refuses O_DIRECT")
    victim.write_bytes(b"\0" * (1 << 20))
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        tb = TensorBytes(str(path), fd)
        os.rename(path, tmp_path / "moved.bin")
        os.symlink(victim, path)                # the path now names another file
        data = np.arange(100_000, dtype=np.uint8)
        tb.write(8192, data)
        assert tb.direct_bytes > 0
        tb.close()
    finally:
        os.close(fd)
    assert victim.read_bytes() == b"\0" * (1 << 20)
    assert (tmp_path / "moved.bin").read_bytes()[8192:8192 + 100_000] == data.tobytes()
