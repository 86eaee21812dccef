"""The guide's IR-to-TBE workflow end to end: dump -> extract -> acl.json ->
load_with_acl_dump (and `ir2tbe run`) -> accucmp convert to npy and txt."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from ir2tbe.acl_dump import read_map
from ir2tbe.dump_data import read_kernel_dump
from tests.test_ir2tbe_kernels import GUIDE_ACL_JSON


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16),
                               torch.nn.Linear(16, 4))


def _step(m, x):
    loss = m(x).softmax(-1).sum()
    loss.backward()
    return loss


def _extract(src, dst, op, seqid):
    """h5copy as the guide does; our own extract when h5copy is not installed."""
    if shutil.which("h5copy"):
        subprocess.run(["h5copy", "-pv", "-i", str(src), "-o", str(dst), "-s", f"/{op}/{seqid}/",
                        "-d", f"/{op}/{seqid}/"], check=True, capture_output=True)
    else:   # pragma: no cover
        import h5py
        with h5py.File(src, "r") as a, h5py.File(dst, "a") as b:
            a.copy(a[f"/{op}/{seqid}"], b.require_group(op), name=str(seqid))


@pytest.fixture
def extracted(tmp_path, monkeypatch):
    import npu_dumper  # noqa: F401  installs torch.utils.dumper
    from dumpfile import DumpFile

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("ACL_DUMP_DATA", raising=False)
    m, x = _model(), torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    with torch.utils.dumper(use_dump=True, dump_path="./dump.h5"):
        _step(m, x)
    with DumpFile("dump.h5") as df:
        ops = {o.op: o.seqid for o in df.ops()}
    picked = {op: ops[op] for op in ("aten.gelu.default", "aten.native_layer_norm.default")}
    for op, seqid in picked.items():
        _extract("dump.h5", "output.h5", op, seqid)
    (tmp_path / "acl.json").write_text(GUIDE_ACL_JSON, encoding="utf-8")
    m.zero_grad()
    return m, x, picked


def test_load_with_acl_dump_then_convert(extracted, tmp_path):
    from accucmp.cli.main import app
    from ir2tbe.acl_config import AclConfigWarning

    m, x, picked = extracted
    plain = _model()
    expected = _step(plain, x)
    with pytest.warns(AclConfigWarning):
        with torch.utils.dumper(use_load=True, dump_path="./", load_file_path="./output.h5",
                                load_with_acl_dump=True):
            loss = _step(m, x)
    # the model computes exactly what it computes without the tool
    assert torch.equal(loss, expected)
    for p, q in zip(m.parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad)

    maps = glob.glob("output_IR2TBE/*/ir2tbe_map.csv")
    assert len(maps) == 1
    rows = read_map(maps[0])
    assert {(r["ir_op"], int(r["seqid"])) for r in rows} == set(picked.items())
    root = os.path.dirname(maps[0])
    for r in rows:      # every kernel file leads back to its IR op and seqid
        d = read_kernel_dump(os.path.join(root, r["file"]))
        assert d.op_name == r["kernel_op"]
        assert all(o.original_op == r["ir_op"] for o in d.outputs)
        assert r["file"].split(os.sep)[1] == r["seqid"]
    gelu_rows = [r for r in rows if r["ir_op"] == "aten.gelu.default"]
    assert "prims.erf.default" in [r["kernel_op"] for r in gelu_rows]

    # the recorded gelu input (from output.h5) is what the first gelu kernel received
    from dumpfile import DumpFile
    with DumpFile("output.h5") as df:
        recorded_in = df.op("aten.gelu.default", picked["aten.gelu.default"]).inputs()["self"].read()
    first = read_kernel_dump(os.path.join(root, gelu_rows[0]["file"]))
    np.testing.assert_array_equal(first.inputs[0].array(), recorded_in)

    r = CliRunner().invoke(app, ["convert", "-d", "output_IR2TBE", "-out", "npy_out", "--format", "both"])
    assert r.exit_code == 0, r.output
    erf_file = os.path.basename(next(x["file"] for x in gelu_rows if x["kernel_op"] == "prims.erf.default"))
    got = np.load(f"npy_out/{erf_file}.output.0.npy")
    erf_in = np.load(f"npy_out/{erf_file}.input.0.npy")
    np.testing.assert_allclose(got, torch.erf(torch.from_numpy(erf_in)).numpy(), rtol=0, atol=0)
    np.testing.assert_allclose(np.loadtxt(f"npy_out/{erf_file}.output.0.txt"), got.reshape(-1), rtol=1e-7)


def test_acl_dump_refused_with_env(extracted, monkeypatch):
    from npu_dumper.errors import DumperError

    m, x, _ = extracted
    monkeypatch.setenv("ACL_DUMP_DATA", "1")
    with pytest.raises(DumperError, match="ACL_DUMP_DATA=1"):
        with torch.utils.dumper(use_load=True, dump_path="./", load_file_path="./output.h5",
                                load_with_acl_dump=True):
            _step(m, x)


def test_ir2tbe_run_cli_without_model(extracted, monkeypatch):
    from ir2tbe.cli import app

    monkeypatch.setenv("COLUMNS", "120")
    with open("strict.json", "w") as f:
        f.write('{"dump": {"dump_path": "./kd", "dump_mode": "output", "dump_op_switch": "on"}}')
    r = CliRunner().invoke(app, ["run", "output.h5", "--acl-config", "strict.json", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    assert "mapped 2 op(s)" in r.output
    rows = read_map(glob.glob("kd/*/ir2tbe_map.csv")[0])
    assert {r_["ir_op"] for r_ in rows} == {"aten.gelu.default", "aten.native_layer_norm.default"}
    root = os.path.dirname(glob.glob("kd/*/ir2tbe_map.csv")[0])
    d = read_kernel_dump(os.path.join(root, rows[0]["file"]))
    assert d.inputs == [] and len(d.outputs) >= 1          # dump_mode "output"
    r = CliRunner().invoke(app, ["map", "layer_norm", "-i", "output.h5"])
    assert r.exit_code == 0 and "prims.rsqrt.default" in r.output
    r = CliRunner().invoke(app, ["run", "missing.h5", "--acl-config", "strict.json"])
    assert r.exit_code == 2 and "missing.h5" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(app, ["run", "output.h5", "--acl-config", "nope.json"])
    assert r.exit_code == 2 and "nope.json: no such file" in r.output


def test_ir2tbe_run_refuses_a_dump_without_inputs(extracted, monkeypatch):
    """A load-replay dump stores outputs only: nothing to replay, said in one line (exit 2)
    instead of 'mapped 0 op(s)'."""
    from ir2tbe.cli import app

    m, x, _ = extracted
    with torch.utils.dumper(use_load=True, load_file_path="dump.h5", dump_path="replay.h5"):
        _step(m, x)
    r = CliRunner().invoke(app, ["run", "replay.h5", "--acl-config", "acl.json"], terminal_width=200)
    assert r.exit_code == 2, r.output
    assert "replay.h5: holds no op inputs" in r.output and "Traceback" not in r.output


def test_ir2tbe_map_of_an_op_that_cannot_run_on_its_recorded_inputs_is_one_line(extracted, monkeypatch):
    """A file whose gelu input says complex32 (the fuzzer's seed 29: a dtype attribute
    edited): gelu has no complex-half kernel, and `map` ended with an internal error (exit 3).
    Now one line naming the file, the op and why, exit 2, as `run` reports such an op."""
    import h5py

    from dumpfile import schema as S
    from ir2tbe.cli import app

    shutil.copy("output.h5", "edited.h5")
    with h5py.File("edited.h5", "r+") as h5:
        seq = next(iter(h5["aten.gelu.default"]))
        h5[f"aten.gelu.default/{seq}/input/self"].attrs[S.ATTR_DTYPE] = "complex32"
    r = CliRunner().invoke(app, ["map", "gelu", "-i", "edited.h5"], terminal_width=200)
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and "edited.h5: aten.gelu.default" in lines[0] and "failed to run on cpu" in lines[0], \
        r.output
    assert "internal error" not in r.output and "Traceback" not in r.output
