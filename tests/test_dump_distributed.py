"""torch.distributed: one file per rank, rank in the root attributes, collectives recorded
with their inputs as before and their outputs as after the communication (2 gloo ranks)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from dumpfile import DumpFile

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _rank_step(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import npu_dumper  # noqa: F401 - installs torch.utils.dumper
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        lin = torch.nn.Linear(4, 3)
        x = torch.randn(2, 4) * (rank + 1)
        r = torch.ones(2) * (rank + 1)
        b = torch.full((2,), float(rank + 5))
        with torch.utils.dumper(use_dump=True, dump_path=os.path.join(out_dir, "d.h5")):
            lin(x).sum().backward()
            grad = lin.weight.grad
            dist.all_reduce(grad)              # in place, returns (tensors, Work)
            dist.reduce(r, dst=0)              # in place, returns only its Work
            dist.broadcast(b, src=1)
    finally:
        dist.destroy_process_group()


def _show(rec):
    return [_show(c) for c in rec.children] if rec.is_list else rec.read()


def test_each_rank_writes_its_own_file_with_collectives_before_and_after(tmp_path):
    import torch.multiprocessing as mp
    mp.spawn(_rank_step, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    grads = {}
    for rank in (0, 1):
        with DumpFile(tmp_path / f"d_rank{rank}.h5") as f:
            assert int(f.attrs["rank"]) == rank and int(f.attrs["world_size"]) == 2
            ops = {o.op: o for o in f.ops()}
            ar = ops["c10d.allreduce_.default"]
            grads[rank] = (_show(ar.inputs()["tensors"])[0], _show(ar.outputs()["result0"])[0])
            red = ops["c10d.reduce_.default"]
            assert _show(red.inputs()["tensors"])[0].tolist() == [rank + 1.0] * 2
            # a collective returning only its Work: the tensor it wrote is an output too
            assert _show(red.outputs()["tensors"])[0].tolist() == [3.0 if rank == 0 else 2.0] * 2
            bc = ops["c10d.broadcast_.default"]
            assert _show(bc.inputs()["tensors"])[0].tolist() == [rank + 5.0] * 2
            assert _show(bc.outputs()["result0"])[0].tolist() == [6.0, 6.0]
    (in0, out0), (in1, out1) = grads[0], grads[1]
    assert not (in0 == in1).all()                      # each rank's own gradient before
    torch.testing.assert_close(torch.from_numpy(out0), torch.from_numpy(in0 + in1))
    torch.testing.assert_close(torch.from_numpy(out1), torch.from_numpy(out0))


def test_rank_and_step_naming_rule_for_dump_and_load_paths(tmp_path):
    from npu_dumper.dump_paths import rank_step_name, resolve_load_path
    assert rank_step_name("run/d.h5", 1) == "run/d_rank1.h5"
    assert rank_step_name("run/d.h5", 1, 3) == "run/d_step3_rank1.h5"
    assert rank_step_name("run/d.h5", None, 3) == "run/d_step3.h5"
    assert rank_step_name("run/d.h5", None) == "run/d.h5"
    assert rank_step_name("run/d_rank1.h5", 1) == "run/d_rank1.h5"      # explicit: kept
    assert rank_step_name("run/d_rank0.h5", 1) == "run/d_rank0_rank1.h5"
    gold = tmp_path / "gold.h5"
    gold.write_bytes(b"")
    # no per-rank file: the one golden serves every rank
    assert resolve_load_path(str(gold), 1, 2) == str(gold)
    (tmp_path / "gold_rank1.h5").write_bytes(b"")
    assert resolve_load_path(str(gold), 1, 2) == str(tmp_path / "gold_rank1.h5")
    (tmp_path / "gold_step2_rank1.h5").write_bytes(b"")
    assert resolve_load_path(str(gold), 1, 2) == str(tmp_path / "gold_step2_rank1.h5")
    assert resolve_load_path(str(gold), 0, 2) == str(gold)
    assert resolve_load_path(str(gold), None) == str(gold)


def test_step_must_be_a_non_negative_int():
    import npu_dumper
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(npu_dumper.DumperError, match="step must be"):
            torch.utils.dumper(dump_path="x.h5", step=bad)
