"""One live op for several recorded ones (npu_dumper/replay/load_replay.py, `_stood_in_for`).

`F.linear` computes a 3-D input as one `addmm` when the input is contiguous and as a product
plus `add` when it is strided; autocast hands a Linear a contiguous bf16 copy of its input, so
an fp32 recording and its bf16 replay take different paths through the same Linear (timm's
XCiT reads its class token as `x[:, 0:1]`). Before, a clean replay failed there: an inserted
`addmm` and missing `mm`/`add`, and in backward a missing bias-gradient `sum`. Now the live op
stands in for the recorded ones it equals in value, and what it reads of the user's own
(weight, bias) is still checked against the recording."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import npu_dumper  # noqa: F401  (installs torch.utils.dumper)
from accucmp.compare.pipeline import compare_dumps
from accucmp.compare.verdict import apply_verdict
from accucmp.report.findings import first_failure


class ClassTokenMLP(nn.Module):
    """A norm, then an MLP on the class token read as a strided view (XCiT's class attention),
    then two Linears of one shape side by side (XCiT's k and v): the live run's one more
    `addmm` before them must not make k take v's recorded call."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.fc1 = nn.Linear(16, 32)
        self.act = nn.GELU()
        self.k = nn.Linear(32, 32)
        self.v = nn.Linear(32, 32)
        self.fc2 = nn.Linear(32, 10)
        with torch.no_grad():
            self.fc1.bias.uniform_(-1, 1)     # a bias that matters to the result

    def forward(self, x):
        cls = self.norm(x)[:, 0:1]          # [B, 1, 16], strided
        h = self.act(self.fc1(cls)).flatten(1)
        return self.fc2(self.k(h) * self.v(h))


def _step(model, x, y):
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x).float(), y).backward()


def _model():
    torch.manual_seed(0)
    return ClassTokenMLP()


def _inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 6, 16, generator=g), torch.randint(0, 10, (4,), generator=g)


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    path = tmp_path_factory.mktemp("stand_in") / "gold.h5"
    x, y = _inputs()
    model = _model()
    with torch.utils.dumper(use_dump=True, dump_path=str(path)):
        _step(model, x, y)
    return path


def _replay(golden, out, model):
    x, y = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16), \
            torch.utils.dumper(use_load=True, load_file_path=str(golden), dump_path=str(out)) as d:
        _step(model, x, y)
    table = apply_verdict(compare_dumps(str(out), str(golden)).table)
    return table, first_failure(table), d.summary["replay"]


def test_the_recording_takes_mm_and_add_where_the_autocast_replay_takes_addmm(golden):
    from dumpfile.read.reader import DumpFile
    f = DumpFile(str(golden))
    try:
        fc1 = [op.op for op in f.ops() if op.module == "fc1" and op.phase == "forward"]
    finally:
        f.close()
    assert "aten.addmm.default" not in fc1 and "aten.add.Tensor" in fc1     # the premise


def test_a_clean_replay_passes_and_says_which_live_ops_stood_in(golden, tmp_path):
    table, ff, summary = _replay(golden, tmp_path / "clean.h5", _model())
    assert ff is None, (ff["NPUDump"], ff["Module"], ff["FailReason"])
    assert not any(summary.departures.values())
    assert any(r.startswith("fc1: live aten.addmm.default for recorded aten.mm") for r in summary.regrouped)
    assert any("aten.sum.dim_IntList" in r for r in summary.regrouped)     # the bias gradient
    assert "computed what recorded ops of their module did" in str(summary)


@pytest.mark.parametrize("scale, said", [
    # 5%: the result is no longer the recorded one, no stand-in: the op itself is the departure
    (1.05, "fc1 runs aten.addmm.default, which the golden run does not have"),
    # 1%: the result is within the stand-in's few units, and the bias it read is not the recorded one
    (1.01, "input self of aten.addmm.default in fc1 differs from the golden's"),
])
def test_a_changed_bias_of_the_linear_that_stood_in_is_named(golden, tmp_path, scale, said):
    model = _model()
    with torch.no_grad():
        model.fc1.bias.mul_(scale)
    table, ff, summary = _replay(golden, tmp_path / "bias.h5", model)
    assert ff is not None and ff["Module"] == "fc1" and ff["Origin"] == "departs", ff
    assert said in str(ff["FailReason"])


def test_an_extra_scale_after_the_linear_is_no_stand_in(golden, tmp_path):
    model = _model()
    model.fc1.register_forward_hook(lambda mod, i, o: o * 1.05)
    table, ff, summary = _replay(golden, tmp_path / "scale.h5", model)
    assert ff is not None and ff["Origin"] == "departs"
    assert "runs aten.mul.Tensor, which the golden run does not have" in str(ff["FailReason"])
