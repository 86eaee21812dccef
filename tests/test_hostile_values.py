"""A dataset where a tensor is expected that holds no numbers (compound, reference, opaque,
string, vlen: what a hostile or damaged file may hold): every read of it is one line naming
the file and the dataset, exit 2, never numpy's TypeError as an internal error."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
from typer.testing import CliRunner

from accucmp.cli.main import app
from dumpfile import DumpFile, DumpFormatError

from . import hostile_corpus
from ._cli_helpers import model_ops, write_dump

runner = CliRunner(env={"COLUMNS": "160", "NO_COLOR": "1"})

STORED = {
    "compound": np.dtype([("a", "<f4"), ("b", "<i4")]),
    "object_reference": h5py.ref_dtype,
    "opaque": np.dtype("V4"),
    "vlen_floats": h5py.vlen_dtype(np.float32),
    "vlen_string": h5py.string_dtype(),
    "fixed_string": np.dtype("S4"),
}


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return write_dump(tmp_path_factory.mktemp("values") / "good.h5", model_ops(n_layers=1))


@pytest.mark.parametrize("kind", sorted(STORED))
def test_a_tensor_stored_as_no_numbers_is_refused(good, tmp_path, kind):
    bad = tmp_path / f"{kind}.h5"
    bad.write_bytes(open(good, "rb").read())
    hostile_corpus._replace(str(bad), lambda h5, p, name, a, shp, dt: p.create_dataset(
        name, shape=shp, dtype=STORED[kind]))
    where = f"{bad}: {hostile_corpus.VICTIM}: stored as "
    with DumpFile(bad) as f:
        rec = f.op("aten.mm.default", 1).outputs()["result"]
        with pytest.raises(DumpFormatError, match="^" + where.replace("[", r"\[")):
            rec.read()
        with pytest.raises(DumpFormatError, match="not numbers"):
            list(rec.iter_chunks(8))
    r = runner.invoke(app, ["ls", str(bad), "--plain", "--stats"])
    assert r.exit_code == 2, r.output
    line = r.output.strip()
    assert len(line.splitlines()) == 1 and line.startswith(f"accucmp: error: {where}"), line
    assert "Traceback" not in line and "internal error" not in line


@pytest.mark.parametrize("shape", ["4,16", np.array([-4, 16]), np.array([4.5, 16.0]), np.array([[4, 16]])],
                         ids=["string", "negative", "floats", "2-d"])
def test_a_shape_attribute_that_is_not_sizes_is_refused(good, tmp_path, shape):
    """int() of a string shape raised as an internal error; a negative size was listed."""
    bad = tmp_path / "bad.h5"
    bad.write_bytes(open(good, "rb").read())
    with h5py.File(bad, "a") as h:
        h[hostile_corpus.VICTIM].attrs["shape"] = shape
    r = runner.invoke(app, ["ls", str(bad), "--plain", "--stats"])
    assert r.exit_code == 2, r.output
    line = r.output.strip()
    assert len(line.splitlines()) == 1, line
    assert line.startswith(f"accucmp: error: {bad}: {hostile_corpus.VICTIM}: its shape attribute "), line
    assert line.endswith("is not a list of sizes (integers >= 0); refused"), line


@pytest.mark.parametrize("code", ["zero", 2.5, np.array([1, 2])], ids=["string", "float", "array"])
def test_a_type_attribute_that_is_not_an_integer_code_is_refused(good, tmp_path, code):
    """int() of a string Type raised as an internal error (ls --stats, extract, export);
    a float was truncated into another kind of value."""
    bad = tmp_path / "bad.h5"
    bad.write_bytes(open(good, "rb").read())
    with h5py.File(bad, "a") as h:
        h[hostile_corpus.VICTIM].attrs["Type"] = code
    for args in (["ls", str(bad), "--plain", "--stats"],
                 ["extract", "-i", str(bad), "-o", str(tmp_path / "x.h5"), "-s", hostile_corpus.VICTIM_OP]):
        r = runner.invoke(app, args)
        assert r.exit_code == 2, (args, r.output)
        line = r.output.strip()
        assert len(line.splitlines()) == 1, line
        assert line.startswith(f"accucmp: error: {bad}: {hostile_corpus.VICTIM}: its Type attribute "), line
        assert line.endswith("is not an integer code; refused"), line


def test_a_catalog_row_nested_past_the_parser_is_walked_instead(good, tmp_path):
    """json.loads of 100k nested brackets raised RecursionError: an internal error in ls,
    compare and calibrate. A row that does not parse is malformed: its op is walked."""
    bad = tmp_path / "deep.h5"
    bad.write_bytes(open(good, "rb").read())
    with h5py.File(bad, "a") as h:
        h["/_npu_dumper/catalog"][0] = "[" * 100000 + "]" * 100000
    for args in (["ls", str(bad), "--plain"], ["ls", str(bad), "--plain", "--stats"]):
        r, want = runner.invoke(app, args), runner.invoke(app, [a if a != str(bad) else good for a in args])
        assert r.exit_code == 0 == want.exit_code, r.output
        assert r.output.replace(str(bad), "X") == want.output.replace(good, "X")
    r = runner.invoke(app, ["compare", "-m", str(bad), "-g", good, "-o", str(tmp_path / "c"), "-q"])
    assert r.exit_code == 0, r.output


def test_an_index_that_is_not_a_table_of_ops_is_refused(good, tmp_path):
    """An index of floats: numpy's IndexError was an internal error in every command."""
    bad = tmp_path / "index.h5"
    bad.write_bytes(open(good, "rb").read())
    with h5py.File(bad, "a") as h:
        del h["/_npu_dumper/index"]
        h["/_npu_dumper/index"] = np.arange(15, dtype="f4")
    for args in (["ls", str(bad), "--plain"], ["compare", "-m", good, "-g", str(bad), "-o", str(tmp_path / "c")]):
        r = runner.invoke(app, args)
        assert r.exit_code == 2, (args, r.output)
        line = r.output.strip()
        assert len(line.splitlines()) == 1 and line.startswith(f"accucmp: error: {bad}: _npu_dumper/index: not an op index"), line


