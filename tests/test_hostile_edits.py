"""Edits of real dumps that made commands hang, fail internally (exit 3) or hide a fault
(issue 32), each refused in one line (exit 2) where the format is read, or read right."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest
from typer.testing import CliRunner

from accucmp.cli.main import app
from dumpfile import DumpFile, DumpFormatError
from dumpfile import schema as S

from ._cli_helpers import model_ops, perturbed, write_dump

runner = CliRunner(env={"COLUMNS": "160", "NO_COLOR": "1"})
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HANG_GUARD = 600          # seconds: a hang, never a slow machine
FAULT = 7                 # the perturbed op's seqid (an mm)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    d = tmp_path_factory.mktemp("edits")
    ops = model_ops()
    golden = write_dump(d / "golden.h5", ops)
    target = write_dump(d / "target.h5", perturbed(ops, FAULT, 0.5))
    return str(golden), str(target)


def _copy(src: str, tmp_path, name: str = "edited.h5") -> str:
    dst = str(tmp_path / name)
    shutil.copy(src, dst)
    return dst


def _refused(args: list[str], path: str) -> str:
    r = runner.invoke(app, args)
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 2, r.output
    assert len(lines) == 1 and path in lines[0] and "internal error" not in lines[0], r.output
    return lines[0]


def _first(path: str, want) -> str:
    found = []
    with h5py.File(path, "r") as h5:
        h5.visititems(lambda n, o: found.append(n) if want(n, o) else None)
    return found[0]


def test_a_files_backtracking_regex_is_refused_not_run(dumps, tmp_path):
    golden, target = dumps
    path = _copy(golden, tmp_path)
    with h5py.File(path, "a") as h5:
        h5.attrs[S.ROOT_OP_FILTER] = '{"exclude": ["(.|.)*Z"]}'
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-m", "accucmp.cli", "compare", "-m", target, "-g", path, "-out",
                        str(tmp_path / "o"), "-q"], capture_output=True, text=True, timeout=HANG_GUARD, env=env)
    assert r.returncode == 2 and "(.|.)*Z" in r.stderr and "alternation inside a quantified group" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("where", ["op_filter", "catalog", "legacy_book"])
def test_json_nested_past_the_cap_is_malformed_not_a_recursion_error(dumps, tmp_path, where):
    golden, target = dumps
    deep = "[" * 5000 + "]" * 5000
    if where == "op_filter":
        path = _copy(golden, tmp_path)
        with h5py.File(path, "a") as h5:
            h5.attrs[S.ROOT_OP_FILTER] = '{"include": ' + deep + "}"
        _refused(["compare", "-m", target, "-g", path, "-out", str(tmp_path / "o"), "-q"], path)
    elif where == "catalog":
        path = _copy(golden, tmp_path)
        with h5py.File(path, "a") as h5:
            rows = h5[S.CATALOG_PATH][()]
            rows[0] = deep.encode()
            h5[S.CATALOG_PATH][...] = rows
        r = runner.invoke(app, ["ls", path, "--plain"])
        assert r.exit_code == 0, r.output         # a malformed row: that op is walked instead
    else:
        legacy = str(tmp_path / "legacy.h5")
        assert runner.invoke(app, ["export", "-i", golden, "-o", legacy, "--layout", "legacy"]).exit_code == 0
        with h5py.File(legacy, "a") as h5:
            h5.attrs["npu_dumper"] = '{"ops": ' + deep + "}"
        _refused(["export", "-i", legacy, "-o", str(tmp_path / "n.h5"), "--layout", "native"], legacy)


@pytest.mark.parametrize("book", ["{", "[1, 2]", '{"ops": {"a": 1}}', '{"op_attrs": {"x/1": ["forward"]}}',
                                  '{"op_attrs": []}'])
def test_export_native_checks_the_legacy_bookkeeping(dumps, tmp_path, book):
    golden, _ = dumps
    legacy = str(tmp_path / "legacy.h5")
    assert runner.invoke(app, ["export", "-i", golden, "-o", legacy, "--layout", "legacy"]).exit_code == 0
    with h5py.File(legacy, "a") as h5:
        h5.attrs["npu_dumper"] = book
    line = _refused(["export", "-i", legacy, "-o", str(tmp_path / "n.h5"), "--layout", "native"], legacy)
    assert "'npu_dumper'" in line


def _make_view(path: str, to: str) -> str:
    """The first tensor made a view (Type 40) whose reference points at `to`."""
    with h5py.File(path, "a") as h5:
        victim = _first(path, lambda n, o: isinstance(o, h5py.Dataset) and n.endswith("output/result"))
        attrs = dict(h5[victim].attrs)
        del h5[victim]
        if to == "number":
            ds = h5.create_dataset(victim, data=np.int64(3))
        else:
            ds = h5.create_dataset(victim, shape=(), dtype=h5py.ref_dtype)
            if to == "string":
                h5.create_dataset(victim + "_text", data="text")
            ds[()] = {"self": ds, "root": h5["/"], "string": h5.get(victim + "_text")}[to].ref
        ds.attrs.update(attrs)
        ds.attrs[S.ATTR_TYPE] = S.TYPE_TENSOR_VIEW
    return victim


@pytest.mark.parametrize("to", ["self", "root", "string", "number"])
def test_a_view_whose_reference_is_not_a_tensor_is_refused(dumps, tmp_path, to):
    golden, target = dumps
    path = _copy(golden, tmp_path)
    victim = _make_view(path, to)
    with DumpFile(path) as f:
        rec = next(r for op in f.ops() for r in op.outputs().values() if r.path == "/" + victim)
        with pytest.raises(DumpFormatError, match="view"):
            rec.read()
    for args in (["ls", path, "--stats", "--plain"], ["export", "-i", path, "-o", str(tmp_path / "l.h5"),
                                                      "--layout", "legacy"]):
        _refused(args, path)
    r = runner.invoke(app, ["compare", "-m", target, "-g", path, "-out", str(tmp_path / "o"), "-q"])
    assert r.exit_code in (1, 2) and "internal error" not in r.output, r.output


@pytest.mark.parametrize("swap", ["tensor_as_group", "output_as_dataset", "index_as_group"])
def test_object_kinds_swapped_are_refused(dumps, tmp_path, swap):
    golden, _ = dumps
    path = _copy(golden, tmp_path)
    with h5py.File(path, "a") as h5:
        if swap == "tensor_as_group":
            victim = _first(path, lambda n, o: isinstance(o, h5py.Dataset) and n.endswith("output/result"))
            attrs = dict(h5[victim].attrs)
            del h5[victim]
            h5.create_group(victim).attrs.update(attrs)
        elif swap == "output_as_dataset":
            victim = _first(path, lambda n, o: isinstance(o, h5py.Group) and n.endswith("/output"))
            del h5[victim]
            h5[victim] = np.arange(3.0)
        else:
            del h5[S.INDEX_PATH]
            h5.create_group(S.INDEX_PATH)
    _refused(["ls", path, "--stats", "--plain"], path)


@pytest.mark.parametrize("shape", ["deep", "wide", "attrs"])
def test_cost_bombs_are_refused_past_documented_caps(dumps, tmp_path, shape):
    from dumpfile.read import safety

    golden, target = dumps
    path = _copy(golden, tmp_path)
    with h5py.File(path, "a") as h5:
        io = _first(path, lambda n, o: isinstance(o, h5py.Group) and n.endswith("/output"))
        if shape == "deep":
            g = h5[io]
            for _ in range(safety.MAX_PATH_LEVELS + 5):
                g = g.create_group("deep")
                g.attrs[S.ATTR_TYPE] = S.TYPE_LIST
        elif shape == "wide":
            g = h5[io].create_group("wide")
            g.attrs[S.ATTR_TYPE] = S.TYPE_LIST
            for i in range(safety.MAX_MEMBERS + 1):
                g.create_dataset(f"wide_{i}", data=np.int64(i)).attrs[S.ATTR_TYPE] = S.TYPE_INT
        else:
            victim = _first(path, lambda n, o: isinstance(o, h5py.Dataset) and n.endswith("output/result"))
            for i in range(safety.MAX_ATTRIBUTES + 1):
                h5[victim].attrs[f"junk{i}"] = i
    for args in (["ls", path, "--stats", "--plain"],
                 ["compare", "-m", target, "-g", path, "-out", str(tmp_path / "o"), "-q"]):
        line = _refused(args, path)
        assert "refused" in line


def test_a_type_attribute_that_is_an_array_is_refused_by_compare(dumps, tmp_path):
    golden, target = dumps
    path = _copy(golden, tmp_path)
    with h5py.File(path, "a") as h5:
        victim = _first(path, lambda n, o: isinstance(o, h5py.Dataset) and n.endswith("output/result"))
        h5[victim].attrs[S.ATTR_TYPE] = [0, 0]
        del h5[S.CATALOG_PATH]                 # (the catalog repeats the Type: the groups are walked)
    r = runner.invoke(app, ["compare", "-m", target, "-g", path, "-out", str(tmp_path / "o"), "-q"])
    assert r.exit_code in (1, 2) and "internal error" not in r.output, r.output


def test_a_seqid_name_past_int64_is_not_a_seqid(dumps, tmp_path):
    golden, _ = dumps
    path = _copy(golden, tmp_path)
    with h5py.File(path, "a") as h5:
        del h5[S.INDEX_PATH]
        del h5[S.CATALOG_PATH]
        h5.move("/aten.mm.default/1", "/aten.mm.default/12345678901234567890123")
    with DumpFile(path) as f:
        assert all(o.seqid != 1 or o.op != "aten.mm.default" for o in f.ops())
    assert S.is_seqid_name("7") and not S.is_seqid_name("12345678901234567890123")
    assert not S.is_seqid_name("²") and not S.is_seqid_name("")


def test_renamed_index_rows_cannot_hide_the_fault(dumps, tmp_path):
    """The rows of the faulty op renamed so they name no group: compare -p printed PASS."""
    golden, target = dumps
    path = _copy(target, tmp_path)
    with h5py.File(path, "a") as h5:
        ix = h5[S.INDEX_PATH][()]
        ix["op"][ix["op"] == b"aten.mm.default"] = b"aten.gone.default"
        h5[S.INDEX_PATH][...] = ix
    line = _refused(["compare", "-m", path, "-g", golden, "-out", str(tmp_path / "o"), "-q", "-p"], path)
    assert "/aten.mm.default/" in line and "in no index row" in line


def test_a_repeated_index_is_refused_naming_the_input(dumps, tmp_path):
    golden, _ = dumps
    path = _copy(golden, tmp_path)
    with h5py.File(path, "a") as h5:
        ix = h5[S.INDEX_PATH][()]
        del h5[S.INDEX_PATH]
        del h5[S.CATALOG_PATH]
        h5.create_dataset(S.INDEX_PATH, data=np.tile(ix, 50))
    line = _refused(["ls", path, "--plain"], path)
    assert "50 times" in line


def test_an_op_filter_selecting_nothing_names_the_filtering_dump(dumps, tmp_path):
    golden, target = dumps
    path = _copy(golden, tmp_path)
    with h5py.File(path, "a") as h5:
        h5.attrs[S.ROOT_OP_FILTER] = '{"include": ["no.such.op"]}'
        for name in list(h5.keys()):
            if name != S.META_GROUP:
                del h5[name]
        del h5[S.INDEX_PATH]
        del h5[S.CATALOG_PATH]
    r = runner.invoke(app, ["compare", "-m", target, "-g", path, "-out", str(tmp_path / "o"), "-q"])
    assert r.exit_code == 2, r.output
    assert f"{path}: its op_filter" in r.output and f"selects none of the ops of {target}" in r.output


@pytest.mark.parametrize("edit", ["2d", "missing_column", "view_rows", "odd_histogram"])
def test_the_statistics_table_is_checked_where_it_is_read(tmp_path, edit):
    torch = pytest.importorskip("torch")
    import npu_dumper

    path = str(tmp_path / "s.h5")
    with npu_dumper.dumper(use_dump=True, dump_path=path, stats_only=True, stats_histogram=True):
        (torch.arange(12.0).reshape(3, 4) * 2).relu()
    with h5py.File(path, "a") as h5:
        t = h5[S.STATS_TABLE_PATH][()]
        del h5[S.STATS_TABLE_PATH]
        if edit == "2d":
            t = np.stack([t, t], axis=1)
        elif edit == "missing_column":
            t = t[[n for n in t.dtype.names if n != "min"]]
        elif edit == "view_rows":
            t["Type"][:] = S.TYPE_TENSOR_VIEW
        else:
            t = t.astype([(n, t.dtype[n]) for n in t.dtype.names])
            for r in t:
                r[S.STATS_HIST_FIELD] = np.array([1, 2, 3], dtype=np.int64)
        h5.create_dataset(S.STATS_TABLE_PATH, data=t, dtype=t.dtype if edit != "2d" else None)
    commands = [["whatif", path, "-out", str(tmp_path / "w")]]
    if edit != "odd_histogram":                   # (ls does not read the histograms)
        commands.append(["ls", path, "--stats", "--plain"])
    for args in commands:
        _refused(args, path)


def test_a_longdouble_tensor_is_refused_by_load_as_torch(dumps, tmp_path):
    pytest.importorskip("torch")
    import npu_dumper

    golden, _ = dumps
    path = _copy(golden, tmp_path)
    with h5py.File(path, "a") as h5:
        victim = _first(path, lambda n, o: isinstance(o, h5py.Dataset) and n.endswith("output/result"))
        attrs = dict(h5[victim].attrs)
        shape = h5[victim].shape
        del h5[victim]
        h5.create_dataset(victim, data=np.ones(shape, np.longdouble)).attrs.update(attrs)
    with npu_dumper.load(path, as_torch=True) as f:
        rec = next(r for op in f.ops() for r in op.outputs().values() if r.path == "/" + victim)
        with pytest.raises(DumpFormatError, match="wider than any tensor dtype"):
            rec.read()


def test_convert_refuses_a_tensor_in_the_holes_of_a_sparse_file(tmp_path):
    import struct

    from ir2tbe import dump_data as D

    folder = tmp_path / "kd"
    folder.mkdir()
    p = str(folder / "Add.add.1.2.1700000000000000")
    D.write_kernel_dump(p, "add", [], [D.TensorToWrite(np.ones(4, np.float32))])
    raw = open(p, "rb").read()
    (hl,) = struct.unpack("<Q", raw[:8])
    msg = D.DumpData()
    msg.ParseFromString(raw[8:8 + hl])
    n = 1 << 28                                  # 1 GiB of float32, none of it stored
    for dims in (msg.output[0].shape.dim, msg.output[0].original_shape.dim):
        del dims[:]
        dims.append(n)
    msg.output[0].size = 4 * n
    head = msg.SerializeToString()
    with open(p, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        f.truncate(8 + len(head) + 4 * n)
    if os.stat(p).st_blocks * 512 >= 4 * n:
        pytest.skip("this file system does not keep sparse files")
    r = runner.invoke(app, ["convert", "-d", str(folder), "-out", str(tmp_path / "npy"), "-q"])
    assert r.exit_code == 2 and "holes of a sparse file" in r.output, r.output
    assert not any(f.endswith(".npy") for _, _, fs in os.walk(tmp_path / "npy") for f in fs)


@pytest.mark.parametrize("value", ["abc", "float32", "1.5"])
def test_report_refuses_a_result_csv_whose_seqid_is_not_a_number(dumps, tmp_path, value):
    import glob

    import pandas as pd

    golden, target = dumps
    assert runner.invoke(app, ["compare", "-m", target, "-g", golden, "-out", str(tmp_path / "c"), "-q"]).exit_code == 1
    csv = glob.glob(str(tmp_path / "c" / "*.csv"))[0]
    table = pd.read_csv(csv, dtype=str, keep_default_na=False)
    table.loc[len(table) // 2, "SeqId"] = value
    table.to_csv(csv, index=False)
    line = _refused(["report", csv, "-out", str(tmp_path / "r"), "-q", "--format", "html"], csv)
    assert "SeqId" in line


def test_a_storage_offset_that_is_not_one_integer_is_refused(dumps, tmp_path):
    golden, _ = dumps
    path = _copy(golden, tmp_path)
    victim = _make_view(path, "string")
    with h5py.File(path, "a") as h5:          # a view of a real tensor, with a bad offset
        base = _first(path, lambda n, o: isinstance(o, h5py.Dataset) and n.endswith("input/self"))
        h5[victim][()] = h5[base].ref
        h5[victim].attrs[S.ATTR_STORAGE_OFFSET] = [1 << 40]
    assert "storage_offset" in _refused(["ls", path, "--stats", "--plain"], path)


@pytest.mark.parametrize("dtype", ["longdouble", "int64"])
def test_a_dtype_attribute_that_is_not_the_stored_data_is_refused_by_torch_readers(dumps, tmp_path, dtype):
    """Fuzzer findings: `npu_dumper.load(as_torch=True)` raised KeyError for a dtype no torch
    has; replay (ir2tbe map) cast float data to int64 and the kernel failed (exit 3)."""
    pytest.importorskip("torch")
    import npu_dumper
    from npu_dumper.replay.recorded import NotReplayable, tensor_from_record

    golden, _ = dumps
    path = _copy(golden, tmp_path)
    with h5py.File(path, "a") as h5:
        victim = _first(path, lambda n, o: isinstance(o, h5py.Dataset) and n.endswith("output/result"))
        h5[victim].attrs[S.ATTR_DTYPE] = dtype
    # load's torch tensors; replay's reads go through the plain reader (DumpFile)
    with (npu_dumper.load(path, as_torch=True) if dtype == "longdouble" else DumpFile(path)) as f:
        rec = next(r for op in f.ops() for r in op.outputs().values() if r.path == "/" + victim)
        with pytest.raises(DumpFormatError if dtype == "longdouble" else NotReplayable, match=dtype):
            rec.read() if dtype == "longdouble" else tensor_from_record(rec)


def test_deeply_nested_op_json_attributes_are_not_read(tmp_path):
    """made_inputs / scalar_args nested thousands of levels (a hostile edit): compare reads
    them as absent (bounded JSON), never a RecursionError."""
    import h5py
    import numpy as np

    from accucmp.compare.pipeline import compare_dumps
    from accucmp.compare.verdict import apply_verdict
    from tests._compare_helpers import write_dump

    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    ops = [dict(op="aten.relu.default", seqid=1, inputs={"self": a}, outputs={"result": a})]
    write_dump(tmp_path / "g.h5", ops)
    write_dump(tmp_path / "t.h5", ops)
    with h5py.File(tmp_path / "t.h5", "a") as f:
        f["/aten.relu.default/1"].attrs["made_inputs"] = "[" * 5000 + "]" * 5000
        f["/aten.relu.default/1"].attrs["scalar_args"] = "{\"a\":" * 3000 + "1" + "}" * 3000
    t = apply_verdict(compare_dumps(str(tmp_path / "t.h5"), str(tmp_path / "g.h5")).table)
    assert (t["Result"] == "pass").all()


def test_load_replay_refuses_a_group_where_its_catalog_says_tensor(tmp_path):
    """The catalog (read at load-replay's entry instead of the groups) says tensor where an
    edit left a group: the transposed weight (addmm's mat2, replayed laid out as recorded)
    was read as a dataset and the user's step died of h5py's TypeError (fuzzer, seed 1)."""
    torch = pytest.importorskip("torch")
    import npu_dumper
    from npu_dumper.errors import DumperError

    path = str(tmp_path / "golden.h5")
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16),
                            torch.nn.Linear(16, 4))
    x = torch.randn(3, 8)
    with npu_dumper.dumper(use_dump=True, dump_path=path):
        m(x).softmax(-1).sum().backward()
    found = []
    with h5py.File(path, "r") as h5:
        h5.visit(lambda n: found.append(n) if n.startswith("aten.addmm.default/") and n.endswith("/input/mat2")
                 else None)
    # (the second Linear's: a catalog's offsets are checked on a sample, first and last included)
    mat2 = sorted(found, key=lambda n: int(n.split("/")[1]))[-1]
    with h5py.File(path, "a") as h5:
        attrs = dict(h5[mat2].attrs)
        del h5[mat2]
        g = h5.create_group(mat2)
        for k, v in attrs.items():
            g.attrs[k] = v
    with pytest.raises(DumperError) as e:
        with npu_dumper.dumper(use_load=True, load_file_path=path, dump_path=str(tmp_path / "r.h5")):
            m(x).softmax(-1).sum().backward()
    assert str(e.value).startswith(f"{path}: /{mat2}: a group where a value of Type 0"), e.value
