"""A target step with a loss scaler (torch.amp.GradScaler) against a golden without one: the
scaler's ops are by design, the gradients are compared with the scale divided out, and a
step that uses gradients the scaler has not unscaled still fails where it does. Real dumps
(npu_dumper/capture/loss_scale.py marks the ops; accucmp/compare/rows.py divides)."""

import json

import h5py
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import npu_dumper  # noqa: F401  (installs torch.utils.dumper)
from accucmp.compare.pipeline import compare_dumps
from accucmp.compare.verdict import apply_verdict
from accucmp.report.findings import first_failure
from dumpfile import schema as S
from tests._compare_helpers import overwrite_op_attr

SCALE = 2.0 ** 16


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(F.gelu(self.norm(self.fc1(x))))


def _step(path, *, scaler: bool, unscale: bool = True, mode=None, weight_bump: float = 0.0,
          clip: str = ""):
    """One SGD step of Net on fixed data in float32 (a power-of-two scale is exact there, so a
    correct scaled step equals the golden's after division, bit for bit). `clip`: "after" the
    unscale (right), "before" it (the porting mistake: the norm of scaled gradients)."""
    model = Net()
    if weight_bump:
        with torch.no_grad():
            model.fc2.weight[0, 0] += weight_bump
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sc = torch.amp.GradScaler("cpu", init_scale=SCALE) if scaler else None
    torch.manual_seed(1)
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
    kw = mode or dict(use_dump=True)
    with torch.utils.dumper(dump_path=str(path), **kw) as dump:
        loss = F.cross_entropy(model(x), y)
        if sc is None:
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
        else:
            sc.scale(loss).backward()
            if clip == "after":
                sc.unscale_(opt)
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            if unscale:
                sc.step(opt)
                sc.update()
            else:                   # the porting mistake: the optimizer steps on scaled gradients
                opt.step()
    return str(path), model, dump


def _judged(target, golden):
    return apply_verdict(compare_dumps(target, golden).table)


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    return _step(tmp_path_factory.mktemp("ls") / "golden.h5", scaler=False)


def test_a_scaled_step_passes_with_the_scale_divided_out(tmp_path, golden):
    """Before: `FAIL: the model's top level runs aten.full.default`, and every backward row
    65536x off."""
    target, _, dump = _step(tmp_path / "scaled.h5", scaler=True)
    assert dump.summary["lossscale"]["scales"] == [SCALE]
    result = compare_dumps(target, golden[0])
    assert any("the target trains with a loss scaler" in n for n in result.meta["notes"])
    t = apply_verdict(result.table)
    assert first_failure(t) is None, t[t["Result"] == "fail"][["NPUDump", "TensorName", "FailReason"]]
    back = t[(t["Phase"] == "backward") & (t["CompareStatus"] == "compared")]
    grads = back[back["LossScale"] == SCALE]
    assert len(grads) >= 10
    # a power-of-two scale divides out exactly: the gradients agree bit for bit
    assert (grads["MaxAbsoluteError"] == 0).all()
    # what the backward reads from the forward (weights, activations) carries no scale
    assert back["LossScale"].isna().any()
    scaler_rows = t[t["CompareFailReason"].astype(str).str.contains("loss scaler's own op")]
    assert {"aten.full.default", "aten.mul.Tensor"} <= set(scaler_rows["NPUDump"])
    assert not (t["CompareStatus"] == "unpaired_op").any()
    # the optimizer's update reads the unscaled gradients: no factor there
    upd = t[(t["Phase"] == "optimizer") & t["NPUDump"].str.startswith("aten.add_")]
    assert len(upd) and upd["LossScale"].isna().all()


