"""The background writer: turns captured ops into the dump file off the main thread.

The main thread only snapshots (aliases) and enqueues; this thread executes what the
plan (sinks/plan.py: new data, a hard link, a view entry) decides for each capture,
copies the data out, writes through dumpfile.DumpWriter and flushes at least every
`flush_interval` seconds even when no op arrives. The process writer (process.py) and
the statistics writer (stats.py) are this pipeline with another last step.
The queue is bounded in bytes and in time: the main thread waits when it is full, or
when the oldest op not yet written was recorded more than `max_lag` (0.4 x
flush_interval) ago, or when the queued ops would take the writer longer than that at
its measured pace (back-pressure, one way: the writer never waits on the main thread).
The time bound keeps the flush promise under load: a writer starved of CPU, or writing
to a slow disk, fell minutes behind, and a kill then lost everything recorded since
(0-91 of ~190 ops read back after 2.5 s on a busy 2-core machine). It only moves the
wait: a block whose writer is slower than the model waits at exit for the rest anyway.
An exception here is kept (`_fail`) and raised in the user's thread at block exit.

With `poll_interval` set (statistics-only dumps), the main thread does not wake this
thread per op: this thread looks at the queue every `poll_interval` seconds while ops
arrive, and sleeps (woken by the next op) after IDLE_POLLS empty looks. On the
reference 2-core VM a wake-up per op cost the model's thread ~2 ms per step of 40
ops (a futex wake and a cross-CPU interrupt each), ~5% of the step.

Full dumps use two threads. The metadata thread makes every HDF5 object (h5py holds
the GIL and its own lock throughout); a large tensor's dataset is created allocated
(DumpWriter.reserve_tensor), so its file offset is known at once, and its bytes are
moved by the data thread: re-layout into a reused staging buffer with torch and
os.pwrite (O_DIRECT where the file system allows: dumpfile/write/direct_io.py), both
without the GIL, overlapping the metadata of later ops and the user's
compute. The data thread takes ops in order; an op is published in the file's index
(DumpWriter.release_ops) only once all its bytes are written, so every op a flush
publishes reads back after a crash.

Every fault of the three writers (a failed write in either thread, a lost or hung
writer process, an interrupt) ends in one place, `_fail`: the first one stops recording,
is re-raised once in the user's thread, and freezes the file at its last good flush.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import numpy as np
import torch

from dumpfile.errors import DumpError, DumpWriteError
from dumpfile.write.writer import DumpWriter, TensorMeta

from ..capture import CaptureRegistry, ListOf, Named, TensorCapture, Value
from ..capture.tensors import numpy_view, storage_array
from .plan import LINK, VIEW, StoragePlan, deferred_dtype
from .protocol import OpJob, settle_attrs
from .worker_threads import TaskHandle, run_in_thread


# empty looks at the queue (poll_interval apart) before the writer sleeps until woken
IDLE_POLLS = 4


class WriterThread:
    def __init__(self, writer: DumpWriter, registry: CaptureRegistry, *, stats_only: bool = False,
                 max_pending_bytes: int = 512 << 20, flush_interval: float = 1.0, dedup: bool = True,
                 poll_interval: float | None = None):
        self.writer = writer
        self.registry = registry
        self.stats_only = stats_only
        self.max_pending_bytes = max_pending_bytes
        self.flush_interval = flush_interval
        self.dedup = dedup
        self.poll_interval = poll_interval
        self._queue: deque[OpJob | None] = deque()
        # submit times of the ops not yet written, oldest first (the time bound)
        self._submitted: deque[float] = deque()
        self.max_lag = max(0.4 * flush_interval, 0.05)
        # ...and no more ops queued than the writer writes in that time (the age of the
        # oldest alone let a fast model queue ~300 ops in 0.2 s that a slow writer then
        # took 6 s to write)
        self._op_cost = 0.0
        self._last_finish = 0.0
        self._cv = threading.Condition()
        self._pending_bytes = 0
        # a polling writer is still woken at once past this many pending bytes
        self._wake_bytes = max_pending_bytes // 4
        self._asleep = False         # waiting to be woken by the next op (under _cv)
        self._dirty = True           # written (or bytes completed) since the last idle flush
        self._error: BaseException | None = None
        # what each capture becomes: new data, a link, a view entry (statistics: a row)
        self.plan = StoragePlan(dedup=dedup, views=not stats_only)
        # data stage (full dumps): (job, [(capture, offset, nbytes)], metadata ok) in op order
        self._data_queue: deque[tuple[OpJob, list, bool] | None] = deque()
        self._data_ok = 0            # ops, counted in order, whose bytes are all written
        self._released = 0           # of those, published through DumpWriter.release_ops
        self._counting = True        # False after the first failed op: nothing after it is published
        self._data_failed = False
        self._staging: torch.Tensor | None = None   # reused re-layout buffer (no page-fault churn)
        self._pieces: list = []
        # pooled threads (worker_threads): a training loop dumping every step does not
        # start two threads per block
        self._data_thread: TaskHandle | None = None
        if not stats_only:
            self._data_thread = run_in_thread(self._data_run, "npu_dumper-data")
        self._thread = run_in_thread(self._run, "npu_dumper-writer")

    @property
    def num_links(self) -> int:
        return self.plan.num_links

    @property
    def num_views(self) -> int:
        return self.plan.num_views

    @property
    def num_datasets(self) -> int:
        return self.plan.num_datasets

    # ---- main-thread side ----------------------------------------------------
    def submit(self, job: OpJob) -> None:
        now = time.monotonic()
        with self._cv:
            while self._error is None and (
                    (self._pending_bytes > self.max_pending_bytes and (self._queue or self._data_queue))
                    or (self._submitted and (now - self._submitted[0] > self.max_lag
                                             or len(self._submitted) * self._op_cost > self.max_lag))):
                self._cv.notify_all()       # (a polling writer may be asleep)
                self._cv.wait(0.05)
                now = time.monotonic()
            self._queue.append(job)
            self._submitted.append(now)
            self._pending_bytes += job.nbytes
            if self.poll_interval is None or self._asleep or self._pending_bytes > self._wake_bytes:
                self._cv.notify_all()

    @property
    def failed(self) -> bool:
        return self._error is not None

    def abandon(self) -> None:
        """Stop writing (a Ctrl-C at block exit): the ops still queued are dropped, the one
        being written is finished; the close then keeps every op written before. Safe from
        a signal handler: it only sets state the writer's threads look at."""
        if self._error is None:
            self._error = DumpError(f"{self.writer.path}: interrupted; the ops not yet written "
                                    "were dropped")

    def close(self) -> None:
        """Write everything queued, then stop the thread."""
        with self._cv:
            self._queue.append(None)
            self._cv.notify_all()
        self._thread.join()

    # ---- writer-thread side ------------------------------------------------------
    def _next_job(self) -> OpJob | None | bool:
        """The next queued job (None: close), or False after `flush_interval` seconds without one."""
        with self._cv:
            idle_since = time.monotonic()
            polls = 0
            while not self._queue:
                if self._release_due():
                    return False
                left = self.flush_interval - (time.monotonic() - idle_since)
                if left <= 0 and self._dirty:
                    return False
                if self.poll_interval is not None and polls < IDLE_POLLS and left > 0:
                    polls += 1
                    self._cv.wait(min(self.poll_interval, left))
                else:
                    # nothing new to make durable: sleep until an op (or the data thread) wakes us
                    self._asleep = True
                    try:
                        self._cv.wait(left if left > 0 else None)
                    finally:
                        self._asleep = False
            return self._queue.popleft()

    def _run(self) -> None:
        w = self.writer
        while True:
            job = self._next_job()
            if job is False:            # idle: make what we have durable
                self._dirty = False
                if self._error is None:
                    try:
                        self._idle_flush()
                    except BaseException as e:  # noqa: BLE001 - raised at block exit
                        self._fail(e)
                continue
            if job is None:
                self._finish_data()
                return
            ok = False
            self._dirty = True
            self._pieces = []
            try:
                if self._error is None:
                    settle_attrs(job)       # (an own-error measurement still running: wait)
                    self._write_job(job)
                    ok = True
            except BaseException as e:  # noqa: BLE001 - raised at block exit
                self._fail(e)
            finally:
                if self._data_thread is not None:
                    with self._cv:
                        self._data_queue.append((job, self._pieces, ok))
                        self._cv.notify_all()
                else:
                    self._finish_job(job)
                self._pieces = []

    def _idle_flush(self) -> None:
        self._release_written()
        self.writer.flush()

    def _fail(self, e: BaseException) -> None:
        """Every failure of this writer, from either thread, comes here. The first one
        stops recording (DumpMode records nothing more, the user's step goes on) and is
        reported once, at block exit (the dumper raises `_error`). A failed write (OSError, h5py's
        RuntimeError, DumpWriteError) also freezes the file as its last good flush left
        it (DumpWriter.fail: nothing more is written to it); anything else drops the
        half-written op and the close keeps every op written before."""
        with self._cv:
            first = self._error is None
            if first:
                self._error = e
            self._cv.notify_all()      # (a user thread waiting in submit)
        if first:
            self._fail_file(e)

    def _fail_file(self, e: BaseException) -> None:
        w = self.writer
        if isinstance(e, (OSError, RuntimeError, DumpWriteError)):
            self._error = w.fail(e)
        else:
            w.abort_op()

    def _release_due(self) -> bool:
        """Whether completed ops should be published now, without waiting for the idle
        flush (the process writer: the child hears of them only from this thread)."""
        return False

    def _finish_job(self, job: OpJob) -> None:
        for cap in job.captures:
            # (unlocked: a deduplicated capture is let go here while copy-on-write may be
            # copying it; TensorCapture.materialize then finds no tensor and copies nothing)
            cap.done = True
            cap.tensor = None
        self.registry.discard_all(job.captures)
        with self._cv:
            self._pending_bytes -= job.nbytes
            if self._submitted:
                # the writer's time per op (from when it could start this one: not before
                # it was submitted, nor before the previous one was done), smoothed
                now = time.monotonic()
                cost = now - max(self._submitted.popleft(), self._last_finish)
                self._op_cost += 0.2 * (cost - self._op_cost)
                self._last_finish = now
            self._cv.notify_all()

    def _release_written(self) -> None:
        """Publish (at the next flush) the ops whose bytes the data thread has written."""
        n = self._data_ok - self._released
        if n > 0:
            self.writer.release_ops(n)
            self._released += n

    def _finish_data(self) -> None:
        """At close: let the data thread write everything, publish it, drop what failed."""
        if self._data_thread is None:
            return
        with self._cv:
            self._data_queue.append(None)
            self._cv.notify_all()
        self._data_thread.join()
        self._release_written()
        if self.writer.num_deferred:    # ops whose bytes were not written: not in the file
            self.writer.release_reserve()
            self.writer.drop_deferred()

    # ---- data-thread side --------------------------------------------------------
    def _data_run(self) -> None:
        while True:
            with self._cv:
                while not self._data_queue:
                    self._cv.wait()
                item = self._data_queue.popleft()
            if item is None:
                self._staging = None
                return
            job, pieces, ok = item
            try:
                ok = self._write_pieces(job, pieces, ok)
            except BaseException as e:  # noqa: BLE001 - raised at block exit
                self._data_failed = True
                self._fail(e)
            finally:
                # counted in order; the first op that failed (metadata or bytes) ends publishing
                if self._counting and ok and not self._data_failed:
                    self._data_ok += 1
                    self._dirty = True       # (_finish_job below wakes the idle metadata thread)
                else:
                    self._counting = False
                self._finish_job(job)

    def _write_pieces(self, job: OpJob, pieces: list, ok: bool) -> bool:
        """Write one op's reserved tensor bytes; returns whether the op is whole."""
        if not self._data_failed:
            for cap, offset, nbytes in pieces:
                self._write_bytes(cap, offset, nbytes)
        return ok

    def _write_bytes(self, cap: TensorCapture, offset: int, nbytes: int) -> None:
        with cap.lock:     # copy-on-write (materialize) waits for us, or we see its clone
            t = cap.tensor
            data = self._bytes_of(t)
            if data.nbytes != nbytes:
                raise DumpError(f"{self.writer.path}: tensor changed size while being written "
                                f"({data.nbytes} bytes for {nbytes} reserved)")
            self.writer.write_at(offset, data)
            cap.done = True
            cap.tensor = None

    def _bytes_of(self, t: torch.Tensor):
        """The C-order bytes write_tensor would store for `t`, as a numpy uint8 array.
        A strided CPU tensor that is not row-major is re-laid-out into a reused staging
        buffer; anything unusual goes through storage_array (a fresh copy)."""
        if t.layout != torch.strided or t.device.type != "cpu" or t.is_conj() or t.is_neg() \
                or t.dtype == torch.complex32 or t.dim() == 0:
            return storage_array(t).reshape(-1).view(np.uint8)
        nbytes = t.numel() * t.element_size()
        if t.is_contiguous():
            src = t.detach().reshape(-1)
        else:
            if self._staging is None or self._staging.numel() < nbytes:
                self._staging = torch.empty(max(nbytes, 4 << 20), dtype=torch.uint8)
            src = self._staging[:nbytes].view(t.dtype).view(t.shape)
            src.copy_(t.detach())
            src = src.reshape(-1)
        return numpy_view(src.view(torch.uint8))   # (not .numpy(): it makes the user's storage non-resizable)

    def _write_job(self, job: OpJob) -> None:
        w = self.writer
        w.begin_op(job.op, job.seqid, phase=job.phase, module=job.module,
                   grad_fn=job.grad_fn, attrs=job.attrs)
        for parent, entries in zip(w.io_groups(), (job.inputs, job.outputs)):
            for name, node in entries:
                self._write_node(parent, name, node)
            if len(entries) > 1:
                w.set_order(parent, [n for n, _ in entries])
        w.end_op(deferred=self._data_thread is not None)
        if self._data_thread is not None:
            self._release_written()

    def _write_node(self, parent, name: str, node: Any) -> None:
        w = self.writer
        if isinstance(node, TensorCapture):
            self._write_tensor(parent, name, node)
        elif isinstance(node, Value):
            w.write_value(parent, name, node.value, node.schema_type or None)
        elif isinstance(node, Named):
            w.write_named(parent, name, node.value, node.type_code, schema_type=node.schema_type or None)
        elif isinstance(node, ListOf):
            grp = w.create_list(parent, name, node.type_code, len(node.items), node.schema_type or None)
            for i, item in enumerate(node.items):
                self._write_node(grp, f"{name}_{i}", item)
        else:  # pragma: no cover - capture only builds the kinds above
            w.write_value(parent, name, str(node))

    def _meta(self, cap: TensorCapture) -> TensorMeta:
        return TensorMeta(dtype=cap.dtype, shape=cap.shape, stride=cap.stride,
                          storage_offset=cap.offset, device=cap.device,
                          uninitialized=cap.uninitialized,
                          extra=cap.extra or {})

    def _write_tensor(self, parent, name: str, cap: TensorCapture) -> None:
        """Execute the plan's placement of one capture through the DumpWriter."""
        w = self.writer
        p = self.plan.place(cap)
        if p.kind is LINK:
            self.plan.stored(p, w.link(parent, name, p.ref), cap)
            return
        if p.kind is VIEW:
            self.plan.stored(p, w.write_view(parent, name, p.ref, self._meta(cap)), cap)
            return
        with cap.lock:
            t = cap.tensor
            reserved = None
            if self._data_thread is not None and (dt := deferred_dtype(cap, t)) is not None \
                    and (reserved := w.reserve_tensor(parent, name, cap.shape, dt, self._meta(cap))):
                path, offset, nbytes = reserved     # the data thread writes the bytes
                self._pieces.append((cap, offset, nbytes))
            else:
                path = w.write_tensor(parent, name, storage_array(t), self._meta(cap))
            if reserved is None:
                cap.done = True
                cap.tensor = None
        self.plan.stored(p, path, cap)
