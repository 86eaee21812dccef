"""Random ops in two independent plain dumps (docs/COMPARE.md, "Random ops").

A dropout's mask depends on the generator's state, an input no file holds: two runs seeded
differently (or on devices whose generators differ) draw other masks. The compare named the
first dropout "caused here" and offered to raise a threshold; it now names the draw as where
the runs depart (Origin `departs`, DecidedBy `RandomDraws`), and only when the op's inputs
agree: a random op fed other values inherits the difference like any op.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import npu_dumper  # noqa: F401  (installs torch.utils.dumper)
from accucmp.compare.op_policies import RANDOM_DRAWS
from accucmp.compare.pipeline import compare_dumps
from accucmp.compare.verdict import apply_verdict
from accucmp.report.findings import first_failure
from dumpfile import schema as S
from dumpfile.departures import attr_is_true
from dumpfile.read.reader import DumpFile

from tests._compare_helpers import overwrite_op_attr


class Net(nn.Module):
    def __init__(self, scale: float = 1.0):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(16, 32)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(32, 4)
        self.scale = scale

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x)) * self.scale))


def _dump(path, *, seed: int, scale: float = 1.0, bf16: bool = False) -> str:
    net = Net(scale).train()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else torch.autocast("cpu", enabled=False)
    with torch.utils.dumper(use_dump=True, dump_path=str(path)):
        torch.manual_seed(seed)
        with ctx:
            loss = F.cross_entropy(net(x).float(), torch.arange(8) % 4)
        loss.backward()
    return str(path)


def _judged(target, golden):
    return apply_verdict(compare_dumps(target, golden).table)


def test_the_dump_marks_the_ops_that_drew_random_numbers(tmp_path):
    path = _dump(tmp_path / "g.h5", seed=1)
    with DumpFile(path) as f:
        marked = {op.op for op in f.ops() if op.attrs.get(S.OP_RANDOM) is not None}
        every = {op.op for op in f.ops()}
    assert marked == {"aten.bernoulli_.float"}, marked          # CPU dropout: empty_like, bernoulli_, div_, mul
    assert "aten.addmm.default" in every and "aten.mul.Tensor" in every


def test_other_draws_are_named_where_the_runs_depart_not_as_a_kernel_error(tmp_path):
    golden = _dump(tmp_path / "g.h5", seed=1)
    assert first_failure(_judged(_dump(tmp_path / "same.h5", seed=1, bf16=True), golden)) is None
    t = _judged(_dump(tmp_path / "other.h5", seed=2, bf16=True), golden)
    first = first_failure(t)
    assert first is not None and first["NPUDump"] == "aten.bernoulli_.float", first
    assert first["Origin"] == "departs" and first["DecidedBy"] == "RandomDraws", first
    assert first["FailReason"].startswith(f"drop {RANDOM_DRAWS} in aten.bernoulli_.float"), first["FailReason"]
    assert "load-replay" in first["FailReason"]
    # the same rows judged without the op's mark: a kernel's error, caused here (as before)
    old = first_failure(apply_verdict(t.drop(columns=["RandomOp"])))
    assert old["NPUDump"] == "aten.bernoulli_.float" and old["Origin"] == "caused here"
    from typer.testing import CliRunner
    from accucmp.cli.main import app
    res = CliRunner(env={"COLUMNS": "100", "NO_COLOR": "1"}).invoke(
        app, ["compare", "-m", str(tmp_path / "other.h5"), "-g", golden, "-o", str(tmp_path / "out")])
    out = " ".join(res.output.split())
    assert res.exit_code == 1 and f"FAIL: drop {RANDOM_DRAWS}" in out, res.output
    assert "-t RelativeEuclideanDistance" not in out, res.output


def test_a_random_op_fed_other_values_inherits_them(tmp_path):
    """The same seed, the same mask, but the dropout's input scaled by 1.5 (the target's
    `mul` by a changed number): the dropout's output differs because its input does."""
    golden = _dump(tmp_path / "g.h5", seed=1)
    t = _judged(_dump(tmp_path / "scaled.h5", seed=1, scale=1.5), golden)
    first = first_failure(t)
    assert first is not None and first["NPUDump"] == "aten.mul.Tensor" and "argument other 1.5" in first["FailReason"]
    drop = t[(t["NPUDump"] == "aten.mul.Tensor") & (t["Module"] == "drop") & (t["IO"] == "output")]
    assert len(drop) and (drop["Result"] == "fail").all()
    assert not t["FailReason"].astype(str).str.contains(RANDOM_DRAWS).any()


def test_a_damaged_mark_means_nothing(tmp_path):
    """A file is input from outside: only a true boolean marks a random op."""
    assert attr_is_true(True) and attr_is_true(__import__("numpy").bool_(True))
    for v in ("yes", b"True", 1, [True], None, False):
        assert not attr_is_true(v), v
    golden = _dump(tmp_path / "g.h5", seed=1)
    target = _dump(tmp_path / "t.h5", seed=2)
    overwrite_op_attr(target, S.OP_RANDOM, "yes")
    overwrite_op_attr(golden, S.OP_RANDOM)          # (deleted: an older dumper's file)
    first = first_failure(_judged(target, golden))
    assert first["NPUDump"] == "aten.bernoulli_.float" and first["Origin"] == "caused here", first
