"""A user's own porting bugs (issue 31): one small model, and the same model with one bug.

The model is conv + BatchNorm feeding a transformer block (LayerNorm, SDPA attention, GELU
MLP, residual adds), the shape of what users port. `make(bug)` builds it with one
deliberate departure from the golden model; `step(model, x)` runs one forward+backward.
The golden run is `make("clean")` in float32; targets run the buggy model under CPU bf16
(or fp16) autocast, so every test also carries the by-design differences of a low
precision run (dtype casts) that must NOT be findings.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

# bug -> (what a user did, the module path a verdict must name)
BUGS = {
    "clean": ("nothing", ""),
    "inserted": ("an extra module multiplies an activation by 1.05", "block.mlp.scale"),
    "eps": ("a LayerNorm's eps 1e-5 -> 1e-1", "block.ln2"),
    "swapped": ("GELU replaced by SiLU", "block.mlp.act"),
    "sdpa_scale": ("SDPA called with scale=1.0", "block.attn"),
    "missing": ("a residual add left out", "block"),
    "weight": ("one Linear's weight 5% off (bad checkpoint conversion)", "block.mlp.fc2"),
}


class Scale(nn.Module):
    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, scale: float | None = None):
        super().__init__()
        self.heads, self.scale = heads, scale
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        kw = {} if self.scale is None else {"scale": self.scale}
        y = F.scaled_dot_product_attention(q, k, v, **kw)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, dim: int, act: nn.Module, scale: float | None = None):
        super().__init__()
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.act = act
        if scale is not None:
            self.scale = Scale(scale)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        x = self.act(self.fc1(x))
        if hasattr(self, "scale"):
            x = self.scale(x)
        return self.fc2(x)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, *, eps2: float = 1e-5, act=None, mlp_scale=None,
                 attn_scale=None, residual2: bool = True):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, attn_scale)
        self.ln2 = nn.LayerNorm(dim, eps=eps2)
        self.mlp = MLP(dim, act if act is not None else nn.GELU(), mlp_scale)
        self.residual2 = residual2

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        y = self.mlp(self.ln2(x))
        return x + y if self.residual2 else y


class ConvTransformer(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4, **block_kw):
        super().__init__()
        self.conv = nn.Conv2d(3, dim, 3, padding=1)
        self.bn = nn.BatchNorm2d(dim)
        self.block = Block(dim, heads, **block_kw)
        self.head = nn.Linear(dim, 10)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x)))            # (b, dim, 4, 4)
        h = h.flatten(2).transpose(1, 2)                 # (b, 16, dim)
        h = self.block(h)
        return self.head(h.mean(dim=1))


def make(bug: str = "clean", seed: int = 0) -> nn.Module:
    """The golden model (bug "clean") or the same weights with one bug."""
    torch.manual_seed(seed)
    golden = ConvTransformer()
    if bug == "clean":
        return golden
    kw = {"inserted": dict(mlp_scale=1.05), "eps": dict(eps2=1e-1), "swapped": dict(act=nn.SiLU()),
          "sdpa_scale": dict(attn_scale=1.0), "missing": dict(residual2=False)}.get(bug, {})
    if bug not in BUGS:
        raise ValueError(bug)
    model = ConvTransformer(**kw)
    model.load_state_dict(golden.state_dict(), strict=True)
    if bug == "weight":
        with torch.no_grad():
            model.block.mlp.fc2.weight.mul_(1.05)
    return model


def inputs(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 3, 4, 4, generator=g), torch.randint(0, 10, (4,), generator=g)


def step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """One training step's forward+backward, under CPU autocast to `dtype` when given."""
    if dtype is None:
        loss = F.cross_entropy(model(x), y)
    else:
        with torch.autocast("cpu", dtype=dtype):
            loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss.detach()


def clone(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)
