"""npu_dumper dump files: path errors, durability (SIGKILL), writer failures, h5 tools, big indexes."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest
import torch

import npu_dumper
from dumpfile import DumpFile, DumpWriter
from dumpfile.errors import DumpWriteError

from ._kill_helpers import killed_dump_tail, sigkill_mid_dump
from npu_dumper.errors import DumperError


def _one_line(e: BaseException) -> str:
    msg = str(e)
    assert "\n" not in msg
    return msg


# ---- bad dump_path: refused at entry, before the model runs ----------------------------
@pytest.mark.parametrize("make_path, needle", [
    (lambda p: p / "missing" / "d.h5", "does not exist"),
    (lambda p: p / "d.hdf5", "must be an existing directory or a file name ending in .h5"),
])
def test_bad_dump_path_refused_before_the_model_runs(tmp_path, make_path, needle):
    ran = []
    path = make_path(tmp_path)
    with pytest.raises(DumperError) as ei:
        with npu_dumper.dumper(use_dump=True, dump_path=str(path)):
            ran.append(1)
    assert not ran
    assert needle in _one_line(ei.value) and str(path) in str(ei.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_directory_refused(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    try:
        with pytest.raises(DumperError, match="not writable"):
            with npu_dumper.dumper(use_dump=True, dump_path=str(d / "x.h5")):
                pass
    finally:
        d.chmod(0o700)


def test_directory_dump_path_gets_time_stamped_name(tmp_path):
    x = torch.ones(2)
    with npu_dumper.dumper(use_dump=True, dump_path=str(tmp_path)) as d:
        x + 1
    name = os.path.basename(d.path)
    assert os.path.dirname(d.path) == str(tmp_path)
    assert name.startswith("dump_") and name.endswith(".h5") and name[5:19].isdigit()
    with DumpFile(d.path) as f:
        assert len(f) == 1 and f.complete


def test_nested_dumper_refused(tmp_path):
    x = torch.ones(1)
    with npu_dumper.dumper(use_dump=True, dump_path=str(tmp_path / "a.h5")):
        with pytest.raises(DumperError, match="nested"):
            with npu_dumper.dumper(use_dump=True, dump_path=str(tmp_path / "b.h5")):
                pass
        x * 2
    # the outer dump still works and a later dumper is allowed
    with npu_dumper.dumper(use_dump=True, dump_path=str(tmp_path / "c.h5")) as d:
        x * 2
    assert d.num_ops == 1


def test_load_file_equal_to_dump_path_refused(tmp_path):
    p = tmp_path / "a.h5"
    with npu_dumper.dumper(use_dump=True, dump_path=str(p)):
        torch.ones(1) * 2
    with pytest.raises(DumperError, match="load_file_path"):
        with npu_dumper.dumper(use_load=True, load_file_path=str(p), dump_path=str(p)):
            pass


@pytest.mark.parametrize("options, needle", [
    (dict(dump_mode="outputs"), "dump_mode must be one of"),
    (dict(phases=["fwd"]), "phases must be a subset"),
    (dict(dumpmode="input"), "unknown option 'dumpmode' (did you mean 'dump_mode'?)"),  # a typo
    (dict(include=3), "include must be a string or a list of strings"),
    (dict(modules=[1]), "modules must be a string or a list of strings"),
    (dict(flush_interval="1"), "flush_interval must be a number of seconds >= 0"),
    (dict(max_pending_bytes=0), "max_pending_bytes must be a positive int"),
    (dict(dump_path=3), "dump_path must be a path"),
])
def test_bad_options_refused(tmp_path, options, needle):
    kw = {"use_dump": True, "dump_path": str(tmp_path / "a.h5"), "writer": "process", **options}
    with pytest.raises(DumperError) as ei:
        with npu_dumper.dumper(**kw):
            torch.ones(2) * 2
    assert needle in _one_line(ei.value)
    assert not (tmp_path / "a.h5").exists()


def test_paths_given_as_bytes_and_a_dangling_link_or_directory_as_load_file(tmp_path):
    with npu_dumper.dumper(use_dump=True, dump_path=os.fsencode(tmp_path / "b.h5")) as d:
        torch.ones(2) * 2
    assert d.path == str(tmp_path / "b.h5") and d.num_ops == 2
    link = tmp_path / "link.h5"
    link.symlink_to(tmp_path / "missing" / "x.h5")
    with pytest.raises(DumperError, match="is a symbolic link to .*which does not exist"):
        with npu_dumper.dumper(use_dump=True, dump_path=str(link)):
            pass
    assert link.is_symlink()                   # (the thread writer used to replace it)
    with pytest.raises(DumperError, match="load_file_path is a directory"):
        with npu_dumper.dumper(load_file_path=str(tmp_path), dump_path=str(tmp_path / "r.h5")):
            pass


def test_disabled_dumper_is_a_no_op(tmp_path):
    with npu_dumper.dumper() as d:
        torch.ones(1) * 2
    assert d.path is None and d.num_ops == 0



@pytest.mark.parametrize("writer, reader", [("thread", "here"), ("process", "here"),
                                            ("process", "other process")])
def test_a_dump_open_in_a_reader_is_not_overwritten(tmp_path, writer, reader):
    # HDF5 truncates a file it creates before it checks the file's lock, so a writer in
    # another process (or a reader there) used to empty the earlier dump and then fail
    p = tmp_path / "held.h5"
    with npu_dumper.dumper(use_dump=True, dump_path=str(p), writer=writer):
        torch.ones(3) * 2
    size = p.stat().st_size
    holder = None
    if reader == "here":
        holder = h5py.File(p, "r")
    else:
        holder = subprocess.Popen(
            [sys.executable, "-c", "import h5py, sys, time; f = h5py.File(sys.argv[1], 'r'); "
             "print('open', flush=True); time.sleep(60)", str(p)], stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "open"
    try:
        with pytest.raises(DumperError) as ei:
            with npu_dumper.dumper(use_dump=True, dump_path=str(p), writer=writer):
                torch.ones(3) * 3
        assert "held.h5: cannot create dump file (it is open elsewhere" in _one_line(ei.value)
    finally:
        holder.close() if reader == "here" else holder.kill()
    assert p.stat().st_size == size
    with DumpFile(p) as f:             # the earlier dump is whole
        assert [o.op for o in f.ops()] == ["aten.ones.default", "aten.mul.Tensor"] and f.complete
        assert f.ops()[1].outputs()["result"].read().tolist() == [2.0, 2.0, 2.0]

@pytest.mark.parametrize("writer", ["thread", "process"])
def test_a_dump_over_an_earlier_one_replaces_it_and_keeps_links_semantics(tmp_path, writer):
    # An earlier dump at the path is unlinked, not truncated (truncating a freshly written
    # file waits for its dirty pages): a reader that opened it before keeps reading it
    # whole. A symlink and a file with a second hard link are written through, as before.
    p = tmp_path / "again.h5"
    with npu_dumper.dumper(use_dump=True, dump_path=str(p), writer=writer):
        torch.ones(3) * 2
    old = os.open(p, os.O_RDONLY)      # (no HDF5 lock: the dump goes ahead)
    try:
        old_size = os.fstat(old).st_size
        with npu_dumper.dumper(use_dump=True, dump_path=str(p), writer=writer):
            torch.ones(2) + 5
        st = os.fstat(old)             # the earlier file: unlinked, whole
        assert st.st_nlink == 0 and st.st_size == old_size
    finally:
        os.close(old)
    with DumpFile(p) as f:
        assert [o.op for o in f.ops()] == ["aten.ones.default", "aten.add.Tensor"] and f.complete

    target = tmp_path / "target.h5"
    link = tmp_path / "link.h5"
    other_name = tmp_path / "other_name.h5"
    os.link(p, other_name)
    shutil.copy(p, target)
    os.symlink(target.name, link)
    for path, seen_through in ((link, target), (p, other_name)):
        with npu_dumper.dumper(use_dump=True, dump_path=str(path), writer=writer):
            torch.ones(4) * 3
        with DumpFile(seen_through) as f:
            assert [o.op for o in f.ops()] == ["aten.ones.default", "aten.mul.Tensor"]
            assert f.ops()[1].outputs()["result"].read().tolist() == [3.0] * 4
    assert link.is_symlink() and os.path.samefile(p, other_name)


# ---- failures in the writer reach the user ---------------------------------------------
def test_writer_failure_surfaces_in_user_thread(tmp_path, monkeypatch):
    def boom(self, *a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(DumpWriter, "write_tensor", boom)
    p = tmp_path / "full.h5"
    with pytest.raises(DumperError) as ei:     # (the patch reaches the thread writer only)
        with npu_dumper.dumper(use_dump=True, dump_path=str(p), writer="thread"):
            for _ in range(50):
                torch.ones(3) * 2
                time.sleep(0.002)
    msg = _one_line(ei.value)
    assert str(p) in msg and "No space left" in msg
    with h5py.File(p) as f:            # readable, marked incomplete
        assert not f.attrs["complete"]


@pytest.mark.parametrize("stats_only", [False, True])
def test_a_failure_at_the_final_flush_is_a_one_line_dumper_error(tmp_path, monkeypatch, stats_only):
    # (disk full may first show at the close's flush: that must read like any other
    # writer failure, not as a DumpWriteError from inside the writer)
    def full(self, **kw):
        raise DumpWriteError(f"{self.path}: write failed (No space left on device)")
    monkeypatch.setattr(DumpWriter, "flush", full)
    p = tmp_path / "d.h5"
    dump = npu_dumper.dumper(use_dump=True, dump_path=str(p), writer="thread",
                             stats_only=stats_only, flush_interval=3600.0)
    with pytest.raises(DumperError) as ei:
        with dump:
            torch.ones(3) * 2
    msg = _one_line(ei.value)
    assert msg.startswith(str(p)) and "No space left on device" in msg
    assert dump.summary["ops_recorded"] == 2        # the summary is still made


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_disk_full_gives_clear_error_and_readable_file(tmp_path, writer):
    """A real ENOSPC from a tiny tmpfs when we may mount one; else skip."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)],
                       capture_output=True)
    if r.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        p = mnt / "d.h5"
        x = torch.randn(64, 1024)
        with pytest.raises(DumperError) as ei:
            with npu_dumper.dumper(use_dump=True, dump_path=str(p), flush_interval=0.0,
                                   writer=writer):
                for _ in range(40):
                    x = x * 1.0001
        assert str(p) in _one_line(ei.value)
        with DumpFile(p) as f:         # readable up to the last flush
            ops = f.ops()
            assert ops and all(o.op == "aten.mul.Tensor" for o in ops)
            np.testing.assert_array_equal(ops[0].inputs()["self"].read().shape, (64, 1024))
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


