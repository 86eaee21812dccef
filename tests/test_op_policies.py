"""Per-op verdict policies (accucmp/compare/op_policies.py) on real dumps: tie-dependent indices are
judged by the values they select, and plain dump-vs-dump names the op that caused an error
("caused here") rather than those that inherited it."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import npu_dumper  # noqa: F401  (installs torch.utils.dumper)
from npu_dumper import inject_fault
from npu_dumper.capture.opschema import op_info
from accucmp.compare.pipeline import compare_dumps
from accucmp.compare.op_policies import KNOWN_KERNEL_ERROR, ORIGIN_CAUSED, ORIGIN_INHERITED, TIE_INDICES, packet
from accucmp.compare.verdict import apply_verdict
from accucmp.report.findings import first_failure


def _overload(name: str):
    ns, op = name.split(".", 1)
    return getattr(getattr(torch.ops, ns), op).default


def test_registries_name_real_outputs():
    """Every listed op exists and the listed outputs are its schema's returns (as the dump names
    them); every aten op that returns values beside indices is covered by a rule."""
    for name, (indices, values) in TIE_INDICES.items():
        names = op_info(_overload(name)).return_names
        assert indices in names and (not values or values in names), (name, names)
    for (name, output), known in KNOWN_KERNEL_ERROR.items():
        f = _overload(name)
        assert output in op_info(f).return_names, (name, output)
        assert known.ulps > 0 and known.dtypes
    for f in (torch.ops.aten.topk.default, torch.ops.aten.max.dim, torch.ops.aten.sort.default,
              torch.ops.aten.kthvalue.default, torch.ops.aten.cummax.default):
        assert op_info(f).return_names == ("values", "indices")
    assert packet("aten.max.dim") == "aten.max" and packet("aten.relu.default") == "aten.relu"


class _Pool(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(1, 4, 1, 1))

    def forward(self, x):
        y = F.max_pool2d(x * self.w, 2)
        return y.sum() + torch.argmax(x.flatten(1), dim=1).sum() * 0


def _tied():
    # values 1 + k * 1e-4: distinct in float32, all 1.0 in bfloat16 -> ties
    g = torch.Generator().manual_seed(0)
    return 1 + torch.randint(0, 8, (2, 4, 8, 8), generator=g).float() * 1e-4


def _run(path, dtype, *, load=None, fault=None):
    torch.manual_seed(0)
    m = _Pool().to(dtype)
    ctx = inject_fault(**fault) if fault else contextlib.nullcontext()
    kw = dict(use_load=True, load_file_path=str(load)) if load else dict(use_dump=True)
    with ctx, torch.utils.dumper(dump_path=str(path), **kw):
        m(_tied().to(dtype)).backward()


def test_max_pool_indices_judged_by_the_values_they_select(tmp_path):
    _run(tmp_path / "g.h5", torch.float32)
    _run(tmp_path / "t.h5", torch.bfloat16, load=tmp_path / "g.h5")
    t = apply_verdict(compare_dumps(str(tmp_path / "t.h5"), str(tmp_path / "g.h5")).table)
    assert (t["Result"] != "fail").all(), t[t["Result"] == "fail"][["NPUDump", "TensorName", "FailReason"]]
    mp = t[t["NPUDump"] == "aten.max_pool2d_with_indices.default"].set_index("TensorName")
    # the indices really differ (ties picked another element), but the values they select agree
    assert mp.loc["result1", "ExactMismatches"] > 0
    assert mp.loc["result1", "Result"] == "pass"
    assert "judged by the values they select (result0: pass)" in mp.loc["result1", "FailReason"]
    am = t[t["NPUDump"] == "aten.argmax.default"].iloc[0]
    assert am["ExactMismatches"] > 0 and am["Result"] == "skipped"
    assert "no values output to judge them by" in am["FailReason"]
    # a fault in the pool's values: the indices row fails with them, and the op is named first
    _run(tmp_path / "f.h5", torch.bfloat16, load=tmp_path / "g.h5",
         fault=dict(op="aten.max_pool2d_with_indices.default", rel=0.07))
    t = apply_verdict(compare_dumps(str(tmp_path / "f.h5"), str(tmp_path / "g.h5")).table)
    mp = t[t["NPUDump"] == "aten.max_pool2d_with_indices.default"].set_index("TensorName")
    assert mp.loc["result0", "Result"] == "fail" and mp.loc["result1", "Result"] == "fail"
    assert first_failure(t)["NPUDump"] == "aten.max_pool2d_with_indices.default"


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x):
        return self.c(torch.tanh(self.b(F.gelu(self.a(x)))))


@pytest.mark.parametrize("op,call", [("aten.gelu.default", 1), ("aten.tanh_backward.default", 1)])
def test_plain_dumps_name_the_op_that_caused_the_error(tmp_path, op, call):
    """fp32 run vs fp32 run with a 5% fault: every later op fails too (its inputs carry the
    error); the one whose inputs still agree is 'caused here', the first failure named."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))

    def run(path, fault=None):
        torch.manual_seed(0)
        m = _MLP()
        ctx = inject_fault(op, rel=0.05, call=call) if fault else contextlib.nullcontext()
        with ctx, torch.utils.dumper(use_dump=True, dump_path=str(path)):
            m(x).square().mean().backward()

    run(tmp_path / "g.h5")
    run(tmp_path / "t.h5", fault=True)
    t = apply_verdict(compare_dumps(str(tmp_path / "t.h5"), str(tmp_path / "g.h5")).table)
    failing = t[t["Result"] == "fail"]
    caused = failing[failing["Origin"] == ORIGIN_CAUSED]
    assert set(caused["NPUDump"]) == {op}, failing[["NPUDump", "IO", "TensorName", "Origin"]].to_string()
    inherited = failing[failing["Origin"] == ORIGIN_INHERITED]
    assert len(inherited) >= 2                              # the error spread and is marked so
    assert (failing["Origin"] != "").all() and (t[t["Result"] != "fail"]["Origin"] == "").all()
    assert first_failure(t)["NPUDump"] == op
    # the terminal summary's first-failure line names it and says so
    from rich.console import Console
    from accucmp.report.summary import print_summary
    console = Console(record=True, width=250)
    print_summary(t, console=console)
    line = next(ln for ln in console.export_text().splitlines() if "first failure" in ln)
    assert op in line and "caused here" in line


