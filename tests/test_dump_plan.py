"""npu_dumper.sinks.plan: what each captured tensor becomes (new data, link, view entry),
decided once for the thread, process and statistics writers, on real captures."""

from __future__ import annotations

import gc

import torch

from npu_dumper.capture import CaptureRegistry, TensorCapture
from npu_dumper.sinks.plan import LINK, NEW, VIEW, StoragePlan, deferred_dtype


def _cap(reg: CaptureRegistry, t: torch.Tensor) -> TensorCapture:
    return TensorCapture(t, reg._gen)


def _store(plan: StoragePlan, cap: TensorCapture, path: str):
    """What a sink does: execute the placement, tell the plan what it stored."""
    p = plan.place(cap)
    plan.stored(p, p.ref if p.kind == LINK else path, cap)
    return p


def test_same_storage_and_layout_twice_is_a_link_to_the_first():
    reg, plan = CaptureRegistry(), StoragePlan()
    w = torch.randn(8, 4)
    first = _store(plan, _cap(reg, w), "/op/1/input/w")
    again = _store(plan, _cap(reg, w), "/op/2/input/w")
    assert first.kind == NEW and again == (LINK, "/op/1/input/w", first.key)
    assert (plan.num_datasets, plan.num_links, plan.num_views) == (1, 1, 0)


def test_restrided_view_of_stored_data_is_a_view_entry_of_it():
    reg, plan = CaptureRegistry(), StoragePlan()
    w = torch.randn(8, 4)
    _store(plan, _cap(reg, w), "/op/1/input/w")
    assert _store(plan, _cap(reg, w.t()), "/op/2/input/wt")[:2] == (VIEW, "/op/1/input/w")
    assert _store(plan, _cap(reg, w[2:5]), "/op/3/input/rows")[:2] == (VIEW, "/op/1/input/w")
    # the view entry itself is what the same view links to next time
    assert _store(plan, _cap(reg, w.t()), "/op/4/input/wt")[:2] == (LINK, "/op/2/input/wt")
    # a slice stored first covers only its rows: the whole tensor is new data
    s = torch.randn(8, 4)
    _store(plan, _cap(reg, s[2:5]), "/op/5/input/rows")
    assert _store(plan, _cap(reg, s), "/op/6/input/s").kind == NEW
    assert (plan.num_datasets, plan.num_links, plan.num_views) == (3, 1, 2)


def test_storage_written_in_between_is_new_data():
    reg, plan = CaptureRegistry(), StoragePlan()
    w = torch.randn(8, 4)
    _store(plan, _cap(reg, w), "/op/1/input/w")
    reg.before_write(w)         # what the mode does before an op writes w's storage
    w.add_(1)
    assert _store(plan, _cap(reg, w), "/op/2/input/w").kind == NEW
    # a write the version counter sees but the registry does not (e.g. under no_grad)
    x = torch.randn(4)
    _store(plan, _cap(reg, x), "/op/3/input/x")
    x.mul_(2)
    assert _store(plan, _cap(reg, x), "/op/4/input/x").kind == NEW
    assert _store(plan, _cap(reg, x[1:]), "/op/5/input/x").kind == VIEW


def test_conj_and_neg_bits_are_new_data_never_a_link_or_view_of_the_storage():
    reg, plan = CaptureRegistry(), StoragePlan()
    z = torch.randn(6, dtype=torch.complex64)
    _store(plan, _cap(reg, z), "/op/1/input/z")
    c = _store(plan, _cap(reg, z.conj()), "/op/2/input/zc")
    n = _store(plan, _cap(reg, z.conj()._neg_view()), "/op/3/input/zn")
    assert c.kind == NEW and n.kind == NEW
    # the same conj view again is the conj view stored before
    assert _store(plan, _cap(reg, z.conj()), "/op/4/input/zc")[:2] == (LINK, "/op/2/input/zc")


def test_a_freed_storage_is_forgotten_so_its_address_reused_is_new_data():
    reg, plan = CaptureRegistry(), StoragePlan()
    seen = set()
    for i in range(3000):       # the allocator hands the same few addresses out again
        t = torch.full((16,), float(i))
        cap = _cap(reg, t)
        p = _store(plan, cap, f"/op/{i}/input/t")
        assert p.kind == NEW, i     # never a link or view of a dead storage at that address
        seen.add(cap.ptr)
        del t, cap
        gc.collect(0)
    assert len(seen) < 3000         # (addresses were reused: the case this guards)
    # dead entries do not pile up (a list of them per address made lookups grow per op)
    assert len(plan._exact) < 2048 and sum(len(v) for v in plan._bases.values()) < 2048


def test_statistics_plan_shares_w_and_w_t_and_plans_no_views():
    reg, plan = CaptureRegistry(), StoragePlan(views=False)
    w = torch.randn(8, 4)
    _store(plan, _cap(reg, w), ("stats of w",))
    assert _store(plan, _cap(reg, w.t()), None)[:2] == (LINK, ("stats of w",))
    assert _store(plan, _cap(reg, w[2:5]), ("rows",)).kind == NEW


def test_no_dedup_makes_everything_new():
    reg, plan = CaptureRegistry(), StoragePlan(dedup=False)
    w = torch.randn(8, 4)
    assert [_store(plan, _cap(reg, t), "/p").kind for t in (w, w, w.t())] == [NEW] * 3
    assert plan.num_datasets == 3


def test_deferred_dtype_only_for_large_natively_stored_strided_tensors():
    reg = CaptureRegistry()
    big, small = torch.randn(256, 256), torch.randn(4)
    assert deferred_dtype(_cap(reg, big), big) == big.numpy().dtype
    assert deferred_dtype(_cap(reg, big.t()), big.t()) is not None    # re-laid-out by the data thread
    assert deferred_dtype(_cap(reg, small), small) is None
    bf = torch.randn(256, 256).to(torch.bfloat16)
    assert str(deferred_dtype(_cap(reg, bf), bf)) == "uint16"       # bf16 stored as its bits
