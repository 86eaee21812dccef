"""Independent runs (plain dumps, no replay): a bf16/fp16 model whose loss is computed in fp32
(logits.float(), as autocast and most training loops do) must not have its fp32 loss ops
named as the first failing op: they carry the low-precision error computed upstream.
Without the fix, log_softmax's input failed at fp32 thresholds (7e4 u of float32) on every
clean bf16 run and was named first ahead of every planted backward fault."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import npu_dumper  # noqa: F401
from npu_dumper import inject_fault
from accucmp.compare.pipeline import compare_dumps
from accucmp.compare.verdict import apply_verdict
from accucmp.report.findings import first_failure


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.ln, self.l2 = nn.Linear(32, 64), nn.LayerNorm(64), nn.Linear(64, 50)

    def forward(self, x):
        return self.l2(F.gelu(self.ln(self.l1(x))))


def _run(path, dtype, fault=None):
    torch.manual_seed(0)
    m = _Net().to(dtype)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 32, generator=g).to(dtype), torch.randint(0, 50, (16,), generator=g)
    ctx = inject_fault(**fault) if fault else contextlib.nullcontext()
    with ctx:
        with torch.utils.dumper(use_dump=True, dump_path=str(path)):
            F.cross_entropy(m(x).float(), y).backward()
    return path


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("inh") / "g.h5", torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_clean_low_precision_run_passes(golden, tmp_path, dtype):
    t = apply_verdict(compare_dumps(str(_run(tmp_path / "t.h5", dtype)), str(golden)).table)
    fails = t[t["Result"] == "fail"]
    assert fails.empty, fails[["NPUDump", "IO", "TensorName", "PrecisionDtype", "FailReason"]].to_string()
    ls = t[(t["NPUDump"] == "aten._log_softmax.default")]
    assert set(ls["DataType"]) == {"float32"}
    # its input carries the low-precision error computed upstream; its output is judged by its
    # own error on that input (measured by the dumper), at the op's own precision
    assert set(ls[ls["IO"] == "input"]["PrecisionDtype"]) == {str(dtype)[6:]}
    out = ls[ls["IO"] == "output"]
    assert set(out["PrecisionDtype"]) == {"float32"} and out["OwnErrorVsFp64"].notna().all()


@pytest.mark.parametrize("dtype,rel", [(torch.bfloat16, 0.05), (torch.float16, 0.02)])
@pytest.mark.parametrize("op", ["aten.gelu_backward.default", "aten.native_layer_norm_backward.default",
                                "aten._log_softmax.default", "aten.gelu.default"])
def test_planted_fault_named_first(golden, tmp_path, dtype, rel, op):
    t = apply_verdict(compare_dumps(str(_run(tmp_path / "t.h5", dtype, dict(op=op, rel=rel))), str(golden)).table)
    ff = first_failure(t)
    assert ff is not None and ff["NPUDump"] == op, None if ff is None else ff[["NPUDump", "IO", "FailReason"]]


def test_fp32_run_is_still_judged_at_fp32(golden, tmp_path):
    """Nothing is inherited in a pure fp32 run: a 1% fault in an fp32 op still fails."""
    t = apply_verdict(compare_dumps(str(_run(tmp_path / "t.h5", torch.float32,
                                             dict(op="aten.gelu.default", rel=0.01))), str(golden)).table)
    assert set(t["PrecisionDtype"].dropna()) <= {"float32", ""}
    assert first_failure(t)["NPUDump"] == "aten.gelu.default"
