"""A kernel that rounds toward zero instead of to nearest fails as `RoundingBias`.

The fault: a bf16 linear layer computed in float32 and converted by truncation (the low 16
bits dropped, as `x.view(int32) >> 16` does), where PyTorch rounds to nearest. Half of its
elements are one bfloat16 unit nearer zero than the correctly rounded result: an own error
of 1 u, against the 6 u a matrix product may have, so every row passed, in a plain compare
and in a load-replay. The run differs all the same, and the same way at every element: a
truncating kernel shrinks what it computes, step after step. Now the dumper counts, of the
elements off the correctly rounded float64 result, those nearer zero and those above it
(own_error's "#rounding"), and the verdict fails an op whose elements lie on one side
(RoundingBias |2 share - 1| > 0.9, from at least 256 elements). A correct kernel's are on
both sides alike; ops whose errors share a cause (float32 results of a Python number, a
norm's per-channel statistics) are left out (verdict._check_rounding_sides).
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from typer.testing import CliRunner

import npu_dumper  # noqa: F401  (installs torch.utils.dumper)
from accucmp.cli.main import app
from accucmp.compare.op_policies import ORIGIN_CAUSED
from accucmp.compare.pipeline import compare_dumps
from accucmp.compare.verdict import DEFAULT_THRESHOLDS, apply_verdict, judge_row
from accucmp.report.findings import first_failure

PLANTED = "aten.addmm.default"


def _truncated(x32: torch.Tensor) -> torch.Tensor:
    """float32 -> bfloat16 by dropping the low 16 bits (round toward zero; exact, no rounding)."""
    return (x32.contiguous().view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)


class TruncatingKernel(TorchDispatchMode):
    """Below the dumper: the `call`-th bf16 call of `op` computed in float32 and truncated.
    Keeps what it did (its output and the float64 result on the same inputs) for the test."""

    def __init__(self, op: str, call: int):
        super().__init__()
        self.op, self.call, self.calls, self.seen = op, call, 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if str(func) == self.op and isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16:
            self.calls += 1
            if self.calls == self.call:
                def up(dtype):
                    return lambda a: a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                out = _truncated(func(*tree_map(up(torch.float32), args), **kwargs))
                self.seen = (out.clone(), func(*tree_map(up(torch.float64), args), **kwargs))
        return out


def _net(dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).to(dtype)


def _step(path, dtype=torch.float32, *, fault: TruncatingKernel | None = None, load=None) -> None:
    net = _net(dtype)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 64, generator=g).to(dtype), torch.randn(32, 64, generator=g)
    mode = dict(use_load=True, load_file_path=str(load)) if load else dict(use_dump=True)
    with fault if fault is not None else contextlib.nullcontext(), torch.utils.dumper(dump_path=str(path), **mode):
        F.mse_loss(net(x).float(), y).backward()


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    path = tmp_path_factory.mktemp("rounding") / "golden.h5"
    _step(path)
    return path


def _judged(target, golden):
    return apply_verdict(compare_dumps(str(target), str(golden)).table)


@pytest.mark.parametrize("replay", [False, True])
def test_a_truncating_kernel_is_named_first(golden, tmp_path, replay):
    fault = TruncatingKernel(PLANTED, call=1)
    _step(tmp_path / "t.h5", torch.bfloat16, fault=fault, load=golden if replay else None)
    table = _judged(tmp_path / "t.h5", golden)
    first = first_failure(table)
    assert first is not None and first["NPUDump"] == PLANTED and first["Module"] == "0", first
    assert first["Origin"] == ORIGIN_CAUSED and "rounding one-sided" in first["FailReason"], first["FailReason"]
    assert "nearer zero" in first["FailReason"] and first["DecidedBy"] == "RoundingBias"
    # the same own error by size as a correct kernel may have: it passes on that count alone
    assert first["OwnErrorVsFp64"] / 2 ** -8 < DEFAULT_THRESHOLDS["RelativeEuclideanDistanceUlps"]
    # the counts against the truncating kernel's own output and float64 on the same inputs
    live, exact = fault.seen
    rounded = exact.to(torch.bfloat16).double()
    off = live.double() != rounded
    toward_zero = off & (live.double().abs() < rounded.abs())
    assert first["OwnInexact"] == int(off.sum()) > 1000
    assert first["OwnTowardZero"] == int(toward_zero.sum()) / int(off.sum()) == 1.0


@pytest.mark.parametrize("replay", [False, True])
def test_the_correct_kernel_passes_and_is_not_one_sided(golden, tmp_path, replay):
    _step(tmp_path / "t.h5", torch.bfloat16, load=golden if replay else None)
    table = _judged(tmp_path / "t.h5", golden)
    assert first_failure(table) is None
    assert not table["FailReason"].astype(str).str.contains("one-sided").any()
    measured = table[table["OwnInexact"].fillna(0) > 0] if "OwnInexact" in table else table.iloc[:0]
    # CPU's bf16 products round to nearest: few elements off, on both sides
    assert (measured["OwnInexact"] < 256).all()


def _row(**kw) -> dict:
    row = {"NPUDump": "aten.mm.default", "TensorName": "result", "IO": "output", "DataType": "bfloat16",
           "GoldenDataType": "float32", "PrecisionDtype": "bfloat16", "CompareStatus": "compared",
           "MatchedBy": "seqid", "RelativeEuclideanDistance": 0.004, "MaxAbsoluteError": 0.01,
           "GoldenAbsMax": 2.0, "OwnErrorVsFp64": 0.002, "OwnMaxErrorVsFp64": 0.008, "OwnRefAbsMax": 2.0,
           "OwnInexact": 1000, "OwnTowardZero": 0.5, "OwnUpward": 0.5}
    row.update(kw)
    return row


def _result(row, **th):
    return judge_row(row, {**DEFAULT_THRESHOLDS, **th}, fp64=False)


@pytest.mark.parametrize("toward_zero,upward,fails,where", [
    (0.5, 0.5, False, ""), (0.93, 0.5, False, ""),        # 0.86 <= 0.9
    (1.0, 0.5, True, "nearer zero"), (0.0, 0.5, True, "farther from zero"),
    (0.5, 1.0, True, "above it"), (0.5, 0.02, True, "below it")])
def test_each_side_is_judged(toward_zero, upward, fails, where):
    res = _result(_row(OwnTowardZero=toward_zero, OwnUpward=upward))
    assert (res[0] == "fail") == fails, res
    if fails:
        assert where in res[1] and res[4] == "RoundingBias"


@pytest.mark.parametrize("kw", [
    dict(OwnInexact=255),                                     # too few to say
    dict(DataType="float32", PrecisionDtype="float32", OwnErrorVsFp64=5e-8, OwnMaxErrorVsFp64=2e-7,
         RelativeEuclideanDistance=1e-7, MaxAbsoluteError=2e-7),  # a float32 result of a Python number
    dict(NPUDump="aten.native_batch_norm.default"),           # per-channel statistics move them together
    dict(NPUDump="aten._softmax.default"),
    dict(OwnTowardZero=1.5), dict(OwnTowardZero=math.nan, OwnUpward=-0.2),   # an edited csv
    dict(OwnInexact=math.nan)])
def test_rows_that_cannot_say_are_not_judged_by_it(kw):
    res = _result(_row(OwnTowardZero=1.0, **kw) if "OwnTowardZero" not in kw else _row(**kw))
    assert res[0] == "pass", res


def test_the_threshold_turns_it_off():
    assert _result(_row(OwnTowardZero=1.0))[0] == "fail"
    assert _result(_row(OwnTowardZero=1.0), RoundingBias=1.0)[0] == "pass"


def test_the_command_line_and_the_html_report_say_it(golden, tmp_path):
    _step(tmp_path / "t.h5", torch.bfloat16, fault=TruncatingKernel(PLANTED, call=1))
    res = CliRunner().invoke(app, ["compare", "-m", str(tmp_path / "t.h5"), "-g", str(golden),
                                   "-o", str(tmp_path / "r"), "--format", "csv,html"], env={"COLUMNS": "80"})
    assert res.exit_code == 1, res.output
    lines = res.output.splitlines()
    assert lines[0].startswith("FAIL: first op caused here is aten.addmm.default #1 in 0: own rounding"), lines[0]
    assert "lie nearer zero" in " ".join(lines[:3]) and "as a kernel that truncates" in res.output
    # a share is no dtype bound: --tolerance does not move it, and the hint does not offer it
    said = " ".join(line.strip() for line in lines)
    assert "decided by: RoundingBias (change it with -t RoundingBias=VALUE)" in said
    page = next((tmp_path / "r").glob("*.html")).read_text()
    assert "own rounding one-sided" in page and "RoundingBias=VALUE</span>.</p>" in page
    res = CliRunner().invoke(app, ["compare", "-m", str(tmp_path / "t.h5"), "-g", str(golden), "-o",
                                   str(tmp_path / "r2"), "--tolerance", "100"], env={"COLUMNS": "80"})
    assert res.exit_code == 1 and "own rounding one-sided" in res.output.splitlines()[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_large_product_is_counted_on_a_sample_that_keeps_the_sides(dtype):
    """A block of 590k elements is counted on about 2^16 of them (own_error._SIDES_SAMPLE):
    a truncated product stays all on one side, a correctly rounded one and one accumulated in
    another order stay on both (GPT-2's 256 x 768 x 2304 shape)."""
    from npu_dumper.replay.own_error import _Errors
    torch.manual_seed(0)
    a, b = torch.randn(256, 768).to(dtype), (torch.randn(768, 2304) / 28).to(dtype)
    exact = a.double() @ b.double()

    def sides(live):
        acc = _Errors()
        acc.add(live, exact)
        got = acc.rounding()
        return got if got is not None else [0, 0, 0]

    f32 = a.float() @ b.float()
    n, toward_zero, _ = sides(_truncated(f32) if dtype == torch.bfloat16 else f32.to(dtype))
    if dtype == torch.bfloat16:
        assert 20_000 < n < 70_000 and toward_zero >= 0.999 * n   # half of a ~65k sample, nearer zero
    split = sum(a[:, i::8].float() @ b[i::8].float() for i in range(8)).to(dtype)    # another order
    for live in (a @ b, split):
        n, toward_zero, upward = sides(live)
        assert n < 256 or (abs(2 * toward_zero / n - 1) < 0.3 and abs(2 * upward / n - 1) < 0.3), (n, toward_zero, upward)


@pytest.mark.parametrize("text,expected", [
    ('{"result": [0.1, 0.2, 1.0], "#rounding": {"result": [300, 290, 10]}}', {"result": (300, 290, 10)}),
    ('{"result": [0.1, 0.2, 1.0]}', {}),                                   # a dump before the counts
    ('{"#rounding": {"result": [300, 301, 0]}}', {}),                      # a side larger than the whole
    ('{"#rounding": {"result": [300, -1, 0]}}', {}),
    ('{"#rounding": {"result": [true, 1, 0]}}', {}),
    ('{"#rounding": {"result": [300.5, 1, 0]}}', {}),
    ('{"#rounding": {"result": [0, 0, 0]}}', {}),
    ('{"#rounding": [[300, 1, 0]]}', {}),
    ('{"#rounding": {"result": [300, 1]}}', {}),
    ('{"#rounding": ' + "[" * 5000 + "]" * 5000 + "}", {}),               # deep nesting: refused, not run
    ("not json #rounding", {}),
])
def test_the_counts_are_read_only_when_they_are_counts(text, expected):
    """own_error is input from outside: counts that cannot be are left out, with the column."""
    from accucmp.compare.rows import _own_error_attr
    errors, rounding = _own_error_attr(text)
    assert rounding == expected
    assert "#rounding" not in errors                    # the own-error lists never take the key


def _grouped_cases():
    torch.manual_seed(0)
    bf = torch.bfloat16
    offs = torch.tensor([5, 5, 12, 20], dtype=torch.int32)          # an empty group too
    rows = (torch.randn(24, 16).to(bf), torch.randn(4, 16, 8).to(bf), offs)      # rows of A; 4 rows past the end
    # (the CPU kernel wants strides of multiples of 16 bytes)
    offs8 = torch.tensor([8, 8, 16, 24], dtype=torch.int32)
    inner = (torch.randn(8, 32).to(bf), torch.randn(32, 8).to(bf), offs8)        # the inner dimension
    cols = (torch.randn(4, 8, 16).to(bf), torch.randn(16, 32).to(bf), offs8)     # the columns of B
    batch = (torch.randn(3, 6, 16).to(bf), torch.randn(3, 16, 8).to(bf), None)
    return {"rows": rows, "inner": inner, "cols": cols, "batch": batch}


def _grouped_exact(a, b, offs):
    """The float64 result group by group, written out here apart from own_error's code."""
    a64, b64 = a.double(), b.double()
    if offs is None:
        return a64 @ b64, None
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    if a.dim() == 2 and b.dim() == 3:
        out = torch.zeros(a.shape[0], b.shape[2], dtype=torch.float64)
        for g, (s, e) in enumerate(zip(starts, ends)):
            out[s:e] = a64[s:e] @ b64[g]
        return out, (slice(0, ends[-1]),)
    if a.dim() == 2 and b.dim() == 2:
        return torch.stack([a64[:, s:e] @ b64[s:e] for s, e in zip(starts, ends)]), None
    out = torch.zeros(a.shape[1], b.shape[1], dtype=torch.float64)
    for g, (s, e) in enumerate(zip(starts, ends)):
        out[:, s:e] = a64[g] @ b64[:, s:e]
    return out, (slice(None), slice(0, ends[-1]))


@pytest.mark.skipif(not hasattr(torch.ops.aten, "_grouped_mm"), reason="no _grouped_mm in this torch")
@pytest.mark.parametrize("form", ["rows", "inner", "cols", "batch"])
def test_a_grouped_product_is_measured_group_by_group(form):
    """_grouped_mm (mixture-of-experts layers: DeepSeek's) has no float64 kernel, so it had no
    own error, and a truncating grouped product passed. Its reference is now each group's
    float64 product; checked against one written out here, and a truncated result fails."""
    import json
    from npu_dumper.capture.opschema import op_info
    from npu_dumper.replay.own_error import measure, prepare
    a, b, offs = _grouped_cases()[form]
    func = torch.ops.aten._grouped_mm.default
    args = (a, b) if offs is None else (a, b, offs)
    live = func(*args)
    exact, part = _grouped_exact(a, b, offs)
    for out, one_sided in ((live, False), (_truncated(func(a.float(), b.float(), *args[2:])), True)):
        prepared = prepare(func, args, {}, {})
        got = json.loads(measure(func, prepared, out))
        red, max_err, ref_max = got["result"]
        o, r = (out, exact) if part is None else (out[part], exact[part])
        rounded = r.to(torch.bfloat16).double()
        assert ref_max == float(rounded.abs().max())
        assert max_err == float((o.double() - rounded).abs().max())
        assert red == pytest.approx(float(torch.linalg.vector_norm(o.double() - rounded) /
                                          torch.linalg.vector_norm(rounded)), rel=1e-12, abs=1e-300)
        sides = got.get("#rounding", {}).get("result")
        if one_sided:
            assert sides is not None and sides[1] == sides[0] > 0       # every element off is nearer zero
        else:
            assert sides is None or sides[0] < 8
