"""Per-layer numbers behind docs/COMPARE.md "Scale on paper" (needs torch; CPU).

    python benchmarks/bench_scale_layer.py

A Llama-style decoder layer (RMSNorm, q/k/v/o projections, rotary embedding, SDPA, gated
SiLU MLP with FF/H = 11008/4096) at a toy size, one training step (forward, backward,
AdamW foreach step) dumped with 1 and 3 layers: the difference is one layer. Prints
- statistics mode: ops and tensor rows per layer, file bytes per row;
- full mode: stored bytes per layer at two token counts; the part that grows with the
  tokens (activations, in H-sized vectors per token) and the part that does not
  (weights, gradients, optimizer state and the foreach ops' intermediates, in copies of
  the layer's parameters).
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import npu_dumper  # noqa: E402
from accucmp.compare.streaming import compare_to_csv  # noqa: E402
from dumpfile import DumpFile  # noqa: E402

H, FF, NH, B = 64, 172, 4, 2


class RMS(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(H))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w


def rope(x, cos, sin):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return x * cos + torch.cat((-x2, x1), -1) * sin


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.n1, self.n2 = RMS(), RMS()
        self.q, self.k, self.v, self.o = (nn.Linear(H, H, bias=False) for _ in range(4))
        self.g, self.u = nn.Linear(H, FF, bias=False), nn.Linear(H, FF, bias=False)
        self.d = nn.Linear(FF, H, bias=False)

    def forward(self, x, cos, sin):
        h = self.n1(x)
        b, t = x.shape[:2]
        q, k, v = (m(h).view(b, t, NH, H // NH).transpose(1, 2) for m in (self.q, self.k, self.v))
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, H)
        x = x + self.o(a)
        h = self.n2(x)
        return x + self.d(F.silu(self.g(h)) * self.u(h))


def step_dump(n_layers, tokens, path, stats_only):
    torch.manual_seed(0)
    layers = nn.ModuleList(Layer() for _ in range(n_layers))
    opt = torch.optim.AdamW(layers.parameters(), foreach=True)
    t = tokens // B
    x = torch.randn(B, t, H)
    pos = torch.arange(t)[:, None] / 10.0
    cos, sin = torch.cos(pos).repeat(1, H // NH), torch.sin(pos).repeat(1, H // NH)
    with npu_dumper.dumper(use_dump=True, dump_path=path, stats_only=stats_only):
        y = x
        for layer in layers:
            y = layer(y, cos, sin)
        y.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return sum(p.numel() for p in layers.parameters()) // n_layers


def stored_bytes(path):
    import h5py

    total = 0

    def visit(_name, obj):
        nonlocal total
        if isinstance(obj, h5py.Dataset) and obj.size:
            total += obj.size * obj.dtype.itemsize

    with DumpFile(path) as f:
        for o in f.ops():
            f.h5[o.path].visititems(visit)
    return total


def main():
    d = tempfile.mkdtemp(prefix="bench_scale_")
    ops, rows, size = {}, {}, {}
    for n in (1, 3):
        p = os.path.join(d, f"s{n}.h5")
        step_dump(n, 32, p, True)
        with DumpFile(p) as f:
            ops[n] = len(f.ops())
        rows[n] = compare_to_csv(p, p, os.path.join(d, f"s{n}.csv")).rows
        size[n] = os.path.getsize(p)
    print(f"statistics: {(ops[3] - ops[1]) / 2:.0f} ops and {(rows[3] - rows[1]) / 2:.0f} tensor rows per layer "
          f"per step; {size[3] / rows[3]:.0f} file bytes per row")
    per_layer = {}
    for tokens in (32, 64):
        b = {}
        for n in (1, 3):
            p = os.path.join(d, f"f{n}_{tokens}.h5")
            params = step_dump(n, tokens, p, False)
            b[n] = stored_bytes(p)
        per_layer[tokens] = (b[3] - b[1]) / 2
        print(f"full, {tokens} tokens: {per_layer[tokens] / 1e6:.2f} MB stored per layer (fp32, H={H})")
    act = (per_layer[64] - per_layer[32]) / 32          # bytes per token per layer
    fixed = per_layer[32] - 32 * act
    print(f"full: activations {act / (H * 4):.0f} H-sized vectors per token per layer; the rest "
          f"{fixed / (params * 4):.1f} copies of the layer's {params} parameters")


if __name__ == "__main__":
    main()
