"""Folder compares (`accucmp compare -m RUN_B/ -g RUN_A/`): per-rank pairing, the merged
answer over all ranks on Dask, replica checks; and the streamed single-pair compare
that holds only the summary's rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from accucmp.cli.main import app
from accucmp.compare.pipeline import compare_dumps, stream_compare
from accucmp.compare.rank_files import pair_folders, rank_key
from accucmp.compare.ranks import compare_runs
from accucmp.compare.streaming import compare_to_csv
from accucmp.report.summary import SummaryBuilder, summarize
from accucmp.compare.verdict import apply_verdict
from dumpfile import schema as S
from dumpfile.errors import DumpFormatError

from ._cli_helpers import Op, model_ops, perturbed, write_dump

runner = CliRunner(env={"COLUMNS": "160", "NO_COLOR": "1"})


def _ddp_ops(rank: int, *, weight_fault: float = 0.0, out_fault_seqid: int | None = None) -> list[Op]:
    """One data-parallel step of a 2-layer MLP on `rank`: the same weights on every rank,
    this rank's own micro-batch, so activations differ across ranks and weights do not."""
    rng = np.random.default_rng(100)
    w1 = rng.standard_normal((8, 8)).astype(np.float32) / 3
    w2 = rng.standard_normal((8, 8)).astype(np.float32) / 3
    x = np.random.default_rng(rank).standard_normal((4, 8)).astype(np.float32)
    if weight_fault:
        w2 = (w2 * (1 + weight_fault)).astype(np.float32)
    h = x @ w1
    y = np.maximum(h, 0)
    z = y @ w2
    ops = [Op("aten.mm.default", 1, {"self": x, "mat2": w1}, {"result": h}, module="l1"),
           Op("aten.relu.default", 2, {"self": h}, {"result": y}, module="l1"),
           Op("aten.mm.default", 3, {"self": y, "mat2": w2}, {"result": z}, module="l2")]
    if out_fault_seqid is not None:
        ops = perturbed(ops, out_fault_seqid, 0.05)
    return ops


def _run(folder: Path, ops_of_rank, ranks, *, name="dump", step=None, world=None):
    folder.mkdir(parents=True, exist_ok=True)
    for r in ranks:
        stem = f"{name}{'' if step is None else f'_step{step}'}_rank{r}.h5"
        write_dump(folder / stem, ops_of_rank(r),
                   root_attrs={S.ROOT_RANK: r, S.ROOT_WORLD_SIZE: world or len(ranks)})


# ---- pairing ----------------------------------------------------------------------------
def test_rank_from_attributes_wins_over_the_name(tmp_path):
    p = tmp_path / "renamed_rank0.h5"
    write_dump(p, model_ops(), root_attrs={S.ROOT_RANK: 2, S.ROOT_WORLD_SIZE: 4})
    k = rank_key(p)
    assert (k.rank, k.world_size, k.source, k.step) == (2, 4, "attributes", None)


def test_rank_and_step_from_the_name_when_not_distributed(tmp_path):
    # a file written outside torch.distributed says rank 0 / world 1: the name decides
    p = tmp_path / "run_step3_rank1.h5"
    write_dump(p, model_ops())
    k = rank_key(p)
    assert (k.rank, k.step, k.source) == (1, 3, "name")
    plain = tmp_path / "single.h5"
    write_dump(plain, model_ops())
    assert (rank_key(plain).rank, rank_key(plain).step) == (0, None)


def test_a_file_that_is_not_a_dump_is_named(tmp_path):
    bad = tmp_path / "x_rank0.h5"
    bad.write_bytes(b"not hdf5")
    with pytest.raises(DumpFormatError, match="x_rank0.h5"):
        rank_key(bad)


