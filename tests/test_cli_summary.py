"""Summary, html report, output writers and option parsing, on hand-built result tables."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pandas as pd
import pytest

from accucmp.cli.boundary import UsageProblem
from accucmp.cli.main import normalize_argv
from accucmp.cli.options import parse_algorithms, parse_formats, parse_thresholds
from accucmp.report.outputs import read_result_csv, to_json, write_results
from accucmp.report.html import render_html
from accucmp.report.summary import describe_row, summarize


def _table():
    return pd.DataFrame({
        "Index": [0, 1, 2, 3, 4, 5],
        "NPUDump": ["aten.mm.default", "aten.add.Tensor", "aten.relu.default", "aten.mm.default",
                    "aten.gelu.default", ""],
        "NPUDumpPath": ["/aten.mm.default/1/output/result", "/aten.add.Tensor/2/output/result",
                        "/aten.relu.default/3/output/result", "/aten.mm.default/7/output/result",
                        "/aten.gelu.default/5/output/result", ""],
        "GroundTruthPath": ["/aten.mm.default/1/output/result", "/aten.add.Tensor/2/output/result",
                            "/aten.relu.default/3/output/result", "/aten.mm.default/7/output/result", "",
                            "/aten.sum.default/6/output/result"],
        "DataType": ["float32"] * 6,
        "Shape": ["(4, 4)"] * 6,
        "CosineSimilarity": [1.0, 0.9999, 0.5, 1.0, math.nan, math.nan],
        "RelativeEuclideanDistance": [1e-7, 0.02, 0.9, 0.05, math.nan, math.nan],
        "CompareFailReason": ["", "", "", "", "No data match in golden dump data.", "No data match in my dump."],
        # seqid 7 is a backward op that fails with a larger error than seqid 2: the first
        # failure in execution order is still seqid 2
        "SeqId": [1, 2, 3, 7, 5, 6],
        "Phase": ["forward", "forward", "forward", "backward", "forward", "forward"],
        "Module": ["l.0", "l.0", "l.0", "l.0", "l.1", "l.1"],
        "GoldenDataType": ["float32"] * 6,
        "Result": ["pass", "fail", "fail", "fail", "unmatched", "unmatched"],
    })


def test_summary_first_failure_is_earliest_seqid_and_worst_by_error():
    s = summarize(_table().sample(frac=1.0, random_state=3), top=2)  # row order must not matter
    assert s.counts == {"fail": 3, "unmatched": 2, "pass": 1}
    assert s.first_failure["SeqId"] == 2 and s.first_failure["NPUDump"] == "aten.add.Tensor"
    assert [r["SeqId"] for r in s.worst] == [3, 7]
    assert [r["SeqId"] for r in s.unmatched] == [5, 6]
    assert describe_row(s.first_failure) == "aten.add.Tensor seqid 2 (forward, l.0) output/result"
    assert describe_row(s.unmatched[1]).startswith("aten.sum.default")  # golden-only row named by its path


def test_summary_without_failures():
    t = _table()
    t["Result"] = "pass"
    s = summarize(t)
    assert s.first_failure is None and s.worst == [] and s.counts == {"pass": 6}


def test_html_is_self_contained_with_plot_and_marks(tmp_path):
    page = render_html(_table(), meta={"target": "a.h5", "golden": "b<c>.h5"})
    assert page.startswith("<!DOCTYPE html>") and page.count("<svg") >= 1
    assert not re.search(r"<(script|link|img)[^>]+(src|href)=", page)  # nothing external
    assert "First failure (execution order): aten.add.Tensor seqid 2" in page
    assert "b&lt;c&gt;.h5" in page  # escaped
    assert page.count("class='r-fail") == 3 and "r-fail first" in page
    assert "backward" in page  # legend tells phases apart


def test_write_results_formats_and_no_clobber(tmp_path):
    t = _table()
    p1 = write_results(t, tmp_path, ["csv", "json", "html"], meta={"x": 1}, basename="result_20260101000000")
    p2 = write_results(t, tmp_path, ["csv"], basename="result_20260101000000")
    assert [p.name for p in p1] == ["result_20260101000000.csv", "result_20260101000000.json",
                                   "result_20260101000000.html"]
    assert p2[0].name == "result_20260101000000_1.csv"
    back = read_result_csv(p1[0])
    assert list(back.columns) == list(t.columns) and back["Result"].tolist() == t["Result"].tolist()
    doc = json.loads(p1[1].read_text())
    assert doc["meta"] == {"x": 1} and doc["rows"][4]["CosineSimilarity"] is None


def test_default_result_name_is_timestamped(tmp_path):
    (p,) = write_results(_table(), tmp_path / "new" / "dir", ["csv"])
    assert re.fullmatch(r"result_\d{14}\.csv", p.name)


def test_json_handles_inf_and_numpy_types():
    t = pd.DataFrame({"a": [np.inf, -np.inf, np.nan], "b": np.array([1, 2, 3], np.int64)})
    rows = json.loads(to_json(t, None))["rows"]
    assert [r["a"] for r in rows] == ["inf", "-inf", None] and rows[0]["b"] == 1


def test_read_result_csv_rejects_other_csv(tmp_path):
    p = tmp_path / "x.csv"
    p.write_text("a,b\n1,2\n")
    with pytest.raises(Exception, match="not an accucmp result csv"):
        read_result_csv(p)


def test_option_parsing():
    assert parse_thresholds(["CosineSimilarity=0.99", "RelativeEuclideanDistance=0.05,MaxAbsoluteError=1e-3"]) == {
        "CosineSimilarity": 0.99, "RelativeEuclideanDistance": 0.05, "MaxAbsoluteError": 1e-3}
    assert parse_thresholds(None) is None
    for bad in (["Cosine"], ["Cosine=abc"], ["=1"]):
        with pytest.raises(UsageProblem):
            parse_thresholds(bad)
    assert parse_formats("html,json") == ["csv", "html", "json"]
    with pytest.raises(UsageProblem, match="pdf"):
        parse_formats("csv,pdf")
    assert parse_algorithms("all") is None and parse_algorithms("a, b") == ["a", "b"]
    assert normalize_argv(["compare", "-p", "1", "-m", "x"]) == ["compare", "-p", "-m", "x"]
    assert normalize_argv(["compare", "-p", "0"]) == ["compare"]
    assert normalize_argv(["compare", "-p", "-m", "1"]) == ["compare", "-p", "-m", "1"]


def test_golden_only_op_is_described_by_its_golden_seqid(tmp_path):
    """An op the target lacks has no target seqid: the line named 'seqid ' with nothing after
    it; it names the golden's seqid instead (real compare of two dumps)."""
    from accucmp.compare.pipeline import compare_dumps
    from accucmp.compare.verdict import apply_verdict
    from tests._compare_helpers import write_dump

    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    ops = [dict(op="aten.relu.default", seqid=1, inputs={"self": a}, outputs={"result": a}),
           dict(op="aten.exp.default", seqid=2, module="l.1", inputs={"self": a}, outputs={"result": np.exp(a)})]
    write_dump(tmp_path / "g.h5", ops)
    write_dump(tmp_path / "t.h5", ops[:1])
    t = apply_verdict(compare_dumps(str(tmp_path / "t.h5"), str(tmp_path / "g.h5")).table)
    # (the op-level row that says the target does not run it has no tensor to name)
    rows = [r for _, r in t.iterrows() if r["Result"] == "unmatched" and r["CompareStatus"] != "unpaired_op"]
    assert rows
    for r in rows:
        line = describe_row(r.to_dict())
        assert line.startswith("aten.exp.default golden seqid 2 (forward, l.1) "), line
    (op_row,) = [r for _, r in t.iterrows() if r["CompareStatus"] == "unpaired_op"]
    assert describe_row(op_row.to_dict()).startswith("aten.exp.default golden seqid 2 (forward, l.1)")
    assert op_row["Departure"] == "missing" and op_row["Result"] == "unmatched"
    paired = [r for _, r in t.iterrows() if r["Result"] == "pass"][0]
    assert describe_row(paired.to_dict()).startswith("aten.relu.default seqid 1 (forward) ")


