"""A bfloat16/float16 model whose module computes in float32 from its weight (`weight.float()`:
Gemma's RMSNorm, DeepSeek-V2's MoE router, which `model.to(torch.bfloat16)` leaves in bf16),
against its float32 run. The float32 copy is a cast of a leaf, so a leaf itself (a changed
weight must still show), and it holds the golden's weight rounded to bfloat16: by design.
It failed as "input mat2 ... differs from the golden's: no op of the step made it" (DeepSeek-V2's
clean bf16 run failed two rows and its planted _grouped_mm fault was not named). The dumper now
says which leaves came back from a coarser dtype (op attribute leaf_rounded), and the verdict
allows them the golden's value rounded to it, no more."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import npu_dumper  # noqa: F401  (installs torch.utils.dumper)
from accucmp.compare.pipeline import compare_dumps
from accucmp.compare.verdict import apply_verdict
from accucmp.report.findings import first_failure
from dumpfile import schema as S
from dumpfile.read.reader import DumpFile


class Router(nn.Module):
    """Scores in float32 whatever the model's dtype, as MoE routers do."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 32) * 0.2)

    def forward(self, x):
        return F.linear(x.float(), self.weight.float()).softmax(-1)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(16, 32)
        self.router = Router()
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.router(torch.relu(self.fc(x))).to(x.dtype))


def _dump(path, dtype, *, bug: float = 1.0) -> str:
    net = Net()
    with torch.no_grad():
        net.router.weight[0].mul_(bug)
    net = net.to(dtype)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.utils.dumper(use_dump=True, dump_path=str(path)):
        F.cross_entropy(net(x).float(), torch.arange(8) % 4).backward()
    return str(path)


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    return _dump(tmp_path_factory.mktemp("upcast") / "g.h5", torch.float32)


def _judged(target, golden):
    return apply_verdict(compare_dumps(target, golden).table)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_low_precision_weight_copied_to_float32_passes_as_the_golden_rounded(golden, tmp_path, dtype):
    target = _dump(tmp_path / "t.h5", dtype)
    with DumpFile(target) as f:
        mm = [op for op in f.ops() if op.op == "aten.mm.default" and op.attrs.get(S.OP_MODULE) == "router"]
        assert mm and mm[0].attrs.get(S.OP_LEAF_ROUNDED) == '{"mat2": "%s"}' % str(dtype)[6:], \
            [op.attrs.get(S.OP_LEAF_ROUNDED) for op in mm]
    t = _judged(target, golden)
    assert first_failure(t) is None, t[t["Result"] == "fail"][["NPUDump", "TensorName", "FailReason"]].to_string()
    row = t[(t["NPUDump"] == "aten.mm.default") & (t["Module"] == "router") & (t["TensorName"] == "mat2")
            & (t["Phase"] == "forward")]
    assert len(row) == 1 and row["DataType"].iloc[0] == "float32"
    assert row["LeafRoundedTo"].iloc[0] == str(dtype)[6:]
    assert row["FailReason"].iloc[0].startswith(f"input mat2: the golden's value rounded to {str(dtype)[6:]}")
    # without the dumper's word the same row fails as a changed weight (as it did)
    assert first_failure(apply_verdict(t.drop(columns=["LeafRoundedTo"]))) is not None


def test_a_changed_weight_behind_the_copy_still_fails_at_its_module(golden, tmp_path):
    t = _judged(_dump(tmp_path / "bug.h5", torch.bfloat16, bug=1.05), golden)
    first = first_failure(t)
    assert first is not None and first["Module"] == "router" and first["Origin"] == "departs", first
    assert first["TensorName"] == "mat2" and "no op of the step made it" in first["FailReason"], first["FailReason"]
