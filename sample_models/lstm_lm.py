"""An LSTM language model: embedding, 2-layer LSTM, tied-size decoder; next-token cross-entropy."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .registry import FULL, TINY, ModelSpec, register


class LSTMLanguageModel(nn.Module):
    def __init__(self, vocab: int = 256, embed: int = 64, hidden: int = 128, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.lstm = nn.LSTM(embed, hidden, num_layers=layers, batch_first=True)
        self.decoder = nn.Linear(hidden, vocab)

    def forward(self, tokens):
        out, _ = self.lstm(self.embed(tokens))
        return self.decoder(out)


def _inputs(gen, batch, cfg):
    # One sequence of length+1 tokens: inputs are the first `length`, targets the next ones.
    seq = torch.randint(0, cfg["vocab"], (batch, cfg["input_length"] + 1), generator=gen)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def _next_token_loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


SPEC = register(ModelSpec(
    name="lstm_lm",
    description="LSTM language model: embedding, 2-layer LSTM, linear decoder; next-token cross-entropy",
    factory=LSTMLanguageModel,
    inputs=_inputs,
    loss_fn=_next_token_loss,
    configs={
        FULL: {"vocab": 256, "embed": 64, "hidden": 128, "layers": 2, "input_length": 32},
        TINY: {"vocab": 16, "embed": 8, "hidden": 8, "layers": 2, "input_length": 4},
    },
    default_batch={FULL: 16, TINY: 2},
    features=("embedding", "lstm", "sigmoid", "tanh", "linear", "cross_entropy"),
))
