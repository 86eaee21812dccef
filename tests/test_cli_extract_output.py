"""`accucmp extract -o OUT` where OUT cannot take the ops: refused in one line (exit 2),
OUT untouched; and `accucmp ls ... | head`: output cut off by its reader ends quietly."""

from __future__ import annotations

import subprocess
import sys

import h5py
import numpy as np
import pytest
from typer.testing import CliRunner

from accucmp.cli.main import app
from dumpfile import DumpFile, DumpWriter, TensorMeta
from dumpfile import schema as S

from ._cli_helpers import model_ops, write_dump

runner = CliRunner(env={"COLUMNS": "120", "NO_COLOR": "1"})


@pytest.fixture
def dump(tmp_path):
    return write_dump(tmp_path / "in.h5", model_ops())


def _extract(src, out, *args):
    return runner.invoke(app, ["extract", "-i", str(src), "-o", str(out), "-s", "/aten.relu.default/3/", *args])


def _refused(r, out, before: bytes, *words):
    assert r.exit_code == 2, r.output
    msg = r.output.strip()
    assert len(msg.splitlines()) == 1 and "Traceback" not in msg, msg
    assert msg.startswith(f"accucmp: error: {out}: "), msg
    for w in words:
        assert w in msg, msg
    assert out.read_bytes() == before   # untouched


def test_extract_refuses_a_statistics_only_table_dump(dump, tmp_path):
    """A statistics-only dump (format 1.1) keeps its ops in tables, not groups: rebuilding
    it as OUT kept only the copied op and dropped all of its own."""
    torch = pytest.importorskip("torch")
    import npu_dumper

    out = tmp_path / "stats.h5"
    x = torch.randn(4, 4)
    with npu_dumper.dumper(use_dump=True, dump_path=str(out), stats_only=True):
        torch.relu(torch.mm(x, x))
    with DumpFile(out) as f:
        n_ops = len(f)
    before = out.read_bytes()
    _refused(_extract(dump, out), out, before, "statistics-only")
    with DumpFile(out) as f:
        assert len(f) == n_ops


def test_extract_refuses_a_statistics_only_tree_dump(dump, tmp_path):
    # format 1.0 layout (op groups holding statistics): appending tensors would mix kinds
    out = tmp_path / "stats10.h5"
    with DumpWriter(out, root_attrs={S.ROOT_STATS_ONLY: True}) as w:
        g = w.begin_op("aten.mm.default", 1)
        w.write_stats(g["output"], "result", [-1.0, 2.0, 0.5, 1.0, 10.0, 0, 0, 100], TensorMeta("float32", (10, 10)))
        w.end_op()
    before = out.read_bytes()
    _refused(_extract(dump, out), out, before, "statistics-only")


def test_extract_refuses_an_hdf5_file_that_is_not_a_dump(dump, tmp_path):
    out = tmp_path / "other.h5"
    with h5py.File(out, "w") as h:
        h["weights"] = np.arange(4.0)
    before = out.read_bytes()
    _refused(_extract(dump, out), out, before, "not a dump")


def test_extract_still_appends_to_a_full_dump(dump, tmp_path):
    out = tmp_path / "full.h5"
    write_dump(out, model_ops(seed=1)[:2])
    r = _extract(dump, out)
    assert r.exit_code == 0, r.output
    with DumpFile(out) as f:
        assert [(o.op, o.seqid) for o in f.ops()] == [("aten.mm.default", 1), ("aten.add.Tensor", 2),
                                                     ("aten.relu.default", 3)]


def test_extract_into_a_missing_directory_names_the_output(dump, tmp_path):
    out = tmp_path / "nonexist" / "x.h5"
    r = _extract(dump, out)
    assert r.exit_code == 2, r.output
    msg = r.output.strip()
    assert len(msg.splitlines()) == 1, msg
    assert str(out) in msg and f"directory {out.parent} does not exist" in msg, msg
    assert ".accucmp_extract_" not in msg    # the temporary file is ours, not the user's


def test_ls_cut_off_by_head_ends_quietly(tmp_path):
    """`accucmp ls big.h5 | head -1`: once the reader is gone, no message, no exit 2."""
    path = tmp_path / "many.h5"
    x = np.arange(4, dtype=np.float32)
    with DumpWriter(path) as w:
        for i in range(1, 3001):   # ~200 KiB of listing: more than a pipe holds
            g = w.begin_op("aten.sin.default", i)
            w.write_tensor(g["output"], "result", x, TensorMeta("float32", (4,), (1,)))
            w.end_op()
    p = subprocess.Popen([sys.executable, "-m", "accucmp.cli.main", "ls", str(path), "--plain"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = p.stdout.readline()
    p.stdout.close()                  # what `head -1` does after its line
    err = p.stderr.read().decode()
    rc = p.wait(timeout=600)
    assert first.startswith(str(path).encode())
    assert err == "", err
    assert rc in (0, 141)
