"""Overflow check (npu_dumper.replay.overflow.OverflowPolicy through torch.utils.dumper)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import npu_dumper  # noqa: F401
from dumpfile import DumpFile
from npu_dumper.errors import DumperError
from npu_dumper.replay.overflow import OverflowDetected, OverflowPolicy


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        with torch.no_grad():
            self.proj.weight.fill_(1.0)
            self.proj.bias.zero_()

    def forward(self, x, divisor):
        y = self.proj(x)               # 12 everywhere for x = 3
        z = torch.exp(y * 1.0)         # e^12 ~ 1.6e5: finite in fp32, inf in fp16
        w = z / divisor                # divisor 0 -> a real inf
        return (w + 1).sum()


def _run(tmp_path, divisor, **kw):
    path = str(tmp_path / "ov.h5")
    net = _Net()
    with torch.utils.dumper(check_overflow=True, dump_path=path, **kw) as d:
        net(torch.full((2, 4), 3.0), divisor)
    return path, d


def _ops(path):
    with DumpFile(path) as f:
        return [(o.op, o.seqid, o.attrs.get("overflow", ""), {k: np.asarray(v.read()) for k, v in o.inputs().items()},
                 {k: np.asarray(v.read()) for k, v in o.outputs().items()}) for o in f.ops()]


def test_exp_overflowing_fp16_is_predicted_from_an_fp32_run(tmp_path, capsys):
    path, d = _run(tmp_path, torch.ones(4), overflow_dtype=torch.float16)
    out = capsys.readouterr().out
    ops = _ops(path)
    assert [o[0] for o in ops] == ["aten.exp.default"]
    op, seqid, why, inputs, outputs = ops[0]
    assert f"IR: aten.exp.default SeqId: {seqid} is overflow!" in out
    assert seqid > 1                                   # the full stream's seqid, sparse in the file
    assert "float16" in why
    assert np.allclose(inputs["self"], 12.0) and np.isfinite(outputs["result"]).all()
    # the ops after it inherit the large values: not reported again
    assert out.count("is overflow!") == 1


def test_real_inf_is_found_where_it_starts(tmp_path, capsys):
    path, d = _run(tmp_path, torch.tensor([1.0, 0.0, 1.0, 1.0]))
    out = capsys.readouterr().out
    ops = _ops(path)
    assert [o[0] for o in ops] == ["aten.div.Tensor"]
    _, seqid, why, inputs, outputs = ops[0]
    assert f"IR: aten.div.Tensor SeqId: {seqid} is overflow!" in out
    assert "inf" in why and np.isinf(outputs["result"]).sum() == 2
    assert np.isfinite(inputs["self"]).all() and inputs["other"][1] == 0


def test_in_place_overflow_dumps_the_input_as_before_the_op(tmp_path, capsys):
    path = str(tmp_path / "ov.h5")
    with torch.utils.dumper(check_overflow=True, dump_path=path):
        x = torch.full((3,), 1e30)
        x.mul_(1e10)
        x.add_(1.0)                     # input already inf: not a new overflow
    (op, _, _, inputs, outputs), = _ops(path)
    assert op == "aten.mul_.Tensor" or op.startswith("aten.mul_")
    assert np.all(inputs["self"] == np.float32(1e30)) and np.isinf(outputs["self"]).all()
    assert capsys.readouterr().out.count("is overflow!") == 1


def test_raise_at_first_overflow(tmp_path, capsys):
    path = str(tmp_path / "ov.h5")
    with pytest.raises(OverflowDetected) as err:
        with torch.utils.dumper(check_overflow=True, dump_path=path, overflow_raise=True):
            x = torch.full((2,), 1e30)
            y = x * 1e10
            y * 1e10                    # never reached
    assert isinstance(err.value, DumperError) and err.value.op == "aten.mul.Tensor"
    assert [o[0] for o in _ops(path)] == ["aten.mul.Tensor"]


def test_stop_after_n_overflows(tmp_path, capsys):
    path = str(tmp_path / "ov.h5")
    with torch.utils.dumper(check_overflow=True, dump_path=path, overflow_limit=1):
        a = torch.full((2,), 1e30) * 1e10
        b = torch.full((2,), -1e30) * 1e10     # a second overflow, past the limit
    assert len(_ops(path)) == 1
    assert capsys.readouterr().out.count("is overflow!") == 1


def test_clean_run_records_nothing_and_says_so(tmp_path, capsys):
    path, d = _run(tmp_path, torch.ones(4))
    assert _ops(path) == []
    assert "0 overflowing op(s)" in capsys.readouterr().out


def test_bad_options_are_refused():
    with pytest.raises(DumperError):
        OverflowPolicy(overflow_dtype=torch.int32)
    with pytest.raises(DumperError):
        OverflowPolicy(limit=0)
    assert OverflowPolicy(dtype="bfloat16").overflow_dtype is torch.bfloat16


def test_infinity_the_caller_asked_for_is_not_an_overflow(tmp_path, capsys):
    """`masked_fill(mask, -inf)`, `torch.full(..., -inf)` (attention masks) and CTC's log-space
    alpha table (log 0 = -inf, wav2vec2's CTC loss) hold -inf by design: each was reported as
    'is overflow!'. A real overflow after them is still found."""
    x = torch.randn(2, 4)
    m = torch.tensor([[True, False, False, False]] * 2)
    log_probs = torch.randn(20, 2, 6).log_softmax(-1)
    targets = torch.randint(1, 6, (2, 5))
    with torch.utils.dumper(check_overflow=True, dump_path=str(tmp_path / "ov.h5")) as d:
        x.masked_fill(m, float("-inf")).softmax(-1)
        torch.full((2, 2), float("-inf")).triu(1)
        torch.zeros(3).fill_(float("inf"))
        torch.nn.functional.ctc_loss(log_probs, targets, torch.full((2,), 20), torch.full((2,), 5))
        (x * 1e30).exp()                                  # a real one
    out = capsys.readouterr().out
    names = [o[0] for o in d.policies[0].overflows]
    assert names == ["aten.exp.default"], out
