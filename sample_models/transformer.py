"""A Transformer encoder block (pre-norm): multi-head attention, softmax, LayerNorm, GELU MLP.

Attention is written out (matmul, scale, softmax, matmul) rather than calling
scaled_dot_product_attention, so softmax is an op of its own in a dump, the way an
NPU graph shows it; the model still has a fused-attention switch for tools that
want to see that op.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .registry import FULL, TINY, ModelSpec, register


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, fused: bool = False):
        super().__init__()
        assert dim % heads == 0, "dim must be a multiple of heads"
        self.heads, self.fused = heads, fused
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if self.fused:
            out = F.scaled_dot_product_attention(q, k, v)
        else:
            scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d // self.heads)
            out = torch.matmul(torch.softmax(scores, dim=-1), v)
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


class EncoderBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: int = 4, fused: bool = False):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads, fused)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_ratio * dim), nn.GELU(),
                                 nn.Linear(mlp_ratio * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """Token + position embedding, encoder blocks, final LayerNorm, classifier over tokens."""

    def __init__(self, vocab: int = 128, dim: int = 64, heads: int = 4, depth: int = 1,
                 max_len: int = 64, fused: bool = False):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(max_len, dim) * 0.02)
        self.blocks = nn.Sequential(*(EncoderBlock(dim, heads, fused=fused) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos[: tokens.shape[1]]
        return self.head(self.norm(self.blocks(x)))


def _inputs(gen, batch, cfg):
    seq = torch.randint(0, cfg["vocab"], (batch, cfg["input_length"] + 1), generator=gen)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def _token_loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


SPEC = register(ModelSpec(
    name="transformer",
    description="Transformer encoder block: multi-head attention, softmax, LayerNorm, GELU MLP; token cross-entropy",
    factory=TinyTransformer,
    inputs=_inputs,
    loss_fn=_token_loss,
    configs={
        FULL: {"vocab": 128, "dim": 64, "heads": 4, "depth": 2, "max_len": 64, "input_length": 32},
        TINY: {"vocab": 16, "dim": 8, "heads": 2, "depth": 1, "max_len": 8, "input_length": 4},
    },
    default_batch={FULL: 16, TINY: 2},
    features=("embedding", "linear", "matmul", "softmax", "layer_norm", "gelu", "cross_entropy"),
))
