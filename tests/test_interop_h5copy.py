"""The guide's `h5copy -s /op/seqid/` of ONE op group on a default dump, then `ir2tbe run`:
the copied group holds its inputs' values (a view whose base lives in another op's group
names a hard link to it in its own op group, dumpfile.write.writer._local_base); where
a copy lacks the base (a dump of format 1.4), ir2tbe exits 2 naming it, never 0 having
mapped 0 ops."""

from __future__ import annotations

import shutil
import subprocess

import h5py
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from dumpfile import schema as S
from tests.test_ir2tbe_kernels import GUIDE_ACL_JSON

pytestmark = pytest.mark.skipif(shutil.which("h5copy") is None,
                                reason="h5copy not installed (apt-get install hdf5-tools)")


def _dump_and_copy_gelu(tmp_path, monkeypatch):
    import npu_dumper  # noqa: F401  installs torch.utils.dumper
    from dumpfile import DumpFile

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("ACL_DUMP_DATA", raising=False)
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    x = torch.randn(2, 3, 8)           # 3-d: Linear's addmm output reaches gelu as a view
    with torch.utils.dumper(use_dump=True, dump_path="./dump.h5"):
        m(x).sum().backward()
    with DumpFile("dump.h5") as df:
        gelu = next(o for o in df.ops() if o.op == "aten.gelu.default")
        rec = gelu.inputs()["self"]
        assert rec.type == S.TYPE_TENSOR_VIEW and "aten.addmm.default" in rec.attrs[S.ATTR_BASE]
        want = rec.read()
    group = f"/aten.gelu.default/{gelu.seqid}/"
    subprocess.run(["h5copy", "-pv", "-i", "dump.h5", "-o", "output.h5", "-s", group, "-d", group],
                   check=True, capture_output=True)
    (tmp_path / "acl.json").write_text(GUIDE_ACL_JSON, encoding="utf-8")
    return group, want


def test_h5copy_of_one_op_then_ir2tbe_maps_it(tmp_path, monkeypatch):
    from dumpfile import DumpFile
    from ir2tbe.cli import app

    _, want = _dump_and_copy_gelu(tmp_path, monkeypatch)
    with DumpFile("output.h5") as f:            # the copy alone holds gelu's input values
        (op,) = f.ops()
        np.testing.assert_array_equal(op.inputs()["self"].read(), want)
    r = CliRunner().invoke(app, ["run", "output.h5", "--acl-config", "acl.json"])
    assert r.exit_code == 0, r.output
    assert "mapped 1 op(s)" in r.output


def test_ir2tbe_exits_2_naming_the_missing_base(tmp_path, monkeypatch):
    from ir2tbe.cli import app

    group, _ = _dump_and_copy_gelu(tmp_path, monkeypatch)
    with h5py.File("output.h5", "a") as f:      # as a copy of a format-1.4 dump: no _base| links
        for k in [k for k in f[group].keys() if k.startswith(S.OP_BASE_LINK_PREFIX)]:
            del f[group + k]
    r = CliRunner().invoke(app, ["run", "output.h5", "--acl-config", "acl.json"])
    assert r.exit_code == 2, r.output
    assert "mapped 0 of 1 op(s)" in r.output and "aten.addmm.default" in r.output, r.output
