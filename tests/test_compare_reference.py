"""`accucmp compare -m RUN/ -g REF.h5`: every rank of a 2-rank gloo run (DDP, FSDP2) of a
tiny transformer LM against one single-process reference dump of the full batch
(accucmp/compare/reference_runs.py). Clean runs pass, a bug planted on rank 1 is named by
rank, op and module, layouts that cannot be compared are one line and exit 2."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch.distributed as dist
from typer.testing import CliRunner

from accucmp.cli.main import app

from . import _dist_runs

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

runner = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"})

CASES = ("ddp_interleaved", "ddp_contiguous", "ddp_weight_bug", "ddp_eps_bug", "fsdp2", "tp", "ddp_scaled",
         "fsdp2_scaled")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = Path(_dist_runs.build_runs(tmp_path_factory.mktemp("reference_runs"), CASES))
    return out


@pytest.fixture(scope="module")
def scheduler():
    """One in-process Dask cluster for the module's compares (a LocalCluster each costs seconds)."""
    from dask.distributed import LocalCluster

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0",
                      silence_logs=logging.CRITICAL) as cluster:
        yield cluster.scheduler_address


def _compare(runs, case, out, scheduler, *extra, golden="ref.h5"):
    res = runner.invoke(app, ["compare", "-m", str(runs / case), "-g", str(runs / golden), "-o", str(out),
                              "--scheduler", scheduler, *extra])
    return res, _rows(out)


def _rows(out: Path) -> dict[int, pd.DataFrame]:
    return {int(p.stem.rsplit("_rank", 1)[1]): pd.read_csv(p) for p in sorted(Path(out).glob("result_*_rank*.csv"))
            if p.stem.rsplit("_rank", 1)[1].isdigit()} if Path(out).is_dir() else {}


@pytest.mark.parametrize("case,split", [("ddp_interleaved", "interleaved"), ("ddp_contiguous", "contiguous")])
def test_ddp_ranks_pass_against_the_single_process_reference(runs, scheduler, tmp_path, case, split):
    res, rows = _compare(runs, case, tmp_path, scheduler, "--format", "csv,html")
    assert res.exit_code == 0, res.output
    line = res.output.splitlines()[0]
    assert line.startswith("comparing 2 DDP rank(s)") and f"({split}, 4 rows" in line, line
    assert "gradients after the all-reduce with the full-batch gradients" in line
    import html
    assert html.escape(line) in next(tmp_path.glob("*.html")).read_text()     # the folder report says it too
    assert res.output.splitlines()[1].startswith("PASS")
    assert sorted(rows) == [0, 1]
    for rank, t in rows.items():
        assert not (t["Result"].isin(["fail", "unmatched"])).any()
        # activations: the rank's rows of the reference's (the forward's batch-sliced rows)
        fwd = t[(t["Phase"] == "forward") & t["ReferencePart"].fillna("").str.startswith("rows ")]
        want = ",".join(map(str, _dist_runs.rows_of(rank, 2, split)))
        assert len(fwd) > 40 and (fwd["Result"] == "pass").all()
        assert fwd["ReferencePart"].str.startswith(f"rows {want} of 4").all()
        # every parameter's gradient after DDP's all-reduce against the full-batch gradient
        grads = t[t["MatchedBy"] == "after all-reduce"]
        assert len(grads) == 27 and (grads["Result"] == "pass").all()
        assert pd.to_numeric(grads["RelativeEuclideanDistance"]).max() < 1e-5
        # the rank's own gradients before the all-reduce are partial sums, the reducer's ops parallelism
        partial = t[t["CompareStatus"] == "partial"]
        assert {"aten.embedding_dense_backward.default", "aten.mm.default"} <= set(partial["NPUDump"])
        assert (partial["Result"] == "skipped").all()
        par = t[t["CompareStatus"] == "parallelism"]
        assert {"c10d.allreduce_.default", "aten.mul.out"} <= set(par["NPUDump"])


def test_fsdp2_activations_and_reduce_scattered_gradients_pass(runs, scheduler, tmp_path):
    res, rows = _compare(runs, "fsdp2", tmp_path, scheduler)
    assert res.exit_code == 0, res.output
    assert res.output.startswith("comparing 2 FSDP2 rank(s)")
    assert "reduce-scattered gradients per parameter" in res.output.splitlines()[0]
    assert sorted(rows) == [0, 1]
    for rank, t in rows.items():
        assert not (t["Result"].isin(["fail", "unmatched"])).any()
        sliced = t[t["ReferencePart"].fillna("").str.startswith("rows ")]
        assert len(sliced) > 80 and (sliced["Result"] == "pass").all()
        # FSDP2's all-gather, copy-in/out and buffers: parallelism
        par = set(t.loc[t["CompareStatus"] == "parallelism", "NPUDump"])
        assert {"fsdp.all_gather_copy_in.default", "c10d._allgather_base_.default",
                "aten.empty.memory_format"} <= par
        # every parameter's shard of its averaged gradient against the reference's rows
        grads = t[t["MatchedBy"] == "after reduce-scatter"]
        assert len(grads) == 27 and (grads["Result"] == "pass").all()
        assert pd.to_numeric(grads["RelativeEuclideanDistance"]).max() < 1e-5
        fc1 = grads[(grads["Module"] == "blocks.0.mlp.fc1") & (grads["GoldenOp"] == "aten.mm.default")]
        assert list(fc1["Shape"]) == ["(16,16)"]           # half of (32, 16): this rank's rows
        assert fc1["ReferencePart"].iloc[0].startswith(f"rows {16 * rank}:{16 * rank + 16} of 32 (dim 0)")
        # the copies of the reduced buffer: marked, compared at the reduce-scatter
        sharded = t[t["CompareStatus"] == "sharded"]
        assert len(sharded) == 3 and sharded["CompareFailReason"].str.contains("compared per parameter").all()