def test_pairing_lists_what_it_cannot_pair_with_the_reason(tmp_path):
    a, b = tmp_path / "A", tmp_path / "B"
    _run(a, lambda r: model_ops(), [0, 1, 2])
    _run(b, lambda r: model_ops(), [0, 1])
    write_dump(b / "copy_rank1.h5", model_ops(), root_attrs={S.ROOT_RANK: 1, S.ROOT_WORLD_SIZE: 3})
    (b / "junk_rank5.h5").write_bytes(b"junk")
    pairing = pair_folders(b, a)
    assert [p.key[0] for p in pairing.pairs] == [0, 1]
    reasons = dict(pairing.unpaired)
    assert "also claimed by" in reasons[str(b / "dump_rank1.h5")]
    assert "no target file for rank 2" in reasons[str(a / "dump_rank2.h5")]
    assert reasons[str(b / "junk_rank5.h5")] == "target: not an HDF5 file"


# ---- the merged answer ------------------------------------------------------------------
@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    """Golden: 3 healthy ranks. Target: rank 1's second weight drifted (a broken replica,
    so its mm output fails at seqid 3), rank 2's relu output is wrong (seqid 2)."""
    d = tmp_path_factory.mktemp("ddp")
    _run(d / "A", lambda r: _ddp_ops(r), [0, 1, 2])
    _run(d / "B", lambda r: _ddp_ops(r, weight_fault=1e-2 if r == 1 else 0.0,
                                     out_fault_seqid=2 if r == 2 else None), [0, 1, 2])
    res = compare_runs(d / "B", d / "A", d / "out", workers=1)
    return d, res


def test_merged_result_names_the_earliest_failure_over_all_ranks(ddp_runs):
    d, res = ddp_runs
    assert not res.errors
    by_rank = {p["rank"]: p for p in res.pairs}
    assert by_rank[0]["counts"].get("fail", 0) == 0
    assert by_rank[1]["first_failure"]["SeqId"] == 3
    assert by_rank[2]["first_failure"]["SeqId"] == 2
    # step (none here), then seqid: rank 2's relu comes before rank 1's mm
    assert (res.earliest["rank"], res.earliest["SeqId"], res.earliest["NPUDump"]) == (2, 2, "aten.relu.default")
    assert res.diverge_first == [2]


def test_per_rank_csvs_hold_what_a_single_compare_gives(ddp_runs):
    d, res = ddp_runs
    for p in res.pairs:
        got = pd.read_csv(p["csv"])
        want = apply_verdict(compare_dumps(p["target"], p["golden"]).table)
        assert list(got["Result"]) == list(want["Result"])
        np.testing.assert_allclose(got["RelativeEuclideanDistance"], want["RelativeEuclideanDistance"])
    ranks = pd.read_csv(res.paths[0])
    assert list(ranks["Rank"]) == [0, 1, 2] and list(ranks["Fail"] > 0) == [False, True, True]
    summary = json.loads(Path(res.paths[1]).read_text())
    assert summary["diverge_first"] == [2] and summary["earliest_failure"]["rank"] == 2


def test_replica_check_finds_the_rank_whose_weights_differ(ddp_runs):
    d, res = ddp_runs
    rep = {x["rank"]: x for x in res.replicas}
    assert set(rep) == {1, 2}                      # each rank against the lowest, rank 0
    # the golden holds the two weights equal across ranks; inputs x, h, y differ (own data)
    assert rep[1]["golden_equal"] == 2 and rep[2]["golden_equal"] == 2
    assert rep[1]["differ"] == 1 and rep[2]["differ"] == 0
    (bad,) = rep[1]["first"]
    assert (bad["NPUDump"], bad["SeqId"], bad["IO"], bad["TensorName"]) == ("aten.mm.default", 3, "input", "mat2")


def test_steps_pair_separately_and_order_the_earliest_failure(tmp_path):
    a, b = tmp_path / "A", tmp_path / "B"
    for step in (0, 1):
        _run(a, lambda r: model_ops(seed=r), [0, 1], step=step)
        # step 0 is clean; in step 1 rank 0 fails at seqid 7, rank 1 at seqid 4
        fault = {0: 7, 1: 4}
        _run(b, lambda r: perturbed(model_ops(seed=r), fault[r], 0.05) if step == 1 else model_ops(seed=r),
             [0, 1], step=step)
    res = compare_runs(b, a, tmp_path / "o", workers=1, replica_check=False)
    assert sorted((p["rank"], p["step"]) for p in res.pairs) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert (res.earliest["step"], res.earliest["SeqId"], res.diverge_first) == (1, 4, [1])
    assert not res.replicas


