"""An update of state that the target's dtype rounds away fails as `absorbed`
(accucmp/compare/absorption.py, op_policies' ABSORBED rule).

The porting bug: a model cast with `model.to(bfloat16)` and trained without float32 master
weights. AdamW's decay `param.mul_(1 - lr * wd)` moves each weight by 1e-5 of itself, under
half a bfloat16 spacing, and an Adam step of 1e-3 leaves a LayerNorm weight of 1.0 where it
is: the target keeps those values, the float32 golden learns. Every op computed right on what
it got and every value stayed within bfloat16's rounding of the golden's, so the run passed,
in a plain compare and in a load-replay. Now the first such update is named. The same step
under autocast (float32 parameters) passes, and an in-place op on a tensor the step made and
drops (Adam's `denom.add_(eps)`) is not judged so.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from typer.testing import CliRunner

import npu_dumper  # noqa: F401  (installs torch.utils.dumper)
from accucmp.cli.main import app
from accucmp.compare.absorption import absorbed_update
from accucmp.compare.op_policies import ORIGIN_ABSORBED
from accucmp.compare.pipeline import compare_dumps
from accucmp.compare.verdict import apply_verdict
from accucmp.numformats import FORMATS, format_of, round_to, spacing
from accucmp.report.findings import first_failure

LR, WD = 1e-3, 0.01


def _net(low: bool) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 8))
    return net.to(torch.bfloat16) if low else net


def _step(path, *, how: str = "fp32", opt: str = "adamw", lr: float = LR, load=None) -> nn.Module:
    """One training step of _net inside the dump block; how: fp32 (the golden), model-bf16
    (`model.to(bfloat16)`, no master weights) or autocast (bf16 compute, fp32 parameters)."""
    net = _net(how == "model-bf16")
    optim = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=WD) if opt == "adamw" \
        else torch.optim.Adam(net.parameters(), lr=lr)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 32, generator=g), torch.randint(0, 8, (16,), generator=g)
    mode = dict(use_load=True, load_file_path=str(load)) if load else dict(use_dump=True)
    with torch.utils.dumper(dump_path=str(path), **mode):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=how == "autocast"):
            out = net(x.to(net[0].weight.dtype))
        F.cross_entropy(out.float(), y).backward()
        optim.step()
        optim.zero_grad()
    return net


@pytest.fixture(scope="module")
def goldens(tmp_path_factory):
    d = tmp_path_factory.mktemp("absorbed")
    _step(d / "adamw.h5")
    _step(d / "adam.h5", opt="adam")
    _step(d / "adam_big.h5", opt="adam", lr=0.1)
    return d


def _judged(target, golden, **th):
    return apply_verdict(compare_dumps(str(target), str(golden)).table, th or None)


@pytest.mark.parametrize("replay", [False, True])
def test_weight_decay_rounded_away_in_bf16_is_named_first(goldens, tmp_path, replay):
    golden = goldens / "adamw.h5"
    _step(tmp_path / "t.h5", how="model-bf16", load=golden if replay else None)
    table = _judged(tmp_path / "t.h5", golden)
    first = first_failure(table)
    assert first is not None and first["NPUDump"] == "aten.mul_.Tensor" and first["Origin"] == ORIGIN_ABSORBED, first
    assert str(first["FailReason"]).startswith("update absorbed: "), first["FailReason"]
    # the first weight the loop decays: Linear 0's, 64 x 32. Recomputed here by torch on the
    # weights themselves, independent of the file: every element the float32 decay moves keeps
    # its bfloat16 value
    w = _net(False)[0].weight.detach()
    moved = w * (1 - LR * WD) != w
    kept = w.bfloat16() * (1 - LR * WD) == w.bfloat16()
    expected = float((moved & kept).sum()) / float(moved.sum())
    assert first["UpdateChanged"] == int(moved.sum())
    assert first["UpdateAbsorbed"] == pytest.approx(expected) and expected == 1.0


@pytest.mark.parametrize("replay", [False, True])
def test_adam_step_on_a_layernorm_weight_of_one_is_absorbed(goldens, tmp_path, replay):
    golden = goldens / "adam.h5"
    net = _step(tmp_path / "t.h5", how="model-bf16", opt="adam", load=golden if replay else None)
    table = _judged(tmp_path / "t.h5", golden)
    first = first_failure(table)
    assert first is not None and first["NPUDump"] == "aten.addcdiv_.default", first
    steps = table[(table["NPUDump"] == "aten.addcdiv_.default") & (table["IO"] == "output")].sort_values("SeqId")
    # the third parameter the loop steps: the LayerNorm's weight (Linear 0's weight and bias
    # take their steps, of ~8 spacings of their bf16 values)
    assert first["Origin"] == ORIGIN_ABSORBED and first["SeqId"] == steps["SeqId"].iat[2], first
    assert (steps["UpdateAbsorbed"].iloc[:2] < 0.05).all(), steps["UpdateAbsorbed"].tolist()
    if not replay:
        # the live model (not the file): the LayerNorm weight did not move in bfloat16
        assert torch.equal(net[1].weight.detach(), torch.ones(64, dtype=torch.bfloat16))


@pytest.mark.parametrize("replay", [False, True])
def test_float32_parameters_under_autocast_pass_and_are_not_measured(goldens, tmp_path, replay):
    golden = goldens / "adamw.h5"
    _step(tmp_path / "t.h5", how="autocast", load=golden if replay else None)
    table = _judged(tmp_path / "t.h5", golden)
    assert first_failure(table) is None
    assert table["UpdateAbsorbed"].isna().all()     # the parameters' dtype is the golden's


def test_an_update_of_a_tensor_the_step_made_is_not_judged(goldens, tmp_path):
    # lr 0.1: every parameter's step survives bfloat16, but Adam's `denom.add_(eps)` of 1e-8
    # on values ~1e-2 is rounded away: denom is the step's own, not state
    golden = goldens / "adam_big.h5"
    _step(tmp_path / "t.h5", how="model-bf16", opt="adam", lr=0.1)
    table = _judged(tmp_path / "t.h5", golden)
    assert first_failure(table) is None
    out = table[table["IO"] == "output"]
    eps = out[(out["NPUDump"] == "aten.add_.Tensor") & (out["DataType"] == "bfloat16")]
    assert len(eps) == 6 and eps["UpdateAbsorbed"].isna().all()     # one a parameter
    steps = out[out["NPUDump"] == "aten.addcdiv_.default"]
    assert len(steps) == 6 and (steps["UpdateAbsorbed"] < 0.5).all() and (steps["UpdateChanged"] > 0).all()


def test_threshold_and_cli(goldens, tmp_path):
    golden = goldens / "adamw.h5"
    _step(tmp_path / "t.h5", how="model-bf16")
    assert first_failure(_judged(tmp_path / "t.h5", golden, UpdateAbsorbedFraction=math.inf)) is None
    res = CliRunner().invoke(app, ["compare", "-m", str(tmp_path / "t.h5"), "-g", str(golden),
                                   "-o", str(tmp_path / "r"), "--format", "csv,html"], env={"COLUMNS": "100"})
    assert res.exit_code == 1, res.output
    assert "update absorbed" in res.output and "aten.mul_.Tensor" in res.output
    page = next((tmp_path / "r").glob("*.html")).read_text()
    assert "Absorbed updates" in page and "master weights" in page


# ---- absorbed_update's edge cases -------------------------------------------------------------
BF16 = format_of("bfloat16")


def _pieces(a, cuts):
    return np.split(np.asarray(a, dtype=np.float64), cuts)


def test_absorbed_update_counts_only_changes_within_a_spacing():
    g_in = np.array([1.0, 1.0, 1.0, 1.0, 0.5, 0.0, np.nan, np.inf])
    g_out = np.array([1.001, 1.001, 1.1, 1.0, 0.5005, 1e-3, 1.0, np.inf])
    t_in = round_to(g_in, BF16)
    #        absorbed  took it  zero update  golden kept  absorbed  took it  NaN  Inf
    t_out = np.array([1.0, 1.0078125, 1.0, 1.0, 0.5, 1e-3, 1.0, np.inf])
    frac, changed = absorbed_update([t_out], [g_out], [t_in], [g_in], BF16)
    # changed: 1.001 x2, 1.1, 0.5005, 1e-3 (NaN and Inf rows left out); absorbed: 1.001, 0.5005
    # (1.1 - 1.0 is over a spacing: the target's update was zero, not rounded away)
    assert changed == 5 and frac == pytest.approx(2 / 5)


def test_absorbed_update_streams_match_whole_and_replay_rounds_the_golden():
    rng = np.random.default_rng(0)
    g_in = rng.standard_normal(1000).astype(np.float32).astype(np.float64)
    g_out = (g_in * (1 - 1e-3)).astype(np.float32).astype(np.float64)
    t_in = round_to(g_in, BF16)
    t_out = round_to(t_in * (1 - 1e-3), BF16)
    whole = absorbed_update([t_out], [g_out], [t_in], [g_in], BF16)
    cut = absorbed_update(_pieces(t_out, [7, 500]), _pieces(g_out, [300]), _pieces(t_in, [1, 2, 999]),
                          _pieces(g_in, [640]), BF16)
    replay = absorbed_update(_pieces(t_out, [10]), _pieces(g_out, [20]), None, _pieces(g_in, [30]), BF16)
    assert whole == cut == replay and whole[1] == 1000 and whole[0] > 0.5
    with pytest.raises(ValueError):
        absorbed_update([t_out[:-1]], [g_out], [t_in], [g_in], BF16)


def test_absorbed_update_with_nothing_changed_is_nan():
    x = np.ones(4)
    frac, changed = absorbed_update([x], [x], [x], [x], BF16)
    assert math.isnan(frac) and changed == 0


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_spacing_is_the_distance_to_the_next_value(name):
    fmt = FORMATS[name]
    dtype = torch.bfloat16 if name == "bf16" else torch.float16
    x = torch.tensor([0.0, 1e-7, 6.1e-5, 0.3, 1.0, 1.5, 3.0, 1000.0, -2.5], dtype=dtype)
    up = (x.view(torch.int16) + 1).view(dtype)      # the next value away from 0 (sign and magnitude)
    expected = (up.double() - x.double()).abs().numpy()
    assert np.array_equal(spacing(x.double().numpy(), fmt), expected)


def test_a_share_or_count_no_comparison_writes_is_not_judged(goldens, tmp_path):
    """`accucmp report` re-judges a saved csv: an UpdateAbsorbed outside [0, 1] or an
    UpdateChanged below 1 (an edited file) is not judged, rather than said as 'inf% of nan'."""
    golden = goldens / "adamw.h5"
    _step(tmp_path / "t.h5", how="model-bf16")
    table = compare_dumps(str(tmp_path / "t.h5"), str(golden)).table
    rows = table.index[table["UpdateAbsorbed"].notna()]
    for bad in (math.inf, -1.0, 2.0):
        table.loc[rows, "UpdateAbsorbed"] = bad
        assert first_failure(apply_verdict(table)) is None, bad
    table.loc[rows, "UpdateAbsorbed"] = 1.0
    table.loc[rows, "UpdateChanged"] = 0.0
    assert first_failure(apply_verdict(table)) is None
    table.loc[rows, "UpdateChanged"] = 5.0
    first = first_failure(apply_verdict(table))
    assert first is not None and first["Origin"] == ORIGIN_ABSORBED
