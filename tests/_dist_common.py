"""What the distributed run builders share (tests/_dist_runs.py, tests/_dist_shard_runs.py):
the transformer block of their tiny LMs, one training step dumped, and 2 gloo ranks spawned
on CPU (init over a free local port)."""

from __future__ import annotations

import os
import socket

import torch
import torch.nn.functional as F


class Block(torch.nn.Module):
    """LayerNorm, attention (SDPA, causal), LayerNorm, GELU MLP (width 2d). `heads`: the
    attention split into heads (q, k, v viewed (b, heads, t, d/heads)); None: one head on
    the (b, t, d) tensors as they are."""

    def __init__(self, d: int, heads: int | None = None, eps: float = 1e-5):
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
        if self.heads is None:
            q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
            x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
            return x + self.mlp(self.ln2(x))
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


def dump_step(loss_of, path: str) -> None:
    """One training step (`loss_of()` the forward and loss, then backward) dumped to `path`."""
    import npu_dumper  # noqa: F401 - installs torch.utils.dumper

    with torch.utils.dumper(use_dump=True, dump_path=path):
        loss_of().backward()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, entry, args: tuple) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        entry(rank, world, *args)
    finally:
        dist.destroy_process_group()


def spawn(entry, args: tuple = (), world: int = 2) -> None:
    """`entry(rank, world, *args)` on `world` gloo ranks (a module-level function: it is
    pickled to the spawned processes), the process group set up and torn down around it."""
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(world, _free_port(), entry, tuple(args)), nprocs=world)
