"""Dumps damaged inside (bytes overwritten in the middle, the size unchanged): every
command names the damaged file in one line and exits 2, and never reads damage as
"no values here" (h5py's .get()/.items() answer None for an object they cannot open)."""

from __future__ import annotations

import os
import random
import shutil

import h5py
import pytest
from typer.testing import CliRunner

from accucmp.cli.main import app
from dumpfile import DumpFile
from dumpfile.errors import DumpFormatError

from ._cli_helpers import model_ops, write_dump

runner = CliRunner(env={"COLUMNS": "120", "NO_COLOR": "1"})


@pytest.fixture
def good(tmp_path):
    return write_dump(tmp_path / "good.h5", model_ops())


def _damage_object(src, dst, h5path: str) -> None:
    """Copy `src` to `dst` and overwrite the object header of `h5path` with garbage: a
    deterministic stand-in for a disk or transfer error hitting file metadata."""
    shutil.copy(src, dst)
    with h5py.File(dst, "r") as h:
        addr = h5py.h5o.get_info(h[h5path].id).addr
    with open(dst, "r+b") as f:
        f.seek(addr)
        f.write(b"\xa5" * 64)


def _one_line_naming(result, path) -> str:
    msg = result.output.strip()
    assert len(msg.splitlines()) == 1, msg
    assert "Traceback" not in msg
    assert msg.startswith(f"accucmp: error: {path}: corrupt or unreadable dump ("), msg
    return msg


# the input group of one op (its values would vanish from a listing), a whole op group
# (the op would vanish), and a tensor (its value unreadable)
DAMAGED = ["/aten.add.Tensor/5/input", "/aten.relu.default/6", "/aten.mm.default/4/output/result"]


@pytest.mark.parametrize("h5path", DAMAGED)
def test_ls_names_the_damaged_file(good, tmp_path, h5path):
    bad = tmp_path / "bad.h5"
    _damage_object(good, bad, h5path)
    r = runner.invoke(app, ["ls", str(bad), "--plain", "--stats"])
    assert r.exit_code == 2, r.output
    _one_line_naming(r, bad)
    # without --stats the listing reads the catalog and nothing under the op groups
    # (dumpfile.read.safety.check_listing): the damage is not reached, and the damaged op is
    # listed as the catalog recorded it, not dropped
    r = runner.invoke(app, ["ls", str(bad), "--plain"])
    assert r.exit_code == 0, r.output
    op, seqid = h5path.split("/")[1:3]
    assert f"\n{seqid}\t{op}\t" in r.output and len(r.output.strip().splitlines()) == 2 + 15, r.output


@pytest.mark.parametrize("h5path", DAMAGED)
@pytest.mark.parametrize("jobs", ["1", "2"])
def test_compare_names_the_damaged_side(good, tmp_path, h5path, jobs):
    bad = tmp_path / "bad.h5"
    _damage_object(good, bad, h5path)
    for mine, golden in ((good, bad), (bad, good)):
        r = runner.invoke(app, ["compare", "-m", str(mine), "-g", str(golden), "-o", str(tmp_path / "cmp"),
                                "-q", "-j", jobs])
        assert r.exit_code == 2, r.output
        msg = _one_line_naming(r, bad)
        assert str(good) not in msg


@pytest.mark.parametrize("h5path", DAMAGED)
def test_extract_names_a_damaged_input_or_output(good, tmp_path, h5path):
    bad = tmp_path / "bad.h5"
    _damage_object(good, bad, h5path)
    out = tmp_path / "out.h5"
    every_op = [a for op in ("aten.mm.default", "aten.add.Tensor", "aten.relu.default") for a in ("-s", f"/{op}/")]
    r = runner.invoke(app, ["extract", "-i", str(bad), "-o", str(out), *every_op])
    assert r.exit_code == 2, r.output
    _one_line_naming(r, bad)
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".accucmp_extract_")]
    # appending to a damaged OUT: rebuilding it would drop what cannot be read
    before = bad.read_bytes()
    r = runner.invoke(app, ["extract", "-i", str(good), "-o", str(bad), "-s", "/aten.mm.default/1/",
                            "-d", "/aten.mm.default/100/"])
    assert r.exit_code == 2, r.output
    _one_line_naming(r, bad)
    assert bad.read_bytes() == before


