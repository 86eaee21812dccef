"""Issue 22: a report a person understands at a glance. The terminal summary's first line
is the verdict sentence; on an 80-column terminal nothing is wider than 80 columns and no
name is broken across lines; piped, lines are neither wrapped nor shortened."""

from __future__ import annotations

import contextlib
import re

import numpy as np
import pytest
from typer.testing import CliRunner

from accucmp.cli.main import app
from accucmp.report.headline import bound_clause, middle_ellipsis, verdict_sentence
from tests._compare_helpers import bf16, write_dump

LONG_MODULE = "encoder.layers.3.attention.output.dense_projection_with_a_long_name"
LONG_OP = "aten._scaled_dot_product_flash_attention_for_cpu.default"
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _ops(fault: float = 1.0, dtype: str = "bfloat16"):
    rng = np.random.default_rng(3)
    a = rng.standard_normal((64, 32)).astype(np.float32)
    ops = []
    for i, (op, mod) in enumerate([("aten.mm.default", "embed"), (LONG_OP, LONG_MODULE),
                                   ("aten.gelu.default", LONG_MODULE + ".act"), ("aten.add.Tensor", "head")]):
        out = bf16(a * (i + 1))
        if i == 1:
            out = bf16(out * fault)
        ops.append(dict(op=op, seqid=i + 1, module=mod, inputs={"self": (bf16(a), dtype)},
                        outputs={"result": (out if i < 2 else bf16(out * fault), dtype)}))
    return ops


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    d = tmp_path_factory.mktemp("glance")
    write_dump(d / "g.h5", _ops())
    write_dump(d / "t.h5", _ops(fault=1.05))
    return d


def _compare(dumps, env, *extra):
    # paths relative to the dumps' folder: the `wrote <csv>` line is then as short wherever
    # pytest puts its temporary folders (under pytest-xdist, popen-gw0/ made it 81 columns)
    runner = CliRunner(env=env)
    with contextlib.chdir(dumps):
        return runner.invoke(app, ["compare", "-m", "t.h5", "-g", "g.h5", "-o", "out", *extra])


