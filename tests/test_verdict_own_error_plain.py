"""Independent compares blame an op only for its own error, and bound each op by its class
(issue 31, parts 2 and 4).

A plain dump of a run in reduced precision records each op's own error against float64 on
the inputs it got (npu_dumper/replay/own_error.py, PlainOwnError) and which inputs an earlier
op made; the verdict judges those rows by it: a difference the inputs carried passes as
`inherited`, sums that cancel get kappa x u, correctly rounded elementwise ops PointwiseUlps.
Each case below failed (or a fault passed) on the code before."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from typer.testing import CliRunner

import npu_dumper  # noqa: F401
from npu_dumper import inject_fault
from accucmp.cli.main import app
from accucmp.compare.pipeline import compare_dumps
from accucmp.compare.verdict import apply_verdict, judge_row, thresholds_with
from accucmp.report.findings import first_failure

BF16_U = 2.0 ** -8
FP16_U = 2.0 ** -11


def _compare(target, golden):
    return apply_verdict(compare_dumps(str(target), str(golden)).table)


def _no_caused_here(t):
    fails = t[t["Result"] == "fail"]
    assert fails.empty, fails[["NPUDump", "IO", "TensorName", "Origin", "FailReason"]].to_string()


# ---- synthetic rows: the rules one at a time ------------------------------------------------

def _row(**kw):
    base = {"CompareStatus": "compared", "DataType": "bfloat16", "GoldenDataType": "float32",
            "PrecisionDtype": "bfloat16", "IO": "output", "TensorName": "result", "MatchedBy": "name",
            "GoldenAbsMax": 1.0, "MaxAbsoluteError": 0.0, "RelativeEuclideanDistance": 0.0}
    base.update(kw)
    return base


def _judge(**kw):
    return judge_row(_row(**kw), thresholds_with(None), fp64=False)


def test_a_1pct_error_in_a_bf16_elementwise_kernel_fails():
    # GELU by the sigmoid approximation: 1.1%, 2.8 u of bfloat16 vs float64 on its own inputs
    # (the old bound, 6 u for every op, let it pass)
    own = 2.8 * BF16_U
    res = _judge(NPUDump="aten.gelu.default", OwnErrorVsFp64=own, OwnMaxErrorVsFp64=0.02, OwnRefAbsMax=3.0,
                 RelativeEuclideanDistance=own, MaxAbsoluteError=0.02)
    assert res[0] == "fail" and res[4] == "PointwiseUlps", res
    # correct rounding passes; an accumulating op keeps the default bound
    assert _judge(NPUDump="aten.gelu.default", OwnErrorVsFp64=0.4 * BF16_U, OwnMaxErrorVsFp64=0.0,
                  OwnRefAbsMax=3.0)[0] == "pass"
    assert _judge(NPUDump="aten.mm.default", OwnErrorVsFp64=own, OwnMaxErrorVsFp64=0.02,
                  OwnRefAbsMax=3.0)[0] == "pass"


@pytest.mark.parametrize("dtype,u", [("bfloat16", BF16_U), ("float16", FP16_U)])
def test_layernorm_grad_bias_that_cancels_is_bounded_by_kappa(dtype, u):
    # PyTorch's CPU LayerNorm-backward grad_bias: 100-200 u off float64 at sum|dY|/|sum dY| ~ 500
    kw = dict(NPUDump="aten.native_layer_norm_backward.default", TensorName="result2", DataType=dtype,
              PrecisionDtype=dtype, OwnRefAbsMax=1.0, OwnMaxErrorVsFp64=0.0, OwnCancellation=500.0)
    res = _judge(OwnErrorVsFp64=150 * u, **kw)
    assert res[0] in ("pass", "skipped"), res          # (bf16: 500 u >= 1, no correct digit: skipped)
    # the same error with no cancellation is a fault
    assert _judge(OwnErrorVsFp64=150 * u, **{**kw, "OwnCancellation": 1.0})[0] == "fail"
    if dtype == "float16":                                # 0.5 x 500 x u = 250 u: beyond it fails
        assert _judge(OwnErrorVsFp64=400 * u, **kw)[0] == "fail"


def test_independent_row_within_its_own_error_passes_as_inherited():
    t = apply_verdict(__import__("pandas").DataFrame([
        _row(NPUDump="aten.native_batch_norm.default", TensorName="result0", SeqId=5,
             RelativeEuclideanDistance=16 * BF16_U, MaxAbsoluteError=0.05, OwnErrorVsFp64=0.3 * BF16_U,
             OwnMaxErrorVsFp64=0.0, OwnRefAbsMax=3.0)]))
    r = t.iloc[0]
    assert r["Result"] == "pass" and r["Origin"] == "inherited", r["FailReason"]
    assert r["FailReason"].startswith("inherited: the golden differs by")


def test_leaf_input_that_differs_is_the_runs_own_and_made_input_is_inherited():
    import pandas as pd
    rows = [_row(NPUDump="aten.addmm.default", SeqId=9, IO="input", TensorName="mat2", MadeBy="leaf",
                 DataType="float32", PrecisionDtype="float32", RelativeEuclideanDistance=0.05, MaxAbsoluteError=0.05),
            _row(NPUDump="aten.addmm.default", SeqId=9, IO="input", TensorName="mat1", MadeBy="op",
                 RelativeEuclideanDistance=20 * BF16_U, MaxAbsoluteError=0.1),
            _row(NPUDump="aten.addmm.default", SeqId=9, IO="output", TensorName="result",
                 RelativeEuclideanDistance=0.06, MaxAbsoluteError=0.1, OwnErrorVsFp64=0.1 * BF16_U,
                 OwnMaxErrorVsFp64=0.0, OwnRefAbsMax=2.0)]
    t = apply_verdict(pd.DataFrame(rows)).set_index("TensorName")
    # where the run departs from the golden one (a different weight), named as such
    assert t.loc["mat2", "Result"] == "fail" and t.loc["mat2", "Origin"] == "departs"
    assert "no op of the step made it" in t.loc["mat2", "FailReason"]
    assert t.loc["mat1", "Result"] == "pass" and t.loc["mat1", "Origin"] == "inherited"
    assert t.loc["result", "Result"] == "pass"


def test_an_output_over_its_own_bound_is_caused_here_in_so_many_words_whatever_its_inputs_carry():
    """An output judged by its own error against float64 fails by what is left after its
    inputs, the op's own: its reason does not also say "inherited" because its inputs carry
    more than its difference from the golden (timm's rexnet under bf16: PyTorch's CPU batch
    norm keeps a bf16 mean, one output element off by 32% of max|ref|)."""
    import pandas as pd
    rows = [_row(NPUDump="aten.native_batch_norm.default", SeqId=7, IO="input", TensorName="input", MadeBy="op",
                 RelativeEuclideanDistance=50 * BF16_U, MaxAbsoluteError=0.3),
            _row(NPUDump="aten.native_batch_norm.default", SeqId=7, IO="output", TensorName="result0",
                 RelativeEuclideanDistance=6 * BF16_U, MaxAbsoluteError=0.3, OwnErrorVsFp64=5.9 * BF16_U,
                 OwnMaxErrorVsFp64=0.32, OwnRefAbsMax=1.0)]
    r = apply_verdict(pd.DataFrame(rows)).set_index("TensorName").loc["result0"]
    assert r["Result"] == "fail" and r["Origin"] == "caused here", r["FailReason"]
    assert r["FailReason"].startswith("own MaxAbsoluteError/max|ref| (vs fp64 on its own inputs)"), r["FailReason"]
    assert "inherited" not in r["FailReason"], r["FailReason"]


def test_nan_or_inf_from_an_input_that_holds_no_correct_digit_is_inherited_not_caused_here():
    """An output NaN/Inf where the golden's is finite is caused here when the op's inputs
    agree; when an input already holds no correct digit (NaN/Inf itself, or 100% off the
    golden's), the non-finite values come with it (timm densenet121 under fp16 autocast: a
    batch norm over 2 values a channel amplified fp16 rounding until a gradient 3.4e3 times
    the golden's overflowed in the next batch norm backward, which was blamed)."""
    import pandas as pd

    def judged(grad_red, grad_nonfinite=0):
        rows = [_row(NPUDump="aten.native_batch_norm_backward.default", SeqId=7, IO="input", TensorName="grad_out",
                     MadeBy="op", DataType="float16", PrecisionDtype="float16",
                     RelativeEuclideanDistance=grad_red, MaxAbsoluteError=grad_red, NonFiniteMismatch=grad_nonfinite),
                _row(NPUDump="aten.native_batch_norm_backward.default", SeqId=7, IO="output", TensorName="result0",
                     DataType="float16", PrecisionDtype="float16", CompareStatus="compared",
                     RelativeEuclideanDistance=float("nan"), MaxAbsoluteError=float("nan"), NonFiniteMismatch=20,
                     CompareFailReason="20 of 1216 elements NaN/Inf on one side only (target 20, golden 0 non-finite)")]
        return apply_verdict(pd.DataFrame(rows)).set_index("TensorName").loc["result0"]

    for red, nonfinite in ((3.4e3, 0), (float("nan"), 5)):
        r = judged(red, nonfinite)
        assert r["Result"] == "fail" and r["Origin"] == "inherited", (red, r["FailReason"])
        assert "(no correct digit): the non-finite values come with it" in r["FailReason"], r["FailReason"]
    r = judged(2 * FP16_U)                    # the inputs agree: the op made the NaN/Inf
    assert r["Result"] == "fail" and r["Origin"] == "caused here", r["FailReason"]


def test_inf_where_the_golden_exceeds_the_dtypes_range_is_an_overflow_of_the_format():
    """Inf where the golden's value is beyond float16's largest finite number: any kernel
    returns it; the run departs there by the format's range (Origin overflow, named first as
    a cause is), not by a kernel's error. Inf where the golden's value fits stays caused here."""
    import pandas as pd

    from accucmp.report.findings import first_failure as first

    def judged(golden_there):
        rows = [_row(NPUDump="aten.mul.Tensor", SeqId=3, IO="output", TensorName="result", DataType="float16",
                     PrecisionDtype="float16", RelativeEuclideanDistance=2 * FP16_U, MaxAbsoluteError=1e-3),
                _row(NPUDump="aten.mm.default", SeqId=4, IO="input", TensorName="self", MadeBy="op",
                     DataType="float16", PrecisionDtype="float16", RelativeEuclideanDistance=2 * FP16_U,
                     MaxAbsoluteError=1e-3),
                _row(NPUDump="aten.mm.default", SeqId=4, IO="output", TensorName="result", DataType="float16",
                     PrecisionDtype="float16", RelativeEuclideanDistance=float("nan"),
                     MaxAbsoluteError=float("nan"), NonFiniteMismatch=3, TargetNonFinite=3,
                     GoldenAbsMaxWhereTargetNonFinite=golden_there,
                     CompareFailReason="3 of 64 elements NaN/Inf on one side only (target 3, golden 0 non-finite)"),
                _row(NPUDump="aten.add.Tensor", SeqId=9, IO="output", TensorName="result", DataType="float16",
                     PrecisionDtype="float16", RelativeEuclideanDistance=0.5, MaxAbsoluteError=0.5)]
        return apply_verdict(pd.DataFrame(rows))

    t = judged(7.1e4)
    mm = t[(t["SeqId"] == 4) & (t["IO"] == "output")].iloc[0]
    assert mm["Result"] == "fail" and mm["Origin"] == "overflow", mm["FailReason"]
    assert "beyond float16's largest finite 65504: the format's range, not the kernel" in mm["FailReason"]
    assert first(t)["SeqId"] == 4                      # named before the later caused-here add
    for fits in (1.1e4, 65510.0):             # (65510 rounds to float16's 65504, not to Inf)
        mm = judged(fits)
        mm = mm[(mm["SeqId"] == 4) & (mm["IO"] == "output")].iloc[0]
        assert mm["Origin"] == "caused here", (fits, mm["FailReason"])


# ---- real runs: fp32 golden vs a bf16/fp16 run, plain dumps ---------------------------------

class _ConvBN(nn.Module):
    """conv -> BatchNorm: the conv's bias gradient is 0 in exact arithmetic (BN removes the mean)."""

    def __init__(self, layers=1, ch=4):
        super().__init__()
        self.stem = nn.Conv2d(3, ch, 3, padding=1)
        self.blocks = nn.ModuleList(nn.Sequential(nn.BatchNorm2d(ch), nn.ReLU(), nn.Conv2d(ch, ch, 3, padding=1))
                                    for _ in range(layers))
        self.bn = nn.BatchNorm2d(ch)
        self.head = nn.Linear(ch, 5)

    def forward(self, x):
        h = self.stem(x)
        for b in self.blocks:
            h = b(h)
        return self.head(F.relu(self.bn(h)).mean((2, 3)))


def _step(model_fn, path, dtype, *, fault=None, autocast=False, x=None):
    torch.manual_seed(0)
    m = model_fn()
    if not autocast:
        m = m.to(dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 8, 8, generator=g) if x is None else x
    y = torch.randint(0, 5, (4,), generator=g)
    ctx = fault if fault is not None else contextlib.nullcontext()
    amp = torch.autocast("cpu", dtype=dtype) if autocast else contextlib.nullcontext()
    with ctx, torch.utils.dumper(use_dump=True, dump_path=str(path)):
        with amp:
            out = m(x if autocast else x.to(dtype))
        F.cross_entropy(out.float(), y).backward()
    return path


@pytest.fixture(scope="module")
def convbn_golden(tmp_path_factory):
    return _step(_ConvBN, tmp_path_factory.mktemp("cb") / "g.h5", torch.float32)


@pytest.mark.parametrize("dtype,autocast", [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float16, False)])
def test_bn_fed_conv_bias_gradient_is_not_blamed(convbn_golden, tmp_path, dtype, autocast):
    # the old code: FAIL at aten.convolution_backward's grad_bias, ~1e5 u, "caused here"
    t = _compare(_step(_ConvBN, tmp_path / "t.h5", dtype, autocast=autocast), convbn_golden)
    _no_caused_here(t)
    gb = t[(t["NPUDump"] == "aten.convolution_backward.default") & (t["TensorName"] == "result2")]
    assert len(gb) and (gb["Result"] != "fail").all()


