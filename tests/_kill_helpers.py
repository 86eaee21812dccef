"""A dump killed with SIGKILL mid-run, for the durability tests of both layouts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import h5py

from dumpfile import DumpFile


def sigkill_mid_dump(tmp_path: Path, *, settle_s: float = 2.5, **dumper_kwargs) -> Path:
    """Start a child that dumps tanh ops forever (flush every 0.2 s), SIGKILL it once it
    has run a while, and return the path of the file it was writing."""
    p = tmp_path / "killed.h5"
    marker = tmp_path / "started"
    kwargs = ", ".join(f"{k}={v!r}" for k, v in dumper_kwargs.items())
    code = textwrap.dedent(f"""
        import time, torch, npu_dumper, pathlib
        x = torch.randn(32, 32)
        with npu_dumper.dumper(use_dump=True, dump_path={str(p)!r}, flush_interval=0.2, {kwargs}):
            for i in range(1000000):
                x = torch.tanh(x * 1.01)
                if i == 20:
                    pathlib.Path({str(marker)!r}).touch()
                time.sleep(0.001)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.time() + 60
        while not marker.exists():
            assert proc.poll() is None and time.time() < deadline, "child did not start dumping"
            time.sleep(0.05)
        time.sleep(settle_s)            # several flushes happen
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    _wait_unlocked(p, 10.0)
    return p


def _wait_unlocked(p: Path, timeout_s: float) -> None:
    """A writer process outlives the killed dumper for a moment (it stops between two
    messages) and holds HDF5's file lock until then."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            h5py.File(p, "r").close()
            return
        except BlockingIOError:
            assert time.monotonic() < deadline, "the writer process kept the file locked"
            time.sleep(0.05)


def killed_dump_tail(p: Path, *, min_flushed: int = 20, wait_unlocked_s: float = 0.0) -> list:
    """Check a killed dump: marked incomplete, more than `min_flushed` ops flushed, every
    listed op in seqid order without gaps. Returns the last three ops (for content checks).

    wait_unlocked_s: a writer process outlives its parent for a moment and holds HDF5's
    file lock until then; wait that long for it to let go."""
    _wait_unlocked(p, wait_unlocked_s)
    with h5py.File(p, "r") as f:
        assert not f.attrs["complete"]
        flushed = int(f.attrs["num_ops"])
        assert flushed > min_flushed
    f = DumpFile(p)
    ops = f.ops()
    assert len(ops) >= flushed
    assert [o.seqid for o in ops] == list(range(1, len(ops) + 1))
    return ops[-3:]
