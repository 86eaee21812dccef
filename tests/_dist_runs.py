"""Dumps of one training step of a tiny transformer LM: a single-process reference on the
full batch and 2-rank gloo runs (DDP, FSDP2, tensor parallel) on CPU, each rank holding its
part of the batch. Reusable run builders for the distributed compare tests.

`build_runs(out, cases)` spawns 2 ranks once (init via file://) and writes, under `out`:
  ref.h5                      the single-process reference (rank 0 writes it before init)
  ref_w24.h5                  the same for a wider model (not a reference of these runs)
  <case>/lm_rank{0,1}.h5      one folder per case of `cases` (see CASES)
The model, its initial weights and the global batch are the same everywhere (seeded), so
every clean run's rank holds exactly its rows of the reference's batch.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

VOCAB, WIDTH, HEADS, SEQ, BATCH = 32, 16, 2, 8, 4


class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int, eps: float = 1e-5):
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(d, eps=eps)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.ln2 = torch.nn.LayerNorm(d, eps=eps)
        self.mlp = torch.nn.Sequential()
        self.mlp.fc1 = torch.nn.Linear(d, 2 * d)
        self.mlp.act = torch.nn.GELU()
        self.mlp.fc2 = torch.nn.Linear(2 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


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


def step(net, tokens, targets) -> None:
    logits = net(tokens)
    F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)).backward()


def dump_step(net, tokens, targets, path: str) -> None:
    import npu_dumper  # noqa: F401 - installs torch.utils.dumper

    with torch.utils.dumper(use_dump=True, dump_path=path):
        step(net, tokens, targets)


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


# case name -> (wrapper, batch split, fault planted after wrapping)
CASES = {
    "ddp_interleaved": (_ddp, "interleaved", None),
    "ddp_contiguous": (_ddp, "contiguous", None),
    "ddp_weight_bug": (_ddp, "interleaved", _weight_off),
    "ddp_eps_bug": (_ddp, "interleaved", _eps_off),
    "fsdp2": (_fsdp, "interleaved", None),
    "tp": (_tp, "all", None),
}


def _rank_main(rank: int, world: int, init_file: str, out: str, cases: tuple[str, ...]) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    if rank == 0:                        # before init: plain single-process dumps
        reference(out)
        reference(out, "ref_w24.h5", width=24)      # a reference of another model (wider)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        tokens, targets = batch()
        for case in cases:
            wrap, split, fault = CASES[case]
            net = model()
            wrapped = wrap(net, rank, world)
            if fault is not None:
                fault(net, rank)
            rows = list(range(BATCH)) if split == "all" else rows_of(rank, world, split)
            folder = os.path.join(out, case)
            os.makedirs(folder, exist_ok=True)
            dump_step(wrapped, tokens[rows], targets[rows], os.path.join(folder, "lm.h5"))
            dist.barrier()
    finally:
        dist.destroy_process_group()


def build_runs(out, cases=tuple(CASES), world: int = 2) -> str:
    """Spawn `world` gloo ranks that write ref.h5 and one folder per case under `out`."""
    import torch.multiprocessing as mp

    out = str(out)
    os.makedirs(out, exist_ok=True)
    mp.spawn(_rank_main, args=(world, os.path.join(out, "init"), out, tuple(cases)), nprocs=world)
    return out
