"""Random ops under load-replay and golden replay: dropout's mask cannot be redrawn on
another device, so replay hands on the recorded outputs and compare skips them, while
seeded ops that draw nothing (attention with dropout_p=0, dropout outside training) are
replayed and compared like any other op."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import npu_dumper
from accucmp.compare.pipeline import compare_dumps
from accucmp.compare.verdict import apply_verdict
from dumpfile import DumpFile
from dumpfile import schema as S
from npu_dumper.replay.op_names import draws_random
from npu_dumper.replay.recorded import load_call


class DropoutAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        h = self.drop(self.fc(x))
        q = h.unsqueeze(1)
        return F.scaled_dot_product_attention(q, q, q).squeeze(1)   # dropout_p=0: no draw


def _step(model, x):
    model(x).square().mean().backward()


def test_draws_random_reads_the_probability_and_training_arguments():
    sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    dropout = torch.ops.aten.native_dropout.default
    assert not draws_random(sdpa, {})                       # schema default dropout_p=0.0
    assert draws_random(sdpa, {"dropout_p": 0.1})
    assert not draws_random(dropout, {"p": 0.5, "train": False})
    assert draws_random(dropout, {"p": 0.5, "train": True})
    assert draws_random(torch.ops.aten.bernoulli_.float, {"p": 0.5})
    assert not draws_random(torch.ops.aten.add.Tensor, {})


def test_load_replay_hands_on_recorded_random_outputs_and_compare_skips_them(tmp_path):
    torch.manual_seed(0)
    model, x = DropoutAttention(), torch.randn(4, 8, 16)
    golden, target = tmp_path / "golden.h5", tmp_path / "target.h5"
    torch.manual_seed(1)
    with npu_dumper.dumper(use_dump=True, dump_path=str(golden)):
        _step(model, x)
    model.zero_grad()
    torch.manual_seed(2)            # another generator state: a fresh draw would differ
    with npu_dumper.dumper(use_load=True, load_file_path=str(golden), dump_path=str(target)) as d:
        _step(model, x)
    summary = d.summary["replay"]
    assert summary.random_replayed >= 1
    assert summary.matched == summary.recorded_ops

    with DumpFile(target) as t, DumpFile(golden) as g:
        random_ops = [o for o in t.ops() if o.attrs.get(S.OP_RANDOM_OUTPUTS_REPLAYED)]
        assert random_ops and all("bernoulli" in o.op or "dropout" in o.op for o in random_ops)
        for o in random_ops:          # the live tensor now holds the reference's mask
            for name, rec in o.outputs().items():
                assert (rec.read() == g.op(o.op, o.seqid).outputs()[name].read()).all()

    table = apply_verdict(compare_dumps(str(target), str(golden)).table)
    skipped = table[table["CompareStatus"] == "random_replayed"]
    assert len(skipped) >= 1 and set(skipped["Result"]) == {"skipped"}
    assert (table["Result"] == "fail").sum() == 0          # every later op saw the same mask
    sdpa = table[table["NPUDump"].str.contains("scaled_dot_product") & (table["IO"] == "output")]
    assert len(sdpa) and set(sdpa["Result"]) == {"pass"}     # compared, not skipped


def test_golden_replay_refuses_only_ops_that_draw(tmp_path):
    torch.manual_seed(0)
    model, x = DropoutAttention(), torch.randn(4, 8, 16)
    path = tmp_path / "d.h5"
    with npu_dumper.dumper(use_dump=True, dump_path=str(path)):
        _step(model, x)
    with DumpFile(path) as f:
        why = {o.op: load_call(o).why_not for o in f.ops()}
    assert any("random op" in w for op, w in why.items() if "bernoulli" in op or "dropout" in op)
    assert all(not w for op, w in why.items() if "scaled_dot_product" in op)
