"""accucmp calibrate: a noise floor from two golden runs turns failures that are the model's
own noise into passes under `compare --noise-floor`, and leaves a real fault failing."""

from __future__ import annotations

import csv

import pandas as pd
from typer.testing import CliRunner

from accucmp.cli.main import app
from tests._cli_helpers import model_ops, perturbed, write_dump


def _results(out):
    (p,) = sorted(out.glob("result_*.csv"))
    return pd.read_csv(p)


def test_noise_floor_excuses_noise_not_a_fault(tmp_path):
    ops = model_ops()
    golden = write_dump(tmp_path / "g.h5", ops)
    # the model's own run-to-run noise: 1e-3 relative on every output (fails fp32's 1e-4 floor)
    second = write_dump(tmp_path / "g2.h5", perturbed(ops, -1, 0.0, seed=1, noise=1e-3))
    fault_seq = ops[3].seqid
    target = write_dump(tmp_path / "t.h5", perturbed(ops, fault_seq, 0.05, seed=2, noise=1e-3))
    r = CliRunner().invoke(app, ["calibrate", "-g", golden, "-m", second, "-out", str(tmp_path / "cal")])
    assert r.exit_code == 0, r.output
    floor = tmp_path / "cal" / "noise_floor.csv"
    rows = list(csv.DictReader(open(floor)))
    outs = [x for x in rows if "/output/" in x["GroundTruthPath"]]   # perturbed() moves outputs only
    assert outs and all(float(x["RelativeEuclideanDistance"]) > 0 for x in outs)

    plain = CliRunner().invoke(app, ["compare", "-m", target, "-g", golden, "-out", str(tmp_path / "a"), "-q"])
    assert plain.exit_code == 1
    before = _results(tmp_path / "a")
    assert (before["Result"] == "fail").sum() > 1       # noise fails without the floor

    r = CliRunner().invoke(app, ["compare", "-m", target, "-g", golden, "-out", str(tmp_path / "b"), "-q",
                                 "--noise-floor", str(floor)])
    assert r.exit_code == 1
    after = _results(tmp_path / "b")
    failing = after[after["Result"] == "fail"]
    assert set(failing["SeqId"]) == {fault_seq}
    excused = after[after["FailReason"].astype(str).str.startswith("within noise floor")]
    assert len(excused) == (before["Result"] == "fail").sum() - len(failing)


def test_noise_floor_bad_file_is_one_line_error(tmp_path):
    ops = model_ops()
    golden = write_dump(tmp_path / "g.h5", ops)
    bad = tmp_path / "x.csv"
    bad.write_text("a,b\n1,2\n")
    r = CliRunner().invoke(app, ["compare", "-m", golden, "-g", golden, "-out", str(tmp_path), "-q",
                                 "--noise-floor", str(bad)])
    assert r.exit_code == 2 and "not a noise_floor.csv" in r.output and len(r.output.strip().splitlines()) == 1