def test_the_dump_marks_the_scaler_ops_and_the_scaled_tensors(tmp_path):
    target, _, _ = _step(tmp_path / "scaled.h5", scaler=True)
    roles, scaled = {}, []
    with h5py.File(target, "r") as f:
        for op in f:
            if not isinstance(f[op], h5py.Group):
                continue
            for seq, g in f[op].items():
                if S.OP_LOSS_SCALER in g.attrs:
                    roles[(op, int(seq))] = g.attrs[S.OP_LOSS_SCALER]
                if S.OP_LOSS_SCALE in g.attrs:
                    scaled.append((g.attrs["phase"], json.loads(g.attrs[S.OP_LOSS_SCALE])))
    by_role = {}
    for (op, _), role in roles.items():
        by_role.setdefault(role, set()).add(op)
    assert by_role["apply"] == {"aten.mul.Tensor"}          # loss * scale, and its backward
    assert by_role["unscale"] == {"aten._amp_foreach_non_finite_check_and_unscale_.default"}
    assert "aten._amp_update_scale_.default" in by_role["state"]
    # every backward op downstream of the seed carries exactly the scale, never its square
    factors = {d["output"] for phase, d in scaled if phase == "backward"}
    assert factors == {SCALE}


def test_an_optimizer_step_on_gradients_not_unscaled_fails_at_that_step(tmp_path, golden):
    """`opt.step()` instead of `scaler.step(opt)`: SGD moves the weights 65536x too far. The
    backward agrees (scale divided out); the first op that reads a scaled gradient outside it
    is where the run departs, although it computed right what it was given."""
    target, _, _ = _step(tmp_path / "noscale.h5", scaler=True, unscale=False)
    t = _judged(target, golden[0])
    first = first_failure(t)
    assert first is not None
    assert first["Phase"] == "optimizer" and first["NPUDump"].startswith("aten.add_"), first
    assert "carry the loss scale 65536" in first["FailReason"]
    assert not ((t["Phase"] == "backward") & (t["Result"] == "fail")).any()


def test_a_changed_weight_is_still_named_under_a_scaler(tmp_path, golden):
    target, _, _ = _step(tmp_path / "bumped.h5", scaler=True, weight_bump=0.5)
    first = first_failure(_judged(target, golden[0]))
    assert first is not None and first["Module"] == "fc2" and first["Phase"] == "forward", first


def test_load_replay_runs_the_scaler_live_and_takes_the_step(tmp_path, golden):
    """Before: the scaler's ops were matched to recorded calls of the same name; the inf
    flag's `.item()` took the recording's step count, so GradScaler skipped the optimizer
    step, and the run failed at the scaler's `full`."""
    g_path, g_model, _ = golden
    target, model, dump = _step(tmp_path / "replay.h5", scaler=True,
                                mode=dict(use_load=True, load_file_path=g_path))
    t = _judged(target, g_path)
    assert first_failure(t) is None, t[t["Result"] == "fail"][["NPUDump", "FailReason"]]
    assert not (t["CompareStatus"] == "departure").any()
    # the step was taken: the weights moved as the golden's did
    for p, q in zip(model.parameters(), g_model.parameters()):
        torch.testing.assert_close(p, q)
    assert dump.summary["lossscale"]["scaler_ops"] > 0


def test_load_replay_names_an_optimizer_step_on_gradients_not_unscaled(tmp_path, golden):
    """The replay hands each matched op the recording's unscaled gradients, so the values of
    `opt.step()` on scaled gradients were right and the replay passed. The live run's order
    is the user's: the first op after the backward that reads gradients still carrying the
    scale (had no value been substituted) is named, as the plain compare names it."""
    g_path = golden[0]
    target, _, _ = _step(tmp_path / "replay.h5", scaler=True, unscale=False,
                         mode=dict(use_load=True, load_file_path=g_path))
    first = first_failure(_judged(target, g_path))
    assert first is not None and first["CompareStatus"] == "departure", first
    assert first["NPUDump"].startswith("aten.add_") and "x65536 (gradients that carry the loss scale" \
        in first["FailReason"], first["FailReason"]


@pytest.fixture(scope="module")
def golden_clipped(tmp_path_factory):
    return _step(tmp_path_factory.mktemp("ls") / "golden_clipped.h5", scaler=False, clip="after")[0]


