"""Where a comparison's rows are computed: in this process, on threads, or in forked worker
processes, and when forking is safe (torch-free).

The pipeline hands over a `work` object (pipeline._Work: the op pairs and how to compare
them) whose rows(lo, hi) computes the rows of pairs[lo:hi] anywhere; this module only
decides where, keeps the rows in execution order and cuts them into pieces of whole ops.
`opener(path, role)` opens a dump again in a forked worker.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections import deque
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

def row_batches(setup, opener):
    """Row dicts in execution order, a list per piece of whole ops."""
    work, jobs = setup.work, setup.jobs
    tf, gf, ff = setup.files
    pairs = work.pairs
    if jobs > 1 and len(pairs) > 1 and _FORK is not None and _safe_to_fork():
        yield from _rows_in_processes(work, tf, gf, ff, jobs, opener)
    elif jobs > 1 and len(pairs) > 1:
        yield from _rows_in_threads(work, jobs)
    else:
        for lo, hi in _spans(len(pairs), 1):
            yield work.rows(lo, hi)


# The name npu_dumper.sinks.worker_threads gives its pooled threads while they wait for work
# (a dump earlier in this process leaves them for a while); kept equal by a test.
IDLE_DUMPER_THREAD_NAME = "npu_dumper-idle"


def _safe_to_fork() -> bool:
    """Fork only when no other thread can hold a lock (h5py's among them) that would stay
    held forever in the child: the main thread alone, or with idle dumper pool threads,
    which wait on a condition of their own and hold nothing. Dask's offload pool thread
    outlives a folder compare's client (distributed keeps it for the process); without a
    client (whose event-loop thread would be listed) nothing hands it work, and it never
    touches HDF5."""
    return threading.current_thread() is threading.main_thread() and not blocking_threads()


def blocking_threads() -> list[threading.Thread]:
    """The threads (other than this one) that make forking unsafe (see _safe_to_fork)."""
    me = threading.current_thread()
    return [t for t in threading.enumerate()
            if not (t is me or (t.daemon and (t.name == IDLE_DUMPER_THREAD_NAME or t.name.startswith(_DASK_OFFLOAD))))]


_DASK_OFFLOAD = "Dask-Offload"


AUTO_JOBS_MIN_PAIRS = 500      # below this, starting workers costs more than it saves
AUTO_JOBS_MAX = 4


def auto_jobs(n_pairs: int) -> int:
    """jobs=0: one worker per available core (at most AUTO_JOBS_MAX) for many ops, else 1."""
    if n_pairs < AUTO_JOBS_MIN_PAIRS:
        return 1
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, min(cores, AUTO_JOBS_MAX))


def _spans(n: int, jobs: int) -> list[tuple[int, int]]:
    # pieces small enough to balance uneven ops over the workers, large enough
    # that handing one over costs little next to comparing it
    step = max(1, min(256, n // (jobs * 8)))
    return [(i, min(n, i + step)) for i in range(0, n, step)]


def _rows_in_threads(work, jobs: int):
    """Where processes cannot fork: one reader thread, metrics on `jobs` threads (numpy
    releases the GIL on large blocks), a bounded window of tasks in flight. Yields row
    lists of whole ops, in order, as their metrics complete."""
    pending: deque = deque()          # (row, future or None), in execution order
    done: list[dict[str, Any]] = []
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for index, pair in enumerate(work.pairs):
            for task in work.pair_tasks(pair, index):
                fut = None
                if work.computes(task):
                    fut = pool.submit(work.comparer.run, task)
                pending.append((task.row, fut))
                _settle(pending, done, 2 * jobs)
            if len(done) >= 256:
                # a piece ends with a whole op: wait for this op's rows still in flight
                _settle(pending, done, 0)
                yield done
                done = []
        _settle(pending, done, 0)
    if done:
        yield done


def _settle(pending: deque, done: list, keep: int) -> None:
    """Move rows from the front of `pending` to `done`, their metrics waited for, until at
    most `keep` are in flight."""
    while len(pending) > keep:
        row, fut = pending.popleft()
        if fut is not None:
            fut.result()
        done.append(row)


# Worker processes: forked, so they inherit the pairs and settings (nothing but
# (lo, hi) is sent to them) and open the dumps again (an HDF5 handle must not be
# shared across a fork). HDF5 serialises every call within a process (h5py's lock),
# so threads cannot read two tensors at once; processes can.
try:
    import multiprocessing as _mp

    _FORK = _mp.get_context("fork")
except (ImportError, ValueError):
    _FORK = None
_WORKER: dict[str, Any] = {}


def _worker_start(work, paths: dict[int, str | None], opener) -> None:
    opened = {key: (opener(path, "worker") if path else None) for key, path in paths.items()}
    for pair in work.pairs:
        for op in (pair.target, pair.golden):
            if op is not None:
                op.file = opened[id(op.file)]
        if pair.region is not None:
            pair.region.rebind(opened)
    if work.ff is not None:
        work = dataclasses.replace(work, ff=opened[id(work.ff)])
    _WORKER["work"] = work


def _worker_rows(span: tuple[int, int]) -> list[dict[str, Any]]:
    return _WORKER["work"].rows(*span)


def _rows_in_processes(work, tf, gf, ff, jobs: int, opener):
    """Row lists of spans of whole ops, in order, from forked workers, at most 2 x jobs spans
    in flight. A ProcessPoolExecutor, not multiprocessing.Pool: when a worker raised, the
    Pool's exit terminated the workers, and one killed while it held the result queue's lock
    (writing its rows) left the pool's task thread waiting for that lock and the compare hung
    in Pool.terminate (seen once in the suite, test_worker_errors_reach_the_caller, for 10
    minutes on a loaded machine). The executor lets a running span finish and cancels the
    rest, so its shutdown kills no worker mid-write."""
    paths = {id(f): f.path for f in (tf, gf, ff) if f is not None}
    spans = _spans(len(work.pairs), jobs)
    pool = ProcessPoolExecutor(max_workers=min(jobs, len(spans)), mp_context=_FORK,
                               initializer=_worker_start, initargs=(work, paths, opener))
    pending: deque = deque()
    try:
        todo = iter(spans)
        for span in todo:
            pending.append(pool.submit(_worker_rows, span))
            if len(pending) >= 2 * jobs:
                break
        while pending:
            try:
                rows = pending.popleft().result()
            except BrokenProcessPool as e:
                # a worker died (the kernel's OOM killer, a signal): one line, not a hang
                # (multiprocessing.Pool waited for its rows for ever) nor a traceback
                raise OSError(f"a compare worker process died ({e}); run again with --jobs 1 to "
                              f"compare in this process") from None
            span = next(todo, None)
            if span is not None:
                pending.append(pool.submit(_worker_rows, span))
            yield rows
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
