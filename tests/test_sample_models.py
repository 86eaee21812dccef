"""sample_models: registry, determinism, sizes, a real training step for every model."""

import pytest
import torch

import sample_models
from sample_models import TINY

ALL = sample_models.names()


def test_registry_has_the_five_models():
    assert ALL == ["mlp", "resnet", "shufflenet", "lstm_lm", "transformer"]


def test_unknown_model_and_size_are_clear_errors():
    with pytest.raises(KeyError, match="no sample model 'vgg'"):
        sample_models.get("vgg")
    with pytest.raises(ValueError, match="has no size 'huge'"):
        sample_models.get("mlp").build(size="huge")


@pytest.mark.parametrize("name", ALL)
def test_same_seed_same_step_different_seed_differs(name):
    spec = sample_models.get(name)
    state = torch.random.get_rng_state()

    def one_step(seed):
        model = spec.build(seed=seed, size=TINY)
        loss = spec.train_step(model, spec.make_inputs(seed=seed, size=TINY))
        grads = [p.grad.clone() for p in model.parameters()]
        weights = [p.grad for p in model.parameters() if p.ndim > 1]
        return loss, grads, weights

    loss_a, grads_a, weight_grads = one_step(0)
    loss_b, grads_b, _ = one_step(0)
    loss_c, _, _ = one_step(1)
    assert torch.isfinite(loss_a) and loss_a.ndim == 0
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
    assert not torch.equal(loss_a, loss_c)
    # Every weight takes part in the step. (Not every bias: a BatchNorm shift followed
    # by a bias-free conv and another BatchNorm has an exactly zero gradient.)
    assert all(g.abs().sum() > 0 for g in weight_grads)
    # Building and stepping never disturbs the caller's global RNG.
    assert torch.equal(torch.random.get_rng_state(), state)


@pytest.mark.parametrize("name", ALL)
def test_batch_parameter_sets_the_batch(name):
    spec = sample_models.get(name)
    x, target = spec.make_inputs(seed=0, batch=3, size=TINY)
    assert x.shape[0] == 3 and target.shape[0] == 3


def test_mlp_full_size_is_the_benchmark_workload():
    spec = sample_models.get("mlp")
    model = spec.build(size="full")
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert [tuple(m.weight.shape) for m in linears] == [(1024, 1024)] * 6
    assert any(isinstance(m, torch.nn.LayerNorm) for m in model.modules())
    x, _ = spec.make_inputs(size="full")
    assert x.shape == (64, 1024) and x.dtype == torch.float32


def test_shufflenet_uses_depthwise_conv_and_resnet_batchnorm():
    shuffle = sample_models.get("shufflenet").build(size=TINY)
    convs = [m for m in shuffle.modules() if isinstance(m, torch.nn.Conv2d)]
    assert any(c.groups == c.in_channels > 1 for c in convs)
    resnet = sample_models.get("resnet").build(size=TINY)
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in resnet.modules())


def test_channel_shuffle_interleaves_groups():
    from sample_models.shufflenet import channel_shuffle
    x = torch.arange(4.0).view(1, 4, 1, 1)
    assert channel_shuffle(x, 2).flatten().tolist() == [0.0, 2.0, 1.0, 3.0]
