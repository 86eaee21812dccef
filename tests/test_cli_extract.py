"""`accucmp extract` and `accucmp ls`: the h5copy workflow and the listing."""

from __future__ import annotations

import shutil
import subprocess

import h5py
import numpy as np
import pytest
from typer.testing import CliRunner

from accucmp.cli.main import app
from accucmp.extract import extract_ops, list_op_groups, parse_op_path
from dumpfile import DumpFile, DumpWriter, TensorMeta
from dumpfile import schema as S

from ._cli_helpers import Op, bf16_bits, model_ops, write_dump

runner = CliRunner(env={"COLUMNS": "120", "NO_COLOR": "1"})


@pytest.fixture
def dump(tmp_path):
    return write_dump(tmp_path / "in.h5", model_ops(), root_attrs={S.ROOT_DEVICE: "npu:0", "custom": "kept"})


def _view_dump(path):
    """op 1 writes a 2x3 base; op 2's input is its transpose stored as a Type-40 view;
    op 2 also has a bf16 output and an in-place output hard-linked to its input."""
    base = np.arange(6, dtype=np.float32).reshape(2, 3)
    with DumpWriter(path) as w:
        g = w.begin_op("aten.mul.Tensor", 1, module="m")
        bpath = w.write_tensor(g["output"], "result", base, TensorMeta("float32", (2, 3), (3, 1)))
        w.end_op()
        g = w.begin_op("aten.mm.default", 2, phase="backward", module="m.sub", attrs={"note": "x"})
        w.write_view(g["input"], "self", bpath, TensorMeta("float32", (3, 2), (1, 3)))
        w.set_order(g["input"], ["self"])
        w.write_tensor(g["output"], "result", bf16_bits(np.array([1.5, -2.25], np.float32)),
                       TensorMeta("bfloat16", (2,), (1,)))
        w.link(g["output"], "self", f"{g.name}/input/self")
        w.end_op()
    return str(path)


def test_parse_op_path_accepts_h5copy_spellings():
    assert parse_op_path("/aten.mm.default/12/") == ("aten.mm.default", 12)
    assert parse_op_path("aten.mm.default/12") == ("aten.mm.default", 12)
    assert parse_op_path("/aten.mm.default/") == ("aten.mm.default", None)
    with pytest.raises(Exception, match="not a number"):
        parse_op_path("/aten.mm.default/x/")


def test_extract_copies_ops_with_attrs_root_attrs_and_index(dump, tmp_path):
    out = tmp_path / "out.h5"
    r = runner.invoke(app, ["extract", "-i", dump, "-o", str(out), "-s", "/aten.mm.default/1/",
                            "-s", "/aten.relu.default/3/"])
    assert r.exit_code == 0, r.output
    with DumpFile(out) as f, DumpFile(dump) as src:
        assert [(o.op, o.seqid) for o in f.ops()] == [("aten.mm.default", 1), ("aten.relu.default", 3)]
        assert f.attrs["custom"] == "kept" and f.attrs[S.ROOT_DEVICE] == "npu:0"
        assert S.INDEX_PATH in f.h5 and f.complete
        a, b = f.op("aten.mm.default", 1), src.op("aten.mm.default", 1)
        assert a.module == "layers.0" and a.phase == "forward"
        np.testing.assert_array_equal(a.inputs()["mat2"].read(), b.inputs()["mat2"].read())
        assert list(a.inputs()) == ["self", "mat2"]  # argument order kept
        assert dict(f.h5[a.path + "/input/mat2"].attrs)["Stride"].tolist() == [16, 1]


def test_extract_appends_and_refuses_to_overwrite(dump, tmp_path):
    out = tmp_path / "out.h5"
    assert runner.invoke(app, ["extract", "-i", dump, "-o", str(out), "-s", "/aten.mm.default/1/"]).exit_code == 0
    assert runner.invoke(app, ["extract", "-i", dump, "-o", str(out), "-s", "/aten.add.Tensor/2/"]).exit_code == 0
    with DumpFile(out) as f:
        assert [o.seqid for o in f.ops()] == [1, 2]
    before = out.read_bytes()
    r = runner.invoke(app, ["extract", "-i", dump, "-o", str(out), "-s", "/aten.add.Tensor/2/"])
    assert r.exit_code == 2
    assert "already exists" in r.output and "/aten.add.Tensor/2/" in r.output
    assert out.read_bytes() == before  # untouched