def test_fsdp2_one_rank_s_bad_gradient_shard_is_named_by_rank_op_and_module(runs, scheduler, tmp_path):
    """Rank 1's chunk of blocks.0.mlp.fc1's weight gradient, after the reduce-scatter, 5% off
    (written into its dump): FAIL on rank 1 alone, at the reduce-scatter, in fc1, the row
    saying which gradient (before: marked `sharded`, exit 0)."""
    import h5py

    _, clean = _compare(runs, "fsdp2", tmp_path / "clean", scheduler)
    t = clean[1]
    row = t[(t["MatchedBy"] == "after reduce-scatter") & (t["Module"] == "blocks.0.mlp.fc1")
            & (t["GoldenOp"] == "aten.mm.default")].iloc[0]
    lo, hi = (int(x) for x in row["TensorName"].split("[", 1)[1].rstrip("]").split(":"))
    bad = tmp_path / "fsdp2_bad_shard"
    shutil.copytree(runs / "fsdp2", bad)
    with h5py.File(bad / "lm_rank1.h5", "r+") as f:
        ds = f[row["NPUDumpPath"]]
        ds[lo:hi] = ds[lo:hi] * 1.05
    res = runner.invoke(app, ["compare", "-m", str(bad), "-g", str(runs / "ref.h5"), "-o", str(tmp_path / "o"),
                              "--scheduler", scheduler, "--summary-json", str(tmp_path / "s.json")])
    assert res.exit_code == 1, res.output
    head = res.output.splitlines()[1]
    assert head.startswith(f"FAIL: first failing op is on rank 1: {row['NPUDump']} #{row['SeqId']} "
                           "in blocks.0.mlp.fc1"), head
    rec = json.loads((tmp_path / "s.json").read_text())
    assert rec["diverge_first"] == [1]
    assert rec["plan"] == res.output.splitlines()[0]          # what is paired how, in the record too
    per = {r["rank"]: r for r in rec["ranks"]}
    assert per[0]["verdict"] == "PASS" and per[1]["counts"]["fail"] == 1
    assert "full-batch gradient aten.mm.default" in str(rec["first_failure"].get("ReferencePart", "")) or \
        "aten.mm.default" in _rows(tmp_path / "o")[1].query("Result == 'fail'")["ReferencePart"].iloc[0]


@pytest.mark.parametrize("case,op,module,why", [
    ("ddp_weight_bug", "aten.addmm.default", "module.blocks.0.mlp.fc1", "input mat2"),
    ("ddp_eps_bug", "aten.native_layer_norm.default", "module.blocks.1.ln2", "eps 0.1, golden 1e-05"),
])
def test_a_bug_planted_on_rank_1_is_named_by_rank_op_and_module(runs, scheduler, tmp_path, case, op, module, why):
    res, _ = _compare(runs, case, tmp_path, scheduler)
    assert res.exit_code == 1, res.output
    head = res.output.splitlines()[1]
    assert head.startswith(f"FAIL: first failing op is on rank 1: {op} #") and f"in {module}" in head, head
    summary = json.loads(next(tmp_path.glob("*_summary.json")).read_text())
    assert summary["diverge_first"] == [1]
    e = summary["earliest_failure"]
    assert (e["rank"], e["NPUDump"], e["Module"]) == (1, op, module)
    assert why in e["FailReason"]


def test_tensor_parallel_run_against_a_reference_is_assembled_and_passes(runs, scheduler, tmp_path):
    # (refused in one line before shard assembly (accucmp/compare/shards.py) landed: this
    # model's TP run, built apart from test_compare_shards' runs, now passes tensor by tensor)
    res, rows = _compare(runs, "tp", tmp_path, scheduler)
    assert res.exit_code == 0, res.output
    assert "size mismatch" not in res.output and "assembled" in res.output, res.output


def test_a_reference_of_another_model_is_one_line_exit_2(runs, scheduler, tmp_path):
    res, rows = _compare(runs, "ddp_interleaved", tmp_path, scheduler, golden="ref_w24.h5")
    assert res.exit_code == 2
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert len(lines) == 1 and "not a reference of the model" in lines[0], res.output
    assert "[32, 16] vs [32, 24]" in lines[0] and not rows


