"""The sample-model registry: one ModelSpec per model, looked up by name.

A spec is data (how to build the model, make its inputs, compute its loss), so that
tools, tests and the demo treat every model the same way and a new model is one
`register()` call, never a new branch somewhere else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

FULL = "full"   # the documented size (the MLP's "full" is the benchmark workload)
TINY = "tiny"   # a few thousand parameters: for tests


@dataclass(frozen=True)
class ModelSpec:
    """How to run one training step of a sample model.

    `configs` maps a size name ("full", "tiny", ...) to the keyword arguments of
    `factory` (the model's constructor) plus the input geometry; `inputs` builds
    (input, target) from a torch.Generator, a batch size and that config.
    """

    name: str
    description: str
    factory: Callable[..., nn.Module]
    inputs: Callable[[torch.Generator, int, dict], tuple[torch.Tensor, torch.Tensor]]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    configs: dict[str, dict[str, Any]]
    default_batch: dict[str, int]
    # Which kinds of op the model exercises; docs and tests read it, nothing branches on it.
    features: tuple[str, ...] = field(default=())

    @property
    def sizes(self) -> tuple[str, ...]:
        return tuple(self.configs)

    def _config(self, size: str) -> dict[str, Any]:
        try:
            return self.configs[size]
        except KeyError:
            raise ValueError(
                f"sample model {self.name!r} has no size {size!r}; sizes: {', '.join(self.configs)}"
            ) from None

    def build(self, seed: int = 0, size: str = FULL) -> nn.Module:
        """The model with parameters drawn from `seed`; the global RNG is left untouched."""
        cfg = self._config(size)
        model_kwargs = {k: v for k, v in cfg.items() if not k.startswith("input_")}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = self.factory(**model_kwargs)
        return model.train()

    def make_inputs(self, seed: int = 0, batch: int | None = None, size: str = FULL):
        """(input, target) drawn from `seed`: the same seed gives the same tensors."""
        cfg = self._config(size)
        gen = torch.Generator().manual_seed(seed)
        return self.inputs(gen, batch or self.default_batch[size], cfg)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(output, target)

    def train_step(self, model: nn.Module, inputs) -> torch.Tensor:
        """Forward, loss and backward of one step (no optimizer); returns the loss, detached.

        Gradients are zeroed first (set to None) so a repeated step is the same step.
        """
        model.zero_grad(set_to_none=True)
        x, target = inputs
        loss = self.loss(model(x), target)
        loss.backward()
        return loss.detach()


MODELS: dict[str, ModelSpec] = {}


def image_classification_inputs(gen: torch.Generator, batch: int, cfg: dict):
    """RGB images of cfg["input_hw"] pixels and class labels below cfg["num_classes"]."""
    hw = cfg["input_hw"]
    x = torch.randn(batch, 3, hw, hw, generator=gen)
    target = torch.randint(0, cfg["num_classes"], (batch,), generator=gen)
    return x, target


def register(spec: ModelSpec) -> ModelSpec:
    if spec.name in MODELS:
        raise ValueError(f"sample model {spec.name!r} is already registered")
    MODELS[spec.name] = spec
    return spec


def get(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise KeyError(f"no sample model {name!r}; known: {', '.join(sorted(MODELS))}") from None


def names() -> list[str]:
    return list(MODELS)
