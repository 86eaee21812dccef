"""dumpfile.watchdog: a call that holds the interpreter lock in C past the bound (what HDF5
does when it loops on a damaged file: issue 32) ends as one line and exit 2, naming the
file being read; a slow command that lets the interpreter run is never cut. The stalled
call here is libc's sleep() called through ctypes.PyDLL, which keeps the lock, as h5py's
attribute reads do. Bounds of 2 s; the outcomes, not the times, are asserted."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HANG_GUARD = 600


def _run(body: str) -> subprocess.CompletedProcess:
    code = "from dumpfile import watchdog\nwatchdog.supervise('accucmp', seconds=2)\n" + body
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD,
                          env=dict(os.environ, PYTHONPATH=ROOT), stdin=subprocess.DEVNULL)


def test_a_call_holding_the_interpreter_in_c_is_cut_with_one_line_naming_the_file():
    r = _run("watchdog.reading('/data/damaged.h5')\nimport ctypes\nctypes.PyDLL(None).sleep(3600)\n")
    assert r.returncode == 2, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("accucmp: error: /data/damaged.h5: reading it made no progress")


def test_a_call_that_released_the_interpreter_but_never_returns_is_cut_too():
    """h5py releases the lock for dataset reads: a zeroed page looped inside the read of
    the catalog's strings while the watchdog thread ran on (the fuzzer's seed 8)."""
    r = _run("watchdog.reading('/data/damaged.h5')\nimport ctypes\nctypes.CDLL(None).sleep(3600)\n")
    assert r.returncode == 2, r
    assert r.stderr.startswith("accucmp: error: /data/damaged.h5: reading it made no progress")


def test_a_command_within_the_bound_keeps_its_exit_code_and_output():
    code = "from dumpfile import watchdog\nwatchdog.supervise('accucmp', seconds=60)\n" \
           "import time\ntime.sleep(1)\nprint('done')\nraise SystemExit(1)\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD,
                       env=dict(os.environ, PYTHONPATH=ROOT), stdin=subprocess.DEVNULL)
    assert (r.returncode, r.stdout, r.stderr) == (1, "done\n", "")


def test_a_signal_that_ends_the_command_ends_the_program_the_same_way():
    r = _run("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n")
    assert r.returncode == -15 and r.stderr == ""


def test_off_with_zero_seconds():
    code = "from dumpfile import watchdog\nimport os\npid = os.getpid()\nwatchdog.supervise('accucmp', seconds=0)\n" \
           "print(os.getpid() == pid)\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.stdout == "True\n"
