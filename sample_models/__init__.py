"""Deterministic, CPU-friendly sample models for tests, benchmarks and `accucmp demo`.

    import sample_models
    spec = sample_models.get("mlp")
    model = spec.build(seed=0, size="tiny")
    inputs = spec.make_inputs(seed=0, size="tiny")
    loss = spec.train_step(model, inputs)     # forward + loss + backward

Models: mlp (the benchmark workload), resnet, shufflenet, lstm_lm, transformer.
Sizes: "full" (documented size; one step well under a second on 2 CPU cores) and
"tiny" (for tests). No torchvision.
"""

from .registry import FULL, MODELS, TINY, ModelSpec, get, names, register

# Importing a model module registers it; the order here is the order of names().
from . import mlp, resnet, shufflenet, lstm_lm, transformer  # noqa: E402,F401

__all__ = ["FULL", "MODELS", "TINY", "ModelSpec", "get", "names", "register"]