def test_clean_run_passes_on_the_command_line_and_says_what_is_inherited(convbn_golden, tmp_path):
    t = _step(_ConvBN, tmp_path / "t.h5", torch.bfloat16, autocast=True)
    res = CliRunner().invoke(app, ["compare", "-m", str(t), "-g", str(convbn_golden), "-out", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    head = res.output.splitlines()[0]
    assert head.startswith("PASS") and "differ from the golden by inherited rounding" in head, head


def _deep():
    return _ConvBN(layers=40, ch=2)


@pytest.fixture(scope="module")
def deep_golden(tmp_path_factory):
    return _step(_deep, tmp_path_factory.mktemp("deep") / "g.h5", torch.float32)


def test_40_layer_bn_net_clean_bf16_has_no_caused_here_row(deep_golden, tmp_path):
    # inherited error over 40 layers plus BN's mean subtraction marked BN rows "caused here"
    _no_caused_here(_compare(_step(_deep, tmp_path / "t.h5", torch.bfloat16), deep_golden))


@pytest.mark.parametrize("op,call", [("aten.native_batch_norm.default", 20)])
def test_40_layer_bn_net_planted_fault_is_caused_here_first(deep_golden, tmp_path, op, call):
    t = _compare(_step(_deep, tmp_path / "f.h5", torch.bfloat16, fault=inject_fault(op, rel=0.05, call=call)),
                 deep_golden)
    ff = first_failure(t)
    from tests._real_models import Fault, planted_seqid
    assert ff is not None and ff["NPUDump"] == op and ff["Origin"] == "caused here", \
        None if ff is None else (ff["NPUDump"], ff["Origin"], ff["FailReason"])
    assert int(ff["GoldenSeqId"]) == planted_seqid(str(deep_golden), Fault(op, call))


class _SigmoidGelu(TorchDispatchMode):
    """A GELU kernel computed as x * sigmoid(1.702 x) instead of erf: ~1.1% off, 2.8 u of bf16."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.gelu.default:
            x = args[0]
            return (x.float() * torch.sigmoid(1.702 * x.float())).to(x.dtype)
        return func(*args, **(kwargs or {}))


class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 64), nn.Linear(64, 5)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x.flatten(1)[:, :16])))


@pytest.mark.parametrize("replay", [False, True])
def test_sigmoid_gelu_in_bf16_is_named(tmp_path, replay):
    g = _step(_Mlp, tmp_path / "g.h5", torch.float32)
    torch.manual_seed(0)
    m = _Mlp().to(torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 3, 8, 8, generator=gen), torch.randint(0, 5, (4,), generator=gen)
    kw = dict(use_load=True, load_file_path=str(g)) if replay else dict(use_dump=True)
    with _SigmoidGelu(), torch.utils.dumper(dump_path=str(tmp_path / "t.h5"), **kw):
        F.cross_entropy(m(x.to(torch.bfloat16)).float(), y).backward()
    ff = first_failure(_compare(tmp_path / "t.h5", g))
    assert ff is not None and ff["NPUDump"] == "aten.gelu.default", None if ff is None else ff["FailReason"]
    assert ff["DecidedBy"] == "PointwiseUlps" and 2 <= ff["ErrorUlps"] <= 4, (ff["ErrorUlps"], ff["FailReason"])


def test_a_leaf_cast_to_float16_is_its_rounding_not_a_difference():
    # ConvNeXt's layer scale 1e-6 in a model cast to float16 is subnormal there: 27 u of relative
    # error, every element within half a spacing (2**-25) of the golden's value
    import pandas as pd
    kw = dict(NPUDump="aten.mul.Tensor", SeqId=3, IO="input", TensorName="self", MadeBy="leaf",
              DataType="float16", PrecisionDtype="float16", GoldenAbsMax=1e-6,
              RelativeEuclideanDistance=27 * FP16_U)
    t = apply_verdict(pd.DataFrame([_row(MaxAbsoluteError=2.9e-8, **kw)]))
    assert t["Result"].iat[0] == "pass" and "rounded to float16" in t["FailReason"].iat[0]
    t = apply_verdict(pd.DataFrame([_row(MaxAbsoluteError=5e-8, **kw)]))      # more than half a spacing
    assert t["Result"].iat[0] == "fail" and t["Origin"].iat[0] == "departs"


class _LNHead(nn.Module):
    """A LayerNorm whose output gradient's columns nearly cancel: sum|dY| / |sum dY| ~ 10^3 per
    column, as in Segformer's LayerNorm backward (grad_bias = sum dY)."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(16)
        g = torch.Generator().manual_seed(5)
        w = torch.randn(256, 16, generator=g)
        self.register_buffer("w", w - w.mean(0) + 0.001)

    def forward(self, x):
        return (self.ln(x).float() * self.w).sum()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_layernorm_grad_bias_at_kappa_500_is_not_blamed(tmp_path, dtype):
    x = torch.randn(256, 16, generator=torch.Generator().manual_seed(6))

    def run(path, dt):
        torch.manual_seed(0)
        m = _LNHead().to(dt)
        with torch.utils.dumper(use_dump=True, dump_path=str(path)):
            m(x.to(dt)).backward()
        return path

    t = _compare(run(tmp_path / "t.h5", dtype), run(tmp_path / "g.h5", torch.float32))
    _no_caused_here(t)
    gb = t[(t["NPUDump"] == "aten.native_layer_norm_backward.default") & (t["TensorName"] == "result2")]
    assert len(gb) == 1 and gb["OwnCancellation"].iat[0] >= 500, gb[["OwnCancellation", "FailReason"]]


class _Block(nn.Module):
    """A conv + BatchNorm + LayerNorm + GELU-MLP model and the user bugs of issue 31."""

    def __init__(self, bug=""):
        super().__init__()
        self.bug = bug
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.proj, self.ln = nn.Linear(8, 16), nn.LayerNorm(16, eps=1e-1 if bug == "eps" else 1e-5)
        self.fc1, self.fc2, self.head = nn.Linear(16, 32), nn.Linear(32, 16), nn.Linear(16, 5)

    def forward(self, x):
        t = self.proj(torch.relu(self.bn(self.conv(x))).flatten(2).transpose(1, 2))
        a = self.fc1(self.ln(t))
        a = F.silu(a) if self.bug == "silu" else F.gelu(a)
        if self.bug == "scale":
            a = a * 1.05
        m = self.fc2(a)
        return self.head((m if self.bug == "residual" else t + m).mean(1))


def test_user_bugs_fail_and_the_clean_autocast_run_passes(tmp_path):
    """fp32 golden vs bf16 autocast, plain dumps: the clean run passes (it failed at a conv
    backward); every bug fails, the changed argument, the swapped activation and the weight 5%
    off at the op that has them (the weight was blamed on a conv backward)."""
    torch.manual_seed(0)
    state = _Block().state_dict()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g)

    def run(path, bug, autocast):
        m = _Block(bug)
        m.load_state_dict(state)
        if bug == "weight":
            with torch.no_grad():
                m.fc2.weight.mul_(1.05)
        with torch.utils.dumper(use_dump=True, dump_path=str(path)):
            with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
                out = m(x)
            F.cross_entropy(out.float(), y).backward()
        return path

    golden = run(tmp_path / "g.h5", "", False)
    named = {"eps": ("aten.native_layer_norm.default", "argument eps 0.1, golden 1e-05"),
             "silu": ("aten.silu", "aligned region"),
             "weight": ("aten.addmm.default", "input mat2 of aten.addmm.default in fc2 differs")}
    for bug in ("", "scale", "eps", "silu", "residual", "weight"):
        t = _compare(run(tmp_path / f"t{bug}.h5", bug, True), golden)
        fails = t[t["Result"] == "fail"]
        if not bug:
            assert fails.empty, fails[["NPUDump", "TensorName", "FailReason"]].to_string()
            continue
        assert not fails.empty, bug
        if bug in named:
            ff = first_failure(t)
            op, why = named[bug]
            origin = "departs" if bug == "weight" else "caused here"      # (a weight: the run's own data)
            assert ff["NPUDump"].startswith(op) and ff["Origin"] == origin, (bug, ff["NPUDump"], ff["FailReason"])
            assert why in ff["FailReason"] + str(ff.get("CompareFailReason")), (bug, ff["FailReason"])


def test_batch_norm_grad_input_over_two_values_a_channel_is_bounded_by_how_much_it_cancels():
    """Batch norm backward's grad_input in training, (g - mean(g) - xhat * mean(g * xhat)) *
    invstd * w, over 2 values a channel (1x1 maps, batch 2: timm's ghostnet at 32x32) cancels
    31-fold, and PyTorch's CPU kernel under bf16 autocast was 12.6 u off float64: blamed as
    its own error in a clean run. The dumper now records that combination's kappa
    (||its |terms| || / ||grad_input||, computed independently here) and the verdict bounds
    the output by kappa x u, as a cancelling sum's."""
    import json

    from torch.utils._pytree import tree_map

    from npu_dumper.capture.opschema import named_args, op_info
    from npu_dumper.replay import own_error

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(2, 16, 1, 1, generator=g) * 3e-3).to(torch.bfloat16)      # var ~ eps
    w, b = torch.rand(16, generator=g) + 0.5, torch.zeros(16)
    _, save_mean, save_invstd = torch.ops.aten.native_batch_norm(x, w, b, None, None, True, 0.1, 1e-5)
    grad = torch.randn(2, 16, 1, 1, generator=g).to(torch.bfloat16)
    func = torch.ops.aten.native_batch_norm_backward.default
    args = (grad, x, w, None, None, save_mean, save_invstd, True, 1e-5, [True, True, True])
    prepared = own_error.prepare(func, args, {}, dict((n, v) for n, _, v in named_args(op_info(func), args, {})))
    out = func(*args)
    got = json.loads(own_error.measure(func, prepared, out))
    assert len(got["result0"]) == 4, got

    d = tree_map(lambda v: v.double() if isinstance(v, torch.Tensor) else v, args)
    ref = func(*d)[0]
    shape, dims = [1, 16, 1, 1], [0, 2, 3]
    xhat = (d[1] - d[5].reshape(shape)) * d[6].reshape(shape)
    terms = (d[0].abs() + d[0].mean(dims, keepdim=True).abs()
             + (xhat * (d[0] * xhat).mean(dims, keepdim=True)).abs()) * (d[6] * d[2]).reshape(shape).abs()
    kappa = float(terms.norm() / ref.norm())
    assert kappa > 2 and math.isclose(got["result0"][3], kappa, rel_tol=1e-9), (got["result0"], kappa)

    # judged: 12 u within kappa x u at kappa 31, a fault of 12 u where nothing cancels fails
    row = dict(NPUDump="aten.native_batch_norm_backward.default", TensorName="result0", OwnRefAbsMax=1.0,
               OwnMaxErrorVsFp64=0.0, OwnErrorVsFp64=12 * BF16_U)
    assert _judge(**row, OwnCancellation=31.0)[0] == "pass"
    assert _judge(**row)[0] == "fail"