def test_terminal_80_columns_verdict_first_names_shortened_not_broken(dumps):
    # a terminal 80 columns wide (TTY_INTERACTIVE=0: no progress bar in the captured text)
    r = _compare(dumps, {"COLUMNS": "80", "TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "0", "NO_COLOR": "1"})
    assert r.exit_code == 1, r.output
    lines = ANSI.sub("", r.output).splitlines()
    assert all(len(ln.rstrip()) <= 80 for ln in lines), "\n".join(ln for ln in lines if len(ln.rstrip()) > 80)
    head = " ".join(ln.strip() for ln in lines[:3])
    # names longer than half the window are shortened where they say least: an op name
    # loses aten./.default before its middle, a module path keeps its end (issue 35)
    assert head.startswith("FAIL: first op caused here is _scaled_dot_product_…h_attention_for_cpu #2 in …"), head
    assert head.split(" #2 in …")[1].split(":")[0] in LONG_MODULE, head
    assert "RelErr 12.8 u > 6 u allowed for bfloat16" in head
    # the worst-ops table: the long module path keeps its end
    table = lines[next(i for i, ln in enumerate(lines) if ln.startswith("worst failing ops")):]
    row = next(ln for ln in table if ln.lstrip().startswith("2 "))
    shortened = next(w for w in row.split() if w.startswith("…") and len(w) > 8)
    assert LONG_MODULE.endswith(shortened[1:]), row
    # no name continues on the next line: every op of the table is whole or shortened
    for ln in [ln for ln in table[1:] if ln.startswith(" ")]:
        first = ln.split()[0] if ln.split() else ""
        assert first.isdigit() or first in ("RelErr", "seqid", "MaxAbsErr/max|golden|"), ln
    # the csv keeps the full names
    csv = next((dumps / "out").glob("result_*.csv")).read_text()
    assert LONG_MODULE in csv and LONG_OP in csv and "RelativeEuclideanDistanceUlps" in csv


def test_piped_output_is_not_wrapped_nor_shortened(dumps):
    r = _compare(dumps, {"COLUMNS": None, "NO_COLOR": "1", "TTY_COMPATIBLE": None, "FORCE_COLOR": None})
    assert r.exit_code == 1, r.output
    lines = r.output.splitlines()
    assert lines[0] == (f"FAIL: first op caused here is {LONG_OP} #2 in {LONG_MODULE}: "
                        "RelErr 12.8 u > 6 u allowed for bfloat16")
    assert "…" not in r.output and "\x1b[" not in r.output
    assert any(len(ln) > 120 and LONG_OP in ln and LONG_MODULE in ln for ln in lines)
    # `wrote PATH` whole, on one line
    assert any(ln.startswith("wrote ") and ln.endswith(".csv") for ln in lines)


def test_pass_sentence_and_the_sentence_function():
    assert verdict_sentence(None, {"pass": 12, "skipped": 1}) == "PASS: 12 tensors within bounds (1 skipped)"
    assert verdict_sentence(None, {"unmatched": 3}).startswith("FAIL: no tensor could be compared (3 unmatched)")
    row = {"NPUDump": "aten.gelu.default", "SeqId": 153.0, "Module": "encoder.layer.3.mlp", "Phase": "forward",
           "DecidingMetric": "RelativeEuclideanDistance", "DecidedBy": "RelativeEuclideanDistanceUlps",
           "DecidingValue": 41.0, "DecidingBound": 6.0, "PrecisionDtype": "bfloat16"}
    assert verdict_sentence(row, {"fail": 1, "pass": 3}) == (
        "FAIL: first failing op is aten.gelu.default #153 in encoder.layer.3.mlp: RelErr 41 u > 6 u allowed for bfloat16")
    # the verdict's Origin column (issue 20) names the op where the error starts
    assert verdict_sentence({**row, "Origin": "caused here"}, {"fail": 1}).startswith(
        "FAIL: first op caused here is aten.gelu.default #153")
    user = {**row, "DecidedBy": "CosineSimilarity", "DecidingMetric": "CosineSimilarity",
            "DecidingValue": 0.98, "DecidingBound": 0.99}
    assert bound_clause(user) == "Cosine 0.98 < 0.99 required (-t CosineSimilarity)"
    assert middle_ellipsis("encoder.layers.3.attention", 11) == "encod…ntion"
    assert middle_ellipsis("short", 11) == "short"


def test_jsonl_rows_and_summary_json_for_ci(dumps, tmp_path):
    import json

    import pandas as pd

    out = tmp_path / "o"
    r = _compare(dumps, {"NO_COLOR": "1"}, "-o", str(out), "-f", "jsonl", "--summary-json", str(tmp_path / "s.json"))
    assert r.exit_code == 1, r.output
    csv = next(out.glob("result_*.csv"))
    rows = [json.loads(ln) for ln in csv.with_suffix(".jsonl").read_text().splitlines()]
    table = pd.read_csv(csv)
    assert len(rows) == len(table) == 8
    assert [x["Result"] for x in rows] == list(table["Result"])
    first = next(x for x in rows if x["Result"] == "fail")
    assert first["DecidedBy"] == "RelativeEuclideanDistanceUlps" and first["Module"] == LONG_MODULE
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["verdict"] == "FAIL" and s["exit_code"] == 1 and s["counts"] == {"pass": 5, "fail": 3}
    assert s["sentence"] == r.output.splitlines()[0]
    ff = s["first_failure"]
    assert (ff["op"], ff["seqid"], ff["module"], ff["dtype"]) == (LONG_OP, 2, LONG_MODULE, "bfloat16")
    assert ff["bound"] == 6.0 and 12 < ff["value"] < 14 and ff["decided_by"] == "RelativeEuclideanDistanceUlps"
    assert str(csv) in s["outputs"]
    # CI re-runs (issue 35 item 8): an earlier summary at the name is replaced without --force
    again = _compare(dumps, {}, "-o", str(tmp_path / "o2"), "--summary-json", str(tmp_path / "s.json"))
    assert again.exit_code == 1, again.output
    assert json.loads((tmp_path / "s.json").read_text())["outputs"] != s["outputs"]
    # anything else at the name (not a summary of ours, or a link) is refused before any
    # tensor is read (no new csv), replaced with --force
    other = tmp_path / "notes.json"
    other.write_text('{"mine": 1}')
    (tmp_path / "link.json").symlink_to(tmp_path / "s.json")
    for taken in (other, tmp_path / "link.json"):
        refused = _compare(dumps, {}, "-o", str(tmp_path / "o3"), "--summary-json", str(taken))
        assert refused.exit_code == 2 and taken.name in refused.output and not (tmp_path / "o3").exists()
    assert other.read_text() == '{"mine": 1}'
    forced = _compare(dumps, {}, "-o", str(tmp_path / "o3"), "--summary-json", str(other), "--force")
    assert forced.exit_code == 1 and json.loads(other.read_text())["verdict"] == "FAIL"
    assert (tmp_path / "link.json").is_symlink()       # never written through


def test_tolerance_knob_on_compare_and_report(dumps, tmp_path):
    import json

    # 12.8 u against 6 u allowed: x2 still fails, x3 passes; the same on a saved csv
    assert _compare(dumps, {}, "-o", str(tmp_path / "a"), "--tolerance", "2", "-q").exit_code == 1
    r = _compare(dumps, {"NO_COLOR": "1"}, "-o", str(tmp_path / "b"), "--tolerance", "3",
                 "--summary-json", str(tmp_path / "s.json"))
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[0] == "PASS: 8 tensors within bounds"
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["verdict"] == "PASS" and s["first_failure"] is None and s["thresholds"] == {"Tolerance": 3.0}
    csv = next((tmp_path / "a").glob("result_*.csv"))
    runner = CliRunner(env={"NO_COLOR": "1"})
    assert runner.invoke(app, ["report", str(csv), "-q"]).exit_code == 1
    assert runner.invoke(app, ["report", str(csv), "--tolerance", "3", "-q"]).exit_code == 0
    bad = runner.invoke(app, ["report", str(csv), "--tolerance", "0"])
    assert bad.exit_code == 2 and bad.output.startswith("accucmp: error: --tolerance")


def test_version_on_both_clis():
    from ir2tbe.cli import app as ir2tbe_app

    for a, prog in ((app, "accucmp"), (ir2tbe_app, "ir2tbe")):
        r = CliRunner().invoke(a, ["--version"], prog_name=prog)
        assert r.exit_code == 0 and re.fullmatch(rf"{prog} \S+\n", r.output), r.output


def test_clean_demo_passes_when_its_only_failures_are_float16_underflow():
    import pandas as pd

    from accucmp.demo import DemoResult

    def result(absmax):
        t = pd.DataFrame({"NPUDump": ["aten.mm.default"] * 2, "SeqId": [35, 39], "Result": ["fail", "pass"],
                          "ComputeDtype": ["float16"] * 2, "GoldenAbsMax": [absmax, 1.0]})
        return DemoResult("mlp", "full", None, None, None, fault=None, table=t,
                          first_failure=t.iloc[0].to_dict())
    assert result(3.5e-5).ok                  # below 4 x float16's smallest normal: underflow
    assert not result(0.5).ok                 # a real failure in a clean run


def test_acl_config_message_names_the_cli_option(tmp_path):
    from ir2tbe.acl_config import AclConfigError, load_acl_config as load

    with pytest.raises(AclConfigError, match="--acl-config"):
        load(tmp_path / "nope.json")


def test_progress_bars_only_when_watched_and_not_quiet(dumps, tmp_path, monkeypatch):
    import contextlib

    from accucmp.cli import progress
    from accucmp.extract import extract_ops
    from accucmp.listing import list_ops

    with progress.progress_bar("x", 10) as advance:      # pytest's streams are no terminal
        assert advance is None
    monkeypatch.setattr(progress, "watched", lambda: True)
    with progress.progress_bar("x", 10, quiet=True) as advance:
        assert advance is None
    with progress.progress_bar("x", 10) as advance:
        assert callable(advance)
        advance()
    # the commands call advance once per op they work through
    calls = []
    @contextlib.contextmanager
    def bar(total):
        calls.append(("total", total))
        yield lambda: calls.append("copied")
    list_ops(dumps / "t.h5", stats=True, progress=bar)
    assert calls == [("total", 4)] + ["copied"] * 4
    calls.clear()
    extract_ops(dumps / "t.h5", tmp_path / "x.h5", [("/aten.mm.default/1/", "/aten.mm.default/1/"),
                                                   ("/aten.add.Tensor/4/", "/aten.add.Tensor/4/")], progress=bar)
    assert calls == [("total", 2), "copied", "copied"]


def test_loss_scale_note_needs_every_worst_backward_tensor_at_one_power_of_two():
    """The note on a loss scale (torch.amp.GradScaler): every failing backward tensor among
    the worst is 2**k times the golden's (relative distance 2**k - 1, standard deviations
    2**k apart, within 1%); anything else, no note."""
    from accucmp.report.findings import loss_scale_of

    def row(red, ratio, phase="backward"):
        return {"Phase": phase, "RelativeEuclideanDistance": red, "TargetStd": ratio * 2.0, "GoldenStd": 2.0}
    scaled = [row(65535.4, 65536.2), row(65534.9, 65535.0), row(4.0, 1.0, "forward")]
    assert loss_scale_of(scaled) == 65536
    assert loss_scale_of([row(1023.0, 1024.0)]) == 1024
    assert loss_scale_of([row(65535.0, 65536.0), row(1023.0, 1024.0)]) is None   # two scales
    assert loss_scale_of([row(65535.0, 65536.0), row(0.5, 1.0)]) is None        # one tensor is not scaled
    assert loss_scale_of([row(50000.0, 50001.0)]) is None                        # not a power of two
    assert loss_scale_of([row(65535.0, -65536.0)]) is None                       # sign flipped, not scaled
    assert loss_scale_of([row(7.0, 8.0)]) is None                                # 2^3: too small to tell
    assert loss_scale_of([row(float("nan"), 1.0)]) is None
    assert loss_scale_of([row(4.0, 1.0, "forward")]) is None                     # no backward row

