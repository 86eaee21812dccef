"""The writer thread of statistics-only dumps: op jobs -> rows of the stats table.

Same queue, backpressure, flushing and error surfacing as WriterThread (it is one);
only the per-op work differs: statistics are computed here (torch reductions, which
release the GIL) and each op becomes a few table rows (dumpfile.write.stats), not
HDF5 groups and datasets. What each tensor becomes is the plan's (sinks/plan.py, with
views=False): the same data seen again (same storage, write generation, version and
element set; W and W.t() share statistics) repeats the numbers it had.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import torch

from dumpfile import schema as S
from dumpfile.stats_table import IO_INPUT, IO_OUTPUT, tensor_cells, value_row
from dumpfile.write.stats import value_rows
from dumpfile.write.writer import set_attrs

from ..capture import ListOf, Named, TensorCapture, Value
from ..capture.tensor_hash import bytes_hash, content_hash
from ..capture.tensor_hist import _EMPTY as _NO_HIST, log2_histogram
from ..capture.tensor_stats import (BATCH_AS, batchable, batchable_description, fast_tensor_stats,
                                    in_memory_order, rows_stats, stack_for_stats)
from .plan import KEY_UNKNOWN, LINK, is_dense
from .protocol import OpJob
from .thread import WriterThread


# A statistics-only job is a few small reductions: the writer looks at the queue this
# often instead of being woken per op (see sinks.thread: a wake-up costs the model's thread)
POLL_SECONDS = 0.002
# Statistics of the small tensors of this op and of the ops queued behind it are computed
# together (tensor_stats.rows_stats): at most this many ops and elements per batch
BATCH_OPS = 128
BATCH_ELEMENTS = 1 << 20


# descriptions whose row cells are kept (tensor rows, value rows): a model has a few hundred
CACHED_DESCRIPTIONS = 1 << 14
_SCALAR_KEY_TYPES = (bool, int, str, type(None))


def _value_key(value: Any) -> tuple | None:
    """A key equal for two values exactly when they make the same rows: the type with the
    value (True, 1 and 1.0 are different rows); floats by their bits' text (-0.0 and 0.0
    differ, and a NaN equals itself); lists and tuples item by item. None: not kept."""
    t = type(value)
    if t in _SCALAR_KEY_TYPES:
        return (t, value)
    if t is float:
        return (t, value.hex())
    if t is list or t is tuple:
        items = []
        for v in value:
            k = _value_key(v)
            if k is None:
                return None
            items.append(k)
        return (t, tuple(items))
    return None


class StatsWriterThread(WriterThread):
    def __init__(self, writer, registry, *, histograms: bool = False, **kw):
        kw["stats_only"] = True
        self.histograms = histograms
        kw.setdefault("poll_interval", POLL_SECONDS)
        super().__init__(writer, registry, **kw)
        self._device_codes: dict[str, int] = {}
        self._scratch: dict = {}
        self._ready: dict = {}       # capture -> statistics computed in a batch, not yet used
        self._keys: dict = {}        # capture -> its dedup key, made by _batch for _stats
        self._tensor_cells: dict = {}   # (dtype, shape, device code, uninitialized) -> row cells
        self._value_tails: dict = {}    # (io, name, kind, value key) -> rows less their seqid
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
        stacked reduction per (dtype, size), kept in _ready for _stats. A capture whose
        statistics an earlier capture of the same key (dedup) or a live dedup entry gives
        is left to _stats, which processes captures in the same order.

        Dense captures still held as their storage (most of them) are staged by their
        bytes: each copied under its lock into a row of one numpy matrix per (dtype, size)
        (TensorCapture.take_bytes: no torch call per tensor, each of which hands the GIL
        to the model's thread), hashed from that row, and reduced row-wise. The others
        (an alias, a copy made by copy-on-write) are copied under their locks with torch
        (stack_for_stats). Either copy is the snapshot; the capture is released (`done`)
        at once, as the per-tensor path does."""
        with self._cv:
            jobs = [job]
            for j in self._queue:
                if j is None or len(jobs) >= BATCH_OPS:
                    break
                jobs.append(j)
        staged: dict[tuple, list] = {}      # (torch dtype, numel) -> captures
        others, keys, elements = [], set(), 0
        for j in jobs:
            j.batched = True
            for cap in j.captures:
                if cap.done or cap in self._ready:
                    continue
                key = self._keys[cap] = self.plan.key(cap)
                if key is not None:
                    if key in keys or self.plan.earlier(key) is not None:
                        continue
                    keys.add(key)
                dt = cap._torch_dtype
                numel = cap.nbytes // dt.itemsize
                if not batchable_description(dt, numel, cap.device == "cpu", bool(cap.stride)):
                    continue                        # (left to _stats, one by one)
                if is_dense(cap.shape, cap.stride):
                    if elements + numel <= BATCH_ELEMENTS:
                        elements += numel
                        staged.setdefault((dt, numel), []).append(cap)
                else:
                    others.append(cap)
        for (dt, numel), caps in staged.items():
            self._stage_bytes(dt, numel, caps, others)
        if others:
            self._batch_tensors(others, elements)

    def _stage_bytes(self, dt, numel: int, caps: list, left: list) -> None:
        """The statistics of same-dtype, same-size dense captures from their bytes, copied
        into one matrix (see _batch); captures that cannot be taken so go to `left`."""
        nbytes = numel * dt.itemsize
        buf = np.empty((len(caps), nbytes), dtype=np.uint8)
        base, taken = buf.ctypes.data, []
        for cap in caps:
            if cap.take_bytes(base + len(taken) * nbytes):
                taken.append(cap)
            else:
                left.append(cap)
        if not taken:
            return
        buf = buf[:len(taken)]
        self.num_batched += len(taken)
        hashes = [bytes_hash(row) for row in buf]
        m = torch.from_numpy(buf).view(dt)
        if self.histograms:
            hists = [log2_histogram(row) for row in m]
        else:
            hists = [_NO_HIST] * len(taken)
        as_dt = BATCH_AS[dt]
        for cap, stats, digest, hist in zip(taken, rows_stats(m if as_dt is dt else m.to(as_dt)),
                                            hashes, hists):
            self._ready[cap] = (stats, digest, hist)

    def _batch_tensors(self, caps: list, elements: int) -> None:
        """The statistics of batchable captures read through torch (aliases, copies made by
        copy-on-write), copied with stack_for_stats under their locks."""
        locked, tensors = [], []
        try:
            for cap in caps:
                cap.lock.acquire()
                locked.append(cap)
                t = None if cap.done else cap.tensor
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
            self._keys.pop(cap, None)
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
            desc = (node.dtype, node.shape, code, node.uninitialized)
            cells = self._tensor_cells.get(desc)
            if cells is None:
                cells = tensor_cells(*desc)
                if len(self._tensor_cells) < CACHED_DESCRIPTIONS:
                    self._tensor_cells[desc] = cells
            rows.append((seqid, io, name, *cells, *stats, digest, hist, ""))
        elif isinstance(node, Value):
            self._value_rows(rows, seqid, io, name, node.value, node.schema_type or None)
        elif isinstance(node, Named):
            self._value_rows(rows, seqid, io, name, node.value, node.type_code)
        elif isinstance(node, ListOf):
            self._value_rows(rows, seqid, io, name, len(node.items), node.type_code)
            base = name.rsplit("/", 1)[-1]
            for i, item in enumerate(node.items):
                self._rows(rows, seqid, io, f"{name}/{base}_{i}", item)
        else:  # pragma: no cover - capture only builds the kinds above
            rows.extend(value_rows(seqid, io, name, str(node)))

    def _value_rows(self, rows: list, seqid: int, io: int, name: str, value: Any,
                    kind: str | int | None) -> None:
        """The rows of a non-tensor value (`kind`: its schema type, or an int: the Type code
        of a Named value or a list header), kept per (io, name, kind, value) without their
        seqid: an op's arguments repeat every step, and each JSON text and Type code cost
        more than the tuple."""
        vkey = _value_key(value)
        key = (io, name, kind, vkey) if vkey is not None else None
        tails = self._value_tails.get(key) if key is not None else None
        if tails is None:
            if isinstance(kind, int):
                made = [value_row(seqid, io, name, kind, value)]
            else:
                made = value_rows(seqid, io, name, value, kind)
            tails = [r[1:] for r in made]
            if key is not None and len(self._value_tails) < CACHED_DESCRIPTIONS:
                self._value_tails[key] = tails
        for tail in tails:
            rows.append((seqid, *tail))

    def _stats(self, cap: TensorCapture) -> tuple[list[float], int, Any]:
        """(statistics, content hash, log2 histogram or empty) of a captured tensor: the
        plan's LINK repeats what the same data had, NEW computes them (or takes the batch's)."""
        p = self.plan.place(cap, self._keys.pop(cap, KEY_UNKNOWN))
        if p.kind is LINK:
            self.plan.stored(p, p.ref, cap)
            return p.ref
        stats = self._ready.pop(cap, None)
        if stats is None:
            with cap.lock:
                # A dense capture held as its storage is read as its storage's elements:
                # a 1-d tensor over them for the statistics (a contiguous tensor's full
                # reductions coalesce to this same 1-d loop: the same numbers) and the
                # bytes themselves for the hash (what content_hash reads, in storage
                # order), without in_memory_order's and content_hash's tensor calls (the
                # writer's Python work holds the GIL the model's thread needs)
                src = cap.storage_address() if cap.nbytes and is_dense(cap.shape, cap.stride) else None
                if src is None:
                    t = cap.tensor
                    digests = self._digests(t)
                    t = in_memory_order(t)
                else:
                    t = cap.storage_elements()
                    digests = (bytes_hash((ctypes.c_char * cap.nbytes).from_address(src)),
                               log2_histogram(t) if self.histograms else _NO_HIST)
                stats = (fast_tensor_stats(t, self._scratch), *digests)
                cap.done = True
                cap.tensor = None
        self.plan.stored(p, stats, cap)
        return stats