def test_cli_folders_exit_1_and_say_which_rank_diverges_first(ddp_runs, tmp_path):
    d, _ = ddp_runs
    (d / "B" / "extra_rank7.h5").write_bytes(b"junk")
    try:
        r = runner.invoke(app, ["compare", "-m", str(d / "B"), "-g", str(d / "A"), "-o", str(tmp_path / "o"),
                                "--workers", "1"])
    finally:
        (d / "B" / "extra_rank7.h5").unlink()
    assert r.exit_code == 1, r.output
    assert "earliest failure over all ranks (step, then seqid): rank 2: aten.relu.default seqid 2" in r.output
    assert r.output.startswith("FAIL: first failing op is on rank 2: aten.relu.default #2"), r.output[:300]
    assert "diverge first: rank(s) 2" in r.output
    assert "replica check rank 1 vs rank 0: 1 of 2" in r.output
    assert "extra_rank7.h5: target: not an HDF5 file" in r.output
    assert len(list((tmp_path / "o").glob("result_*_rank[0-9]*.csv"))) == 3


def test_cli_folders_with_nothing_to_pair_is_one_line_exit_2(tmp_path):
    (tmp_path / "A").mkdir()
    (tmp_path / "B").mkdir()
    r = runner.invoke(app, ["compare", "-m", str(tmp_path / "B"), "-g", str(tmp_path / "A"),
                            "-o", str(tmp_path / "o")])
    assert r.exit_code == 2
    assert r.output.strip().splitlines() == [
        f"accucmp: error: {tmp_path / 'B'} and {tmp_path / 'A'}: no rank pairs to compare (no .h5 files)"]


def test_compare_of_two_files_does_not_import_dask(tmp_path):
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    write_dump(a, model_ops())
    write_dump(b, model_ops())
    code = ("import sys; from accucmp.cli.main import main\n"
            f"try:\n    main(['compare', '-m', {str(b)!r}, '-g', {str(a)!r}, '-o', {str(tmp_path / 'o')!r}, '-q'])\n"
            "except SystemExit:\n    pass\n"
            "print(sorted(m for m in ('dask', 'distributed', 'torch') if m in sys.modules))\n")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


# ---- streaming: the same result, a batch at a time --------------------------------------
def _mixed_pair(tmp_path):
    """bf16 ops first (their precision is inherited by later fp32 rows), an unmatched op,
    faults at two seqids: enough to tell a streamed result from the in-memory one."""
    g_ops = model_ops(n_layers=4)
    for o in g_ops[:3]:
        o.dtype = "bfloat16"
    t_ops = perturbed(g_ops, 8, 0.05, noise=1e-3)
    t_ops = perturbed(t_ops, 14, 0.2)
    for o in t_ops[:3]:
        o.dtype = "bfloat16"
    t_ops.append(Op("aten.sum.default", 99, {"self": np.ones(3, np.float32)}, {"result": np.ones(1, np.float32)}))
    t, g = tmp_path / "t.h5", tmp_path / "g.h5"
    write_dump(t, t_ops)
    write_dump(g, g_ops)
    return str(t), str(g)


@pytest.mark.parametrize("batch_rows", [1, 7, 4096])
def test_streamed_csv_equals_the_in_memory_result(tmp_path, batch_rows):
    t, g = _mixed_pair(tmp_path)
    want = apply_verdict(compare_dumps(t, g).table)
    r = compare_to_csv(t, g, tmp_path / "s.csv", batch_rows=batch_rows)
    got = pd.read_csv(tmp_path / "s.csv")
    assert r.rows == len(want) == len(got)
    for c in ("Index", "NPUDump", "Result", "PrecisionDtype", "FailReason"):
        assert got[c].fillna("").astype(str).tolist() == want[c].fillna("").astype(str).tolist(), c
    np.testing.assert_allclose(got["Severity"], want["Severity"])
    # the summary kept while streaming is the one of the whole table
    whole = summarize(want)
    s = r.summary
    assert s.counts == whole.counts and s.total == whole.total
    assert s.first_failure["Index"] == whole.first_failure["Index"]
    assert [w["Index"] for w in s.worst] == [w["Index"] for w in whole.worst]
    assert [u["Index"] for u in s.unmatched] == [u["Index"] for u in whole.unmatched]