def test_extract_dest_renames_and_whole_op(dump, tmp_path):
    out = tmp_path / "out.h5"
    r = runner.invoke(app, ["extract", "-i", dump, "-o", str(out), "-s", "/aten.mm.default/1/", "-d", "/aten.mm.default/100/"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["extract", "-i", dump, "-o", str(out), "-s", "/aten.relu.default/"])
    assert r.exit_code == 0, r.output
    with DumpFile(out) as f:
        assert [(o.op, o.seqid) for o in f.ops()] == [("aten.relu.default", 3), ("aten.relu.default", 6),
                                                       ("aten.relu.default", 9), ("aten.mm.default", 100)]
        assert f.op("aten.mm.default", 100).attrs["seqid"] == 100


def test_extract_unknown_op_is_one_line_exit_2(dump, tmp_path):
    r = runner.invoke(app, ["extract", "-i", dump, "-o", str(tmp_path / "o.h5"), "-s", "/aten.mm.default/2/"])
    assert r.exit_code == 2
    assert "no op group /aten.mm.default/2/" in r.output and "seqids 1, 4, 7, 11, 13, 15" in r.output
    assert "Traceback" not in r.output and not (tmp_path / "o.h5").exists()


def test_extract_materialises_views_and_keeps_links(tmp_path):
    src = _view_dump(tmp_path / "v.h5")
    out = tmp_path / "out.h5"
    extract_ops(src, out, [("/aten.mm.default/2/", "/aten.mm.default/2/")])
    with h5py.File(out, "r") as h:
        ds = h["/aten.mm.default/2/input/self"]
        assert int(ds.attrs["Type"]) == S.TYPE_TENSOR and "base" not in ds.attrs
        np.testing.assert_array_equal(ds[()], np.arange(6, dtype=np.float32).reshape(2, 3).T)
        assert h["/aten.mm.default/2/output/self"].id == ds.id  # hard link kept
        assert h["/aten.mm.default/2"].attrs["note"] == "x"
    with DumpFile(out) as f:
        op = f.op("aten.mm.default", 2)
        assert op.phase == "backward" and op.module == "m.sub"
        np.testing.assert_array_equal(op.outputs()["result"].read(), [1.5, -2.25])  # bf16 bits exact
        assert op.outputs()["result"].dtype == "bfloat16"


def test_extract_from_report_takes_failing_ops(dump, tmp_path):
    import pandas as pd

    csv = tmp_path / "result_1.csv"
    pd.DataFrame({
        "Index": [0, 1, 2], "NPUDump": ["aten.mm.default", "aten.add.Tensor", "aten.relu.default"],
        "NPUDumpPath": ["/aten.mm.default/1/output/result", "/aten.add.Tensor/2/output/result",
                        "/aten.relu.default/3/output/result"],
        "GroundTruthPath": ["/aten.mm.default/1/output/result", "/aten.add.Tensor/2/output/result",
                            "/aten.relu.default/3/output/result"],
        "Result": ["pass", "fail", "fail"], "CompareFailReason": ["", "", ""],
    }).to_csv(csv, index=False)
    out = tmp_path / "out.h5"
    r = runner.invoke(app, ["extract", "-i", dump, "-o", str(out), "--from-report", str(csv)])
    assert r.exit_code == 0, r.output
    with DumpFile(out) as f:
        assert [o.seqid for o in f.ops()] == [2, 3]


@pytest.mark.skipif(shutil.which("h5copy") is None, reason="h5copy not installed")
def test_real_h5copy_output_and_our_append_agree(dump, tmp_path):
    """A file started with real h5copy (no index, no root attrs) is appended to, and every
    op (h5copy's and ours) is listed; real h5copy can copy from our output too."""
    out = tmp_path / "out.h5"
    subprocess.run(["h5copy", "-p", "-i", dump, "-o", str(out), "-s", "/aten.mm.default/1", "-d",
                    "/aten.mm.default/1"], check=True)
    extract_ops(dump, out, [("/aten.relu.default/3/", "/aten.relu.default/3/")])
    with DumpFile(out) as f:
        assert [o.seqid for o in f.ops()] == [1, 3]
        np.testing.assert_array_equal(f.op("aten.mm.default", 1).outputs()["result"].read(),
                                      DumpFile(dump).op("aten.mm.default", 1).outputs()["result"].read())
    again = tmp_path / "again.h5"
    subprocess.run(["h5copy", "-p", "-i", str(out), "-o", str(again), "-s", "/aten.relu.default/3", "-d",
                    "/aten.relu.default/3"], check=True)
    with h5py.File(again, "r") as h:
        assert list_op_groups(h) == [("aten.relu.default", 3)]


def test_ls_plain_lists_ops_in_seqid_order_with_stats(dump):
    r = runner.invoke(app, ["ls", dump, "--stats"])
    assert r.exit_code == 0, r.output
    lines = [ln for ln in r.output.splitlines() if ln[:1].isdigit()]
    assert [int(ln.split("\t")[0]) for ln in lines] == list(range(1, 16))
    first = lines[0].split("\t")
    assert first[1:4] == ["aten.mm.default", "forward", "layers.0"]
    assert "self: float32[4, 16]" in first[4] and "min=" in first[5]
    assert "alpha=1" in lines[1]


def test_ls_select_and_stats_values(tmp_path):
    p = write_dump(tmp_path / "d.h5", [
        Op("aten.add.Tensor", 1, {"self": np.array([1.0, np.nan, np.inf, -3.0], np.float32)},
           {"result": np.array([1.0, 2.0], np.float32)}),
        Op("aten.mul.Tensor", 2, {}, {"result": np.zeros(2, np.float32)}),
    ])
    r = runner.invoke(app, ["ls", p, "--stats", "--select", "add"])
    assert r.exit_code == 0, r.output
    assert "aten.mul" not in r.output
    assert "min=-3 max=1 mean=-1 nan=1 inf=1" in r.output


@pytest.mark.parametrize("content", [None, b"not hdf5 at all", "truncated", "not_dump"])
def test_ls_and_extract_bad_input_is_one_line_exit_2(tmp_path, dump, content):
    p = tmp_path / "bad.h5"
    if content == "truncated":
        data = open(dump, "rb").read()
        p.write_bytes(data[: len(data) // 3])
    elif content == "not_dump":
        with h5py.File(p, "w") as h:
            h["x"] = np.arange(3)
    elif content is not None:
        p.write_bytes(content)
    for args in (["ls", str(p)], ["extract", "-i", str(p), "-o", str(tmp_path / "o.h5"), "-s", "/a/1/"]):
        r = runner.invoke(app, args)
        assert r.exit_code == 2, (args, r.output)
        msg = r.output.strip()
        assert len(msg.splitlines()) == 1 and str(p) in msg and "Traceback" not in msg


def test_extracted_ops_compare_with_the_run_they_came_from(tmp_path):
    """An extract holds a few ops under their seqids. Compared with the whole dump, the
    name-stream alignment paired its second mm with the run's first mm: the extract of a
    run failed against that same run ('values differ'). It now pairs by seqid when the
    seqids line up, and leaves out the ops the extract does not hold."""
    from tests._compare_helpers import write_dump as write_plain
    from accucmp.compare.pipeline import compare_dumps
    from accucmp.compare.verdict import apply_verdict

    rng = np.random.default_rng(1)
    ops = []
    for i, name in enumerate(["aten.mm.default", "aten.relu.default", "aten.mm.default", "aten.sum.default",
                              "aten.mm.default"], start=1):
        v = rng.standard_normal((4, 4)).astype(np.float32)
        ops.append(dict(op=name, seqid=i, inputs={"self": v}, outputs={"result": v * i}))
    write_plain(tmp_path / "run.h5", ops)
    r = runner.invoke(app, ["extract", "-i", str(tmp_path / "run.h5"), "-o", str(tmp_path / "x.h5"),
                            "-s", "/aten.mm.default/3/", "-s", "/aten.mm.default/5/"])
    assert r.exit_code == 0, r.output
    for mine, golden in ((tmp_path / "x.h5", tmp_path / "run.h5"), (tmp_path / "run.h5", tmp_path / "x.h5")):
        res = compare_dumps(str(mine), str(golden))
        t = apply_verdict(res.table)
        assert res.meta["pairing"] == "seqid"
        assert (t["Result"] == "pass").all(), t[["NPUDump", "SeqId", "GoldenSeqId", "Result"]]
        assert sorted(set(t["SeqId"])) == [3, 5] and (t["SeqId"] == t["GoldenSeqId"]).all()
    r = runner.invoke(app, ["compare", "-m", str(tmp_path / "x.h5"), "-g", str(tmp_path / "run.h5"), "-o", str(tmp_path / "c")])
    assert r.exit_code == 0 and "extracted: paired by seqid, 3 op(s) of the other file outside the extract left out" in r.output


def test_ls_plain_keeps_one_row_per_op_when_a_name_holds_a_tab_or_newline(tmp_path):
    p = write_dump(tmp_path / "tab.h5", [
        Op("aten.relu.default", 1, {"self": np.ones(2, np.float32)}, {"result": np.ones(2, np.float32)},
           module="blocks.a\tb"),
        Op("aten.neg.default", 2, {"self": np.ones(2, np.float32)}, {"result": -np.ones(2, np.float32)},
           module="line\nbreak"),
    ])
    r = runner.invoke(app, ["ls", p, "--plain"])
    assert r.exit_code == 0, r.output
    rows = [ln.split("\t") for ln in r.output.splitlines()[2:]]
    assert [len(row) for row in rows] == [6, 6]
    assert rows[0][3] == "blocks.a\\tb" and rows[1][3] == "line\\nbreak"


def test_ls_from_the_catalog_shows_what_the_groups_hold(tmp_path, monkeypatch):
    # a real dump (lists, views, hard links, None, int lists, dtypes, a complex value only
    # in the file): the listing read from the catalog equals the one walked from the groups
    import torch
    import npu_dumper
    import sample_models
    from accucmp import listing

    spec = sample_models.get("lstm_lm")
    model, batch = spec.build(seed=0, size="tiny"), spec.make_inputs(seed=0, size="tiny")
    p = str(tmp_path / "m.h5")
    with npu_dumper.dumper(use_dump=True, dump_path=p, record_views=True):
        spec.train_step(model, batch)
        torch.ones(2) * complex(1, 2)
        torch.cat([torch.ones(2), torch.zeros(3)])
    calls = []
    real_walk, real_rows = listing._light_values, listing._catalog_rows
    monkeypatch.setattr(listing, "_light_values", lambda f, path: calls.append(path) or real_walk(f, path))
    via_catalog, info = listing.list_ops(p)
    # only the op whose value JSON cannot hold (the complex scalar) walks its groups
    assert len(calls) == 1 and calls[0].startswith("/aten.mul.Tensor/"), calls
    calls.clear()
    monkeypatch.setattr(listing, "_catalog_rows", lambda f: None)
    walked, _ = listing.list_ops(p)
    assert len(calls) == info["ops"] > 30
    assert via_catalog == walked
    kinds = {v.kind for ln in walked for v in ln.values}
    assert {"Tensor", "Tensor(view)"} <= kinds and len(kinds) > 4, kinds
    assert any("/" in v.name for ln in walked for v in ln.values)          # list children
    # a catalog that is not one row per index row is not used
    calls.clear()
    monkeypatch.setattr(listing, "_catalog_rows", real_rows)
    with h5py.File(p, "r+") as h:
        cat = h[S.CATALOG_PATH]
        cat.resize((cat.shape[0] - 1,))
    again, _ = listing.list_ops(p)
    assert again == walked and len(calls) == info["ops"]
