"""Own-error measurements off the model's thread: the float64 reference overlaps the step.

A load-replay (and a plain dump of a reduced-precision run) measures every op whose inputs
were rounded against float64 on those inputs (own_error.py). On the model's thread that
reference was most of the replay's time (GPT-2 small under bf16 autocast: 5.6 s of the
model thread's 9.7 s, the float64 matrix products alone 3.8 s; docs/REPLAY.md). The
measurement needs nothing from the ops after it, so it is handed to one worker thread
(torch kernels release the interpreter lock: the float64 products run on another core while
the model computes) and its result reaches the file late: the op's `own_error` attribute is
a `concurrent.futures.Future` that the dump's writer waits for before it writes the op
(sinks/protocol.settle_attrs). The numbers are those of the same measurement made on the
model's thread: the same function on the same tensors, because

- a tensor a pending measurement reads (the op's inputs and outputs) is not written before
  the measurement is done: the dumper's copy-on-write registry calls `before_write` with a
  storage's address before any op writes (or resizes) it, and the model's thread then waits
  for the measurements that read that storage (in order: one worker finishes them in order);
- only plain CPU tensors go to the worker: a CUDA op's reference is queued on the model's
  stream by the model's thread (another thread would use another stream), and a tensor
  subclass (DTensor, a wrapper) may compute through state of the thread that made it;
- the worker runs no dispatch mode (modes and autocast are per thread: a planted fault, an
  emulation, the dump's own mode never reach the reference, as `_disable_current_modes`
  ensures on the model's thread).

Memory stays bounded: the tensors the queued measurements hold (and the float64 copies an
in-place op's measurement took before it ran) are counted, and past `max_bytes` (or
`max_ops` queued) the model's thread waits for the oldest. At the block's exit every
measurement still queued finishes (the writer needs them); one whose op the writer dropped
(Ctrl-C) is cancelled.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from . import own_error
from .layout import storage_key

# what the queued measurements may hold beyond the step's own tensors, and how many ops
DEFAULT_MAX_BYTES = 128 << 20
DEFAULT_MAX_OPS = 512


class MeasureWorker:
    """One thread measuring ops' own error in submission order (see module doc)."""

    def __init__(self, registry: Any = None, *, max_bytes: int = DEFAULT_MAX_BYTES,
                 max_ops: int = DEFAULT_MAX_OPS):
        self.max_bytes = max_bytes
        self.max_ops = max_ops
        self._registry = registry
        self._pool: ThreadPoolExecutor | None = None
        # (future, storage addresses it reads, bytes it holds), oldest first; the model's thread
        # adds and retires entries, under _lock (a resize hook may run on another thread)
        self._queued: deque[tuple[Future, tuple[int, ...], int]] = deque()
        self._readers: dict[int, int] = {}      # storage address -> queued measurements reading it
        self._bytes = 0
        self._lock = threading.RLock()
        self.waits_for_writes = 0               # times a write waited for a measurement
        self.waited_s = 0.0                     # the model's thread's wall time spent waiting
        if registry is not None and hasattr(registry, "write_listeners"):
            registry.write_listeners.append(self._before_write)

    # ---- the model's thread --------------------------------------------------------
    def measure(self, func: Any, prepared: Any, out: Any) -> "str | Future | None":
        """The op's own-error JSON, now (or None), or a Future of it measured on the worker."""
        tensors = self._tensors_if_async(prepared, out)
        if tensors is None or self._registry is None:
            return own_error.measure(func, prepared, out)
        prepared, out = own_error.aliased(prepared), tree_map(own_error.alias_of, out)
        addresses: set[int] = set()
        nbytes = 0
        for t in tensors:
            ptr = storage_key(t)
            if ptr is not None and ptr not in addresses:
                addresses.add(ptr)
                nbytes += t.untyped_storage().nbytes()
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="npu_dumper-own-error")
            while self._queued and (self._bytes + nbytes > self.max_bytes or len(self._queued) >= self.max_ops):
                self._retire_oldest()
            future = self._pool.submit(_measure_quietly, func, prepared, out)
            self._queued.append((future, tuple(addresses), nbytes))
            for ptr in addresses:
                self._readers[ptr] = self._readers.get(ptr, 0) + 1
            self._bytes += nbytes
        return future

    @staticmethod
    def _tensors_if_async(prepared: Any, out: Any) -> list[torch.Tensor] | None:
        """The tensors a measurement reads, when every one is a plain CPU tensor; else None
        (measured on the model's thread)."""
        leaves, _ = tree_flatten((own_error.tensors_read(prepared), out))
        tensors = []
        for v in leaves:
            if isinstance(v, torch.Tensor):
                if type(v) is not torch.Tensor and type(v) is not torch.nn.Parameter:
                    return None
                if v.device.type != "cpu" or v.layout != torch.strided or v.is_nested:
                    return None
                tensors.append(v)
        return tensors

    def _before_write(self, ptr: int) -> None:
        """A storage is about to be written: the measurements reading it finish first."""
        if not self._readers:
            return
        with self._lock:
            if ptr in self._readers:
                self.waits_for_writes += 1
            while ptr in self._readers:
                self._retire_oldest()

    def _retire_oldest(self) -> None:
        future, addresses, nbytes = self._queued.popleft()
        if not future.done():
            t0 = time.perf_counter()
            try:
                future.result()
            except BaseException:  # noqa: BLE001 - (cancelled): the writer drops the attribute
                pass
            self.waited_s += time.perf_counter() - t0
        for ptr in addresses:
            left = self._readers[ptr] - 1
            if left:
                self._readers[ptr] = left
            else:
                del self._readers[ptr]
        self._bytes -= nbytes

    def close(self, cancel: bool = False) -> None:
        """Finish (or, `cancel`: drop) what is queued and stop the thread."""
        registry = self._registry
        if registry is not None and self._before_write in getattr(registry, "write_listeners", ()):
            registry.write_listeners.remove(self._before_write)
        with self._lock:
            pool, self._pool = self._pool, None
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=cancel)
            self._queued.clear()
            self._readers.clear()
            self._bytes = 0


def _measure_quietly(func: Any, prepared: Any, out: Any) -> str | None:
    # (looked up on the module each time: a benchmark's wrapper around measure sees it)
    try:
        with torch.no_grad():
            return own_error.measure(func, prepared, out)
    except Exception:  # noqa: BLE001 - an output that cannot be measured: the row is judged as before
        return None


__all__ = ["MeasureWorker", "DEFAULT_MAX_BYTES", "DEFAULT_MAX_OPS"]
