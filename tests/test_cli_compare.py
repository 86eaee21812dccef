"""`accucmp compare` and `accucmp report` through typer's CliRunner, on torch-free dumps."""

from __future__ import annotations

import os
import subprocess
import sys

import h5py
import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from accucmp.cli.main import app
from dumpfile import schema as S

from ._cli_helpers import model_ops, perturbed, write_dump

runner = CliRunner(env={"COLUMNS": "120", "NO_COLOR": "1"})
FAULTY_SEQID = 5  # a forward aten.add.Tensor in layer 1


@pytest.fixture
def dumps(tmp_path):
    """golden dump; a clean load-replay (fp32 rounding noise); one with op 5 off by 5%."""
    ops = model_ops(seed=0)
    golden = write_dump(tmp_path / "golden.h5", ops)
    clean = write_dump(tmp_path / "clean.h5", perturbed(ops, -1, 0.0, noise=2 ** -24), mode=S.MODE_LOAD)
    faulty = write_dump(tmp_path / "faulty.h5", perturbed(ops, FAULTY_SEQID, 0.05, noise=2 ** -24),
                        mode=S.MODE_LOAD)
    return golden, clean, faulty


def _result_csv(out_dir):
    found = sorted(p for p in os.listdir(out_dir) if p.startswith("result_") and p.endswith(".csv")
                   and "_failed" not in p)
    assert found, os.listdir(out_dir)
    return os.path.join(out_dir, found[-1])


