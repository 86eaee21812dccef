"""The compare's stages and what each hands the next (accucmp/compare/pipeline.py's table):
match -> Matched, read -> Task, metrics -> Measured, verdict -> Judged. Small dumps, torch-free."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest

from accucmp.compare.pairing import match_ops
from accucmp.compare.pipeline import stream_compare
from accucmp.compare.rows import STATUS_UNMATCHED, tasks_for_pair
from accucmp.compare.verdict import VERDICT_COLUMNS, apply_verdict, judge
from dumpfile import schema as S
from dumpfile.read.reader import DumpFile
from tests._compare_helpers import write_dump


def _op(name, seqid, x, y):
    return {"op": name, "seqid": seqid, "inputs": {"self": x}, "outputs": {"result": y}}


@pytest.fixture()
def pair(tmp_path):
    x = np.linspace(-1, 1, 16, dtype=np.float32)
    g_ops = [_op("aten.relu.default", 1, x, np.maximum(x, 0)), _op("aten.exp.default", 2, x, np.exp(x)),
             _op("aten.tanh.default", 3, x, np.tanh(x))]
    t_ops = [_op("aten.relu.default", 1, x, np.maximum(x, 0)), _op("aten.exp.default", 2, x, np.exp(x) * 1.1),
             _op("aten.sigmoid.default", 3, x, 1 / (1 + np.exp(-x))), _op("aten.tanh.default", 4, x, np.tanh(x))]
    t, g = tmp_path / "t.h5", tmp_path / "g.h5"
    write_dump(t, t_ops)
    write_dump(g, g_ops)
    return str(t), str(g)


def test_match_stage_hands_on_the_op_pairs_and_how_they_were_paired(pair):
    t, g = pair
    with DumpFile(t) as tf, DumpFile(g) as gf:
        m = match_ops(tf, gf, tf.ops(), gf.ops())
        names = [(p.target.op if p.target else None, p.golden.op if p.golden else None) for p in m.pairs]
        assert ("aten.sigmoid.default", None) in names          # the target's extra op stays unmatched
        assert ("aten.exp.default", "aten.exp.default") in names
        assert (m.target_ops, m.golden_ops, m.replay, m.inherit) == (4, 3, False, True)
        assert m.ios == (S.INPUT_GROUP, S.OUTPUT_GROUP)
        with pytest.raises(dataclasses.FrozenInstanceError):
            m.replay = True

        # read stage: one Task per tensor pair, the unmatched op's rows marked as such
        sig = next(p for p in m.pairs if p.target is not None and p.target.op == "aten.sigmoid.default")
        tasks = tasks_for_pair(sig, None, ["CosineSimilarity"], m.replay, 0, m.ios)
        assert [(tk.row["IO"], tk.row["TensorName"], tk.row["CompareStatus"]) for tk in tasks] == [
            ("input", "self", STATUS_UNMATCHED), ("output", "result", STATUS_UNMATCHED)]
        assert tasks[0].golden is None and tasks[0].target is not None


def test_metrics_batches_and_their_verdict(pair):
    t, g = pair
    with stream_compare(t, g, batch_rows=2) as st:
        batches = list(st.batches)
    assert len(batches) > 1
    for m in batches:
        j = judge(m)
        assert j.first == m.first == int(m.table["Index"].iloc[0])
        assert set(VERDICT_COLUMNS) <= set(j.table.columns) and not set(VERDICT_COLUMNS) & set(m.table.columns)
        pd.testing.assert_frame_equal(j.table, apply_verdict(m.table))
    judged = pd.concat([judge(m).table for m in batches])
    failed = judged[judged["Result"] == "fail"]
    assert list(zip(failed["NPUDump"], failed["TensorName"])) == [("aten.exp.default", "result")]
