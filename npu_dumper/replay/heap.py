"""Give the C heap's free pages back to the system while a replay allocates.

Load-replay (and the own-error reference) allocate what a plain step does not: the recorded
inputs cast to the live dtype, float64 copies and results. Most are a few MB to tens of MB
and freed at once. Each such free raises glibc's dynamic mmap threshold (up to 32 MB), after
which blocks of that size come from the heap (and from the per-thread arenas of the
prefetch and own-error threads) and stay resident when freed, fragmented: the process keeps
what the step let go. Measured (bf16 load-replay against the plain bf16 step's peak RSS,
docs/REPLAY.md, "Fourth round"): BERT-base with `own_error=False` 1.54x, ConvNeXt-tiny 1.54x
with the own error; 1.12x and 1.29x with this.

`allocated(nbytes)` counts such bytes (from any thread) and once per `TRIM_BYTES` of them
calls `malloc_trim(0)`, which gives the free pages of every arena back (glibc 2.8+). Not
after each op: a trimmed page that the next allocation wants is a page fault again.
Every 256 MB left ConvNeXt-tiny at 1.36x, every 128 MB ResNet-50 at 1.32x; every 64 MB
costs those conv nets' replays ~6% more time than every 128 MB. (glibc's count of free
bytes, `mallinfo2`, cannot drive it: it still counts a chunk whose pages a trim gave back.)
Without glibc, nothing.
"""

from __future__ import annotations

import ctypes
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
trims = 0           # how many times the heap was trimmed (tests, benchmarks)


def allocated(nbytes: int) -> None:
    """`nbytes` of replay-only memory were allocated (and will be freed): see the module doc."""
    global _since, trims
    if _malloc_trim is None or nbytes <= 0:
        return
    with _lock:
        _since += nbytes
        if _since < TRIM_BYTES:
            return
        _since = 0
        trims += 1
    _malloc_trim(0)        # (outside the lock: it takes every arena's own lock)
