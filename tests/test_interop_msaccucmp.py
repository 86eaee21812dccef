"""The real msaccucmp (mindstudio-probe 26.2.0) reads `accucmp export --layout legacy` files.

Its venv is made once under `.cache/msprobe-venv` in the checkout (gitignored) with
`--no-deps mindstudio-probe==26.2.0` plus the three packages its h5 compare imports
(numpy, h5py, protobuf): ~10 s the first time, reused after. Skipped, with the reason,
only where it cannot be installed (no network, no index).

Per sample model (tiny) and dtype (float32, bfloat16): a golden step is dumped, the same
step is load-replayed with a planted fault (accucmp/demo.py's inject_fault at the site the
demo picks); both are exported and compared by the real tool and by ours.
"""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from accucmp.compare.pipeline import compare_dumps
from accucmp.report.export import run_export
from dumpfile.read import legacy as L

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / ".cache" / "msprobe-venv"
PKG = "mindstudio-probe==26.2.0"
METRIC_COLS = ["CosineSimilarity", "MaxAbsoluteError", "AccumulatedRelativeError",
               "RelativeEuclideanDistance", "KullbackLeiblerDivergence", "MeanAbsoluteError",
               "RootMeanSquareError", "MaxRelativeError", "MeanRelativeError"]


def _venv_python() -> Path:
    return VENV / "bin" / "python"


@pytest.fixture(scope="session")
def msaccucmp() -> list[str]:
    py = _venv_python()
    marker = VENV / ".ready"
    if not marker.exists():
        VENV.parent.mkdir(parents=True, exist_ok=True)
        try:
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True,
                           capture_output=True, timeout=300)
            pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
            subprocess.run(pip + ["--no-deps", PKG], check=True, capture_output=True, timeout=600)
            subprocess.run(pip + ["numpy", "h5py", "protobuf"], check=True, capture_output=True,
                           timeout=600)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
            out = getattr(e, "stderr", b"") or b""
            pytest.skip(f"cannot install {PKG} into {VENV}: {e}; {out.decode(errors='replace')[-300:]}")
        marker.write_text(PKG)
    script = subprocess.run([str(py), "-c", "import msprobe, os; print(os.path.dirname(msprobe.__file__))"],
                            capture_output=True, text=True)
    if script.returncode:
        pytest.skip(f"{PKG} in {VENV} does not import: {script.stderr[-300:]}")
    return [str(py), os.path.join(script.stdout.strip(), "msaccucmp", "msaccucmp.py")]


def run_real(cmd: list[str], target: Path, golden: Path, out: Path) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(cmd + ["compare", "-m", str(target), "-g", str(golden), "-out", str(out)],
                       capture_output=True, text=True, timeout=600)
    found = sorted(out.glob("result_*.csv"))
    assert r.returncode == 0 and found, r.stdout[-2000:] + r.stderr[-2000:]
    with open(found[-1], newline="") as fh:
        return list(csv.DictReader(fh))


def _num(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def _to(inputs, dtype):
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in inputs)


def _dump_pair(name: str, dtype: torch.dtype, d: Path) -> tuple[Path, Path, str]:
    """(target, golden, fault op): a step and its load-replay with a planted fault."""
    from accucmp.demo_fault import pick_fault_site
    from npu_dumper import dumper
    from npu_dumper.replay.emulation import inject_fault
    from sample_models import registry

    spec = registry.get(name)
    golden, target = d / f"{name}_g.h5", d / f"{name}_t.h5"
    model = spec.build(seed=0, size="tiny").to(dtype)
    inputs = _to(spec.make_inputs(seed=0, size="tiny"), dtype)
    with dumper(dump_path=str(golden)):
        spec.train_step(model, inputs)
    site = pick_fault_site(golden)
    model = spec.build(seed=0, size="tiny").to(dtype)
    with inject_fault(site.op, rel=site.rel, call=site.call):
        with dumper(use_load=True, load_file_path=str(golden), dump_path=str(target)):
            spec.train_step(model, inputs)
    return target, golden, site.op


