"""Clean fp32 -> bf16/fp16 load-replays of a conv net with BatchNorm: no false alarms with an
fp64 golden, and a planted fault is still the first failing op (real dumps, real ops).

The conv before BatchNorm has a bias. Its gradient is 0 in exact arithmetic (BatchNorm
removes the channel mean), so the fp32 golden holds rounding noise (~5e-8) and a bf16/fp16
replay a larger noise: relative error 300x. The fp64 golden replay shows the golden's own
error is ~10x its value; carried to the target's precision the result holds no correct
digit, so it is not judged. Without the fix it failed ("error vs fp64 ... 3.24e+03 > 19.6"),
and in fp16 the well-conditioned grad_weight failed too (4.2 u vs a 4 u floor).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F
import pytest

import npu_dumper  # noqa: F401  (installs torch.utils.dumper)
from npu_dumper import inject_fault
from npu_dumper.replay.golden import replay as golden_replay
from accucmp.compare.pipeline import compare_dumps
from accucmp.compare.verdict import apply_verdict
from accucmp.report.findings import first_failure


class _ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 16, 3, padding=1)          # bias followed by BatchNorm
        self.b1 = nn.BatchNorm2d(16)
        self.c2 = nn.Conv2d(16, 16, 3, padding=1, bias=False)
        self.b2 = nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        x = F.relu(self.b1(self.c1(x)))
        x = F.relu(x + self.b2(self.c2(x)))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def _make():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return _ConvBN(), torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 10, (8,), generator=g)


def _step(m, x, y):
    m.zero_grad(set_to_none=True)
    F.cross_entropy(m(x).float(), y).backward()


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    d = tmp_path_factory.mktemp("xprec")
    m, x, y = _make()
    with torch.utils.dumper(use_dump=True, dump_path=str(d / "g.h5")):
        _step(m, x, y)
    golden_replay(str(d / "g.h5"), str(d / "g64.h5"), progress=False)
    return d


def _replay(d, dtype, fault=None, own_error=True):
    m, x, y = _make()
    m, x = m.to(dtype), x.to(dtype)
    out = d / f"t_{str(dtype)[6:]}_{bool(fault)}_{own_error}.h5"
    ctx = inject_fault(**fault) if fault else contextlib.nullcontext()
    with ctx:
        with torch.utils.dumper(use_load=True, load_file_path=str(d / "g.h5"), dump_path=str(out),
                                own_error=own_error):
            _step(m, x, y)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_clean_replay_passes_with_fp64_golden(golden, dtype):
    """(own_error=False: the judgement against the golden, refined by the fp64 golden replay)"""
    t = apply_verdict(compare_dumps(str(_replay(golden, dtype, own_error=False)), str(golden / "g.h5"),
                                    golden_fp64=str(golden / "g64.h5")).table)
    fails = t[t["Result"] == "fail"]
    assert fails.empty, fails[["NPUDump", "SeqId", "TensorName", "FailReason"]].to_string()
    noise = t[t["FailReason"].astype(str).str.startswith("ill-conditioned")]
    # the conv bias gradient (result2 of the first conv's backward) and nothing well-conditioned
    assert set(noise["NPUDump"]) == {"aten.convolution_backward.default"}
    assert set(noise["TensorName"]) == {"result2"}
    assert (noise["Result"] == "skipped").all()
    # and the terminal summary says so (the rows are only in the csv otherwise)
    from rich.console import Console
    from accucmp.report.summary import print_summary
    console = Console(record=True, width=200)
    print_summary(t, console=console)
    assert "1 tensor(s) not judged: ill-conditioned" in console.export_text()


def _kappa(terms: torch.Tensor, dims: tuple[int, ...]) -> float:
    """How much a sum of `terms` over `dims` cancels, in float64 (the larger of the norm-wise
    and the largest-element ratio of sum|terms| to |sum|)."""
    x = terms.double()
    s, a = x.sum(dims), x.abs().sum(dims)
    return max(float(a.norm() / s.norm()), float(a.max() / s.abs().max()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_clean_replay_without_own_error_judges_sums_by_the_rounding_of_their_terms(golden, dtype):
    """own_error=False, no fp64 golden: the conv bias gradient that is 0 in exact arithmetic is
    300x off the golden, and rounding its terms (grad_output) to the target's dtype alone moves
    it by more than its size: not judged (it failed, "first op caused here", before). The
    cancellation is the golden's own grad_output's, recomputed here in torch from the file;
    the well-conditioned sums (the linear layer's bias gradient) are judged, and pass."""
    import h5py

    t = apply_verdict(compare_dumps(str(_replay(golden, dtype, own_error=False)), str(golden / "g.h5")).table)
    fails = t[t["Result"] == "fail"]
    assert fails.empty, fails[["NPUDump", "SeqId", "TensorName", "FailReason"]].to_string()
    bias = t[(t["NPUDump"] == "aten.convolution_backward.default") & (t["TensorName"] == "result2")]
    assert len(bias) == 1
    bias = bias.iloc[0]
    assert bias["Result"] == "skipped" and bias["RelativeEuclideanDistance"] > 10
    assert bias["FailReason"].startswith("ill-conditioned: a sum whose terms the replay rounded")
    with h5py.File(golden / "g.h5", "r") as h5:
        grad_output = torch.from_numpy(h5[bias["GroundTruthPath"].rsplit("/", 2)[0] + "/input/grad_output"][()])
    assert bias["RoundedInputCancellation"] == pytest.approx(_kappa(grad_output, (0, 2, 3)), rel=1e-9)
    u = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    assert bias["RoundedInputCancellation"] * u >= 1
    fc = t[(t["NPUDump"] == "aten.sum.dim_IntList") & (t["Module"] == "fc")]
    assert len(fc) == 1 and fc.iloc[0]["Result"] == "pass"
    assert 1 <= fc.iloc[0]["RoundedInputCancellation"] < 100
    # and the terminal summary says what was left unjudged
    from rich.console import Console
    from accucmp.report.summary import print_summary
    console = Console(record=True, width=200)
    print_summary(t, console=console)
    assert "1 tensor(s) not judged: ill-conditioned" in console.export_text()


@pytest.mark.parametrize("dtype,rel", [(torch.bfloat16, 0.07), (torch.float16, 0.02)])
def test_planted_fault_in_a_sum_named_first_without_own_error(golden, dtype, rel):
    """The widened bound is what rounding the terms can do, not a pass for every sum: a 7%
    (bf16) / 2% (fp16) error in the linear layer's bias gradient is still the first failure."""
    tgt = _replay(golden, dtype, dict(op="aten.sum.dim_IntList", rel=rel, call=1), own_error=False)
    t = apply_verdict(compare_dumps(str(tgt), str(golden / "g.h5")).table)
    ff = first_failure(t)
    assert ff is not None and ff["NPUDump"] == "aten.sum.dim_IntList" and ff["Module"] == "fc", \
        t[t["Result"] == "fail"][["NPUDump", "Module", "FailReason"]].to_string()
    assert "the replay's rounding of its terms moves it by" in ff["FailReason"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_clean_replay_judged_by_own_error(golden, dtype):
    """By default the replay measures each op whose inputs it rounded against float64 on those
    inputs: no fp64 golden needed. The conv bias gradient that is 0 in exact arithmetic is
    300x off the golden, but the op computed what it was given: judged, and passes."""
    t = apply_verdict(compare_dumps(str(_replay(golden, dtype)), str(golden / "g.h5")).table)
    fails = t[t["Result"] == "fail"]
    assert fails.empty, fails[["NPUDump", "SeqId", "TensorName", "FailReason"]].to_string()
    bias = t[(t["NPUDump"] == "aten.convolution_backward.default") & (t["TensorName"] == "result2")].iloc[0]
    assert bias["RelativeEuclideanDistance"] > 10          # far off the golden ...
    assert bias["OwnErrorVsFp64"] < 2 ** -8                # ... yet within one unit of what it was given
    # every low-precision output (its op's inputs were rounded) carries the measurement,
    # batch norm's (which also writes its running statistics) included
    outs = t[(t["IO"] == "output") & (t["DataType"] == str(dtype)[6:])]
    assert outs["OwnErrorVsFp64"].notna().all(), outs[outs["OwnErrorVsFp64"].isna()]["NPUDump"].tolist()


@pytest.mark.parametrize("dtype,rel", [(torch.bfloat16, 0.05), (torch.float16, 0.02)])
@pytest.mark.parametrize("op,call", [("aten.convolution.default", 1), ("aten.native_batch_norm_backward.default", 2),
                                     ("aten.convolution_backward.default", 2)])
def test_planted_fault_still_first_with_fp64_golden(golden, dtype, rel, op, call):
    tgt = _replay(golden, dtype, dict(op=op, rel=rel, call=call))
    t = apply_verdict(compare_dumps(str(tgt), str(golden / "g.h5"), golden_fp64=str(golden / "g64.h5")).table)
    ff = first_failure(t)
    assert ff is not None and ff["NPUDump"] == op
    assert set(t[t["Result"] == "fail"]["NPUDump"]) == {op}


def test_fp16_underflow_is_named_on_every_row_of_the_op(tmp_path):
    """Larger inputs and batch: the backward gradients sit below float16's smallest normal
    (6.1e-5). convolution_backward's grad_weight is not tiny itself, but it is computed from
    an underflowing grad_output and fails by tens of u; its reason must say why (its
    grad_input row shows the underflow), not just '54 u of float16'."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    m, x, y = _ConvBN(), torch.randn(32, 3, 32, 32, generator=g) * 10, torch.randint(0, 10, (32,), generator=g)
    with torch.utils.dumper(use_dump=True, dump_path=str(tmp_path / "g.h5")):
        _step(m, x, y)
    torch.manual_seed(0)
    m = _ConvBN().half()
    with torch.utils.dumper(use_load=True, load_file_path=str(tmp_path / "g.h5"), dump_path=str(tmp_path / "t.h5"),
                            own_error=False):
        _step(m, x.half(), y)
    t = apply_verdict(compare_dumps(str(tmp_path / "t.h5"), str(tmp_path / "g.h5")).table)
    fails = t[t["Result"] == "fail"]
    cb = fails[(fails["NPUDump"] == "aten.convolution_backward.default") & (fails["TensorName"] == "result1")
               & (fails["GoldenAbsMax"] > 2.0 ** -12)]
    assert not cb.empty, fails[["NPUDump", "TensorName", "GoldenAbsMax", "FailReason"]].to_string()
    for reason in cb["FailReason"]:
        assert "has golden max|x|" in reason and "underflow in float16" in reason, reason
    # every failing row of the step is explained by underflow, cancellation or is a few u over
    unexplained = fails[~fails["FailReason"].str.contains("underflow|cancels")]
    assert (unexplained["ErrorUlps"] < 12).all(), unexplained[["NPUDump", "TensorName", "FailReason"]].to_string()


def test_autocast_replay_records_which_input_it_rounded(golden, tmp_path):
    """Under bf16 autocast BatchNorm's backward gets a bf16 grad_out beside float32 weight and
    statistics: the replay dump records each argument's dtype (op attribute
    input_arg_dtypes), so compare knows the terms of its grad_bias were rounded and allows
    what that can move it by, without the own error (before that attribute: `input_dtypes`
    "bfloat16,float32" cannot say which, and the row was judged as if nothing was rounded)."""
    import json

    import h5py

    m, x, y = _make()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.utils.dumper(use_load=True, load_file_path=str(golden / "g.h5"), dump_path=str(tmp_path / "t.h5"),
                                own_error=False):
            _step(m, x, y)
    with h5py.File(tmp_path / "t.h5", "r") as h5:
        ops = h5["aten.native_batch_norm_backward.default"]
        recorded = [json.loads(ops[s].attrs["input_arg_dtypes"]) for s in ops]
    assert recorded and all(d["grad_out"] == "bfloat16" and d["weight"] == "float32" for d in recorded), recorded
    t = apply_verdict(compare_dumps(str(tmp_path / "t.h5"), str(golden / "g.h5")).table)
    bias = t[(t["NPUDump"] == "aten.native_batch_norm_backward.default") & (t["TensorName"] == "result2")]
    assert len(bias) == 2 and bias["RoundedInputCancellation"].notna().all()
    fails = t[t["Result"] == "fail"]
    assert fails.empty, fails[["NPUDump", "SeqId", "TensorName", "FailReason"]].to_string()


def _without_arg_dtypes(src, dst):
    """A copy of a replay dump as written before the op attribute input_arg_dtypes."""
    import shutil

    import h5py

    shutil.copy(src, dst)
    with h5py.File(dst, "r+") as h5:
        def strip(_, obj):
            if isinstance(obj, h5py.Group) and "input_arg_dtypes" in obj.attrs:
                del obj.attrs["input_arg_dtypes"]
        h5.visititems(strip)
    return dst


def test_older_replay_dumps_get_kappa_only_when_every_input_was_rounded(golden, tmp_path):
    """A replay dump older than input_arg_dtypes says only the set of its ops' input dtypes:
    a sum's terms count as rounded when every floating input was (the model cast to bf16),
    not when float32 ones sit beside bf16 ones (autocast's BatchNorm backward)."""
    cast = _without_arg_dtypes(_replay(golden, torch.bfloat16, own_error=False), tmp_path / "cast.h5")
    t = apply_verdict(compare_dumps(str(cast), str(golden / "g.h5")).table)
    bias = t[(t["NPUDump"] == "aten.convolution_backward.default") & (t["TensorName"] == "result2")]
    assert bias["RoundedInputCancellation"].notna().all() and (bias["Result"] == "skipped").all()
    m, x, y = _make()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.utils.dumper(use_load=True, load_file_path=str(golden / "g.h5"), dump_path=str(tmp_path / "a.h5"),
                                own_error=False):
            _step(m, x, y)
    mixed = _without_arg_dtypes(tmp_path / "a.h5", tmp_path / "mixed.h5")
    t = apply_verdict(compare_dumps(str(mixed), str(golden / "g.h5")).table)
    bn = t[(t["NPUDump"] == "aten.native_batch_norm_backward.default") & (t["TensorName"] == "result2")]
    assert len(bn) == 2 and bn["RoundedInputCancellation"].isna().all()
