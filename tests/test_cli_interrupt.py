"""Ctrl-C at any moment of `accucmp compare` (issue 32): exit 130, one line "interrupted",
no traceback, and every output left is complete (a temporary .part file is removed; the
line names the outputs already written). The moments are seeded delays after the start;
the test asserts the outcome whatever the moment turned out to be (the compare may have
finished first), never a time. The child starts with SIGINT blocked, so that no interrupt
lands inside the interpreter's own start-up (before any of our code runs, which no
program can handle); the entry point unblocks it once its handler is in place, and a
signal that arrived meanwhile is handled then."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from ._cli_helpers import model_ops, perturbed, write_dump

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HANG_GUARD = 600


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("sigint")
    ops = model_ops(n_layers=6, width=64, batch=16)
    return (write_dump(d / "target.h5", perturbed(ops, 5, 0.3)), write_dump(d / "golden.h5", ops))


def _as_from_a_terminal() -> None:
    # A suite started in the background by a non-interactive shell (`.ci/run &`, nohup)
    # inherits SIGINT *ignored*, and an ignored disposition survives exec: the program then
    # rightly keeps ignoring Ctrl-C (dumpfile.interrupts.install), and every moment here
    # "lost" its interrupt (6 of 8 failed, exit 1 with nothing said). The child gets the
    # disposition a terminal gives it.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _compare_interrupted_after(delay: float, pair, out: str) -> tuple[subprocess.CompletedProcess, bool]:
    target, golden = pair
    env = dict(os.environ, PYTHONPATH=ROOT)
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})      # inherited by the child
    try:
        p = subprocess.Popen([sys.executable, "-m", "accucmp.cli", "compare", "-m", target, "-g", golden, "-out", out,
                              "-q", "-p", "--format", "csv,jsonl,html,json"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=env, cwd=ROOT, stdin=subprocess.DEVNULL,
                             preexec_fn=_as_from_a_terminal)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    time.sleep(delay)
    finished_first = p.poll() is not None
    sent_at = time.time()
    p.send_signal(signal.SIGINT)
    o, e = p.communicate(timeout=HANG_GUARD)
    if not finished_first and p.returncode != 130:
        # the compare may end between poll() and the signal (seen once in a loaded suite run):
        # it finished first when every output it wrote was whole before the signal was sent
        # (a file's mtime comes from the kernel's coarse clock, never ahead of time.time())
        written = [os.path.getmtime(os.path.join(dp, f)) for dp, _, fs in os.walk(out) for f in fs]
        finished_first = bool(written) and max(written) <= sent_at
    return subprocess.CompletedProcess(p.args, p.returncode, o.decode(), e.decode()), finished_first


@pytest.mark.parametrize("moment", range(8))
def test_sigint_at_a_seeded_moment_is_one_line_exit_130_and_leaves_whole_outputs(pair, tmp_path, moment):
    delay = random.Random(moment).uniform(0.0, 4.0)
    out = str(tmp_path / "out")
    r, finished_first = _compare_interrupted_after(delay, pair, out)
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr
    files = sorted(os.path.relpath(os.path.join(dp, f), out) for dp, _, fs in os.walk(out) for f in fs)
    assert not [f for f in files if ".part" in f], files          # no half-written file
    if r.returncode == 130:
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("accucmp: interrupted"), r.stderr
        for f in files:                                           # what is left is whole
            if f.endswith(".html"):
                assert open(os.path.join(out, f), encoding="utf-8").read().rstrip().endswith("</html>")
            if f.endswith(".json"):
                json.load(open(os.path.join(out, f), encoding="utf-8"))
            if f.endswith(".jsonl"):
                for ln in open(os.path.join(out, f), encoding="utf-8"):
                    json.loads(ln)
    else:                                      # only when the compare was over before the signal
        assert finished_first and r.returncode == 1, (r.returncode, r.stderr)
        assert any(f.endswith(".html") for f in files)