@pytest.mark.parametrize("replay", [False, True])
def test_clipping_before_the_unscale_is_named_at_the_norm_in_both_modes(tmp_path, golden_clipped, replay):
    """torch.amp's documented mistake: clip_grad_norm_ before scaler.unscale_ clips by the norm
    of scaled gradients. Clipping after it passes; before it, the norm is named."""
    mode = dict(use_load=True, load_file_path=golden_clipped) if replay else None
    right, _, _ = _step(tmp_path / "after.h5", scaler=True, clip="after", mode=mode)
    assert first_failure(_judged(right, golden_clipped)) is None
    wrong, _, _ = _step(tmp_path / "before.h5", scaler=True, clip="before", mode=mode)
    first = first_failure(_judged(wrong, golden_clipped))
    assert first is not None and first["NPUDump"].startswith("aten._foreach_norm"), first
    assert "loss scale" in first["FailReason"], first["FailReason"]


def _adamw_step(path, *, scaler: bool, fused: bool, mode=None, mistake: bool = False) -> str:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, fused=fused)
    sc = torch.amp.GradScaler("cpu", init_scale=1024.0) if scaler else None
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
    with torch.utils.dumper(dump_path=str(path), **(mode or dict(use_dump=True))):
        loss = F.cross_entropy(net(x), y)
        if sc is None:
            loss.backward()
            opt.step()
        else:
            sc.scale(loss).backward()
            if mistake:
                opt.step()          # the step on gradients the scaler has not unscaled
            else:
                sc.step(opt)
                sc.update()
    return str(path)


@pytest.mark.parametrize("replay", [False, True])
def test_a_fused_adamw_step_under_a_scaler_passes_and_one_on_scaled_gradients_fails(tmp_path, replay):
    """GradScaler hands a fused optimizer step the scale to divide out (grad_scale, found_inf)
    instead of unscaling first; `step` checks the gradients with a dummy inverse scale of 1.
    Before, that check was taken for the unscale (every gradient compared 1024x off the
    golden's: a clean plain compare failed), the load-replay handed the fused step the
    recording's unscaled gradients with the live grad_scale (divided twice: AdamW's moments
    1024x off), and the two arguments the golden's call lacks failed as changed arguments."""
    golden = _adamw_step(tmp_path / "golden.h5", scaler=False, fused=True)
    mode = dict(use_load=True, load_file_path=golden) if replay else None
    clean = _adamw_step(tmp_path / "clean.h5", scaler=True, fused=True, mode=mode)
    assert first_failure(_judged(clean, golden)) is None
    wrong = _adamw_step(tmp_path / "wrong.h5", scaler=True, fused=True, mode=mode, mistake=True)
    first = first_failure(_judged(wrong, golden))
    assert first is not None and first["NPUDump"].startswith("aten._fused_adamw_"), first
    assert "loss scale" in first["FailReason"], first["FailReason"]


def _scaled_step(path, init_scale, *, mode=None, fp16=False):
    """Net's step with a GradScaler of `init_scale`, in float32 or under float16 autocast."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sc = torch.amp.GradScaler("cpu", init_scale=init_scale)
    torch.manual_seed(1)
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
    with torch.autocast("cpu", dtype=torch.float16, enabled=fp16), \
            torch.utils.dumper(dump_path=str(path), **(mode or dict(use_dump=True))):
        sc.scale(F.cross_entropy(model(x), y)).backward()
        sc.step(opt)
        sc.update()
    return str(path), model


def test_two_runs_that_both_scale_compare_by_the_ratio_of_their_scales(tmp_path):
    """The golden trained with its own GradScaler at another scale (its dynamic scale moved
    elsewhere): its scaler ops are by design too, and the gradients compare by the ratio."""
    g_path, g_model = _scaled_step(tmp_path / "g.h5", 2.0 ** 10)
    t_path, _ = _scaled_step(tmp_path / "t.h5", SCALE)
    t = _judged(t_path, g_path)
    assert first_failure(t) is None, t[t["Result"] == "fail"][["NPUDump", "TensorName", "FailReason"]]
    assert set(t["LossScale"].dropna()) == {SCALE / 2.0 ** 10}
    # the scales themselves (the `mul`'s other operand, the unscale's inverse scale) are the
    # scaler's, skipped with the reason
    state = t[t["CompareStatus"] == "loss_scaler"]
    assert len(state) and (state["Result"] == "skipped").all()
    r_path, r_model = _scaled_step(tmp_path / "r.h5", SCALE, mode=dict(use_load=True, load_file_path=g_path))
    r = _judged(r_path, g_path)
    assert first_failure(r) is None, r[r["Result"] == "fail"][["NPUDump", "FailReason"]]
    for p, q in zip(r_model.parameters(), g_model.parameters()):
        torch.testing.assert_close(p, q)


def test_an_overflow_under_the_scale_fails_and_says_what_the_scaler_does(tmp_path, golden):
    """float16 gradients times 2^24 overflow: the step differs (GradScaler skips it), and the
    row says that this is the scaler at work, not a kernel's fault."""
    t_path, model = _scaled_step(tmp_path / "inf.h5", 2.0 ** 24, fp16=True)
    first = first_failure(_judged(t_path, golden[0]))
    assert first is not None and first["Phase"] == "backward", first
    assert "overflowed under the loss scale 1.67772e+07" in first["FailReason"], first["FailReason"]
    # GradScaler found the Inf and skipped the update: fc2 kept its initial weight
    torch.testing.assert_close(model.fc2.weight, Net().fc2.weight)