# ---- durability: SIGKILL mid-dump ----------------------------------------------------------
def test_sigkill_mid_dump_leaves_readable_file(tmp_path):
    # (process: its own test, killed at any moment: the child finishes its HDF5 call)
    p = sigkill_mid_dump(tmp_path, settle_s=2.5, writer="thread", between_flushes=True)
    for o in killed_dump_tail(p):      # the last flushed ops read back
        assert o.inputs()["self"].read().shape == (32, 32)
    if shutil.which("h5ls"):
        r = subprocess.run(["h5ls", str(p)], capture_output=True, text=True)
        assert r.returncode == 0 and "aten.tanh.default" in r.stdout


# ---- the original's tools ----------------------------------------------------------------
@pytest.mark.skipif(not shutil.which("h5copy") or not shutil.which("h5dump"),
                    reason="hdf5-tools (h5copy, h5dump) not installed: apt-get install hdf5-tools")
def test_h5copy_pv_and_h5dump_work_on_a_dump(tmp_path):
    lin = torch.nn.Linear(16, 16)
    x = torch.randn(4, 16)
    p = tmp_path / "d.h5"
    with npu_dumper.dumper(use_dump=True, dump_path=str(p)):
        lin(lin(x)).sum().backward()
    out = tmp_path / "out.h5"
    for seq in ("1", "2"):
        r = subprocess.run(["h5copy", "-pv", "-i", str(p), "-o", str(out), "-s",
                            f"/aten.addmm.default/{seq}/", "-d", f"/aten.addmm.default/{seq}/"],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    r = subprocess.run(["h5dump", "-H", str(out)], capture_output=True, text=True)
    assert r.returncode == 0 and "mat2" in r.stdout and "DataType" in r.stdout
    r = subprocess.run(["h5dump", "-d", "/aten.addmm.default/1/input/mat1", str(p)],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "H5T_IEEE_F32LE" in r.stdout
    with DumpFile(out) as f:           # no index in the copy: listed by walking links
        ops = f.ops()
        assert [(o.op, o.seqid) for o in ops] == [("aten.addmm.default", 1), ("aten.addmm.default", 2)]
        np.testing.assert_array_equal(ops[0].inputs()["mat1"].read(), x.numpy())
        np.testing.assert_array_equal(ops[0].inputs()["mat2"].read(), lin.weight.detach().t().numpy())


# ---- reading a big dump without opening every group --------------------------------------
def test_reader_lists_100k_ops_from_the_index(tmp_path):
    p = tmp_path / "big.h5"
    n = 100_000
    names = ("aten.add.Tensor", "aten.mul.Tensor", "aten.addmm.default")
    with DumpWriter(p, flush_interval=1e9) as w:
        # real groups, made with the low-level API (the high-level one would take a minute)
        parents = {nm: w.file.create_group(nm).id for nm in names}
        for i in range(1, n + 1):
            nm = names[i % 3]
            h5py.h5g.create(parents[nm], str(i).encode())
            w._pending_index.append((i, nm, 0, "", ""))
            w.num_ops += 1
    opened = []
    orig = h5py.Group.__getitem__

    def counting(self, key):
        opened.append(key)
        return orig(self, key)

    with DumpFile(p) as f:
        h5py.Group.__getitem__ = counting
        try:
            t0 = time.perf_counter()
            ops = f.ops()
            elapsed = time.perf_counter() - t0
        finally:
            h5py.Group.__getitem__ = orig
    assert len(ops) == n
    assert all(a.seqid <= b.seqid for a, b in zip(ops, ops[1:]))
    assert len(opened) < 10, "listing must not open op groups"
    print(f"listed {len(ops)} ops in {elapsed:.2f} s")


def test_claim_blocks_allocates_the_range_it_is_given(tmp_path):
    # reserve_tensor claims a tensor's blocks when it reserves them, so a full disk shows
    # there (before more metadata piles up) and not at the later write of its bytes
    from dumpfile.write.writer import claim_blocks
    p = tmp_path / "f.bin"
    fd = os.open(p, os.O_RDWR | os.O_CREAT)
    try:
        if not claim_blocks(fd, 1 << 20, 1 << 20):
            pytest.skip("no fallocate on this file system")
        st = os.fstat(fd)
        assert st.st_size == 2 << 20 and st.st_blocks * 512 >= 1 << 20
        with pytest.raises(OSError) as ei:          # more than any disk holds
            claim_blocks(fd, 0, 1 << 60)
        assert ei.value.errno in (errno.ENOSPC, errno.EFBIG)
    finally:
        os.close(fd)


def test_a_flush_keeps_little_clean_metadata_and_the_cache_size_for_dirty_entries(tmp_path):
    # HDF5 walks every cached entry at each flush: a cache left to fill its 32 MB with
    # clean entries made each flush slower as the dump grew. After a flush past 8 MB the
    # writer keeps ~2 MB of them; the cache's size (which holds dirty entries until the next flush) is
    # set back, and nothing dropped was dirty: the file reads back whole.
    from dumpfile.write.durability import CLEAN_METADATA_DROP_ABOVE, CLEAN_METADATA_KEPT_BYTES
    from dumpfile.write.h5objects import METADATA_CACHE_BYTES
    p = tmp_path / "many.h5"
    n = 4000
    with DumpWriter(p, flush_interval=1e9) as w:
        for i in range(1, n + 1):
            w.begin_op("aten.add.Tensor", i)
            w.write_value(w.io_groups()[0], "alpha", i)
            w.end_op()
        before = w.file.id.get_mdc_size()[2]
        w.flush()
        after = w.file.id.get_mdc_size()[2]
        assert w.file.id.get_mdc_config().max_size == METADATA_CACHE_BYTES
        assert before > CLEAN_METADATA_DROP_ABOVE and after <= CLEAN_METADATA_KEPT_BYTES
        w.begin_op("aten.add.Tensor", n + 1)        # (evicted entries are read back)
        w.end_op()
    with DumpFile(p) as f:
        ops = f.ops()
        assert len(ops) == n + 1 and ops[-1].seqid == n + 1
        assert ops[3210].inputs()["alpha"].read() == 3211
