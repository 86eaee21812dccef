"""Dumps of one training step of a tiny transformer LM: a single-process reference on the
full batch and 2-rank gloo runs (DDP, FSDP2, tensor parallel) on CPU, each rank holding its
part of the batch. Reusable run builders for the distributed compare tests.

`build_runs(out, cases)` spawns 2 ranks once (tests/_dist_common.py) and writes, under `out`:
  ref.h5                      the single-process reference (written before the spawn)
  ref_w24.h5                  the same for a wider model (not a reference of these runs)
  <case>/lm_rank{0,1}.h5      one folder per case of `cases` (see CASES)
The model, its initial weights and the global batch are the same everywhere (seeded), so
every clean run's rank holds exactly its rows of the reference's batch.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ._dist_common import Block, dump_step as _dump, spawn

VOCAB, WIDTH, HEADS, SEQ, BATCH = 32, 16, 2, 8, 4


class TinyLM(torch.nn.Module):
    def __init__(self, width: int = WIDTH):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, width)
        self.blocks = torch.nn.ModuleList([Block(width, HEADS) for _ in range(2)])
        self.head = torch.nn.Linear(width, VOCAB)

    def forward(self, tokens):
        x = self.emb(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def model(width: int = WIDTH) -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(width)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def rows_of(rank: int, world: int, split: str) -> list[int]:
    """The rows of the global batch a rank holds: DistributedSampler's default interleaving
    (rank, rank + world, ...) or contiguous blocks."""
    if split == "interleaved":
        return list(range(rank, BATCH, world))
    per = BATCH // world
    return list(range(rank * per, (rank + 1) * per))


def step(net, tokens, targets):
    logits = net(tokens)
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def dump_step(net, tokens, targets, path: str) -> None:
    _dump(lambda: step(net, tokens, targets), path)


def reference(out: str, name: str = "ref.h5", width: int = WIDTH) -> str:
    tokens, targets = batch()
    path = os.path.join(out, name)
    dump_step(model(width), tokens, targets, path)
    return path


def _ddp(net, rank, world):
    from torch.nn.parallel import DistributedDataParallel
    return DistributedDataParallel(net)


def _fsdp(net, rank, world):
    from torch.distributed.fsdp import fully_shard
    for b in net.blocks:
        fully_shard(b)
    return fully_shard(net)


def _tp(net, rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    for b in net.blocks:
        parallelize_module(b.mlp, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    return net


def _weight_off(net, rank):
    """Rank 1's first MLP weight 5% off (after the wrapper's broadcast from rank 0)."""
    if rank == 1:
        with torch.no_grad():
            net.blocks[0].mlp.fc1.weight.mul_(1.05)


def _eps_off(net, rank):
    if rank == 1:
        net.blocks[1].ln2.eps = 1e-1


# case name -> (wrapper, batch split, fault planted after wrapping[, trains with a GradScaler])
CASES = {
    "ddp_interleaved": (_ddp, "interleaved", None),
    "ddp_contiguous": (_ddp, "contiguous", None),
    "ddp_weight_bug": (_ddp, "interleaved", _weight_off),
    "ddp_eps_bug": (_ddp, "interleaved", _eps_off),
    "fsdp2": (_fsdp, "interleaved", None),
    "tp": (_tp, "all", None),
    # fp32 with a loss scaler against the reference without one: every gradient 65536x
    "ddp_scaled": (_ddp, "interleaved", None, True),
    "fsdp2_scaled": (_fsdp, "interleaved", None, True),
}


def _rank_main(rank: int, world: int, out: str, cases: tuple[str, ...]) -> None:
    import torch.distributed as dist

    tokens, targets = batch()
    for case in cases:
        wrap, split, fault, *scaled = CASES[case]
        net = model()
        wrapped = wrap(net, rank, world)
        if fault is not None:
            fault(net, rank)
        rows = list(range(BATCH)) if split == "all" else rows_of(rank, world, split)
        folder = os.path.join(out, case)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, "lm.h5")
        if scaled and scaled[0]:
            _scaled_step(wrapped, tokens[rows], targets[rows], path)
        else:
            dump_step(wrapped, tokens[rows], targets[rows], path)
        dist.barrier()


def _scaled_step(net, tokens, targets, path: str) -> None:
    """dump_step with a torch.amp.GradScaler at 65536 (forward, scaled backward)."""
    import npu_dumper  # noqa: F401 - installs torch.utils.dumper

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    with torch.utils.dumper(use_dump=True, dump_path=path):
        scaler.scale(step(net, tokens, targets)).backward()


def build_runs(out, cases=tuple(CASES), world: int = 2) -> str:
    """ref.h5 and ref_w24.h5 (single process), then `world` gloo ranks writing one folder
    per case under `out`."""
    out = str(out)
    os.makedirs(out, exist_ok=True)
    reference(out)
    reference(out, "ref_w24.h5", width=24)      # a reference of another model (wider)
    spawn(_rank_main, (out, tuple(cases)), world)
    return out
