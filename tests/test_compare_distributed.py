"""Compares of distributed runs (issue 33): real dumps of 2 gloo ranks on CPU, one spawn for
the module. DDP under bf16 autocast against DDP in fp32 (the reducer's `mul.out` calls come
in another order), a DDP-wrapped model against the unwrapped one (`module.` paths), and
FSDP2's device mesh in the root's parallel layout."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

from dumpfile import DumpFile

from ._dist_common import spawn

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


class Up(torch.nn.Module):
    """A Linear, `fused`: as nn.Linear (addmm in `up.lin`); else written out in this block's
    forward as x @ W.t() + b (mm, add in `up`)."""

    def __init__(self, fused: bool):
        super().__init__()
        self.fused, self.lin = fused, torch.nn.Linear(32, 64)

    def forward(self, x):
        return self.lin(x) if self.fused else x @ self.lin.weight.t() + self.lin.bias


class Net(torch.nn.Module):
    """An LM's pieces at toy size: embedding, an MLP block, LayerNorm, head."""

    def __init__(self, fused: bool = True):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 32)
        self.up = Up(fused)
        self.down = torch.nn.Linear(64, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.head = torch.nn.Linear(32, 16)

    def forward(self, tok):
        h = self.emb(tok)
        return self.head(self.norm(h + self.down(torch.nn.functional.gelu(self.up(h)))))


def _batch(rank: int) -> torch.Tensor:
    return torch.randint(0, 16, (2, 8), generator=torch.Generator().manual_seed(10 + rank))


def _ranks(rank, world, out):
    import contextlib

    import npu_dumper  # noqa: F401 - installs torch.utils.dumper
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    for name, autocast in (("ddp_fp32", False), ("ddp_bf16", True)):
        torch.manual_seed(0)
        model = DDP(Net())
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with torch.utils.dumper(dump_path=os.path.join(out, name, "d.h5")):
            with ctx:
                y = model(_batch(rank))
            y.float().sum().backward()
    torch.manual_seed(0)          # the wrapped model's `module.up` only
    model = DDP(Net())
    with torch.utils.dumper(dump_path=os.path.join(out, "ddp_up", "d.h5"), modules=["module.up"]):
        model(_batch(rank)).sum().backward()
    torch.manual_seed(0)
    net = Net()
    for layer in (net.up, net.down):
        fully_shard(layer)
    fully_shard(net)
    with torch.utils.dumper(dump_path=os.path.join(out, "fsdp", "d.h5")):
        net(_batch(rank)).sum().backward()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import npu_dumper  # noqa: F401

    out = tmp_path_factory.mktemp("dist")
    for name in ("ddp_fp32", "ddp_bf16", "ddp_up", "fsdp"):
        (out / name).mkdir()
    spawn(_ranks, (str(out),))
    # the single-process run a user trusts: rank 0's batch, no wrapper, up.lin written out
    torch.manual_seed(0)
    with torch.utils.dumper(dump_path=str(out / "single_unfused.h5")):
        Net(fused=False)(_batch(0)).sum().backward()
    return out


def _table(target, golden):
    from accucmp.compare.pipeline import compare_dumps
    from accucmp.compare.verdict import apply_verdict

    res = compare_dumps(str(target), str(golden))
    return apply_verdict(res.table), res.meta


def test_fsdp2_dump_records_its_device_mesh(runs):
    for rank in (0, 1):
        with DumpFile(runs / "fsdp" / f"d_rank{rank}.h5") as f:
            layout = json.loads(f.attrs["parallel_layout"])
        assert layout["wrappers"] == ["fsdp2"]
        assert layout["meshes"] == [{"mesh_shape": [2], "mesh_dim_names": None, "mesh_ranks": [0, 1]}]


def test_ddp_bf16_against_fp32_pairs_no_ops_of_other_shapes(runs):
    """Under autocast the reducer scales a layer's bias gradient before its weight's: paired
    by name and k-th call, `mul.out` joined (64, 32) with (64) (8 size-mismatch rows a rank)."""
    for rank in (0, 1):
        table, meta = _table(runs / "ddp_bf16" / f"d_rank{rank}.h5", runs / "ddp_fp32" / f"d_rank{rank}.h5")
        assert (table["CompareStatus"] != "size_mismatch").all(), table[
            table["CompareStatus"] == "size_mismatch"][["NPUDump", "SeqId", "Shape", "GoldenShape"]].to_string()
        scaled = table[table["NPUDump"] == "aten.mul.out"]
        assert len(scaled) >= 16 and (scaled["Shape"] == scaled["GoldenShape"]).all()
        assert (table["Result"] != "fail").all()
        assert any("re-paired by shape" in n for n in meta["notes"])


def test_ddp_wrapped_run_pairs_with_the_unwrapped_one(runs):
    """DDP names the model's modules `module.up.lin`; the unwrapped run `up`. The fused Linear
    (addmm) aligns with the written-out x @ W.t() + b of the block around it (a region), and a
    DDP dump filtered to `module.up` selects the unwrapped run's `up` ops."""
    table, meta = _table(runs / "ddp_fp32" / "d_rank0.h5", runs / "single_unfused.h5")
    region = table[(table["MatchedBy"] == "region") & (table["Phase"] == "forward")]
    assert set(region["NPUDump"]) == {"aten.addmm"}, meta["aligned_regions"]
    assert set(region["Module"]) == {"module.up.lin"} and (region["Result"] == "pass").all()
    assert (table["Result"] != "fail").all()
    only_up, meta = _table(runs / "ddp_up" / "d_rank0.h5", runs / "single_unfused.h5")
    assert meta["golden_ops"] > 0 and (only_up["Result"] != "fail").all()
    assert (only_up["Result"] == "pass").sum() >= 4
