"""The guide's `h5copy -s /op/seqid/` of ONE op group on a default dump, then `ir2tbe run`:
the copied group holds its inputs' values (a view whose base lives in another op's group
is stored as data, npu_dumper.writer_thread.VIEW_COPY_MAX_BYTES); where it does not,
ir2tbe exits 2 naming the missing base, never 0 having mapped 0 ops."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch
from typer.testing import CliRunner

from tests.test_ir2tbe_kernels import GUIDE_ACL_JSON

pytestmark = pytest.mark.skipif(shutil.which("h5copy") is None,
                                reason="h5copy not installed (apt-get install hdf5-tools)")


def _dump_and_copy_gelu(tmp_path, monkeypatch, bound: int):
    import npu_dumper  # noqa: F401  installs torch.utils.dumper
    import npu_dumper.writer_thread as WT
    from dumpfile import DumpFile

    monkeypatch.setattr(WT, "VIEW_COPY_MAX_BYTES", bound)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("ACL_DUMP_DATA", raising=False)
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    x = torch.randn(2, 3, 8)           # 3-d: Linear's addmm output reaches gelu as a view
    with torch.utils.dumper(use_dump=True, dump_path="./dump.h5"):
        m(x).sum().backward()
    with DumpFile("dump.h5") as df:
        gelu = next(o for o in df.ops() if o.op == "aten.gelu.default")
        kind = gelu.inputs()["self"].type
    subprocess.run(["h5copy", "-pv", "-i", "dump.h5", "-o", "output.h5", "-s", f"/aten.gelu.default/{gelu.seqid}/",
                    "-d", f"/aten.gelu.default/{gelu.seqid}/"], check=True, capture_output=True)
    (tmp_path / "acl.json").write_text(GUIDE_ACL_JSON, encoding="utf-8")
    return kind


def test_h5copy_of_one_op_then_ir2tbe_maps_it(tmp_path, monkeypatch):
    from dumpfile import schema as S
    from ir2tbe.cli import app

    kind = _dump_and_copy_gelu(tmp_path, monkeypatch, 64 << 20)
    assert kind == S.TYPE_TENSOR           # stored as data in gelu's own group
    r = CliRunner().invoke(app, ["run", "output.h5", "--acl-config", "acl.json"])
    assert r.exit_code == 0, r.output
    assert "mapped 1 op(s)" in r.output


def test_ir2tbe_exits_2_naming_the_missing_base(tmp_path, monkeypatch):
    from dumpfile import schema as S
    from ir2tbe.cli import app

    kind = _dump_and_copy_gelu(tmp_path, monkeypatch, 0)     # bound 0: views kept
    assert kind == S.TYPE_TENSOR_VIEW
    r = CliRunner().invoke(app, ["run", "output.h5", "--acl-config", "acl.json"])
    assert r.exit_code == 2, r.output
    assert "mapped 0 of 1 op(s)" in r.output and "aten.addmm.default" in r.output, r.output