def test_stream_batches_hold_whole_ops(tmp_path):
    t, g = _mixed_pair(tmp_path)
    with stream_compare(t, g, batch_rows=2) as st:
        batches = list(st.batches)
        parts = [m.table for m in batches]
        assert st.meta["rows"] == sum(len(p) for p in parts)
    assert len(parts) > 1
    # each batch says where it starts; the Index column counts on from there
    assert [m.first for m in batches] == [int(p["Index"].iloc[0]) for p in parts] \
        == list(np.cumsum([0] + [len(p) for p in parts[:-1]]))
    keys = [set(zip(p["NPUDump"], p["SeqId"].fillna(-1))) for p in parts]
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            assert not (a & b)            # no op split across two batches


def test_summary_builder_keeps_only_top_rows(tmp_path):
    t, g = _mixed_pair(tmp_path)
    table = apply_verdict(compare_dumps(t, g).table)
    b = SummaryBuilder(top=1)
    for lo in range(0, len(table), 5):
        b.add(table.iloc[lo:lo + 5])
    s = b.result()
    assert len(s.worst) == 1 and len(s.unmatched) == 1
    assert s.worst[0]["Index"] == summarize(table, top=1).worst[0]["Index"]


class _Recorder:
    def __init__(self):
        self.n_tasks, self.rows_seen, self.done = None, 0, 0

    def start(self, n):
        self.n_tasks = n

    def rows(self, n):
        self.rows_seen += n

    def pair_done(self):
        self.done += 1


def test_existing_scheduler_and_progress_counts(ddp_runs, tmp_path):
    from dask.distributed import LocalCluster
    import logging

    d, first = ddp_runs
    rec = _Recorder()
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0",
                      silence_logs=logging.CRITICAL) as cluster:
        res = compare_runs(d / "B", d / "A", tmp_path / "o", scheduler=cluster.scheduler_address, progress=rec)
    assert res.earliest == first.earliest and res.diverge_first == first.diverge_first
    # 3 pairs + 2 replica checks; every row written was reported to the bar
    assert rec.n_tasks == rec.done == 5
    assert rec.rows_seen == sum(p["rows"] for p in res.pairs) == 24


def test_progress_bar_only_on_a_terminal(ddp_runs, tmp_path):
    import io

    from rich.console import Console

    from accucmp.compare.ranks import run_folder_compare

    d, _ = ddp_runs
    for terminal in (True, False):
        buf = io.StringIO()
        console = Console(file=buf, force_terminal=terminal, width=150, color_system=None)
        code = run_folder_compare(d / "B", d / "A", tmp_path / f"o{terminal}", console=console, workers=1)
        assert code == 1
        assert ("rank pairs" in buf.getvalue()) is terminal


def test_two_file_compare_still_forks_after_a_folder_compare(ddp_runs, monkeypatch):
    """distributed keeps an idle offload thread for the process once a client ran; the
    fork guard must not take it for a busy thread (compare would fall back to threads)."""
    import threading

    from accucmp.compare import parallel as compare

    dask_threads = [t for t in threading.enumerate() if t.name.startswith("Dask-Offload")]
    assert dask_threads
    # other tests of the session may leave threads of their own: look at these alone
    monkeypatch.setattr(threading, "enumerate", lambda: [threading.main_thread(), *dask_threads])
    assert compare._safe_to_fork()


@pytest.mark.parametrize("path", ["processes", "threads"])
def test_streamed_batches_from_workers_keep_order_and_whole_ops(tmp_path, monkeypatch, path):
    from accucmp.compare import parallel as C

    t, g = _mixed_pair(tmp_path)
    want = apply_verdict(compare_dumps(t, g).table)
    if path == "threads":
        monkeypatch.setattr(C, "_FORK", None)      # as where fork is unavailable
    monkeypatch.setattr(C, "_spans", lambda n, jobs: [(i, min(n, i + 2)) for i in range(0, n, 2)])
    r = compare_to_csv(t, g, tmp_path / "s.csv", jobs=2, batch_rows=3)
    got = pd.read_csv(tmp_path / "s.csv")
    assert r.rows == len(want)
    assert got["Result"].tolist() == want["Result"].tolist()
    assert got["NPUDumpPath"].fillna("").tolist() == want["NPUDumpPath"].fillna("").tolist()
    assert r.summary.first_failure["Index"] == summarize(want).first_failure["Index"]