def test_reader_records_raise_dump_format_error_naming_the_file(good, tmp_path):
    bad = tmp_path / "bad.h5"
    _damage_object(good, bad, "/aten.add.Tensor/5/input")
    # the open walks every link and dataset (dumpfile.read.safety) and meets the damage there;
    # a damaged object it does not reach would raise at the read instead
    with pytest.raises(DumpFormatError, match=f"^{bad}: corrupt or unreadable dump"):
        with DumpFile(bad) as f:
            f.op("aten.add.Tensor", 5).inputs()


def test_damage_anywhere_is_named_or_harmless(good, tmp_path):
    """2 KiB of random bytes at 5%..95% of the file: every command either succeeds (the
    damage hit tensor bytes or free space: no HDF5 check can see it) or names the file."""
    bad = tmp_path / "bad.h5"
    size = os.path.getsize(good)
    named = 0
    for pct in range(5, 100, 10):
        shutil.copy(good, bad)
        with open(bad, "r+b") as f:
            f.seek(size * pct // 100)
            f.write(random.Random(pct).randbytes(2048))
        for args in (["ls", str(bad), "--plain", "--stats"],
                     ["compare", "-m", good, "-g", str(bad), "-o", str(tmp_path / "cmp"), "-q"],
                     ["extract", "-i", str(bad), "-o", str(tmp_path / f"x{pct}.h5"), "-s", "/aten.mm.default/"]):
            r = runner.invoke(app, args)
            assert "Traceback" not in r.output and "internal error" not in r.output, (pct, args, r.output)
            if r.exit_code == 2:
                assert r.output.strip().startswith(f"accucmp: error: {bad}: "), (pct, args, r.output)
                named += "corrupt or unreadable dump" in r.output
    assert named  # the sweep did hit metadata somewhere


def test_a_dump_still_being_written_is_not_called_corrupt(good, tmp_path):
    """`accucmp ls` on a dump whose dumper block is still running hits HDF5's file lock;
    it said 'cannot open as HDF5 (truncated or corrupt?)' about a healthy file."""
    import subprocess
    import sys
    holder = subprocess.Popen(
        [sys.executable, "-c", "import h5py, sys, time; f = h5py.File(sys.argv[1], 'a'); "
         "print('open', flush=True); time.sleep(60)", str(good)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        with pytest.raises(DumpFormatError, match="is open for writing by another process"):
            DumpFile(good)
        r = runner.invoke(app, ["ls", str(good)])
        assert r.exit_code == 2
        assert r.output.strip() == (f"accucmp: error: {good}: is open for writing by another process "
                                    "(a dumper block still running?); read it once the writer has closed it")
    finally:
        holder.kill()
        holder.wait()
    with DumpFile(good) as f:          # once the writer is gone, it reads
        assert len(f.ops()) > 0


def test_compare_names_an_op_group_turned_into_a_dataset(good, tmp_path):
    """Found by benchmarks/fuzz_files.py (kind swap): an op's group replaced by a dataset in
    a file whose catalog does not describe the op made an internal error (exit 3,
    'DatasetID' object has no attribute 'links')."""
    bad = tmp_path / "bad.h5"
    shutil.copy(good, bad)
    with h5py.File(bad, "r+") as h:
        for key in [k for k in h.attrs if "catalog" in k]:
            del h.attrs[key]
        if "_npu_dumper/catalog" in h:
            del h["_npu_dumper/catalog"]
        del h["/aten.relu.default/6"]
        h.create_dataset("/aten.relu.default/6", data=[0.0, 1.0])
    for mine, golden in ((good, bad), (bad, good)):
        r = runner.invoke(app, ["compare", "-m", str(mine), "-g", str(golden), "-o", str(tmp_path / "cmp"), "-q"])
        assert r.exit_code == 2, r.output
        msg = r.output.strip()
        assert len(msg.splitlines()) == 1 and "Traceback" not in msg and str(bad) in msg, msg
