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
from dumpfile.read import probe, probed_files, safety

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


# ---- the record of files probed, across processes (probed_files.py) -------------------
def _forget(path: str) -> tuple:
    """This process's memory of `path` dropped (what a new process starts with); its key."""
    key = safety._file_key(os.stat(path), safety.max_dataset_bytes())
    safety._CHECKED.discard(key)
    probe._PROBED.difference_update({k for k in probe._PROBED if k[0] == key})
    return key


def _count_children(monkeypatch) -> list:
    runs = []
    real_run = subprocess.run

    def counting(*a, **k):
        runs.append(a)
        return real_run(*a, **k)
    monkeypatch.setattr(subprocess, "run", counting)
    return runs


def test_a_file_probed_by_one_process_is_not_probed_by_the_next_until_it_changes(dumps, tmp_path, monkeypatch):
    good, _ = dumps
    mine = str(tmp_path / "golden.h5")
    shutil.copy(good, mine)
    record = tmp_path / "record" / "probed-files"
    monkeypatch.setenv(probed_files.RECORD_ENV, str(record))
    monkeypatch.setenv("ACCUCMP_STALL_SECONDS", "300")
    runs = _count_children(monkeypatch)
    key = _forget(mine)
    probe.probe(mine, probe.REPLAY)
    assert len(runs) == 1 and record.exists()
    assert oct(record.stat().st_mode & 0o777) == "0o600"

    _forget(mine)                                   # a later process: the record answers
    probe.probe(mine, probe.REPLAY)
    probe.probe(mine, probe.LOAD)                   # (a replay's probe covers a load's)
    assert len(runs) == 1
    assert key in safety._CHECKED                   # nor is the check of its objects made again
    import npu_dumper
    with npu_dumper.load(mine) as df:
        assert len(df.ops()) == len(model_ops(n_layers=8))
    assert len(runs) == 1

    monkeypatch.setenv(safety.MAX_BYTES_ENV, "64")      # a process whose limit its datasets exceed
    _forget(mine)
    probe.probe(mine, probe.REPLAY)
    assert len(runs) == 2                           # probed (and refused there: nothing recorded)
    monkeypatch.delenv(safety.MAX_BYTES_ENV)

    os.utime(mine)                                  # changed (here only its times): probed again
    _forget(mine)
    probe.probe(mine, probe.REPLAY)
    assert len(runs) == 3

    lines = record.read_text().splitlines()        # (replay and load, twice)
    assert len(lines) == 4 and all(line.startswith("v1 ") for line in lines)


def test_a_damaged_file_is_never_recorded_and_a_forged_line_needs_the_files_identity(dumps, tmp_path, monkeypatch):
    """The record holds identities, not names: a line naming a damaged file's path does
    nothing; only its exact identity and change time would, which a probe that passed wrote."""
    _, bad = dumps
    mine = str(tmp_path / "looping.h5")
    shutil.copy(bad, mine)
    record = tmp_path / "probed-files"
    record.write_text(f"v1 {mine} replay\nnot a line\n")
    monkeypatch.setenv(probed_files.RECORD_ENV, str(record))
    r = _run("import torch, npu_dumper\n"
             "from npu_dumper.errors import DumperError\n"
             f"try:\n    with torch.utils.dumper(use_load=True, load_file_path={mine!r}, "
             f"dump_path={str(tmp_path / 'r.h5')!r}):\n        torch.ones(2).add(1)\n"
             "except DumperError as e:\n    print(type(e).__name__, e)\n")
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1 and "stalled reading its metadata" in lines[0], (r.stdout, r.stderr[-2000:])
    assert record.read_text() == f"v1 {mine} replay\nnot a line\n"      # nothing added


def test_the_record_is_bounded_never_written_through_a_symlink_and_can_be_turned_off(tmp_path, monkeypatch):
    ident = (1, 2, 3, 4, 5)
    target = tmp_path / "elsewhere"
    target.write_text("untouched\n")
    link = tmp_path / "probed-files"
    link.symlink_to(target)
    monkeypatch.setenv(probed_files.RECORD_ENV, str(link))
    probed_files.add(ident, 100, (probe.LOAD,))
    assert target.read_text() == "untouched\n"
    assert not probed_files.known(ident, probe.LOAD, 1 << 30)

    record = tmp_path / "record"
    monkeypatch.setenv(probed_files.RECORD_ENV, str(record))
    probed_files.add(ident, 100, (probe.LOAD,))
    assert probed_files.known(ident, probe.LOAD, 100)
    assert not probed_files.known(ident, probe.LOAD, 99)      # a dataset over this process's limit
    assert not probed_files.known(ident, probe.REPLAY, 1 << 30)
    assert not probed_files.known((1, 2, 3, 4, 6), probe.LOAD, 1 << 30)   # another change time

    monkeypatch.setattr(probed_files, "RECORD_BYTES", 4096)
    for i in range(400):
        probed_files.add((i, 2, 3, 4, 5), 100, (probe.LOAD,))
    assert record.stat().st_size <= 4096
    assert probed_files.known((399, 2, 3, 4, 5), probe.LOAD, 100)       # the newest kept
    assert not probed_files.known((0, 2, 3, 4, 5), probe.LOAD, 100)     # the oldest dropped

    monkeypatch.setenv(probed_files.RECORD_ENV, "")
    assert probed_files.record_path() is None
    probed_files.add((7, 2, 3, 4, 5), 100, (probe.LOAD,))
    assert not probed_files.known((7, 2, 3, 4, 5), probe.LOAD, 1 << 30)
