"""End to end with real dumps: dump -> faulty load-replay -> `accucmp compare` names the
faulty op first -> `accucmp extract --from-report` -> the extract replays as a load file."""

from __future__ import annotations

import os

import pandas as pd
import pytest
from typer.testing import CliRunner

torch = pytest.importorskip("torch")
npu_dumper = pytest.importorskip("npu_dumper")
emulation = pytest.importorskip("npu_dumper.replay.emulation")

from accucmp.cli.main import app  # noqa: E402
from dumpfile import DumpFile  # noqa: E402

runner = CliRunner(env={"COLUMNS": "120", "NO_COLOR": "1"})


def _model_and_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    x = torch.randn(5, 8)

    def step():
        model.zero_grad()
        model(x).sum().backward()

    return step


def test_perturbed_op_is_first_failure_then_extract_and_replay(tmp_path):
    step = _model_and_step()
    golden, faulty = str(tmp_path / "golden.h5"), str(tmp_path / "faulty.h5")
    with npu_dumper.dumper(use_dump=True, dump_path=golden):
        step()
    with emulation.inject_fault(op="aten.gelu.default", rel=0.05):
        with npu_dumper.dumper(use_load=True, load_file_path=golden, dump_path=faulty):
            step()

    out = tmp_path / "o"
    r = runner.invoke(app, ["compare", "-m", faulty, "-g", golden, "-out", str(out)])
    assert r.exit_code == 1, r.output
    assert "first failure (execution order): aten.gelu.default seqid 2 (forward" in r.output
    csv = str(next(p for p in out.iterdir() if p.suffix == ".csv"))
    table = pd.read_csv(csv)
    assert set(table.loc[table["Result"] == "fail", "NPUDump"]) == {"aten.gelu.default"}

    ext = str(tmp_path / "ext.h5")
    r = runner.invoke(app, ["extract", "-i", golden, "-o", ext, "--from-report", csv])
    assert r.exit_code == 0, r.output
    # a backward mm whose golden input is a stored view: materialised in the extract
    mm = next(o.seqid for o in DumpFile(golden).ops() if o.op == "aten.mm.default" and o.phase == "backward")
    r = runner.invoke(app, ["extract", "-i", golden, "-o", ext, "-s", f"/aten.mm.default/{mm}/"])
    assert r.exit_code == 0, r.output

    replayed = str(tmp_path / "replayed.h5")
    with npu_dumper.dumper(use_load=True, load_file_path=ext, dump_path=replayed):
        step()
    with DumpFile(replayed) as f:
        assert [(o.op, o.seqid) for o in f.ops()] == [("aten.gelu.default", 2), ("aten.mm.default", mm)]
    r = runner.invoke(app, ["compare", "-m", replayed, "-g", golden, "-out", str(tmp_path / "o2"), "-q"])
    assert r.exit_code == 0, r.output
    t2 = pd.read_csv(next(p for p in (tmp_path / "o2").iterdir() if p.suffix == ".csv"))
    assert set(t2.loc[t2["Result"] == "pass", "SeqId"]) == {2, mm}
    assert os.path.getsize(ext) < os.path.getsize(golden)


def test_golden_fp64_and_jobs_through_the_cli(tmp_path):
    pytest.importorskip("accucmp.cli.golden")
    step = _model_and_step()
    golden, faulty, g64 = (str(tmp_path / n) for n in ("golden.h5", "faulty.h5", "g64.h5"))
    with npu_dumper.dumper(use_dump=True, dump_path=golden):
        step()
    with emulation.inject_fault(op="aten.addmm.default", rel=0.01, call=2):
        with npu_dumper.dumper(use_load=True, load_file_path=golden, dump_path=faulty):
            step()
    r = runner.invoke(app, ["golden", "-i", golden, "-o", g64, "--no-progress"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["compare", "-m", faulty, "-g", golden, "--golden-fp64", g64, "--jobs", "2",
                            "-out", str(tmp_path / "o")])
    assert r.exit_code == 1, r.output
    assert "first failure (execution order): aten.addmm.default seqid 3" in r.output
    table = pd.read_csv(next(p for p in (tmp_path / "o").iterdir() if p.suffix == ".csv"))
    assert {"TargetErrorVsFp64", "GoldenErrorVsFp64"} <= set(table.columns)
    assert set(table.loc[table["Result"] == "fail", "SeqId"]) == {3}
