"""A filtered dump (modules=/phases=/include=/exclude=) compared with an unfiltered dump of
the same run: each side's ops go through the other's recorded selection before pairing.

Before: the name-stream alignment paired the filtered dump's backward mm of layer 3 with
the golden's first backward mm (another layer) and its sum with the last golden sum:
'size mismatch' failures on a run compared with itself."""

from __future__ import annotations

import h5py
import pytest
from typer.testing import CliRunner

from accucmp.cli.main import app
from accucmp.compare.pipeline import compare_dumps
from accucmp.compare.verdict import apply_verdict
from dumpfile import DumpFile
from dumpfile import schema as S

torch = pytest.importorskip("torch")
import npu_dumper  # noqa: E402

runner = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"})


def _dump(path, **filters):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                            torch.nn.Linear(32, 4))
    x = torch.randn(8, 16)
    with npu_dumper.dumper(use_dump=True, dump_path=str(path), **filters):
        torch.nn.functional.cross_entropy(m(x), torch.tensor([0, 1, 2, 3] * 2)).backward()
    return str(path)


@pytest.mark.parametrize("filters", [dict(modules=["3"], phases=["backward"]),
                                     dict(include=["mm", "sum"]),
                                     dict(exclude=["addmm"], phases=["backward"])])
def test_filtered_dump_against_full_dump_of_the_same_run(tmp_path, filters):
    full = _dump(tmp_path / "full.h5")
    flt = _dump(tmp_path / "flt.h5", **filters)
    with DumpFile(flt) as f:
        assert f.op_filter is not None and not f.op_filter.trivial
        flt_seqids = sorted(o.seqid for o in f.ops())
    with DumpFile(full) as f:
        assert f.op_filter is None
    for mine, golden in ((flt, full), (full, flt)):
        t = apply_verdict(compare_dumps(mine, golden).table)
        assert (t["Result"] == "pass").all(), t[t["Result"] != "pass"][["NPUDump", "SeqId", "GoldenSeqId", "CompareFailReason"]]
        # every selected op paired with the same op of the other run: same seqid on both sides
        assert sorted(set(t["SeqId"])) == flt_seqids
        assert (t["SeqId"] == t["GoldenSeqId"]).all()
    r = runner.invoke(app, ["compare", "-m", flt, "-g", full, "-o", str(tmp_path / "cmp")])
    assert r.exit_code == 0, r.output
    assert "the target dump was filtered" in r.output


def test_same_filter_on_both_sides_is_not_a_note(tmp_path):
    a = _dump(tmp_path / "a.h5", modules=["0"])
    b = _dump(tmp_path / "b.h5", modules=["0"])
    res = compare_dumps(a, b)
    assert res.meta["op_filter"]["ops_left_out"] == 0
    assert (apply_verdict(res.table)["Result"] == "pass").all()


def test_incomplete_dump_warning_is_printed(tmp_path):
    a = _dump(tmp_path / "a.h5")
    b = _dump(tmp_path / "b.h5")
    with h5py.File(a, "r+") as f:
        f.attrs[S.ROOT_COMPLETE] = False
    r = runner.invoke(app, ["compare", "-m", a, "-g", b, "-o", str(tmp_path / "cmp")])
    assert r.exit_code == 0, r.output
    assert "not closed cleanly (complete=False)" in r.output
