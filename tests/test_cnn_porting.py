"""Porting differences in a small CNN (convolution, batch norm, ReLU, pooling, SGD with momentum
in the step), fp32 golden against a bf16-autocast target, as plain dumps and as a load-replay.

Found by a trial of fourteen porting mistakes (torchvision-style code against a port):

* `F.relu(x, inplace=True)` against `F.relu(x)`: the same function; the plain compare passed,
  the clean replay failed on `runs aten.relu_.default, which the golden run does not have`.
  A live op now takes a recorded call of its in-place variant (or of the op it varies) in its
  own module (load_replay._in_place_partner).
* A convolution given a bias the golden's lacks (`bias=True`): the plain compare passed its
  output as inherited from earlier ops, whose outputs agree, and named the next layer's weight
  (the bias took random numbers from the initialisation). A tensor argument one run passes and
  the other does not is now a changed argument (rows.tensors_only_one_passes): named at the
  convolution, caused here.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import npu_dumper  # noqa: F401  (installs torch.utils.dumper)
from accucmp.compare.pipeline import compare_dumps
from accucmp.compare.verdict import apply_verdict
from accucmp.report.findings import first_failure


class Net(nn.Module):
    def __init__(self, *, inplace: bool = False, conv_bias: bool = False):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=conv_bias)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1, bias=False)
        self.head = nn.Linear(16, 5)
        self.inplace = inplace

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)), inplace=self.inplace)
        x = F.max_pool2d(x, 2)
        x = F.relu(self.conv2(x), inplace=self.inplace)
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


def _step(path, *, target: bool, load=None, **kw) -> str:
    torch.manual_seed(0)
    net = Net(**kw)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 3, 12, 12, generator=g), torch.randint(0, 5, (4,), generator=g)
    mode = dict(use_load=True, load_file_path=str(load)) if load else dict(use_dump=True)
    with torch.utils.dumper(dump_path=str(path), **mode):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=target):
            out = net(x)
        F.cross_entropy(out.float(), y).backward()
        opt.step()
    return str(path)


def _first(target, golden):
    return first_failure(apply_verdict(compare_dumps(target, golden).table))


@pytest.fixture(scope="module")
def goldens(tmp_path_factory):
    d = tmp_path_factory.mktemp("cnn")
    return {inplace: _step(d / f"golden_{inplace}.h5", target=False, inplace=inplace) for inplace in (False, True)}


@pytest.mark.parametrize("golden_inplace", [False, True])
@pytest.mark.parametrize("replay", [False, True])
def test_an_in_place_relu_against_an_out_of_place_one_passes(goldens, tmp_path, golden_inplace, replay):
    golden = goldens[golden_inplace]
    target = _step(tmp_path / "t.h5", target=True, load=golden if replay else None, inplace=not golden_inplace)
    assert _first(target, golden) is None


def test_an_inserted_in_place_op_elsewhere_is_still_named(goldens, tmp_path):
    """The in-place partner is taken only in the live op's own module."""
    golden = goldens[False]

    def hook(module, args, out):
        return out.mul_(1.05)

    torch.manual_seed(0)
    handle = nn.modules.module.register_module_forward_hook(
        lambda m, a, o: hook(m, a, o) if isinstance(m, nn.Linear) else None)
    try:
        target = _step(tmp_path / "t.h5", target=True, load=golden)
    finally:
        handle.remove()
    first = _first(target, golden)
    assert first is not None and first["Module"] == "head" and "aten.mul_" in first["NPUDump"], first


@pytest.mark.parametrize("replay", [False, True])
def test_a_convolution_given_a_bias_the_golden_lacks_is_named_at_it(goldens, tmp_path, replay):
    golden = goldens[False]
    target = _step(tmp_path / "t.h5", target=True, load=golden if replay else None, conv_bias=True)
    first = _first(target, golden)
    assert first is not None and first["Module"] == "conv1" and first["NPUDump"].startswith("aten.convolution"), first
    if not replay:
        assert first["Origin"] == "caused here", first
        assert first["FailReason"].startswith("argument bias a tensor, golden None"), first["FailReason"]
        assert "not caused here" not in first["FailReason"]