class Rotary(nn.Module):
    """A complex rotation between two Linears (DeepSeek-V2's rotary embedding): its backward
    carries complex gradients."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 4)
        self.register_buffer("freqs", torch.polar(torch.ones(4), torch.arange(4.0)))

    def forward(self, x):
        z = torch.view_as_complex(self.fc1(x).view(-1, 4, 2)) * self.freqs
        return self.fc2(torch.view_as_real(z).flatten(1))


def test_complex_gradients_divide_the_scale_out_too(tmp_path):
    """Before: `operands could not be broadcast together` on DeepSeek-V2's complex rotary
    gradients (the division made them real, half their length)."""
    def step(path, scaler):
        model = Rotary()
        torch.manual_seed(1)
        x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
        with torch.utils.dumper(dump_path=str(path), use_dump=True):
            loss = F.cross_entropy(model(x), y)
            (scaler.scale(loss) if scaler else loss).backward()
        return str(path)
    g = step(tmp_path / "g.h5", None)
    t = _judged(step(tmp_path / "t.h5", torch.amp.GradScaler("cpu", init_scale=SCALE)), g)
    assert first_failure(t) is None, t[t["Result"] == "fail"][["NPUDump", "FailReason"]]
    cplx = t[(t["DataType"] == "complex64") & (t["LossScale"] == SCALE)]
    assert len(cplx) and (cplx["CompareStatus"] == "compared").all()
    assert (cplx["MaxAbsoluteError"] == 0).all()


@pytest.mark.parametrize("attr", ['{"input": {"self": -65536}, "output": NaN}', '{"output": 1e400}', '[1, 2]',
                                  '{"output": true}', '{"input": "x", "state": 7}', "[" * 5000 + "]" * 5000,
                                  "not json"])
def test_a_damaged_loss_scale_attribute_divides_nothing(tmp_path, golden, attr):
    """A file is input from outside: a scale that is not a finite positive number, or an
    attribute that is no such object, is ignored (the gradients are compared as they are, and
    fail 65536x off), never a traceback or a division of the file's choosing."""
    target, _, _ = _step(tmp_path / "scaled.h5", scaler=True)
    overwrite_op_attr(target, S.OP_LOSS_SCALE, attr)
    t = _judged(target, golden[0])
    assert t["LossScale"].isna().all()
    # the scaled loss's first reader (the backward's seed, ones_like) is compared as it is
    assert first_failure(t) is not None
    assert (t[t["Phase"] == "backward"]["Result"] == "fail").any()


def test_an_op_the_file_calls_a_scaler_with_an_unknown_role_is_judged_as_any_other(tmp_path, golden):
    """The scaler's `full` (its scale, from a number: an op that reads no value of the run,
    op attribute constant) is no departure of its own; its `mul` of the loss is where the
    run departs."""
    target, _, _ = _step(tmp_path / "scaled.h5", scaler=True)
    overwrite_op_attr(target, S.OP_LOSS_SCALER, "trust me")
    first = first_failure(_judged(target, golden[0]))
    assert first is not None and first["NPUDump"] == "aten.mul.Tensor" and first["Origin"] == "departs", first