def test_a_rank_pair_reports_a_damaged_file_as_its_error_but_lets_a_bug_through(tmp_path, monkeypatch):
    """In a folder compare, an HDF5 failure on one pair's bytes is that pair's error (exit 2
    in the summary); an exception of our own code is not dressed up as bad input: it goes up
    to the CLI boundary, which reports it as a bug (exit 3)."""
    import h5py

    from accucmp.compare import rank_tasks, streaming

    bad = tmp_path / "not_hdf5.h5"
    bad.write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 64)

    def h5py_failure(*a, **k):
        h5py.File(bad, "r")                 # raises from inside h5py (OSError here)

    monkeypatch.setattr(streaming, "compare_to_csv", h5py_failure)
    out = rank_tasks.pair_task("t.h5", "g.h5", str(tmp_path / "r.csv"), {})
    assert out["error"].startswith("t.h5 vs g.h5: OSError")      # the pair named, the cause kept

    def our_bug(*a, **k):
        raise KeyError("a bug of ours")

    monkeypatch.setattr(streaming, "compare_to_csv", our_bug)
    with pytest.raises(KeyError, match="a bug of ours"):
        rank_tasks.pair_task("t.h5", "g.h5", str(tmp_path / "r.csv"), {})


# ---- folder mode as a first-class compare (issue 33) -------------------------------------
def test_cli_folders_summary_json_carries_the_verdict_and_per_rank_results(ddp_runs, tmp_path):
    d, _ = ddp_runs
    js = tmp_path / "verdict.json"
    r = runner.invoke(app, ["compare", "-m", str(d / "B"), "-g", str(d / "A"), "-o", str(tmp_path / "o"),
                            "--workers", "1", "-q", "--summary-json", str(js)])
    assert r.exit_code == 1, r.output
    rec = json.loads(js.read_text())
    two_file_keys = {"verdict", "sentence", "exit_code", "tensors", "counts", "inherited", "first_failure",
                     "worst", "target", "golden", "thresholds", "outputs", "accucmp_version"}
    assert two_file_keys <= set(rec)
    assert (rec["verdict"], rec["exit_code"]) == ("FAIL", r.exit_code)
    assert rec["sentence"].startswith("FAIL: first failing op is on rank 2: aten.relu.default #2 in l1")
    assert (rec["first_failure"]["rank"], rec["first_failure"]["op"]) == (2, "aten.relu.default")
    ranks = rec["ranks"]
    assert [x["rank"] for x in ranks] == [2, 1, 0]          # the diverge-first rank leads
    by = {x["rank"]: x for x in ranks}
    assert by[2]["diverges_first"] and by[2]["first_failure"]["module"] == "l1"
    assert (by[1]["verdict"], by[1]["first_failure"]["op"], by[1]["replica"]["differ"]) == (
        "FAIL", "aten.mm.default", 1)
    assert by[0]["verdict"] == "PASS" and by[0]["counts"] == {"pass": 8}
    assert rec["diverge_first"] == [2] and rec["worst"][0]["rank"] in (1, 2)
    # the merged summary json next to the csvs carries the same verdict
    merged = json.loads(next((tmp_path / "o").glob("result_*_summary.json")).read_text())
    assert (merged["verdict"], merged["sentence"], merged["exit_code"]) == (
        rec["verdict"], rec["sentence"], rec["exit_code"])


