"""`accucmp compare -m RUN/ -g REF.h5` on models the distributed compare was not written
against (tests/_unseen_runs.py, one spawn of 2 gloo ranks): a Hugging Face GPT-2 (tiny
config) under DDP and FSDP2, and a CNN with BatchNorm under DDP. Clean runs pass (GELU's
backward squares the saved activation: no loss scale in it; BatchNorm normalises over each
rank's rows: what follows it differs by design), planted bugs are named by rank, op and
module."""

from __future__ import annotations

import logging
from pathlib import Path

import pandas as pd
import pytest
import torch.distributed as dist
from typer.testing import CliRunner

from accucmp.cli.main import app

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

runner = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"})
RUNS = (("gpt2", "ddp"), ("gpt2", "fsdp"), ("gpt2", "ddp_eps_bug"), ("cnn", "ddp"), ("cnn", "ddp_eps_bug"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from . import _unseen_runs

    return Path(_unseen_runs.build(tmp_path_factory.mktemp("unseen"), RUNS))


@pytest.fixture(scope="module")
def scheduler():
    from dask.distributed import LocalCluster

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0",
                      silence_logs=logging.CRITICAL) as cluster:
        yield cluster.scheduler_address


def _compare(runs, kind, case, out, scheduler):
    res = runner.invoke(app, ["compare", "-m", str(runs / kind / case), "-g", str(runs / kind / "ref.h5"),
                              "-o", str(out), "--scheduler", scheduler])
    rows = {int(p.stem.rsplit("_rank", 1)[1]): pd.read_csv(p) for p in Path(out).glob("result_*_rank*.csv")
            if p.stem.rsplit("_rank", 1)[1].isdigit()}
    return res, rows


@pytest.mark.parametrize("case,grads", [("ddp", "after all-reduce"), ("fsdp", "after reduce-scatter")])
def test_gpt2_runs_pass_against_the_single_process_reference(runs, scheduler, tmp_path, case, grads):
    res, rows = _compare(runs, "gpt2", case, tmp_path, scheduler)
    assert res.exit_code == 0, res.output           # before: FAIL at pow in GELU's backward (x2 applied)
    for t in rows.values():
        pw = t[(t["NPUDump"] == "aten.pow.Tensor_Scalar") & (t["Phase"] == "backward")]
        assert len(pw) and (pw["Result"] == "pass").all() and not pw["ReferencePart"].str.contains(" x2").any()
        g = t[t["MatchedBy"] == grads]
        assert len(g) == 28 and (g["Result"] == "pass").all()       # every parameter's gradient


def test_batchnorm_under_ddp_passes_and_says_what_differs_by_design(runs, scheduler, tmp_path):
    res, rows = _compare(runs, "cnn", "ddp", tmp_path, scheduler)
    assert res.exit_code == 0, res.output           # before: FAIL at native_batch_norm on rank 0
    for t in rows.values():
        conv = t[(t["Module"] == "module.conv") & (t["Phase"] == "forward")]
        assert (conv["Result"] == "pass").all() and len(conv) >= 4        # before the BatchNorm: compared
        stats = t[t["CompareStatus"] == "partial"]
        assert stats["CompareFailReason"].str.contains("statistics over this rank's part of the batch").any()
        # the running statistics BatchNorm updated from the rank's rows, read in its backward
        run = stats[stats["TensorName"].isin(["running_mean", "running_var"]) & (stats["Phase"] == "backward")]
        assert len(run) == 2
        # DDP's averaged gradients of per-rank statistics: by design, not failures
        grads = t[t["MatchedBy"] == "after all-reduce"]
        assert len(grads) == 6 and (grads["CompareStatus"] == "partial").all()


@pytest.mark.parametrize("model,op,module", [
    ("gpt2", "aten.native_layer_norm.default", "module.transformer.h.1.ln_2"),
    ("cnn", "aten.native_batch_norm.default", "module.bn"),        # (BatchNorm: still named)
], ids=["gpt2-layer-norm", "cnn-batch-norm"])
def test_eps_on_rank_1_is_named(runs, scheduler, tmp_path, model, op, module):
    res, _ = _compare(runs, model, "ddp_eps_bug", tmp_path, scheduler)
    assert res.exit_code == 1, res.output
    head = res.output.splitlines()[1]
    assert head.startswith(f"FAIL: first failing op is on rank 1: {op} #") and f"in {module}" in head, head