def test_folders_of_different_world_sizes_are_one_line_exit_2(runs, scheduler, tmp_path):
    import h5py

    other = tmp_path / "four_ranks"
    shutil.copytree(runs / "ddp_interleaved", other)
    for p in other.glob("*.h5"):
        with h5py.File(p, "r+") as f:
            f.attrs["world_size"] = 4
    res = runner.invoke(app, ["compare", "-m", str(runs / "ddp_interleaved"), "-g", str(other),
                              "-o", str(tmp_path / "o"), "--scheduler", scheduler])
    assert res.exit_code == 2
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert len(lines) == 1 and "different world sizes" in lines[0], res.output


def test_stated_split_that_is_wrong_fails_at_the_batch(runs, scheduler, tmp_path):
    """--batch-split contiguous on an interleaved run: rank 1's batch is not rows 2,3 of the
    reference's, and the verdict says so at the first op reading it (never a pass)."""
    res, rows = _compare(runs, "ddp_interleaved", tmp_path, scheduler, "--batch-split", "contiguous")
    assert res.exit_code == 1, res.output
    t = rows[1]
    first = t[t["Result"] == "fail"].iloc[0]
    assert (first["NPUDump"], first["TensorName"]) == ("aten.embedding.default", "indices")


def _whole_and_in_pieces(run_dir, layout: str, runs, tmp_path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Rank 1 of `run_dir` against the reference, its tensors read whole and in pieces of 24
    elements: the two result tables."""
    from accucmp.compare.reference_runs import RankView, find_batch_split
    from accucmp.compare.streaming import compare_to_csv

    target, ref = str(run_dir / "lm_rank1.h5"), str(runs / "ref.h5")
    split = find_batch_split(target, ref, 2, 1)
    out = []
    for chunk in (1 << 22, 24):
        view = RankView(1, 2, tuple(split.rows(1, 2)), split.batch, 2.0, (layout,))
        r = compare_to_csv(target, ref, tmp_path / f"c{chunk}.csv", view=view, chunk_elements=chunk)
        out.append(pd.read_csv(r.csv))
    return out[0], out[1]


def test_reference_slices_read_in_small_pieces_measure_the_same(runs, tmp_path):
    """The reference's batch slice read in pieces of 24 elements (a large tensor's path)
    gives the rows and verdicts of the whole read, metrics equal to rounding."""
    a, b = _whole_and_in_pieces(runs / "ddp_interleaved", "ddp", runs, tmp_path)
    assert list(a["Result"]) == list(b["Result"]) and (a["Result"] == "pass").sum() > 200
    ra, rb = (pd.to_numeric(x["RelativeEuclideanDistance"]) for x in (a, b))
    assert ((ra - rb).abs().fillna(0) < 1e-6).all()


def test_one_rank_file_against_the_reference_says_to_give_the_folder(runs, tmp_path):
    res = runner.invoke(app, ["compare", "-m", str(runs / "ddp_interleaved" / "lm_rank0.h5"),
                              "-g", str(runs / "ref.h5"), "-o", str(tmp_path), "-q"])
    assert res.exit_code == 1
    assert "is one rank of a 2-rank run" in res.output and "give the run's folder" in res.output


def test_reduce_scattered_gradients_read_in_small_pieces_measure_the_same(runs, tmp_path):
    """FSDP2's per-parameter chunks (FlatRange: the rows of dim 0 holding the range, in slabs
    of --chunk-elements; below one row, the source streamed) read in pieces of 24 elements
    give the rows of the whole read."""
    a, b = (t[t["MatchedBy"] == "after reduce-scatter"].reset_index(drop=True)
            for t in _whole_and_in_pieces(runs / "fsdp2", "fsdp2", runs, tmp_path))
    assert len(a) == 27 and list(a["Result"]) == list(b["Result"]) == ["pass"] * 27
    ra, rb = (pd.to_numeric(x["RelativeEuclideanDistance"]) for x in (a, b))
    assert ((ra - rb).abs() < 1e-6).all() and list(a["TensorName"]) == list(b["TensorName"])


@pytest.mark.parametrize("case,part", [("ddp_scaled", "after all-reduce"), ("fsdp2_scaled", "after reduce-scatter")])
def test_ranks_that_train_with_a_grad_scaler_pass_with_the_scale_divided_out(runs, scheduler, tmp_path, case, part):
    """Each rank's gradients carry GradScaler's 65536; the reference's do not. The reduced
    gradients, re-paired with the reference's full-batch ones, are compared with the scale
    divided out (before: `FAIL ... aten.copy_.default #102 in emb (backward): RelErr 6.55e+04`,
    DDP's copy of the all-reduced bucket into .grad)."""
    res, rows = _compare(runs, case, tmp_path, scheduler)
    assert res.exit_code == 0, res.output
    assert sorted(rows) == [0, 1]
    for t in rows.values():
        assert not (t["Result"] == "fail").any(), t[t["Result"] == "fail"][["NPUDump", "FailReason"]]
        reduced = t[t["MatchedBy"] == part]
        assert len(reduced) and (reduced["LossScale"] == 2.0 ** 16).all() and (reduced["Result"] == "pass").all()
