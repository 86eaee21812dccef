"""dumpfile.read.probe: `npu_dumper.load` and load-replay run in the user's process, where no
watchdog may end a loop inside HDF5; a damaged file's metadata is read first in a watched
child, and a stall there is a one-line DumpFormatError / ReplayError naming the file.

The damaged file: a dump whose catalog strings' global heap has 4 KiB zeroed after its
header (what the fuzzer's seed 8 made with one zeroed page): HDF5 loops for ever reading
the catalog. Bounds of 2 s; outcomes asserted, not times. The scenarios run in
subprocesses so that the old code's hang fails the test at the guard instead of hanging it."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys

import h5py
import pytest

from dumpfile import schema as S
from dumpfile.read import probe, safety

from ._cli_helpers import model_ops, write_dump

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HANG_GUARD = 300          # seconds: a hang, never a slow machine


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    d = tmp_path_factory.mktemp("probe")
    good = write_dump(d / "good.h5", model_ops(n_layers=8))
    bad = str(d / "looping.h5")
    shutil.copy(good, bad)
    with h5py.File(good, "r") as h5:
        cat = h5[S.CATALOG_PATH]
        _, chunk = cat.id.read_direct_chunk((0,))
        # each variable-length string: length (4), global heap collection address (8), index (4)
        heaps = sorted({struct.unpack_from("<IQI", chunk, 16 * i)[1] for i in range(cat.shape[0])})
    with open(bad, "r+b") as f:
        f.seek(heaps[-1])
        assert f.read(4) == b"GCOL"
        f.seek(heaps[-1] + 16)          # the collection's header kept, its objects zeroed
        f.write(bytes(4096))
    return good, bad


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD,
                          env=dict(os.environ, PYTHONPATH=ROOT, ACCUCMP_STALL_SECONDS="2"),
                          stdin=subprocess.DEVNULL)


def test_load_replay_of_a_file_that_loops_hdf5_is_refused_in_one_line(dumps, tmp_path):
    _, bad = dumps
    r = _run("import torch, npu_dumper\n"
             "from npu_dumper.errors import DumperError\n"
             f"try:\n    with torch.utils.dumper(use_load=True, load_file_path={bad!r}, "
             f"dump_path={str(tmp_path / 'r.h5')!r}):\n        torch.ones(2).add(1)\n"
             "except DumperError as e:\n    print(type(e).__name__, e)\n")
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1 and bad in lines[0] and "stalled reading its metadata" in lines[0], r.stdout


def test_npu_dumper_load_of_a_file_that_loops_hdf5_is_refused_in_one_line(dumps):
    _, bad = dumps
    r = _run("import npu_dumper\nfrom dumpfile.errors import DumpFormatError\n"
             f"try:\n    with npu_dumper.load({bad!r}) as df:\n        df.ops(); df.catalog_rows()\n"
             "except DumpFormatError as e:\n    print(e)\n")
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{bad}: stalled reading its metadata"), r.stdout


def test_a_good_file_is_probed_once_and_its_check_not_made_again(dumps, monkeypatch):
    good, _ = dumps
    key = safety._file_key(os.stat(good), safety.max_dataset_bytes())
    safety._CHECKED.discard(key)
    probe._PROBED.difference_update({k for k in probe._PROBED if k[0] == key})
    monkeypatch.setenv("ACCUCMP_STALL_SECONDS", "300")
    probe.probe(good, probe.REPLAY)
    assert key in safety._CHECKED                  # the child's check holds for this file
    assert (key, probe.LOAD) in probe._PROBED      # a replay's probe covers a load's

    def no_child(*a, **k):
        raise AssertionError("probed twice")
    monkeypatch.setattr(subprocess, "run", no_child)
    probe.probe(good, probe.LOAD)
    import npu_dumper
    with npu_dumper.load(good) as df:
        assert len(df.ops()) == len(model_ops(n_layers=8))


def test_no_probe_where_the_process_is_watched_or_the_bound_is_zero(dumps, monkeypatch):
    good, _ = dumps

    def no_child(*a, **k):
        raise AssertionError("probed")
    monkeypatch.setattr(subprocess, "run", no_child)
    monkeypatch.setattr(probe, "_PROBED", set())
    monkeypatch.setenv("ACCUCMP_STALL_SECONDS", "0")
    probe.probe(good, probe.REPLAY)
    monkeypatch.setenv("ACCUCMP_STALL_SECONDS", "300")
    from dumpfile import watchdog
    monkeypatch.setattr(watchdog, "_NOTE", object())      # supervise's child: watched already
    probe.probe(good, probe.REPLAY)


def test_replay_entry_starts_the_writer_child_before_it_probes_the_golden(dumps, tmp_path, monkeypatch):
    """The probe (a child interpreter of its own, ~0.3-0.5 s) and the dump writer's child
    start side by side: the writer's child is running when the probe is made, and it is the
    one the block's writer then uses (no second start)."""
    import torch

    import npu_dumper
    from dumpfile.write import remote
    from npu_dumper.replay import load_replay

    good, _ = dumps
    with remote._pool_lock:
        pooled, remote._pooled = remote._pooled, None
    if pooled is not None:
        pooled.discard()
    started = []
    original_init = remote._Child.__init__

    def counting_init(self):
        original_init(self)
        started.append(self)
    monkeypatch.setattr(remote._Child, "__init__", counting_init)
    seen = []
    monkeypatch.setattr(load_replay.probe, "probe",
                        lambda path, purpose=probe.LOAD: seen.append(
                            (path, len(started), remote._pooled is not None and remote._pooled.alive())))
    # (writer="process": "auto" falls back to the thread writer for the rest of a process in
    # which the child once failed to start, as a test before this one may have made it)
    with npu_dumper.dumper(use_load=True, load_file_path=good, dump_path=str(tmp_path / "r.h5"), writer="process"):
        torch.ones(2).add(1)
    assert seen == [(good, 1, True)]
    assert len(started) == 1
    with h5py.File(tmp_path / "r.h5", "r") as h5:        # (the block's file, written by that child)
        assert h5.attrs[S.ROOT_LOAD_FILE] == good


def test_early_writer_start_replaces_a_pooled_child_that_died(monkeypatch):
    """remote.spawn with a dead child in the pool: the new child takes its place (it was
    discarded at return while the dead one held the pool, and the writer started a third)."""
    from dumpfile.write import remote

    with remote._pool_lock:
        pooled, remote._pooled = remote._pooled, None
    if pooled is not None:
        pooled.discard()
    dead = remote._Child()
    dead.proc.kill()
    dead.proc.wait()
    remote._pooled = dead
    remote.spawn()
    try:
        assert remote._pooled is not None and remote._pooled is not dead and remote._pooled.alive()
        assert dead.conn.closed
    finally:
        with remote._pool_lock:
            child, remote._pooled = remote._pooled, None
        if child is not None:
            child.discard()
