"""Dumps of one training step of a tiny transformer LM under tensor parallel, FSDP2 and DDP
(2 gloo ranks, CPU) and of the single-process reference, for the sharded-compare tests.

    runs = dump_runs(out_dir, ("ref", "tp", "tp_bug", "fsdp", "ddp"))
    # out_dir/ref.h5, out_dir/tp/d_rank{0,1}.h5, ...

The model: embedding, one block (LayerNorm, attention with SDPA, LayerNorm, GELU MLP), an
LM head. TP parallelizes the block's MLP (fc1 ColwiseParallel, fc2 RowwiseParallel) and
every rank sees the whole batch; FSDP2 (`fully_shard` on the block and the root) and DDP
give each rank half the batch. "tp_bug" is TP with rank 1's local shard of fc1.weight
scaled by 1.05 (one shard wrong, rank 0's right); "tp_ln_bug" TP with rank 1's copy of
the (replicated, not parallelized) ln2.weight scaled by 1.05; "fsdp_bf16" FSDP2 under a
MixedPrecisionPolicy (bfloat16 parameters, float32 reduction); "fsdp_bug" FSDP2 with rank 1's
shard of fc1.weight scaled by 1.05, "fsdp_bf16_bug" the same under the bfloat16 policy,
"fsdp_bf16_replay" each rank of the bfloat16-policy run load-replaying its rank of "fsdp"
(which must come before it in `kinds`); "sp" sequence parallel (SPBlock: LayerNorm sharded on the
sequence dim, the MLP's fc1 Colwise from and fc2 Rowwise to sequence shards), against the
reference of its own model, ref_sp.h5.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ._dist_common import Block as _Block, dump_step, spawn

VOCAB, DIM, HIDDEN, SEQ, BATCH = 16, 16, 32, 4, 4      # HIDDEN: the shared block's 2 x DIM
BUG_SCALE = 1.05


class SPBlock(torch.nn.Module):
    """Block whose feed-forward half (LayerNorm and MLP) is one module, `ffn`, so that a
    sequence-parallel plan can shard it on the sequence dim."""

    def __init__(self):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(DIM)
        self.qkv = torch.nn.Linear(DIM, 3 * DIM)
        self.proj = torch.nn.Linear(DIM, DIM)
        self.ffn = torch.nn.Sequential()
        self.ffn.add_module("ln2", torch.nn.LayerNorm(DIM))
        self.ffn.add_module("fc1", torch.nn.Linear(DIM, HIDDEN))
        self.ffn.add_module("act", torch.nn.GELU())
        self.ffn.add_module("fc2", torch.nn.Linear(HIDDEN, DIM))

    def forward(self, x):
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        x = x + self.proj(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.ffn(x)


class TinyLM(torch.nn.Module):
    def __init__(self, block=None):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.block = block() if block is not None else _Block(DIM)
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        return self.head(self.block(self.emb(tokens)))


def batch():
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(logits, labels):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def _model(kind: str = "") -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(SPBlock if kind == "sp" else None)


def _wrap(kind: str, net: TinyLM, world: int):
    if kind == "sp":        # sequence parallel: the feed-forward half sharded on the sequence dim
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInputOutput, RowwiseParallel,
                                                       SequenceParallel, parallelize_module)
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        parallelize_module(net.block, mesh, {
            "ffn": PrepareModuleInputOutput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                            output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),),
                                            use_local_input=False, use_local_output=True),
            "ffn.ln2": SequenceParallel(),
            "ffn.fc1": ColwiseParallel(input_layouts=Shard(1)),
            "ffn.fc2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)})
        return net
    if kind.startswith("tp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        parallelize_module(net.block.mlp, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        if kind == "tp_bug" and dist.get_rank() == 1:
            with torch.no_grad():
                net.block.mlp.fc1.weight.to_local().mul_(BUG_SCALE)
        if kind == "tp_ln_bug" and dist.get_rank() == 1:      # a replicated weight off on one rank
            with torch.no_grad():
                net.block.ln2.weight.mul_(BUG_SCALE)
        return net
    if kind.startswith("fsdp"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if kind.startswith("fsdp_bf16") else MixedPrecisionPolicy()
        fully_shard(net.block, mp_policy=mp)
        model = fully_shard(net, mp_policy=mp)
        if kind in ("fsdp_bug", "fsdp_bf16_bug") and dist.get_rank() == 1:   # rank 1's shard (rows 16:32) of fc1.weight
            with torch.no_grad():
                net.block.mlp.fc1.weight.to_local().mul_(BUG_SCALE)
        return model
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel(net)
    raise ValueError(kind)


def _step(model, tokens, labels, path: str) -> None:
    dump_step(lambda: _loss(model(tokens), labels), path)


def _ranks(rank: int, world: int, out: str, kinds: tuple[str, ...]) -> None:
    tokens, labels = batch()
    for kind in kinds:
        model = _wrap(kind, _model(kind), world)
        if not kind.startswith(("tp", "sp")):       # data parallel: each rank its half of the batch
            tokens_r, labels_r = tokens.chunk(world)[rank], labels.chunk(world)[rank]
        else:
            tokens_r, labels_r = tokens, labels
        os.makedirs(os.path.join(out, kind), exist_ok=True)
        if kind == "fsdp_bf16_replay":      # each rank load-replays its rank of the fp32 "fsdp" run
            import npu_dumper  # noqa: F401 - installs torch.utils.dumper
            with torch.utils.dumper(use_load=True, load_file_path=os.path.join(out, "fsdp", f"d_rank{rank}.h5"),
                                    dump_path=os.path.join(out, kind, "d.h5")):
                _loss(model(tokens_r), labels_r).backward()
        else:
            _step(model, tokens_r, labels_r, os.path.join(out, kind, "d.h5"))
        dist.barrier()


def dump_reference(path: str, kind: str = "") -> None:
    """The single-process run on the whole batch (the run a user trusts); kind "sp": of
    the sequence-parallel run's model (its feed-forward half is one module)."""
    tokens, labels = batch()
    _step(_model(kind), tokens, labels, path)


def dump_runs(out: str, kinds=("tp", "tp_bug", "fsdp", "ddp"), reference: bool = True) -> str:
    """Every run of `kinds` in out/KIND/d_rank{0,1}.h5 (one spawn of 2 ranks), and the
    reference in out/ref.h5 (and out/ref_sp.h5 for "sp")."""
    out = os.fspath(out)
    os.makedirs(out, exist_ok=True)
    if reference:
        dump_reference(os.path.join(out, "ref.h5"))
        if "sp" in kinds:
            dump_reference(os.path.join(out, "ref_sp.h5"), "sp")
    if kinds:
        spawn(_ranks, (out, tuple(kinds)))
    return out


if __name__ == "__main__":          # python -m tests._dist_shard_runs OUT [KIND ...]
    import sys
    dump_runs(sys.argv[1], tuple(sys.argv[2:]) or ("tp", "tp_bug", "fsdp", "ddp"))
