"""A dump killed with SIGKILL mid-run, for the durability tests of both layouts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path


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
    return p
