"""The torch-free install (issue 35 item 9): `pip install npu-accuracy-toolkit` without
extras leaves torch out, and compare, ls and report run there. A fresh venv (no system
site-packages), the project installed into it by pip as a user would (from a copy of the
sources, resolving every dependency from the package indexes this machine is set up
with), then the commands on dumps written here. A dump-side command says which extra it
needs (exit 2), not an internal error.

Skipped, with the reason, only where no venv with pip can be made or no package index is
reachable; an install that fails otherwise fails the test. Takes about a minute (pip
unpacking numpy, pandas, h5py, matplotlib, dask)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ._cli_helpers import model_ops, perturbed, write_dump

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dumpfile", "npu_dumper", "accucmp", "ir2tbe", "sample_models")


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(PIP_NO_INPUT="1", PIP_DISABLE_PIP_VERSION_CHECK="1", NO_COLOR="1")
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, **kw)


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("torchfree")
    env_dir = base / "venv"
    made = _run([sys.executable, "-m", "venv", env_dir], timeout=300)
    pip = env_dir / "bin" / "pip"
    if made.returncode != 0 or not pip.exists():
        pytest.skip(f"cannot make a venv with pip here: {(made.stderr or made.stdout).strip()[-200:]}")
    probe = _run([pip, "download", "--no-deps", "-q", "-d", base / "probe", "h5py"], timeout=300)
    if probe.returncode != 0:
        pytest.skip(f"no package index reachable for pip: {probe.stderr.strip()[-200:]}")
    src = base / "src"                       # a copy: the build leaves nothing in the checkout
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    inst = _run([pip, "install", "-q", "--no-compile", src], timeout=900)
    assert inst.returncode == 0, inst.stdout[-2000:] + inst.stderr[-2000:]
    return env_dir


def test_base_install_leaves_torch_out(venv):
    py = venv / "bin" / "python"
    r = _run([py, "-c", "import torch"])
    assert r.returncode != 0 and "No module named 'torch'" in r.stderr
    r = _run([py, "-c", "import importlib.metadata as m; print(m.version('npu-accuracy-toolkit'))"])
    assert r.returncode == 0 and r.stdout.strip(), r.stderr


def test_compare_ls_and_report_run_without_torch(venv, tmp_path):
    accucmp = venv / "bin" / "accucmp"
    golden = model_ops()
    t = write_dump(tmp_path / "t.h5", perturbed(golden, 4, 0.05))
    g = write_dump(tmp_path / "g.h5", golden)
    out = tmp_path / "out"
    r = _run([accucmp, "compare", "-m", t, "-g", g, "-o", out, "--format", "csv,html",
              "--summary-json", tmp_path / "s.json"], cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stdout.startswith("FAIL: first op caused here is aten.mm.default #4 in layers.1"), r.stdout
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["verdict"] == "FAIL" and summary["first_failure"]["seqid"] == 4
    csv = next(out.glob("result_*.csv"))
    assert csv.with_suffix(".html").stat().st_size > 10_000          # the report with its figure
    r = _run([accucmp, "ls", t], cwd=tmp_path)
    assert r.returncode == 0 and "aten.mm.default" in r.stdout, r.stdout + r.stderr
    r = _run([accucmp, "report", csv, "--threshold", "RelativeEuclideanDistanceFloor=0.1"], cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("PASS"), r.stdout + r.stderr
    # the dump side says what to install, in one line (exit 2), not an internal error
    r = _run([accucmp, "golden", "-i", t, "-o", tmp_path / "gold.h5"], cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip() == ("accucmp: error: this needs torch, which this install leaves out (the comparison "
                                "side runs without it): install torch first (e.g. pip install torch), then "
                                "pip install 'npu-accuracy-toolkit[torch]'"), r.stderr
