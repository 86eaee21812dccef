"""Values the target's dtype cannot hold, below its normal range, are where the run departs
(compare/rows.cast_source and verdict._judge_cast: a cast the golden lacks; column RangeLoss
and verdict._range_lost: an op right on what it got whose golden values underflow).

The porting bug: float16 autocast without a loss scaler, on a loss whose gradients are ~3e-7.
Autocast's cast of the float32 gradient to float16 keeps 26% of it wrong (subnormal float16
has a spacing of 6e-8), and the first layer's gradients come out 100% off. The cast is
unpaired by design (the golden has none) and the op that reads its result got it from an op
of the step, so its row passed the difference on as inherited: the run passed with 0 failing
rows in a plain compare and in a load-replay (whose own error, against float64 on the same
rounded inputs, was 0). Now the cast is named in the plain compare, the op reading the
underflowed recording in the replay, both with Origin `underflow`. The same step with the
loss unscaled passes, and so does bfloat16 (float32's range). And a float16 model whose layer
scale of 1e-6 (ConvNeXt's init) zeroes its residual branch (2e-8 rounds to 0) is named at that
`mul` in both modes, where both passed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import npu_dumper  # noqa: F401  (installs torch.utils.dumper)
from accucmp.compare.op_policies import ORIGIN_UNDERFLOW, UNDERFLOW_CLAUSE
from accucmp.compare.pipeline import compare_dumps
from accucmp.compare.rows import MATCHED_BY_CAST
from accucmp.compare.verdict import apply_verdict
from accucmp.report.findings import first_failure

SMALL = 1e-5


def _step(path, *, dtype=None, scale: float = SMALL, load=None, grads: dict | None = None):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 10))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
    mode = dict(use_load=True, load_file_path=str(load)) if load else dict(use_dump=True)
    with torch.utils.dumper(dump_path=str(path), **mode):
        with torch.autocast("cpu", dtype=dtype or torch.float16, enabled=dtype is not None):
            out = net(x)
        logits = out.float()
        if grads is not None:
            # an independent view of the cast: the gradient autocast hands the float16 product
            # (after its cast) against the float32 one it was cast from
            out.register_hook(lambda t: grads.setdefault("low", t.detach().clone()))
            logits.register_hook(lambda t: grads.setdefault("fp32", t.detach().clone()))
        (F.cross_entropy(logits, y) * scale).backward()


@pytest.fixture(scope="module")
def goldens(tmp_path_factory):
    d = tmp_path_factory.mktemp("underflow")
    _step(d / "small.h5")
    _step(d / "unit.h5", scale=1.0)
    return d


def _judged(target, golden):
    return apply_verdict(compare_dumps(str(target), str(golden)).table)


def test_float16_gradients_below_the_normal_range_are_named_at_the_cast(goldens, tmp_path):
    grads: dict = {}
    _step(tmp_path / "t.h5", dtype=torch.float16, grads=grads)
    table = _judged(tmp_path / "t.h5", goldens / "small.h5")
    first = first_failure(table)
    assert first is not None and first["NPUDump"] == "aten._to_copy.default", first
    assert first["Origin"] == ORIGIN_UNDERFLOW and first["Phase"] == "backward"
    assert first["MatchedBy"] == MATCHED_BY_CAST and "smallest normal" in first["FailReason"]
    # the row's number is the cast's own loss, as torch's hooks see it
    low, fp32 = grads["low"].double(), grads["fp32"].double()
    assert float(fp32.abs().max()) < 2.0 ** -14            # all below float16's smallest normal
    expected = float((low - fp32).norm() / fp32.norm())
    assert first["RelativeEuclideanDistance"] == pytest.approx(expected, rel=1e-6) and expected > 0.1
    # a leaf's cast (autocast's float16 copy of a weight) is judged where it is read, not here
    casts = table[(table["NPUDump"] == "aten._to_copy.default") & (table["IO"] == "output")]
    assert (casts["Phase"] == "forward").any()
    assert (casts.loc[casts["Phase"] == "forward", "MatchedBy"] != MATCHED_BY_CAST).all()


def test_the_replay_names_the_op_that_read_the_underflowed_recording(goldens, tmp_path):
    _step(tmp_path / "t.h5", dtype=torch.float16, load=goldens / "small.h5")
    table = _judged(tmp_path / "t.h5", goldens / "small.h5")
    first = first_failure(table)
    assert first is not None and first["NPUDump"] == "aten.mm.default" and first["Phase"] == "backward", first
    assert first["Origin"] == ORIGIN_UNDERFLOW and UNDERFLOW_CLAUSE in first["FailReason"]
    # what float16 alone loses of the golden's values there: nearly all (the largest, 3.7e-8,
    # is within a subnormal spacing of 0)
    assert first["RangeLoss"] > 0.9 and first["GoldenAbsMax"] < torch.finfo(torch.float16).tiny / 1000
    # a loss rounding cannot make (an edited csv re-judged by `accucmp report`): not judged
    edited = compare_dumps(str(tmp_path / "t.h5"), str(goldens / "small.h5")).table
    edited["RangeLoss"] = edited["RangeLoss"].where(edited["RangeLoss"].isna(), 5.0)
    again = first_failure(apply_verdict(edited))
    assert again is None or again["Origin"] != ORIGIN_UNDERFLOW or UNDERFLOW_CLAUSE not in again["FailReason"]


@pytest.mark.parametrize("replay", [False, True])
@pytest.mark.parametrize("case", ["float16, unscaled loss", "bfloat16, small loss"])
def test_values_in_range_pass(goldens, tmp_path, replay, case):
    dtype, golden = (torch.float16, "unit.h5") if case.startswith("float16") else (torch.bfloat16, "small.h5")
    _step(tmp_path / "t.h5", dtype=dtype, scale=1.0 if golden == "unit.h5" else SMALL,
          load=goldens / golden if replay else None)
    table = _judged(tmp_path / "t.h5", goldens / golden)
    assert first_failure(table) is None
    if not replay:
        # the backward's casts of what ops made are measured, and pass: rounding, <= 0.5 u
        casts = table[table["MatchedBy"] == MATCHED_BY_CAST]
        assert len(casts) >= 1 and (casts["Result"] == "pass").all()
        assert (casts["ErrorUlps"] <= 0.5).all(), casts["ErrorUlps"].tolist()


class _LayerScaled(nn.Module):
    """A residual block with ConvNeXt's layer scale, initialised to 1e-6."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(32, 32)
        self.gamma = nn.Parameter(torch.full((32,), 1e-6))
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(x + self.gamma * self.fc(x) * 0.01)


