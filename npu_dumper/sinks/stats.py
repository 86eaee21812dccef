"""The writer thread of statistics-only dumps: op jobs -> rows of the stats table.

Same queue, backpressure, flushing and error surfacing as WriterThread (it is one);
only the per-op work differs: statistics are computed here (torch reductions, which
release the GIL) and each op becomes a few table rows (dumpfile.write.stats), not
HDF5 groups and datasets. What each tensor becomes is the plan's (sinks/plan.py, with
views=False): the same data seen again (same storage, write generation, version and
element set; W and W.t() share statistics) repeats the numbers it had.
"""

from __future__ import annotations

from typing import Any

from dumpfile import schema as S
from dumpfile.stats_table import IO_INPUT, IO_OUTPUT, tensor_row, value_row
from dumpfile.write.stats import value_rows
from dumpfile.write.writer import set_attrs

from ..capture import ListOf, Named, TensorCapture, Value
from ..capture.tensor_hash import content_hash
from ..capture.tensor_hist import _EMPTY as _NO_HIST, log2_histogram
from ..capture.tensor_stats import batchable, fast_tensor_stats, in_memory_order, rows_stats, stack_for_stats
from .plan import LINK
from .protocol import OpJob
from .thread import WriterThread


# A statistics-only job is a few small reductions: the writer looks at the queue this
# often instead of being woken per op (see sinks.thread: a wake-up costs the model's thread)
POLL_SECONDS = 0.002
# Statistics of the small tensors of this op and of the ops queued behind it are computed
# together (tensor_stats.rows_stats): at most this many ops and elements per batch
BATCH_OPS = 64
BATCH_ELEMENTS = 1 << 20


class StatsWriterThread(WriterThread):
    def __init__(self, writer, registry, *, histograms: bool = False, **kw):
        kw["stats_only"] = True
        self.histograms = histograms
        kw.setdefault("poll_interval", POLL_SECONDS)
        super().__init__(writer, registry, **kw)
        self._device_codes: dict[str, int] = {}
        self._scratch: dict = {}
        self._ready: dict = {}       # capture -> statistics computed in a batch, not yet used
        self.num_batched = 0         # tensors whose statistics came from a batch
        # the root's device attributes, written here at the first tensor (while the model
        # computes) instead of at block exit; the exit rewrites them only if they differ
        self.device_written: str | None = None

    def _run(self) -> None:
        # The file is created here, overlapping the model's first ops; a failure surfaces
        # in the user's thread at the next op (DumpMode checks `failed`) or at block exit.
        try:
            self.writer.open()
        except BaseException as e:  # noqa: BLE001 - raised at block exit
            self._error = e
        super()._run()

    def _batch(self, job: OpJob) -> None:
        """Statistics of the small tensors of `job` and of the jobs queued behind it, one
        stacked reduction per (dtype, size), kept in _ready for _stats. Each capture is
        copied under its lock (copy-on-write waits for that, as for the per-tensor path)
        and released (`done`) at once; a capture whose statistics an earlier capture of the
        same key (dedup) or a live dedup entry gives is left to _stats, which processes
        captures in the same order."""
        with self._cv:
            jobs = [job]
            for j in self._queue:
                if j is None or len(jobs) >= BATCH_OPS:
                    break
                jobs.append(j)
        caps, keys, elements = [], set(), 0
        for j in jobs:
            j.batched = True
            for cap in j.captures:
                if cap.done or cap in self._ready:
                    continue
                key = self.plan.key(cap)
                if key is not None:
                    if key in keys or self.plan.earlier(key) is not None:
                        continue
                    keys.add(key)
                caps.append(cap)
        if len(caps) < 2:
            return
        locked, tensors = [], []
        try:
            for cap in caps:
                cap.lock.acquire()
                locked.append(cap)
                t = cap.tensor
                if t is None or not batchable(t) or elements + t.numel() > BATCH_ELEMENTS:
                    cap.lock.release()
                    locked.pop()
                    continue
                elements += t.numel()
                tensors.append(t)
            if len(locked) < 2:
                return
            self.num_batched += len(locked)
            groups = stack_for_stats(tensors)       # the copies: the snapshot
            # hashes (and histograms) read the bytes: before the captures are let go
            digests = [self._digests(t) for t in tensors]
            for cap in locked:
                cap.done = True
                cap.tensor = None
        finally:
            for cap in locked:
                cap.lock.release()
        for m, idx in groups:
            for i, stats in zip(idx, rows_stats(m)):
                self._ready[locked[i]] = (stats, *digests[i])

    def _digests(self, t) -> tuple[int, Any]:
        """(content hash, log2 histogram or empty) of a tensor (format 1.7 columns)."""
        return content_hash(t), (log2_histogram(t) if self.histograms else _NO_HIST)

    def _finish_job(self, job: OpJob) -> None:
        for cap in job.captures:
            self._ready.pop(cap, None)
        super()._finish_job(job)

    def _write_job(self, job: OpJob) -> None:
        if not job.batched:
            self._batch(job)
        rows: list[tuple] = []
        for io, entries in ((IO_INPUT, job.inputs), (IO_OUTPUT, job.outputs)):
            for name, node in entries:
                self._rows(rows, job.seqid, io, name, node)
        self.writer.add_op(job.op, job.seqid, rows, phase=job.phase, module=job.module,
                           grad_fn=job.grad_fn, attrs=job.attrs)

    def _rows(self, rows: list, seqid: int, io: int, name: str, node: Any) -> None:
        if isinstance(node, TensorCapture):
            code = self._device_codes.get(node.device)
            if code is None:
                code = self._device_codes[node.device] = S.device_type_code(node.device)
            if self.device_written is None:
                set_attrs(self.writer.file, {S.ROOT_DEVICE: node.device, S.ROOT_DEVICE_TYPE: code})
                self.device_written = node.device
            stats, digest, hist = self._stats(node)
            rows.append(tensor_row(seqid, io, name, node.dtype, node.shape, code,
                                   stats, node.uninitialized, digest, hist))
        elif isinstance(node, Value):
            rows.extend(value_rows(seqid, io, name, node.value, node.schema_type or None))
        elif isinstance(node, Named):
            rows.append(value_row(seqid, io, name, node.type_code, node.value))
        elif isinstance(node, ListOf):
            rows.append(value_row(seqid, io, name, node.type_code, len(node.items)))
            base = name.rsplit("/", 1)[-1]
            for i, item in enumerate(node.items):
                self._rows(rows, seqid, io, f"{name}/{base}_{i}", item)
        else:  # pragma: no cover - capture only builds the kinds above
            rows.extend(value_rows(seqid, io, name, str(node)))

    def _stats(self, cap: TensorCapture) -> tuple[list[float], int, Any]:
        """(statistics, content hash, log2 histogram or empty) of a captured tensor: the
        plan's LINK repeats what the same data had, NEW computes them (or takes the batch's)."""
        p = self.plan.place(cap)
        if p.kind is LINK:
            self.plan.stored(p, p.ref, cap)
            return p.ref
        stats = self._ready.pop(cap, None)
        if stats is None:
            with cap.lock:
                t = cap.tensor
                stats = (fast_tensor_stats(in_memory_order(t), self._scratch), *self._digests(t))
                cap.done = True
                cap.tensor = None
        self.plan.stored(p, stats, cap)
        return stats
