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


def sigkill_mid_dump(tmp_path: Path, *, settle_s: float = 2.5, between_flushes: bool = False,
                     **dumper_kwargs) -> Path:
    """Start a child that dumps tanh ops forever (flush every 0.2 s), SIGKILL it once it
    has run a while, and return the path of the file it was writing.

    between_flushes: kill just after one of the child's flushes has completed (~0.2 s
    before the next). With writer="thread" the flush runs in the process that is killed,
    and a kill that lands inside one (~4% of the time here) can leave a group's link
    table half written (docs/FORMAT.md, "Durability"); this tests every other moment."""
    p = tmp_path / "killed.h5"
    marker = tmp_path / "started"
    flushed = tmp_path / "flushed"
    kwargs = ", ".join(f"{k}={v!r}" for k, v in dumper_kwargs.items())
    hook = textwrap.dedent(f"""
        from dumpfile.write.writer import DumpWriter
        _flush = DumpWriter.flush
        def _flush_and_tell(self, **kw):
            _flush(self, **kw)
            pathlib.Path({str(flushed)!r}).write_text(str(time.monotonic_ns()))
        DumpWriter.flush = _flush_and_tell
    """) if between_flushes else ""
    code = textwrap.dedent(f"""
        import time, torch, npu_dumper, pathlib
        __HOOK__
        x = torch.randn(32, 32)
        with npu_dumper.dumper(use_dump=True, dump_path={str(p)!r}, flush_interval=0.2, {kwargs}):
            for i in range(1000000):
                x = torch.tanh(x * 1.01)
                if i == 20:
                    pathlib.Path({str(marker)!r}).touch()
                time.sleep(0.001)
    """)
    code = code.replace("__HOOK__", hook.strip())
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.time() + 60
        while not marker.exists():
            assert proc.poll() is None and time.time() < deadline, "child did not start dumping"
            time.sleep(0.05)
        time.sleep(settle_s)            # several flushes happen
        if between_flushes:             # then the next flush's end
            seen = flushed.read_text() if flushed.exists() else ""
            while not flushed.exists() or flushed.read_text() == seen:
                assert proc.poll() is None and time.time() < deadline + settle_s, "child stopped flushing"
                time.sleep(0.0005)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    wait_unlocked(p, 10.0)
    return p


def wait_unlocked(p: Path, timeout_s: float = 10.0) -> None:
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
    wait_unlocked(p, wait_unlocked_s)
    with h5py.File(p, "r") as f:
        assert not f.attrs["complete"]
        flushed = int(f.attrs["num_ops"])
        assert flushed > min_flushed
    f = DumpFile(p)
    ops = f.ops()
    assert len(ops) >= flushed
    assert [o.seqid for o in ops] == list(range(1, len(ops) + 1))
    return ops[-3:]