def _scaled_step(path, low: bool, load=None):
    net = _LayerScaled()
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    if low:
        net, x = net.half(), x.half()
    mode = dict(use_load=True, load_file_path=str(load)) if load else dict(use_dump=True)
    with torch.utils.dumper(dump_path=str(path), **mode):
        net(x).float().square().mean().backward()


@pytest.mark.parametrize("replay", [False, True])
def test_a_float16_layer_scale_that_zeroes_its_branch_is_named(tmp_path, replay):
    _scaled_step(tmp_path / "g.h5", low=False)
    _scaled_step(tmp_path / "t.h5", low=True, load=tmp_path / "g.h5" if replay else None)
    table = _judged(tmp_path / "t.h5", tmp_path / "g.h5")
    first = first_failure(table)
    assert first is not None and first["NPUDump"] == "aten.mul.Tensor" and first["Phase"] == "forward", first
    assert first["Origin"] == ORIGIN_UNDERFLOW and UNDERFLOW_CLAUSE in first["FailReason"]
    # gamma x fc(x): the second mul, 1e-6 x ~0.5 x 0.01, all below float16's smallest subnormal
    assert first["RangeLoss"] == 1.0


class _Record:
    """A value record's reading side, enough for the metrics stage's whole-tensor read."""

    def __init__(self, values):
        from dumpfile import schema as S
        self.type, self.values = S.TYPE_TENSOR, values

    def read(self):
        return self.values


@pytest.mark.parametrize("golden_dtype,expected", [("float32", True), ("bfloat16", True), ("float16", False)])
def test_range_loss_is_what_rounding_the_golden_to_the_target_loses(golden_dtype, expected):
    from accucmp.compare.measure import Comparer
    values = torch.linspace(1e-8, 3e-7, 100)
    row = {"DataType": "float16", "GoldenDataType": golden_dtype, "GoldenAbsMax": 3e-7}
    Comparer(("RelativeEuclideanDistance",), 1 << 20)._range_loss(row, _Record(values.double().numpy()), 100)
    if not expected:        # (a float16 golden holds nothing float16 cannot)
        assert "RangeLoss" not in row
        return
    loss = float((values.half().double() - values.double()).norm() / values.double().norm())
    assert row["RangeLoss"] == pytest.approx(loss, rel=1e-9) and loss > 0.05
    # at a loss scale of 2^16 the target holds them in float16's normal range: nothing lost
    scaled = {"DataType": "float16", "GoldenDataType": golden_dtype, "GoldenAbsMax": 3e-7}
    Comparer(("RelativeEuclideanDistance",), 1 << 20)._range_loss(scaled, _Record(values.double().numpy()), 100,
                                                                 2.0 ** 16)
    assert "RangeLoss" not in scaled


@pytest.mark.parametrize("replay", [False, True])
def test_small_gradients_under_a_grad_scaler_pass(goldens, tmp_path, replay):
    """The step whose float16 gradients underflow without a scaler, under GradScaler (2^16):
    the target holds them in range. A load-replay computes each op on the recording's unscaled
    values, so its float16 range is taken at the scale the live run carries (loss_scale's
    `carried`), not at the recording's."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 10))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    mode = dict(use_load=True, load_file_path=str(goldens / "small.h5")) if replay else dict(use_dump=True)
    with torch.utils.dumper(dump_path=str(tmp_path / "t.h5"), **mode):
        with torch.autocast("cpu", dtype=torch.float16):
            out = net(x)
        scaler.scale(F.cross_entropy(out.float(), y) * SMALL).backward()
    table = _judged(tmp_path / "t.h5", goldens / "small.h5")
    assert first_failure(table) is None
    assert table["RangeLoss"].isna().all()      # at 2^16 x 3e-7 no golden value is near the edge