def test_saved_result_keeps_numeric_looking_module_paths(tmp_path):
    """nn.Sequential children are named '0', '3', '1.10': read back from the csv as numbers,
    `accucmp report` printed '(forward)' without the module, and '1.10' would be 1.1."""
    from typer.testing import CliRunner

    from accucmp.cli.main import app
    from tests._compare_helpers import write_dump

    a = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    mods = ["0", "1.10", "3"]
    ops = [dict(op="aten.relu.default", seqid=i + 1, module=m, inputs={"self": a}, outputs={"result": a * (i + 1)})
           for i, m in enumerate(mods)]
    bad = [dict(o, outputs={"result": o["outputs"]["result"] * (1.05 if o["seqid"] == 2 else 1)}) for o in ops]
    write_dump(tmp_path / "g.h5", ops)
    write_dump(tmp_path / "t.h5", bad)
    runner = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"})
    r = runner.invoke(app, ["compare", "-m", str(tmp_path / "t.h5"), "-g", str(tmp_path / "g.h5"),
                            "-o", str(tmp_path / "out"), "-q"])
    assert r.exit_code == 1, r.output
    csv = next((tmp_path / "out").glob("result_*.csv"))
    t = read_result_csv(csv)
    assert sorted(set(t["Module"])) == mods
    r = runner.invoke(app, ["report", str(csv)])
    assert r.exit_code == 1
    assert "first failure (execution order): aten.relu.default seqid 2 (forward, 1.10) output/result" in r.output