def test_an_input_that_overflows_float16_in_its_cast_is_named_as_an_overflow(tmp_path):
    """An activation of 1e5 (fine in float32) meets a Linear under fp16 autocast: its cast to
    float16 is Inf, and the addmm returns NaN/Inf. The addmm computed what it was given; the
    run departs there by float16's range. Plain compare: the addmm's input row is Inf where
    the golden's reaches 1e5. Load-replay: the replay's cast of the recorded input overflowed
    (op attribute input_overflow). Both name the addmm with Origin overflow."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 4)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    x[0, 0] = 3.0                   # 3e5 after the multiply: Inf in float16

    def step(path, amp, load=None):
        kw = dict(use_load=True, load_file_path=str(load)) if load else dict(use_dump=True)
        ctx = torch.autocast("cpu", dtype=torch.float16) if amp else contextlib.nullcontext()
        with torch.utils.dumper(dump_path=str(path), **kw):
            with ctx:
                out = lin(x.mul(1e5))
            out.float().sum().backward()
        return path

    golden = step(tmp_path / "g.h5", False)
    for name, load in (("plain", None), ("replay", golden)):
        t = _compare(step(tmp_path / f"{name}.h5", True, load), golden)
        first = first_failure(t)
        # plain: autocast's cast of the input is where it becomes Inf (its row measured against
        # what it was given: rows.cast_source); the replay's cast is no op: the addmm
        expected = "aten.addmm.default" if load else "aten._to_copy.default"
        assert first is not None and first["NPUDump"] == expected, (name, first)
        assert first["Origin"] == "overflow", (name, first["Origin"], first["FailReason"])
        assert "Inf" in first["FailReason"] and "the format's range" in first["FailReason"], first["FailReason"]
        if load:
            assert "(its largest recorded value) is Inf cast to float16" in first["FailReason"]
    # the terminal and the HTML report do not offer a threshold for NaN/Inf on one side
    # (-t NonFiniteMismatch=VALUE is no threshold: compare refused it)
    res = CliRunner(env={"COLUMNS": "100", "NO_COLOR": "1"}).invoke(
        app, ["compare", "-m", str(tmp_path / "plain.h5"), "-g", str(golden), "-o", str(tmp_path / "out"),
              "-f", "csv,html"])
    out = " ".join(res.output.split())
    assert res.exit_code == 1 and "decided by: NaN/Inf on one side only" in out, res.output
    assert "-t NonFiniteMismatch" not in out, res.output
    import glob
    page = open(glob.glob(str(tmp_path / "out" / "*.html"))[0]).read()
    assert "-t NonFiniteMismatch" not in page and "Decided by NaN/Inf on one side only" in page
