"""The reference MLP: 6 x (Linear + GELU), then LayerNorm; MSE loss.

Its "full" size (width 1024, batch 64, fp32) is the project's benchmark workload,
the same network the msprobe numbers in docs were measured on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .registry import FULL, TINY, ModelSpec, register


class ReferenceMLP(nn.Module):
    def __init__(self, width: int = 1024, depth: int = 6):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.act = nn.GELU()
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        for layer in self.layers:
            x = self.act(layer(x))
        return self.norm(x)


def _inputs(gen, batch, cfg):
    x = torch.randn(batch, cfg["width"], generator=gen)
    target = torch.randn(batch, cfg["width"], generator=gen)
    return x, target


SPEC = register(ModelSpec(
    name="mlp",
    description="reference MLP: 6 x Linear(1024,1024)+GELU, LayerNorm; MSE loss (the benchmark workload)",
    factory=ReferenceMLP,
    inputs=_inputs,
    loss_fn=F.mse_loss,
    configs={FULL: {"width": 1024, "depth": 6}, TINY: {"width": 32, "depth": 6}},
    default_batch={FULL: 64, TINY: 4},
    features=("linear", "gelu", "layer_norm", "mse_loss"),
))
