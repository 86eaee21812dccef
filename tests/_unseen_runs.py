"""Models the distributed compare was not written against, tried as a user would: a Hugging
Face GPT-2 (tiny GPT2Config, no download; dropout 0) and a small CNN with BatchNorm, one
training step each. `build(out, runs)` writes out/<kind>/ref.h5 (single process, full batch)
and out/<kind>/<case>/d_rank{0,1}.h5 (2 gloo ranks, interleaved halves of the batch) for
each (kind, case) of `runs`, in one spawn. Cases: ddp, fsdp, fsdp_bf16 and their _weight_bug
(rank 1's first MLP / conv weight 5% off) and _eps_bug (rank 1's LayerNorm / BatchNorm eps
0.1) variants.
"""

import contextlib
import os

import torch
import torch.distributed as dist

from ._dist_common import spawn


B, T, V = 4, 8, 100

def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=V, n_positions=16,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)

class CNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.fc = torch.nn.Linear(8, 10)
    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))

def cnn():
    torch.manual_seed(0)
    return CNN()

def data(kind):
    g = torch.Generator().manual_seed(3)
    if kind == "cnn":
        return torch.randn(B, 3, 6, 6, generator=g), torch.randint(0, 10, (B,), generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    return ids, ids

def loss(kind, net, x, y):
    if kind == "cnn":
        return torch.nn.functional.cross_entropy(net(x), y)
    return net(input_ids=x, labels=y).loss

def step(kind, net, x, y, path, autocast=False):
    import npu_dumper  # noqa
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with torch.utils.dumper(use_dump=True, dump_path=path):
        with ctx:
            l = loss(kind, net, x, y)
        l.backward()

def wrap(case, net):
    if case.startswith("ddp"):
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel(net)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if "bf16" in case else MixedPrecisionPolicy()
    blocks = net.transformer.h if hasattr(net, "transformer") else []
    for b in blocks:
        fully_shard(b, mp_policy=mp)
    return fully_shard(net, mp_policy=mp)

def plant(case, kind, net, rank):
    if rank != 1:
        return
    if case.endswith("weight_bug"):
        w = net.transformer.h[0].mlp.c_fc.weight if kind == "gpt2" else net.conv.weight
        with torch.no_grad():
            (w.to_local() if hasattr(w, "to_local") else w).mul_(1.05)
    if case.endswith("eps_bug"):
        if kind == "gpt2":
            net.transformer.h[1].ln_2.eps = 1e-1
        else:
            net.bn.eps = 1e-1

def _model(kind):
    return gpt2() if kind == "gpt2" else cnn()


def _ranks(rank, world, out, runs):
    rows = list(range(rank, B, world))
    for kind, case in runs:
        x, y = data(kind)
        net = _model(kind)
        m = wrap(case, net)
        plant(case, kind, net, rank)
        os.makedirs(os.path.join(out, kind, case), exist_ok=True)
        step(kind, m, x[rows], y[rows], os.path.join(out, kind, case, "d.h5"))
        dist.barrier()


def build(out, runs) -> str:
    """Spawn 2 gloo ranks once for every (kind, case) of `runs`; the references first."""
    out = os.fspath(out)
    for kind in sorted({k for k, _ in runs}):
        os.makedirs(os.path.join(out, kind), exist_ok=True)
        x, y = data(kind)
        step(kind, _model(kind), x, y, os.path.join(out, kind, "ref.h5"))
    spawn(_ranks, (out, tuple(runs)))
    return out