def test_clean_replay_passes_exit_0(dumps, tmp_path):
    golden, clean, _ = dumps
    r = runner.invoke(app, ["compare", "-m", clean, "-g", golden, "-out", str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    table = pd.read_csv(_result_csv(tmp_path / "o"))
    for col in ("Index", "NPUDump", "NPUDumpPath", "GroundTruthPath", "DataType", "Shape", "CosineSimilarity",
                "RelativeEuclideanDistance", "KullbackLeiblerDivergence", "CompareFailReason", "SeqId", "Phase",
                "Module", "GoldenDataType", "Result"):
        assert col in table.columns, col
    assert set(table["Result"]) == {"pass"}
    assert table["SeqId"].is_monotonic_increasing
    assert "every compared tensor passes" in r.output


def test_one_perturbed_op_is_the_first_failure_exit_1(dumps, tmp_path):
    golden, _, faulty = dumps
    out = tmp_path / "o"
    r = runner.invoke(app, ["compare", "-m", faulty, "-g", golden, "--out", str(out), "--format", "csv,json,html"])
    assert r.exit_code == 1, r.output
    assert f"first failure (execution order): aten.add.Tensor seqid {FAULTY_SEQID} (forward, layers.1)" in r.output
    table = pd.read_csv(_result_csv(out))
    failed = table[table["Result"] == "fail"]
    assert set(failed["SeqId"]) == {FAULTY_SEQID}
    stem = _result_csv(out)[:-4]
    assert os.path.exists(stem + ".json") and os.path.exists(stem + ".html")
    assert "aten.add.Tensor seqid 5" in open(stem + ".html").read()


def test_dash_p_writes_failing_rows_and_both_tensors(dumps, tmp_path):
    golden, _, faulty = dumps
    out = tmp_path / "o"
    r = runner.invoke(app, ["compare", "-m", faulty, "-g", golden, "-out", str(out), "-p", "-q"])
    assert r.exit_code == 1, r.output
    failed_csv = [p for p in os.listdir(out) if p.endswith("_failed.csv")]
    assert len(failed_csv) == 1
    rows = pd.read_csv(out / failed_csv[0])
    assert len(rows) >= 1 and set(rows["Result"]) == {"fail"}
    npy_dir = next(p for p in out.iterdir() if p.is_dir() and p.name.startswith("failed_"))
    files = sorted(os.listdir(npy_dir))
    npu = [f for f in files if ".npu." in f]
    gold = [f for f in files if ".golden." in f]
    assert len(npu) == len(gold) == len(rows)
    a, b = np.load(npy_dir / npu[0]), np.load(npy_dir / gold[0])
    np.testing.assert_allclose(a, b * 1.05, rtol=1e-5)


def test_threshold_override_and_report_rejudge(dumps, tmp_path):
    golden, clean, _ = dumps
    out = tmp_path / "o"
    assert runner.invoke(app, ["compare", "-m", clean, "-g", golden, "-out", str(out), "-q"]).exit_code == 0
    csv = _result_csv(out)
    # a threshold far below fp32 rounding makes the same result fail, without the tensors
    os.rename(golden, golden + ".gone")
    r = runner.invoke(app, ["report", csv, "--threshold", "RelativeEuclideanDistance=1e-30", "--format", "html"])
    assert r.exit_code == 1, r.output
    assert "first failure" in r.output
    assert any(p.endswith("_rethreshold.html") for p in os.listdir(out))
    r = runner.invoke(app, ["report", csv])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["report", csv, "--threshold", "NoSuchMetric=1"])
    assert r.exit_code == 2 and "Traceback" not in r.output


def test_select_restricts_ops(dumps, tmp_path):
    golden, _, faulty = dumps
    r = runner.invoke(app, ["compare", "-m", faulty, "-g", golden, "-out", str(tmp_path), "--select", "relu", "-q"])
    assert r.exit_code == 0, r.output
    table = pd.read_csv(_result_csv(tmp_path))
    assert set(table["NPUDump"]) == {"aten.relu.default"}


def test_xlsx_without_openpyxl_is_one_line(dumps, tmp_path):
    pytest.importorskip("pandas")
    try:
        import openpyxl  # noqa: F401
        pytest.skip("openpyxl installed")
    except ImportError:
        pass
    golden, clean, _ = dumps
    r = runner.invoke(app, ["compare", "-m", clean, "-g", golden, "-out", str(tmp_path), "--format", "xlsx"])
    assert r.exit_code == 2 and "openpyxl" in r.output and len(r.output.strip().splitlines()) == 1


def _bad_files(tmp_path, good):
    missing = tmp_path / "missing.h5"
    not_h5 = tmp_path / "not.h5"
    not_h5.write_bytes(b"\x00hello, not hdf5" * 10)
    trunc = tmp_path / "trunc.h5"
    data = open(good, "rb").read()
    trunc.write_bytes(data[: len(data) // 2])
    not_dump = tmp_path / "notdump.h5"
    with h5py.File(not_dump, "w") as h:
        h["weights"] = np.arange(4)
    return {"missing": missing, "not_hdf5": not_h5, "truncated": trunc, "not_dump": not_dump,
            "directory": tmp_path}


@pytest.mark.parametrize("kind", ["missing", "not_hdf5", "truncated", "not_dump", "directory"])
@pytest.mark.parametrize("side", ["-m", "-g"])
def test_bad_input_one_line_exit_2(dumps, tmp_path, kind, side):
    golden, clean, _ = dumps
    bad = str(_bad_files(tmp_path, golden)[kind])
    args = ["compare", "-m", bad, "-g", golden] if side == "-m" else ["compare", "-m", clean, "-g", bad]
    r = runner.invoke(app, args + ["-out", str(tmp_path / "o")])
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and bad in lines[0] and "Traceback" not in r.output


def test_corrupt_shape_attr_gives_a_reason_not_a_traceback(dumps, tmp_path):
    golden, clean, _ = dumps
    with h5py.File(clean, "r+") as h:
        h["/aten.mm.default/1/output/result"].attrs["shape"] = np.array([999, 999], np.int64)
        del h["_npu_dumper/catalog"]     # an in-place edit drops the catalog (docs/FORMAT.md "The catalog")
    r = runner.invoke(app, ["compare", "-m", clean, "-g", golden, "-out", str(tmp_path / "o")])
    assert "Traceback" not in r.output
    if r.exit_code == 2:
        assert len(r.output.strip().splitlines()) == 1
    else:
        assert r.exit_code == 1, r.output
        table = pd.read_csv(_result_csv(tmp_path / "o"))
        row = table[table["NPUDumpPath"] == "/aten.mm.default/1/output/result"].iloc[0]
        assert row["Result"] != "pass" and isinstance(row["CompareFailReason"], str) and row["CompareFailReason"]


def test_cli_never_imports_torch(dumps, tmp_path):
    """`accucmp --help`, `compare --help` and a real compare/ls/report run without importing torch."""
    golden, _, faulty = dumps
    code = f"""
import sys
from accucmp.cli.main import main
for argv in (["--help"], ["compare", "--help"], ["extract", "--help"], ["report", "--help"],
             ["compare", "-m", {faulty!r}, "-g", {golden!r}, "-out", {str(tmp_path / "o")!r}, "-q"],
             ["ls", {golden!r}, "--stats"]):
    try:
        main(argv)
    except SystemExit:
        pass
import glob
try:
    main(["report", sorted(glob.glob({str(tmp_path / "o" / "result_*.csv")!r}))[0], "-q"])
except SystemExit:
    pass
assert "torch" not in sys.modules, "torch was imported"
print("NO_TORCH_OK")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert "NO_TORCH_OK" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]




def test_cli_import_is_light():
    """`accucmp --help` must start fast: importing the CLI, with every registered
    command module, pulls in none of torch, pandas, h5py, numpy, matplotlib."""
    code = ("import sys\n"
            "import accucmp.cli.main\n"
            "heavy = [m for m in ('torch', 'pandas', 'h5py', 'numpy', 'matplotlib') if m in sys.modules]\n"
            "print('HEAVY', heavy)")
    r = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True, timeout=600)
    heavy_line = next((ln for ln in r.stdout.splitlines() if ln.startswith("HEAVY")), r.stderr[-1500:])
    culprits = [ln.split("|")[-1].strip() for ln in r.stderr.splitlines() if "accucmp." in ln]
    assert heavy_line == "HEAVY []", f"{heavy_line}; accucmp modules imported: {culprits}"


def _original_layout(path, scale=1.0):
    """A file in the original Ascend dumper's layout: wrapper op names, Type/DataType/Stride
    attributes, no dtype or shape attributes, no root attributes."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    w = rng.standard_normal((8, 3)).astype(np.float32)
    with h5py.File(path, "w") as f:
        def tensor(parent, name, arr):
            d = parent.create_dataset(name, data=arr)
            d.attrs.update({"Type": 0, "DataType": 1, "DeviceType": 10, "FormatType": 2,
                            "Stride": np.array([3, 1][:arr.ndim], np.int64)})
        g = f.create_group("addmm/1")
        tensor(g.create_group("input"), "mat1", x)
        tensor(g.create_group("output"), "result", (x @ w * scale).astype(np.float32))
        g = f.create_group("relu/2")
        tensor(g.create_group("input"), "self", (x @ w).astype(np.float32))
        tensor(g.create_group("output"), "result", np.maximum(x @ w * scale, 0).astype(np.float32))
    return str(path)


def test_original_layout_files_list_and_compare(tmp_path):
    """`ls --stats` printed '?' as the dtype of every tensor of a file without dtype
    attributes (the original dumper wrote none), while plain `ls` said float32."""
    g = _original_layout(tmp_path / "g.h5")
    t = _original_layout(tmp_path / "t.h5", scale=1.02)
    for args in (["ls", g], ["ls", "--stats", g]):
        r = runner.invoke(app, args)
        assert r.exit_code == 0, r.output
        assert "?[" not in r.output and "mat1: float32[4, 8]" in r.output, r.output
    r = runner.invoke(app, ["compare", "-m", t, "-g", g, "-o", str(tmp_path / "o")])
    assert r.exit_code == 1
    assert "first failure (execution order): addmm seqid 1 (forward) output/result" in r.output
    r = runner.invoke(app, ["compare", "-m", g, "-g", g, "-o", str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
