"""When the background writer wakes: polling (statistics-only), sleeping, idle flushes."""

from __future__ import annotations

import time

import torch

import npu_dumper
from npu_dumper.sinks import stats as stats_writer


def _wait_until(cond, timeout: float = 600.0) -> float:
    """Seconds until `cond()` held (fails the test past `timeout`: a hang guard, not a speed goal)."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "condition not reached"
        time.sleep(0.001)
    return time.monotonic() - t0


def _drained(wt) -> bool:
    with wt._cv:
        return not wt._queue and wt._pending_bytes == 0


def test_stats_writer_polls_sleeps_when_idle_and_the_next_op_wakes_it(tmp_path):
    # a flush interval far longer than the test: only a wake-up can get the op written soon
    with npu_dumper.dumper(use_dump=True, stats_only=True, dump_path=str(tmp_path / "s.h5"),
                           flush_interval=60.0) as d:
        wt = d._writer
        assert wt.poll_interval == stats_writer.POLL_SECONDS
        x = torch.randn(16, 16)
        y = x * 2
        _wait_until(lambda: _drained(wt))
        # after IDLE_POLLS empty looks the writer sleeps until an op wakes it
        _wait_until(lambda: wt._asleep)
        y = y + 1
        assert _wait_until(lambda: _drained(wt)) < 30.0      # woken: the flush interval is 60 s
        assert d._mode.num_recorded == 3         # randn, mul, add
    assert d.num_ops == 3


def test_a_polling_writer_is_woken_at_once_when_many_bytes_are_pending(tmp_path, monkeypatch):
    monkeypatch.setattr(stats_writer, "POLL_SECONDS", 30.0)     # it would look only every 30 s
    with npu_dumper.dumper(use_dump=True, stats_only=True, dump_path=str(tmp_path / "s.h5"),
                           flush_interval=60.0, max_pending_bytes=1 << 16) as d:
        wt = d._writer
        torch.randn(64, 1024).mul(2)             # 256 KiB per tensor: past max_pending_bytes / 4
        assert _wait_until(lambda: _drained(wt)) < 20.0     # woken: it polls every 30 s
    assert d.num_ops == 2                        # randn and mul


def test_an_idle_writer_flushes_once_not_again_and_again(tmp_path):
    # flush_interval=0: "flush as soon as idle". Idle with nothing new, the writer must
    # sleep, not flush in a loop (which took the GIL from the model thousands of times a second)
    with npu_dumper.dumper(use_dump=True, writer="thread", dump_path=str(tmp_path / "d.h5"),
                           flush_interval=0.0) as d:
        w = d._writer.writer
        flushes = []
        real_flush = w.flush
        w.flush = lambda **kw: (flushes.append(time.monotonic()), real_flush(**kw))
        torch.randn(32, 32).tanh()
        _wait_until(lambda: _drained(d._writer) and flushes)
        time.sleep(0.1)                          # the flushes of the ops and their bytes
        settled = len(flushes)
        time.sleep(0.3)
        assert len(flushes) == settled <= 20     # then none: the old loop made thousands
        torch.ones(4).neg()                      # a new op: flushed again once idle
        n = len(flushes)
        _wait_until(lambda: len(flushes) > n)
    assert d.num_ops == 4

