"""Load-replay gives the C heap's free pages back while it allocates (npu_dumper/replay/heap.py):
blocks freed in the middle of a heap whose mmap threshold a large free raised stay resident
until malloc_trim, and the replay's casts, reads and float64 results are such blocks
(issue 34: a BERT-base replay peaked at 1.51x the plain step's RSS, 1.12x with the trim)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import npu_dumper  # noqa: F401
from npu_dumper.replay import heap

glibc = pytest.mark.skipif(heap._malloc_trim is None, reason="no glibc malloc_trim here")


@glibc
@pytest.mark.parametrize("count", [0, 1])
def test_counted_bytes_give_the_fragmented_heap_back(count):
    """A heap holding ~240 MB of freed 8 MB blocks (what a replay's casts leave once a large
    free raised the mmap threshold): RSS drops by most of it when the replay's counted bytes
    reach the mark, and not before."""
    code = textwrap.dedent(f"""
        import ctypes
        from npu_dumper.replay import heap

        def rss_anon_mb():
            for line in open("/proc/self/status"):
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) / 1024

        libc = ctypes.CDLL("libc.so.6")
        libc.malloc.restype = ctypes.c_void_p
        libc.malloc.argtypes = [ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]
        # what a replay's large frees leave: blocks of 8 MB served from the heap (the mmap
        # threshold above them, as glibc's dynamic threshold sets it) and kept when freed
        # (no trim of the heap's top by free itself), wherever they lie
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        assert libc.mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1
        assert libc.mallopt(M_TRIM_THRESHOLD, 1 << 30) == 1
        blocks = []
        for _ in range(30):
            b = libc.malloc(8 << 20)
            ctypes.memset(b, 1, 8 << 20)        # resident
            blocks.append(b)
        for b in blocks:
            libc.free(b)
        before = rss_anon_mb()
        heap.TRIM_BYTES = 64 << 20
        heap.allocated((64 << 20) - 1)          # below the mark: nothing given back
        below = rss_anon_mb()
        if {count}:
            heap.allocated(1)                   # the mark: trimmed
        after = rss_anon_mb()
        print(before, below, after, heap.trims)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    before, below, after, trims = (float(x) for x in out.stdout.split())
    assert before - below < 20, (before, below)
    if count:
        assert trims == 1 and before - after > 150, (before, after)
    else:
        assert trims == 0 and before - after < 20, (before, after)


class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(256, 512), nn.Linear(512, 64)

    def forward(self, x):
        return self.l2(F.gelu(self.l1(x)))


@glibc
@pytest.mark.parametrize("own_error", [True, False])
def test_a_bf16_replay_counts_its_casts(tmp_path, monkeypatch, own_error):
    """The replay's recorded inputs cast to bf16 (and, with own error, the float64 results)
    are counted: the heap is trimmed as they pass the mark, in both modes."""
    torch.manual_seed(0)
    model, x = _Mlp(), torch.randn(32, 256)
    gold = tmp_path / "gold.h5"
    with torch.utils.dumper(use_dump=True, dump_path=str(gold)):
        model(x).sum().backward()
    counted = []
    real = heap.allocated
    monkeypatch.setattr(heap, "allocated", lambda n: (counted.append(n), real(n)))
    monkeypatch.setattr(heap, "TRIM_BYTES", 1 << 10)
    trims = heap.trims
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.utils.dumper(use_load=True, load_file_path=str(gold), dump_path=str(tmp_path / "r.h5"),
                                own_error=own_error):
            model(x).sum().backward()
    # at least the bf16 copies of x (32x256), l1's output (32x512) and l2's weight (64x512)
    assert sum(counted) >= 2 * (32 * 256 + 32 * 512 + 64 * 512)
    assert heap.trims > trims


@glibc
def test_the_heap_is_trimmed_only_near_the_blocks_peak(monkeypatch):
    """A mark passed while the process's RSS is far below the highest RSS seen in the block
    (after its peak: the backward freeing the forward's activations) gives nothing back: a
    trimmed page is a page fault when reused, and only the peak counts. Near it, it trims."""
    calls = []
    monkeypatch.setattr(heap, "_malloc_trim", lambda pad: calls.append(pad) or 1)
    monkeypatch.setattr(heap, "TRIM_BYTES", 1 << 20)
    rss = heap._rss()
    assert rss > 0
    heap.reset()
    monkeypatch.setattr(heap, "_highest", rss + (512 << 20))     # a peak 512 MB above now
    heap.allocated(1 << 20)
    assert calls == []
    monkeypatch.setattr(heap, "_highest", rss)                   # at the peak
    heap.allocated(1 << 20)
    assert calls == [0]
    heap.reset()                                                 # a new block: its own peak
    heap.allocated(1 << 20)
    assert calls == [0, 0]
