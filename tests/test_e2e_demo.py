"""`accucmp demo` through the CLI on a tiny model: finds the planted fault, writes the reports."""

from __future__ import annotations

import pandas as pd
from typer.testing import CliRunner

from accucmp.cli.main import app


def invoke(args, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    return CliRunner().invoke(app, args)


def test_demo_finds_the_planted_fault_and_writes_reports(tmp_path, monkeypatch):
    out = tmp_path / "demo"
    result = invoke(["demo", "--model", "transformer", "--size", "tiny", "--out", str(out)], monkeypatch)
    assert result.exit_code == 0, result.output
    assert "found it" in result.output
    csvs, htmls = list(out.glob("result_*.csv")), list(out.glob("result_*.html"))
    assert len(csvs) == 1 and len(htmls) == 1
    table = pd.read_csv(csvs[0])
    failed = table[table["Result"] == "fail"]
    assert failed["NPUDump"].nunique() == 1 and failed["SeqId"].nunique() == 1
    # The worst op was mapped to kernels in CANN layout, with a mapping table.
    assert list((out / "kernels").glob("*/ir2tbe_map.csv"))
    assert (out / "golden_cpu_fp32.h5").exists() and (out / "target_npu_emulated.h5").exists()


def test_demo_named_fault_and_no_fault(tmp_path, monkeypatch):
    named = invoke(["demo", "--model", "mlp", "--size", "tiny", "--out", str(tmp_path / "a"),
                    "--fault", "aten.native_layer_norm.default:0.05:1", "--no-kernels"], monkeypatch)
    assert named.exit_code == 0, named.output
    assert "aten.native_layer_norm.default seqid" in named.output
    clean = invoke(["demo", "--model", "mlp", "--size", "tiny", "--out", str(tmp_path / "b"),
                    "--fault", "none", "--no-kernels"], monkeypatch)
    assert clean.exit_code == 0, clean.output
    assert "all ops pass" in clean.output


def test_demo_bad_input_is_one_line_exit_2(tmp_path, monkeypatch):
    for args in (["demo", "--model", "vgg"], ["demo", "--size", "huge"],
                 ["demo", "--size", "tiny", "--fault", "aten.nope.default", "--out", str(tmp_path)]):
        result = invoke(args, monkeypatch)
        assert result.exit_code == 2, (args, result.output)
        assert "Traceback" not in result.output
        errors = [line for line in result.output.splitlines() if line.startswith("accucmp: error:")]
        assert len(errors) == 1, result.output