MODELS = ["mlp", "resnet", "shufflenet", "lstm_lm", "transformer"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model", MODELS)
def test_real_msaccucmp_reads_exports_and_agrees(msaccucmp, tmp_path, model, dtype):
    target, golden, fault_op = _dump_pair(model, dtype, tmp_path)
    lt, lg = tmp_path / "t_legacy.h5", tmp_path / "g_legacy.h5"
    run_export(str(target), str(lt), "legacy", device_type="npu")
    run_export(str(golden), str(lg), "legacy")
    theirs = run_real(msaccucmp, lt, lg, tmp_path / "real")
    ours = compare_dumps(str(target), str(golden)).table

    def key_of(path: str) -> str:
        _, op, rest = path.split("/", 2)
        return f"/{L.legacy_op_name(op)}/{rest}"

    by_path = {r["NPUDumpPath"]: r for r in theirs if r["NPUDumpPath"] not in ("", "NaN")}
    rows = [r for r in ours.to_dict("records") if r["NPUDumpPath"] and r["GroundTruthPath"]
            and not math.isnan(_num(r["CosineSimilarity"]))]
    assert rows, "our compare produced no rows"
    got = [(r, by_path.get(key_of(r["NPUDumpPath"]))) for r in rows]
    with_metrics = [(r, t) for r, t in got if t is not None and not math.isnan(_num(t["CosineSimilarity"]))]
    assert len(with_metrics) >= 0.95 * len(rows), (
        f"{model}: the real msaccucmp gave metrics for {len(with_metrics)} of our {len(rows)} rows; "
        f"missing e.g. {[r['NPUDumpPath'] for r, t in got if t is None][:5]}")
    bad = []
    for r, t in with_metrics:
        for c in METRIC_COLS:
            a, b = _num(r[c]), _num(t[c])
            if math.isnan(a) or math.isnan(b):
                continue
            # they print 6 decimals and compute in float32: 1e-5 absolute, relative for large values
            if abs(a - b) > 1e-5 * max(1.0, abs(b)):
                bad.append((r["NPUDumpPath"], c, a, b))
        # same formula and formatting: the strings are equal
        assert r["StandardDeviation"] == t["StandardDeviation"], r["NPUDumpPath"]
    assert not bad, f"{model}: {len(bad)} metrics differ from the real tool's, e.g. {bad[:5]}"
    # the planted fault is among the real tool's worst rows (lowest cosine)
    real_rows = [t for _, t in with_metrics]
    worst = sorted(real_rows, key=lambda t: _num(t["CosineSimilarity"]))[:3]
    assert any(t["NPUDump"] == L.legacy_op_name(fault_op) for t in worst), (
        fault_op, [(t["NPUDumpPath"], t["CosineSimilarity"]) for t in worst])


def _original_file(path: Path, tensors: dict, half_as_f32: bool) -> None:
    """A file as the original dumper wrote it: wrapper op names, no root attributes, Half as
    F32 with DataType 10, DeviceType NPU for the target."""
    import h5py
    with h5py.File(path, "w") as f:
        for p, arr in tensors.items():
            a = np.asarray(arr)
            code = 10 if a.dtype == np.float16 else 9 if a.dtype == np.bool_ else 1
            if a.dtype == np.float16 and half_as_f32:
                a = a.astype(np.float32)
            ds = f.create_dataset(p, data=a)
            ds.attrs.update({"Type": 0, "DataType": code, "DeviceType": 10 if half_as_f32 else 0,
                             "FormatType": 2, "Stride": np.array(
                                 [int(np.prod(a.shape[i + 1:])) for i in range(a.ndim)], np.int64)})


def test_hand_built_original_fp16_vs_fp32_no_false_alarms(msaccucmp, tmp_path):
    """fp16 target (stored as F32, DataType 10) vs fp32 golden: judged at fp16 precision by
    ours (no failures), read by the real tool too; bool stays bool; Backward op is backward."""
    from accucmp.cli.main import app
    from dumpfile.read.reader import DumpFile
    from typer.testing import CliRunner

    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((16, 32)), rng.standard_normal((32, 8))
    y = a @ b
    gold = {"/addmm/1/input/mat1": a.astype(np.float32), "/addmm/1/output/result": y.astype(np.float32),
            "/AddmmBackward/2/output/grad_inputs": y.astype(np.float32),
            "/gt/3/output/result": y > 0}
    targ = {k: (v.astype(np.float16) if v.dtype != np.bool_ else v) for k, v in gold.items()}
    t, g = tmp_path / "npu.h5", tmp_path / "gpu.h5"
    _original_file(t, targ, half_as_f32=True)
    _original_file(g, gold, half_as_f32=False)
    with DumpFile(t) as f:
        ops = {o.op: o for o in f.ops()}
        assert ops["addmm"].outputs()["result"].dtype == "float16"
        assert ops["gt"].outputs()["result"].read().dtype == np.bool_
        assert ops["AddmmBackward"].phase == "backward" and ops["addmm"].phase == "forward"
    r = CliRunner().invoke(app, ["compare", "-m", str(t), "-g", str(g), "-o", str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    assert "fail" not in r.output.split("\n")[0] or " 0 fail" in r.output.split("\n")[0], r.output
    theirs = run_real(msaccucmp, t, g, tmp_path / "real")
    assert {x["NPUDumpPath"] for x in theirs} >= {"/addmm/1/output/result", "/gt/3/output/result"}
    # and the mixed pair: this original file against our own dump of the same op
    from dumpfile.write.writer import DumpWriter, TensorMeta
    ours = tmp_path / "ours.h5"
    with DumpWriter(ours) as w:
        w.begin_op("aten.addmm.default", 1)
        _, o = w.io_groups()
        w.write_tensor(o, "result", y.astype(np.float32), TensorMeta("float32", y.shape, (8, 1)))
        w.end_op()
    res = compare_dumps(str(t), str(ours)).table
    row = res[res["NPUDumpPath"] == "/addmm/1/output/result"].iloc[0]
    assert row["GroundTruthPath"] == "/aten.addmm.default/1/output/result"
    assert _num(row["CosineSimilarity"]) > 0.9999
