"""npu_dumper.sinks.worker_threads: background threads reused across dumper blocks."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import npu_dumper
from npu_dumper.sinks import worker_threads as wt


def test_consecutive_blocks_reuse_their_writer_thread(tmp_path):
    idents = []
    before = threading.active_count()
    for i in range(4):
        with npu_dumper.dumper(use_dump=True, stats_only=True, dump_path=str(tmp_path / f"s{i}.h5")) as d:
            torch.ones(8) * 2
            idents.append(d._writer._thread.ident)
        assert d.num_ops == 2
    assert len(set(idents)) == 1                      # the same thread ran every block's writer
    assert threading.active_count() <= before + 1     # and no thread piled up
    assert all(t.name != "npu_dumper-writer" for t in threading.enumerate())   # idle again


def test_a_failing_task_leaves_the_thread_usable_and_tasks_never_share_a_thread():
    def boom():
        raise RuntimeError("task failure")

    h = wt.run_in_thread(boom, "t-boom")
    h.join(600)
    assert not h.is_alive()
    seen = []
    release = threading.Event()

    def slow():
        seen.append(threading.current_thread().ident)
        release.wait(600)

    a = wt.run_in_thread(slow, "t-a")
    b = wt.run_in_thread(slow, "t-b")                 # a is busy: b gets another thread
    for _ in range(60000):                            # (a hang guard: 600 s)
        if len(seen) == 2:
            break
        time.sleep(0.01)
    release.set()
    a.join(600), b.join(600)
    assert len(seen) == 2 and seen[0] != seen[1]
    assert h.ident in seen                            # the thread of the failed task ran again


def test_idle_threads_retire_and_new_ones_start(monkeypatch):
    monkeypatch.setattr(wt, "IDLE_SECONDS", 0.05)
    first = wt.run_in_thread(lambda: None, "t-1")
    first.join(600)
    deadline = time.monotonic() + 600
    while first.thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not first.thread.is_alive()                # retired after IDLE_SECONDS
    ran = []
    second = wt.run_in_thread(lambda: ran.append(threading.current_thread()), "t-2")
    second.join(600)
    assert ran and ran[0] is not first.thread


def test_compare_still_forks_its_workers_after_a_dump_in_the_same_process(tmp_path):
    """Idle pool threads hold no lock: compare's fork guard lets them pass, not others."""
    from accucmp.compare import parallel as compare

    assert compare.IDLE_DUMPER_THREAD_NAME == wt.IDLE_NAME
    # (threads an earlier test of this process left, e.g. torch.compile's compile pool,
    # block forking on their own: what is checked is that the dump adds none)
    before = set(compare.blocking_threads())
    with npu_dumper.dumper(use_dump=True, dump_path=str(tmp_path / "d.h5")):
        torch.ones(8) * 2
    assert any(t.name == wt.IDLE_NAME for t in threading.enumerate())
    assert set(compare.blocking_threads()) <= before
    if not before:
        assert compare._safe_to_fork()
    stop = threading.Event()
    busy = threading.Thread(target=stop.wait, name="user-thread", daemon=True)
    busy.start()
    try:
        assert not compare._safe_to_fork()
    finally:
        stop.set()
        busy.join()
