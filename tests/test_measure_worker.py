"""Own-error measurements made off the model's thread (npu_dumper/replay/measure_worker.py)
record the numbers the same measurement makes on the model's thread, whatever the step does
to the tensors afterwards, and change nothing else in the dump (issue 34)."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import Future

import h5py
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import npu_dumper  # noqa: F401
from dumpfile import schema as S
from npu_dumper.replay import measure_worker, own_error
from npu_dumper.sinks.protocol import OpJob, settle_attrs


def _op_attrs(path) -> dict[tuple[str, int], dict]:
    """{(op, seqid): group attributes} of every op group of a dump."""
    out = {}
    with h5py.File(path, "r") as f:
        for op, g in f.items():
            if not isinstance(g, h5py.Group):
                continue
            for seq, og in g.items():
                if isinstance(og, h5py.Group) and S.OP_SEQID in og.attrs:
                    out[(op, int(og.attrs[S.OP_SEQID]))] = dict(og.attrs)
    return out


def _own(path) -> dict[tuple[str, int], dict]:
    return {k: json.loads(a[S.OP_OWN_ERROR]) for k, a in _op_attrs(path).items() if S.OP_OWN_ERROR in a}


class _Net(nn.Module):
    """Ops whose inputs and outputs the step writes in place right after them: a matrix
    product's result scaled in place, a pointwise result shifted in place, a weight updated
    in place inside the block (an optimizer step in the dumped region)."""

    def __init__(self):
        super().__init__()
        self.l1, self.ln, self.l2 = nn.Linear(48, 64), nn.LayerNorm(64), nn.Linear(64, 16)

    def forward(self, x):
        h = self.l1(x)
        h.mul_(1.5)                 # writes the addmm's result
        g = F.gelu(self.ln(h))
        g.add_(0.25)                # writes gelu's result
        return self.l2(g)


def _step(model, x, y):
    loss = F.mse_loss(model(x).float(), y)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(0.1 * p.grad)    # writes every weight the products read


def _dump(path, *, slow_worker: float = 0.0, synchronous: bool = False, monkeypatch=None):
    torch.manual_seed(0)
    model = _Net().to(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 48, generator=g).to(torch.bfloat16)
    y = torch.randn(32, 16, generator=g)
    if synchronous:
        # the same policy with no registry: every measurement on the model's thread
        monkeypatch.setattr(measure_worker.MeasureWorker, "__init__",
                            _sync_init(measure_worker.MeasureWorker.__init__))
    if slow_worker:
        real = own_error.measure

        def slow(func, prepared, out):
            if threading.current_thread() is not threading.main_thread():
                time.sleep(slow_worker)      # the step runs far ahead of the measurements
            return real(func, prepared, out)
        monkeypatch.setattr(own_error, "measure", slow)
    with torch.utils.dumper(use_dump=True, dump_path=str(path)):
        _step(model, x, y)
        _step(model, x, y)
    return path


def _sync_init(init):
    def sync(self, registry=None, **kw):
        init(self, None, **kw)
    return sync


def test_measured_off_thread_equals_measured_in_line_despite_in_place_writes(tmp_path, monkeypatch):
    sync = _own(_dump(tmp_path / "sync.h5", synchronous=True, monkeypatch=monkeypatch))
    monkeypatch.undo()
    # the worker made slow: without the wait before a write, the in-place mul_/clamp_/sub_
    # run before the measurement reads the tensors, and the numbers change
    worker = _own(_dump(tmp_path / "worker.h5", slow_worker=0.02, monkeypatch=monkeypatch))
    assert len(sync) > 20
    assert worker.keys() == sync.keys()
    for key in sync:
        assert worker[key] == sync[key], key


def test_the_worker_holds_no_reference_autograd_can_see(tmp_path, monkeypatch):
    """A queued measurement holding the step's tensor objects made AccumulateGrad copy each
    gradient instead of stealing it (new_empty_strided + copy_ ops in the dump): the recorded
    op stream must be that of the in-line measurement."""
    sync = _op_attrs(_dump(tmp_path / "sync.h5", synchronous=True, monkeypatch=monkeypatch))
    monkeypatch.undo()
    worker = _op_attrs(_dump(tmp_path / "worker.h5", slow_worker=0.01, monkeypatch=monkeypatch))
    assert sorted(worker) == sorted(sync)


def test_queued_bytes_stay_within_the_budget():
    worker = measure_worker.MeasureWorker(registry=_Registry(), max_bytes=1 << 20, max_ops=8)
    mm = torch.ops.aten.mm.default
    peak = 0
    futures = []
    try:
        for i in range(20):
            a, b = torch.randn(256, 256).bfloat16(), torch.randn(256, 256).bfloat16()   # 128 KiB each
            out = a @ b
            prepared = own_error.prepare(mm, (a, b), {}, {"self": a, "mat2": b})
            futures.append(worker.measure(mm, prepared, out))
            peak = max(peak, worker._bytes)
            assert len(worker._queued) <= 8
    finally:
        worker.close()
    assert all(isinstance(f, Future) for f in futures)
    assert peak <= (1 << 20)
    got = [json.loads(f.result()) for f in futures]
    assert all(g["result"][0] > 0 for g in got)     # measured (a bf16 product rounds)


def test_a_write_waits_for_the_measurements_reading_that_storage():
    registry = _Registry()
    worker = measure_worker.MeasureWorker(registry=registry)
    mm = torch.ops.aten.mm.default
    a, b = torch.randn(64, 64).bfloat16(), torch.randn(64, 64).bfloat16()
    out = a @ b
    expected = own_error.measure(mm, own_error.prepare(mm, (a, b), {}, {}), out)
    gate = threading.Event()
    real = own_error.measure

    def gated(func, prepared, o):
        gate.wait(5)
        return real(func, prepared, o)
    own_error.measure = gated
    try:
        future = worker.measure(mm, own_error.prepare(mm, (a, b), {}, {}), out)
        assert not future.done()
        threading.Timer(0.05, gate.set).start()
        registry.before_write(out)          # as the dumper does before an op writes `out`
        assert future.done()                # (the write waited for it)
        out.zero_()
    finally:
        own_error.measure = real
        worker.close()
    assert future.result() == expected
    assert worker.waits_for_writes == 1


def test_cuda_and_subclass_tensors_are_measured_in_line():
    worker = measure_worker.MeasureWorker(registry=_Registry())
    mm = torch.ops.aten.mm.default
    a = torch.randn(8, 8).bfloat16()
    out = a @ a
    try:
        got = worker.measure(mm, own_error.prepare(mm, (a, a), {}, {}), out.as_subclass(_Sub))
    finally:
        worker.close()
    assert isinstance(got, str)


def test_settle_attrs_waits_and_drops_what_came_to_nothing():
    done, none, failed = Future(), Future(), Future()
    done.set_result('{"result": [0.0, 0.0, 1.0]}')
    none.set_result(None)
    failed.set_exception(RuntimeError("no float64 kernel"))
    job = OpJob("aten.mm.default", 1, "forward", "", "", {"own_error": done, "a": none, "b": failed, "c": 3},
                [], [])
    settle_attrs(job)
    assert job.attrs == {"own_error": '{"result": [0.0, 0.0, 1.0]}', "c": 3}


class _Sub(torch.Tensor):
    pass


class _Registry:
    """The part of capture.CaptureRegistry the worker uses."""

    def __init__(self):
        self.write_listeners = []

    def before_write(self, t):
        for listener in self.write_listeners:
            listener(t.untyped_storage().data_ptr())


def test_a_failed_write_with_measurements_queued_ends_in_one_line_and_a_readable_file(tmp_path):
    """Disk full (EFBIG under RLIMIT_FSIZE) while the worker still has measurements queued:
    the user's step goes on, the block raises one line, the file keeps the ops written before,
    each with the own error measured for it, and nothing hangs."""
    import os
    import subprocess
    import sys
    import textwrap
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    p = tmp_path / "full.h5"
    code = textwrap.dedent(f"""
        import resource, signal, threading, time, torch, npu_dumper
        from npu_dumper.errors import DumperError
        from npu_dumper.replay import own_error
        real = own_error.measure
        def slow(func, prepared, out):          # measurements lag the step
            if threading.current_thread() is not threading.main_thread():
                time.sleep(0.002)
            return real(func, prepared, out)
        own_error.measure = slow
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, 4 << 20))
        x = torch.randn(128, 256).bfloat16()
        done = 0
        try:
            with npu_dumper.dumper(use_dump=True, dump_path={str(p)!r}, flush_interval=0.2) as d:
                for i in range(150):
                    x = torch.tanh(x * 1.01)
                    done += 1
                    time.sleep(0.005)
        except DumperError as e:
            print("ERR", e)
        print("steps", done, "kept", d.summary["ops_kept"])
    """)
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(root)),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr
    lines = r.stdout.splitlines()
    err = [ln for ln in lines if ln.startswith("ERR")]
    assert len(err) == 1 and "File too large" in err[0], r.stdout
    assert lines[-1].split()[:2] == ["steps", "150"]
    kept = int(lines[-1].split()[3])
    assert kept >= 10
    own = _own(p)
    attrs = _op_attrs(p)
    assert len(attrs) == kept
    # every kept op that computes (mul, tanh) carries its own error
    computing = [k for k in attrs if k[0] in ("aten.mul.Tensor", "aten.tanh.default")]
    assert computing and all(k in own for k in computing)
