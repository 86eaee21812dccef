"""A correct elementwise op that turns its inputs' rounding into a large error fails as
`amplified` (accucmp/compare/op_policies.py, AMPLIFIED rule).

The porting bug: rotary position embeddings whose angles are computed in bfloat16 (a port that
drops Llama's float32 upcast). At position 1,000 an angle is rounded by up to 4 rad; cos and
sin of the rounded angles come out 80 u of bfloat16 off the golden's, from inputs 0.4 u off.
Every op computed right on what it got (own error 0 u), so each row passed as "inherited" and
the run passed, while its loss differed from the golden's by 0.8%. Now cos is named, in a plain
compare and in a load-replay, as where the precision cannot carry the computation; the same
model with its angles in float32 passes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import npu_dumper  # noqa: F401  (installs torch.utils.dumper)
from accucmp.compare.op_policies import ORIGIN_AMPLIFIED
from accucmp.compare.pipeline import compare_dumps
from accucmp.compare.verdict import apply_verdict
from accucmp.report.findings import first_failure

POSITIONS = 1024


class Rope(nn.Module):
    def __init__(self, angles_in_bf16: bool):
        super().__init__()
        self.low = angles_in_bf16
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16)))

    def forward(self, x):
        pos = torch.arange(x.shape[1], dtype=torch.float32)
        inv = self.inv_freq
        if self.low:
            pos, inv = pos.to(torch.bfloat16), inv.to(torch.bfloat16)
        angles = torch.outer(pos, inv)
        emb = torch.cat([angles, angles], -1)
        cos, sin = emb.cos(), emb.sin()
        rotated = torch.cat([-x[..., 8:], x[..., :8]], -1)
        return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class Net(nn.Module):
    def __init__(self, angles_in_bf16: bool):
        super().__init__()
        torch.manual_seed(0)
        self.q = nn.Linear(16, 16)
        self.rope = Rope(angles_in_bf16)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        return self.out(self.rope(self.q(x)))


def _step(path, *, target: bool, angles_in_bf16: bool = False, load=None) -> str:
    net = Net(angles_in_bf16)
    x = torch.randn(1, POSITIONS, 16, generator=torch.Generator().manual_seed(1))
    mode = dict(use_load=True, load_file_path=str(load)) if load else dict(use_dump=True)
    with torch.utils.dumper(dump_path=str(path), **mode):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=target):
            y = net(x)
        y.float().square().mean().backward()
    return str(path)


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    return _step(tmp_path_factory.mktemp("rope") / "golden.h5", target=False)


@pytest.mark.parametrize("replay", [False, True])
def test_rope_angles_in_bf16_are_named_at_cos_as_amplified_rounding(golden, tmp_path, replay):
    target = _step(tmp_path / "t.h5", target=True, angles_in_bf16=True, load=golden if replay else None)
    table = apply_verdict(compare_dumps(target, golden).table)
    first = first_failure(table)
    assert first is not None and first["NPUDump"] == "aten.cos.default" and first["Module"] == "rope", first
    assert first["Origin"] == ORIGIN_AMPLIFIED
    assert first["FailReason"].startswith("amplified rounding:") and "bfloat16 cannot carry" in first["FailReason"]
    assert "earlier ops made" not in first["FailReason"]        # (the attribution it replaces)
    # what follows carries the difference on: inherited, not failing again
    failing = table[table["Result"] == "fail"]
    assert set(failing["NPUDump"]) == {"aten.cos.default", "aten.sin.default"}, failing[["NPUDump", "FailReason"]]


@pytest.mark.parametrize("replay", [False, True])
def test_rope_angles_in_float32_pass(golden, tmp_path, replay):
    target = _step(tmp_path / "t.h5", target=True, angles_in_bf16=False, load=golden if replay else None)
    assert first_failure(apply_verdict(compare_dumps(target, golden).table)) is None


def test_the_html_report_explains_amplified_rounding(golden, tmp_path):
    from accucmp.report.html import explanations
    from accucmp.report.summary import summarize

    target = _step(tmp_path / "t.h5", target=True, angles_in_bf16=True)
    table = apply_verdict(compare_dumps(target, golden).table)
    titles = dict(explanations(table, summarize(table)))
    assert "Amplified rounding" in titles and "float32" in titles["Amplified rounding"]


def test_an_outputs_only_plain_dump_claims_no_amplified_rounding(golden, tmp_path):
    """Without input rows a plain compare cannot tell rounding amplified from what the inputs
    carried in from earlier ops: the rule is for a load-replay's rows there (their ops got
    the golden's inputs, cast), not a plain dump written with dump_mode="output"."""
    net = Net(angles_in_bf16=True)
    x = torch.randn(1, POSITIONS, 16, generator=torch.Generator().manual_seed(1))
    path = tmp_path / "outputs.h5"
    with torch.utils.dumper(use_dump=True, dump_path=str(path), dump_mode="output"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = net(x)
        y.float().square().mean().backward()
    table = apply_verdict(compare_dumps(str(path), golden).table)
    assert not (table["Origin"] == ORIGIN_AMPLIFIED).any()