def test_cli_folders_html_is_one_report_led_by_the_diverge_first_rank(ddp_runs, tmp_path):
    d, _ = ddp_runs
    r = runner.invoke(app, ["compare", "-m", str(d / "B"), "-g", str(d / "A"), "-o", str(tmp_path),
                            "--workers", "1", "-q", "-f", "html"])
    assert r.exit_code == 1, r.output
    (page,) = tmp_path.glob("result_*.html")
    text = page.read_text()
    assert "FAIL: first failing op is on rank 2: aten.relu.default #2 in l1" in text
    assert "<h2>Ranks</h2>" in text and "2 (diverges first)" in text
    assert text.index("2 (diverges first)") < text.index("result_", text.index("<h2>Ranks</h2>"))
    assert "Rank 2 (diverges first): its report" in text and "<table id='all'>" in text
    assert "<h2>Replica checks</h2>" in text and "rank 1 vs rank 0" in text


@pytest.fixture(scope="module")
def drifted_replica(tmp_path_factory):
    """Rank 1's second weight off by a few float32 ulps: every tensor passes against the golden,
    and only the replica check (bit-for-bit equal across ranks in the golden) sees it."""
    d = tmp_path_factory.mktemp("replica")
    _run(d / "A", lambda r: _ddp_ops(r), [0, 1])
    _run(d / "B", lambda r: _ddp_ops(r, weight_fault=3e-7 if r == 1 else 0.0), [0, 1])
    return d


@pytest.mark.parametrize("args, code", [([], 1), (["--select", "relu"], 0), (["--exclude", "aten.mm"], 0),
                                        (["-x", "mm"], 0), (["--exclude", "aten.relu.*"], 1)])
def test_select_and_exclude_reach_the_replica_check_and_the_sentence_agrees(drifted_replica, tmp_path,
                                                                           args, code):
    """Before: --select relu printed 'PASS: 4 tensors within bounds' and exited 1, from the
    replica check of the unselected mm's weight."""
    d = drifted_replica
    js = tmp_path / "v.json"
    r = runner.invoke(app, ["compare", "-m", str(d / "B"), "-g", str(d / "A"), "-o", str(tmp_path / "o"),
                            "--workers", "1", "--summary-json", str(js)] + args)
    assert r.exit_code == code, r.output
    head = r.output.splitlines()[0]
    rec = json.loads(js.read_text())
    assert rec["exit_code"] == code and rec["sentence"] == head
    assert head.startswith("PASS" if code == 0 else "FAIL"), head
    if code:
        assert head.startswith("FAIL: replica check: rank 1 differs from rank 0 in 1 of ")
        assert "aten.mm.default #3 in l2 input/mat2" in head
    by = {x["rank"]: x for x in rec["ranks"]}
    assert by[1]["verdict"] == ("PASS" if code == 0 else "FAIL")


def test_exclude_on_two_files_leaves_the_op_out(tmp_path):
    write_dump(tmp_path / "g.h5", _ddp_ops(0))
    write_dump(tmp_path / "t.h5", _ddp_ops(0, out_fault_seqid=3))
    r = runner.invoke(app, ["compare", "-m", str(tmp_path / "t.h5"), "-g", str(tmp_path / "g.h5"), "-o",
                            str(tmp_path / "o"), "-q", "--exclude", "aten.mm.default"])
    assert r.exit_code == 0, r.output
    table = pd.read_csv(next((tmp_path / "o").glob("result_*.csv")))
    assert set(table["NPUDump"]) == {"aten.relu.default"}
    r = runner.invoke(app, ["compare", "-m", str(tmp_path / "t.h5"), "-g", str(tmp_path / "g.h5"), "-o",
                            str(tmp_path / "o2"), "-q", "--exclude", "*"])
    assert r.exit_code == 2 and "no op is left by --exclude '*'" in r.output


def test_folders_where_select_leaves_no_op_are_one_line_exit_2(drifted_replica, tmp_path):
    d = drifted_replica
    r = runner.invoke(app, ["compare", "-m", str(d / "B"), "-g", str(d / "A"), "-o", str(tmp_path),
                            "--workers", "1", "-q", "-f", "html", "--select", "nothinghere"])
    assert r.exit_code == 2
    assert r.output.strip().splitlines()[-1] == (
        f"accucmp: error: {d / 'B'}: no op is left by --select 'nothinghere' on any rank; nothing to compare")