def test_a_named_datatype_among_an_ops_values_is_refused(good, tmp_path):
    """A committed datatype in an op's input group was taken for a dataset ('Datatype'
    object has no attribute 'ndim': an internal error in ls --stats and whatif)."""
    bad = tmp_path / "named.h5"
    bad.write_bytes(open(good, "rb").read())
    with h5py.File(bad, "a") as h:
        h["/aten.mm.default/1/input/weird"] = np.dtype("<f4")
    for args in (["ls", str(bad), "--plain", "--stats"], ["compare", "-m", str(bad), "-g", good, "-o", str(tmp_path / "c")]):
        r = runner.invoke(app, args)
        assert r.exit_code == 2, (args, r.output)
        line = r.output.strip()
        assert len(line.splitlines()) == 1, line
        assert line == (f"accucmp: error: {bad}: /aten.mm.default/1/input/weird is a named datatype where "
                        "an op's value is expected; refused"), line


def test_a_tensor_with_a_null_dataspace_is_refused_where_read(good, tmp_path):
    """A null dataspace (h5py.Empty: no shape, no elements) where a tensor is expected:
    extract's size count and export's copy raised internal errors; compare -p aborted its
    outputs. Reading it is refused in one line; compare keeps the row as failing."""
    bad = tmp_path / "null.h5"
    bad.write_bytes(open(good, "rb").read())
    hostile_corpus._replace(str(bad), lambda h5, p, name, a, shp, dt: p.create_dataset(
        name, data=h5py.Empty("<f4")))
    with DumpFile(bad) as f:
        with pytest.raises(DumpFormatError, match="null dataspace"):
            f.op("aten.mm.default", 1).outputs()["result"].read()
    r = runner.invoke(app, ["export", "-i", str(bad), "-o", str(tmp_path / "e.h5")])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
    assert f"{bad}: {hostile_corpus.VICTIM}: stored with a null dataspace" in r.output
    r = runner.invoke(app, ["extract", "-i", str(bad), "-o", str(tmp_path / "x.h5"), "-s", hostile_corpus.VICTIM_OP, "-q"])
    assert r.exit_code == 0, r.output
    with h5py.File(tmp_path / "x.h5") as h:            # copied as it is
        assert h[hostile_corpus.VICTIM].shape is None
    r = runner.invoke(app, ["compare", "-m", str(bad), "-g", good, "-o", str(tmp_path / "c"), "-p", "-q"])
    assert r.exit_code == 1, r.output
    (failed,) = (tmp_path / "c").glob("result_*_failed.csv")
    assert hostile_corpus.VICTIM.lstrip("/") in failed.read_text() or hostile_corpus.VICTIM in failed.read_text()


def test_extract_refuses_a_soft_link_back_to_its_own_op(good, tmp_path):
    """A tensor replaced by a soft link to its op's name group: extract copied the group
    into itself until RecursionError (an internal error)."""
    bad = tmp_path / "cycle.h5"
    bad.write_bytes(open(good, "rb").read())
    with h5py.File(bad, "a") as h:
        del h[hostile_corpus.VICTIM]
        h[hostile_corpus.VICTIM] = h5py.SoftLink("/aten.mm.default")
    r = runner.invoke(app, ["extract", "-i", str(bad), "-o", str(tmp_path / "x.h5"), "-s", hostile_corpus.VICTIM_OP, "-q"])
    assert r.exit_code == 2, r.output
    line = r.output.strip()
    assert len(line.splitlines()) == 1 and line.startswith(f"accucmp: error: {bad}: "), line
    assert line.endswith("a soft link back to a group that contains it (a cycle); refused"), line
    assert not (tmp_path / "x.h5").exists()


def test_whatif_refuses_a_shape_attribute_that_disagrees_with_the_data(good, tmp_path):
    """whatif blocked the stored values by the declared shape's last dimension: a shape
    bigger than the data was numpy's reshape error, an internal error."""
    bad = tmp_path / "lies.h5"
    bad.write_bytes(open(good, "rb").read())
    with h5py.File(bad, "a") as h:
        h[hostile_corpus.VICTIM].attrs["shape"] = np.array([400, 1600])
    r = runner.invoke(app, ["whatif", str(bad), "-o", str(tmp_path / "w"), "-q"])
    assert r.exit_code == 2, r.output
    line = r.output.strip()
    assert len(line.splitlines()) == 1, line
    assert line.startswith(f"accucmp: error: {bad}: {hostile_corpus.VICTIM}: shape attribute (400,1600)"), line
    assert line.endswith("disagrees with the stored data (64 elements)"), line
