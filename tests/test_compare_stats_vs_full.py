"""A statistics-only dump against a full dump of the same run: the full side's statistics
must be computed as the dumper computes the stored ones, or the same run fails."""

from __future__ import annotations

import math

import pytest
from typer.testing import CliRunner

from accucmp.cli.main import app
from accucmp.compare.pipeline import compare_dumps

torch = pytest.importorskip("torch")
import npu_dumper  # noqa: E402

runner = CliRunner(env={"COLUMNS": "120", "NO_COLOR": "1"})


def _run(path, stats_only):
    g = torch.Generator().manual_seed(0)
    z = torch.complex(torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g))
    x = torch.randn(7, 3, generator=g) + 2.0
    with npu_dumper.dumper(use_dump=True, dump_path=str(path), stats_only=stats_only):
        torch.ops.aten.clone.default(z)          # complex: stored statistics are of |z|
        torch.ops.aten.mul.Tensor(x, 3.0)        # real
    return str(path)


@pytest.mark.filterwarnings("error::numpy.exceptions.ComplexWarning")
def test_same_run_statistics_vs_full_passes_complex_included(tmp_path):
    st, full = _run(tmp_path / "st.h5", True), _run(tmp_path / "full.h5", False)
    for mine, golden in ((st, full), (full, st)):
        r = runner.invoke(app, ["compare", "-m", mine, "-g", golden, "-o", str(tmp_path / "cmp"), "-q"])
        assert r.exit_code == 0, r.output
    t = compare_dumps(st, full).table
    assert set(t["CompareStatus"]) == {"stats"} and len(t) == 4
    for _, row in t.iterrows():
        # the dumper's std is the sample std (n-1); both sides agree to float32 rounding
        assert math.isclose(row["TargetStd"], row["GoldenStd"], rel_tol=1e-5), row.to_dict()
        assert math.isclose(row["TargetMean"], row["GoldenMean"], rel_tol=1e-5, abs_tol=1e-6), row.to_dict()