class _LN(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(64)
        self.fc = nn.Linear(64, 8)

    def forward(self, x):
        return self.fc(F.gelu(self.ln(x - x.mean(-1, keepdim=True))))


def test_amplified_input_difference_is_inherited_in_plain_dumps(tmp_path):
    """bf16 run vs fp32 run: LayerNorm's saved mean of rows whose mean is 0 in exact arithmetic
    is 100% off (rounding noise), though its inputs and its normalised output agree: the inputs'
    difference amplified, marked inherited; a fault planted after it is the op named first."""
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))

    def run(path, dtype, fault=False, own_error=True):
        torch.manual_seed(0)
        m = _LN().to(dtype)
        ctx = inject_fault("aten.gelu.default", rel=0.07) if fault else contextlib.nullcontext()
        with ctx, torch.utils.dumper(use_dump=True, dump_path=str(path), own_error=own_error):
            m(x.to(dtype)).float().square().mean().backward()

    run(tmp_path / "g.h5", torch.float32)
    # a dump without the dumper's own-error measurement: the heuristic rule
    run(tmp_path / "t.h5", torch.bfloat16, own_error=False)
    t = apply_verdict(compare_dumps(str(tmp_path / "t.h5"), str(tmp_path / "g.h5")).table)
    ln = t[(t["NPUDump"] == "aten.native_layer_norm.default") & (t["IO"] == "output")].set_index("TensorName")
    assert ln.loc["result1", "Result"] == "fail" and ln.loc["result0", "Result"] == "pass"
    assert ln.loc["result1", "Origin"] == ORIGIN_INHERITED
    assert "inputs' small difference, amplified" in ln.loc["result1", "FailReason"]
    assert (t["Origin"] != ORIGIN_CAUSED).all()
    # with it (the default): the op's own error on its own inputs passes, the row passes as inherited
    run(tmp_path / "o.h5", torch.bfloat16)
    t = apply_verdict(compare_dumps(str(tmp_path / "o.h5"), str(tmp_path / "g.h5")).table)
    ln = t[(t["NPUDump"] == "aten.native_layer_norm.default") & (t["IO"] == "output")].set_index("TensorName")
    assert ln.loc["result1", "Result"] == "pass" and ln.loc["result1", "Origin"] == ORIGIN_INHERITED
    assert ln.loc["result1", "FailReason"].startswith("inherited: the golden differs by")
    assert (t["Result"] != "fail").all()
    run(tmp_path / "f.h5", torch.bfloat16, fault=True)
    t = apply_verdict(compare_dumps(str(tmp_path / "f.h5"), str(tmp_path / "g.h5")).table)
    ff = first_failure(t)
    assert (ff["NPUDump"], ff["Origin"]) == ("aten.gelu.default", ORIGIN_CAUSED)


def test_pointwise_bound_class_lists_only_ops_torch_tags_pointwise():
    """op_policies.POINTWISE (the correctly rounded elementwise ops judged by PointwiseUlps) is
    data because the dump records no op tags: every entry must be an op torch tags pointwise."""
    from accucmp.compare.op_policies import CLASS_POINTWISE, CLASS_SUM, POINTWISE, bound_class
    for name in sorted(POINTWISE):
        pkt = getattr(torch.ops.aten, name.split(".", 1)[1])
        tagged = [o for o in pkt.overloads() if torch.Tag.pointwise in getattr(pkt, o).tags]
        assert tagged, f"{name}: no overload tagged pointwise"
    assert bound_class("aten.gelu.default", "result") == CLASS_POINTWISE
    assert bound_class("aten.native_layer_norm_backward.default", "result2") == CLASS_SUM
    assert bound_class("aten.mm.default", "result") == ""
