"""Load-replay's memory is bounded by the ops in flight (npu_dumper/replay/source.py): a
recorded tensor is held while a recorded op still to come reads it, at most max_load_bytes,
and let go (its mapping of the load file with it) after its last reader."""

from __future__ import annotations

import contextlib
import gc
import io
import weakref

import pytest
import torch

import npu_dumper
from npu_dumper.errors import DumperError
from npu_dumper.replay.load_replay import ReplayPolicy


class _Chain(torch.nn.Module):
    """Eight layers, each weight (256 KiB) read by its forward addmm and its backward mm."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(256, 256) for _ in range(8))

    def forward(self, x):
        for lin in self.layers:
            x = torch.tanh(lin(x))
        return x


def _step(model, x):
    model.zero_grad(set_to_none=True)
    model(x).square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def _golden(tmp_path):
    model = _Chain()
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(1))
    ref = tmp_path / "ref.h5"
    with npu_dumper.dumper(use_dump=True, dump_path=str(ref)):
        _step(model, x)
    return model, x, ref


def _replay(model, x, ref, out, **options):
    with contextlib.redirect_stdout(io.StringIO()):
        with npu_dumper.dumper(use_load=True, load_file_path=str(ref), dump_path=str(out), **options) as d:
            grads = _step(model, x)
    return d.policies[0], grads


def test_recorded_tensors_held_stay_within_the_budget_whatever_the_recording(tmp_path):
    model, x, ref = _golden(tmp_path)
    # the recording holds far more than the budget: 8 weights read twice, activations
    _, plain = _replay(model, x, ref, tmp_path / "big.h5")
    policy, grads = _replay(model, x, ref, tmp_path / "small.h5", max_load_bytes=600 << 10)
    tensors = policy._tensors
    assert 0 < tensors.peak_held_bytes <= 600 << 10
    assert policy.summary.matched == policy.summary.live_ops       # every op replayed ...
    for a, b in zip(grads, plain):                                  # ... to the same results
        assert torch.equal(a, b)


def test_a_tensor_is_kept_while_a_later_recorded_op_reads_it_and_let_go_after(tmp_path):
    model, x, ref = _golden(tmp_path)
    policy = ReplayPolicy(ref, verbose=False, prefetch_ops=0, max_load_bytes=64 << 20)
    policy.begin()
    try:
        tensors = policy._tensors
        # a weight: recorded as an input of two ops (forward addmm, backward mm) -> one tensor
        readers: dict = {}
        for e in policy._order:
            for rec in e.inputs.values():
                if rec.is_tensor and rec.numel == 256 * 256 and getattr(rec, "ident", None) is not None:
                    readers.setdefault(rec.ident, []).append((e, rec))
        ident, uses = next((k, v) for k, v in readers.items() if len(v) >= 2)
        (first, rec1), (last, rec2) = uses[0], uses[-1]
        t = policy._load(rec1)
        gone = weakref.ref(t)
        tensors.release(first.index, first.inputs)
        assert policy._load(rec2) is t          # still to be read: the same tensor
        for e, _ in uses[1:]:
            tensors.release(e.index, e.inputs)
        assert ident not in tensors._cache      # its last reader has taken it
        del t
        gc.collect()
        assert gone() is None                   # and nothing else holds it (nor its mapping)
        assert tensors.held_bytes == sum(v.numel() * v.element_size() for v in tensors._cache.values())
    finally:
        policy.end()


def test_a_tensor_no_recorded_op_reads_again_is_not_cached(tmp_path):
    model, x, ref = _golden(tmp_path)
    policy = ReplayPolicy(ref, verbose=False, prefetch_ops=0)
    policy.begin()
    try:
        entry = next(e for e in policy._order for r in e.inputs.values()
                     if r.is_tensor and r.numel >= 256 * 256)
        for rec in entry.inputs.values():
            if rec.is_tensor:
                policy._load(rec)
        tensors = policy._tensors
        tensors.release(entry.index, entry.inputs)
        assert not any(getattr(r, "ident", None) in tensors._cache for r in entry.inputs.values()
                       if r.is_tensor and len(tensors._uses.get(r.ident, ())) == 0)
    finally:
        policy.end()


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "1G"])
def test_max_load_bytes_must_be_a_positive_int(bad):
    with pytest.raises(DumperError, match="max_load_bytes must be a positive int"):
        npu_dumper.dumper(use_load=True, load_file_path="x.h5", dump_path="y.h5", max_load_bytes=bad)
