"""Give the C heap's free pages back to the system while a replay allocates.

Load-replay (and the own-error reference) allocate what a plain step does not: the recorded
inputs cast to the live dtype, float64 copies and results. Most are a few MB to tens of MB
and freed at once. Each such free raises glibc's dynamic mmap threshold (up to 32 MB), after
which blocks of that size come from the heap (and from the per-thread arenas of the
prefetch and own-error threads) and stay resident when freed, fragmented: the process keeps
what the step let go. Measured (bf16 load-replay against the plain bf16 step's peak RSS,
docs/REPLAY.md, "Fourth round"): BERT-base with `own_error=False` 1.54x, ConvNeXt-tiny 1.54x
with the own error; 1.12x and 1.29x with this.

`allocated(nbytes)` counts such bytes (from any thread); once per `TRIM_BYTES` of them it
reads the process's RSS and, when it is within `TRIM_BYTES` of the highest RSS read since
`reset()` (the block's start), calls `malloc_trim(0)`, which gives the free pages of every
arena back (glibc 2.8+). Only there, because only the peak counts and a trimmed page that
the next allocation wants is a page fault again: trimming at every mark cost GPT-2 at 24
layers 18-20% more CPU in its replay (the pages faulted back in, 2,236 ops), while the
conv nets' peaks need it every 64 MB (every 256 MB left ConvNeXt-tiny at 1.36x, every
128 MB ResNet-50 at 1.32x). (glibc's count of free bytes, `mallinfo2`, cannot drive it: it
still counts a chunk whose pages a trim gave back.) Without glibc, nothing.
"""

from __future__ import annotations

import ctypes
import os
import threading

TRIM_BYTES = 64 << 20        # replay-only bytes allocated between two trims

try:
    _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
    _malloc_trim.argtypes = [ctypes.c_size_t]
    _malloc_trim.restype = ctypes.c_int
except (OSError, AttributeError):
    _malloc_trim = None

_lock = threading.Lock()
_since = 0
_highest = 0        # the highest RSS read since reset(), bytes
trims = 0           # how many times the heap was trimmed (tests, benchmarks)
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def reset() -> None:
    """A new block begins: its own peak is what the trims keep down."""
    global _since, _highest
    with _lock:
        _since = _highest = 0


def _rss() -> int:
    """The process's resident bytes (/proc/self/statm), or 0 where it cannot be read (every
    mark then trims)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def allocated(nbytes: int) -> None:
    """`nbytes` of replay-only memory were allocated (and will be freed): see the module doc."""
    global _since, _highest, trims
    if _malloc_trim is None or nbytes <= 0:
        return
    with _lock:
        _since += nbytes
        if _since < TRIM_BYTES:
            return
        _since = 0
    rss = _rss()
    with _lock:
        near_peak = rss == 0 or rss + TRIM_BYTES >= _highest
        _highest = max(_highest, rss)
        if not near_peak:
            return
        trims += 1
    _malloc_trim(0)        # (outside the lock: it takes every arena's own lock)
