"""A bound on what a damaged file can cost, whatever HDF5 does (issue 32).

A zeroed 4 KiB page in a dump made HDF5 loop for ever inside an attribute read (`ls
--stats`, `compare`, `whatif`, `npu_dumper.load`: still spinning at 200 s). The loop is in
C and holds the interpreter lock (h5py releases it for dataset reads, not for attribute
reads: measured, a thread made 11 steps during a 2.2 s attribute read and 2,476 during a
3.7 s dataset read), so no Python signal handler or thread can run while it spins.

(A loop inside a call that released the lock, such as h5py's dataset reads, is caught by
the watchdog thread sampling the main thread's position: see _push_deadline.)

What does run: the kernel. `supervise(prog)`, the first thing the `accucmp` entry point
does (accucmp/cli/entry.py), forks. The parent (only the standard library imported, a
few MB) waits for the child and leaves with its exit status. The child runs the command
with a watchdog thread that pushes a real-time timer (setitimer) `seconds` ahead once a
second. That thread needs the interpreter lock to run: when the main thread holds it in
C for `seconds` (a loop in HDF5), the timer fires and SIGALRM's default action ends the
child. The parent turns that into one line naming the file being read (DumpFile notes
each file it opens in a shared page) and exit 2:

    accucmp: error: FILE: reading it made no progress for 300 s (HDF5 looping on damaged
    metadata?); refused ...

`$ACCUCMP_STALL_SECONDS` (default 300; 0: no watchdog, no fork) sets the bound. No
command of ours holds the lock for long on good files: dataset reads release it, tensors
are read in chunks, torch and large numpy operations release it; the bound is the time
one call may hold the lock without letting the watchdog run. SIGINT, SIGTERM and SIGHUP
sent to the parent are passed on to the child; Ctrl-C is reported by the child
(dumpfile.interrupts) and the parent exits 130 as it did. Stdlib only.
"""

from __future__ import annotations

import mmap
import os
import signal
import sys
import threading
import time

STALL_ENV = "ACCUCMP_STALL_SECONDS"
DEFAULT_STALL_SECONDS = 300
BAD_INPUT = 2
# a call that released the interpreter lock and stays at one position: this many times the
# bound before it counts as stalled (_push_deadline)
RELEASED_FACTOR = 4

_NOTE: mmap.mmap | None = None         # in the child: where the file being read is noted
_NOTE_BYTES = 4096


def stall_seconds() -> float:
    text = os.environ.get(STALL_ENV, "").strip()
    try:
        return float(text) if text else float(DEFAULT_STALL_SECONDS)
    except ValueError:
        return float(DEFAULT_STALL_SECONDS)


def reading(path: str) -> None:
    """Note the file now being read (DumpFile calls it as it opens one): the parent names
    it if the child stalls. A memory write: no system call."""
    note = _NOTE
    if note is not None:
        data = os.fsencode(path)[: _NOTE_BYTES - 1] + b"\0"
        note[: len(data)] = data


def supervise(prog: str, seconds: float | None = None) -> None:
    """Fork; return in the child (the command runs there, watched); the parent never
    returns. Nothing happens when the watchdog is off or the system cannot fork."""
    global _NOTE
    seconds = stall_seconds() if seconds is None else seconds
    if seconds <= 0 or not hasattr(os, "fork") or not hasattr(signal, "setitimer"):
        return
    note = mmap.mmap(-1, _NOTE_BYTES)              # anonymous and shared: the child writes, the parent reads
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    pid = os.fork()
    if pid == 0:
        _NOTE = note
        watch(seconds)
        return
    _parent(prog, pid, note, seconds)


def active() -> bool:
    """Whether this process is a watched command's (supervise's child): what it reads is
    bounded already, a library entry needs no probe of its own (dumpfile.read.probe)."""
    return _NOTE is not None


def watch(seconds: float, released_factor: float = RELEASED_FACTOR) -> None:
    """Watch this process: a call stalled for the bound ends it by SIGALRM (_push_deadline).
    Only for a process that is ours to end: supervise's child, the metadata probe's."""
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    threading.Thread(target=_push_deadline, args=(seconds, released_factor), name="accucmp-watchdog",
                     daemon=True).start()


# modules whose frames wait for others (a pool's results, a child, a queue): a main
# thread blocked there for long is waiting, not stuck
_WAITING = ("threading", "multiprocessing", "concurrent", "queue", "selectors", "subprocess", "asyncio")


def _push_deadline(seconds: float, released_factor: float = RELEASED_FACTOR) -> None:
    """Two stalls end the child by SIGALRM: one C call holding the interpreter lock (this
    thread cannot run: the timer it pushes ahead fires), and one C call that released it
    but never returns (h5py releases the lock for dataset reads: a zeroed page looped
    inside the read of the catalog's strings, this thread ran on and the timer never
    fired). For the second, the main thread's position (its top frame and instruction)
    is sampled each step: unchanged for `released_factor` x `seconds` outside a module that
    waits for others, the main thread is inside one call that long. (Longer than the first
    bound: a legitimate loop of large reads from one call site, extract copying a huge
    tensor from a slow disk, also shows one position between most samples.)"""
    step = min(1.0, seconds / 4)
    main = threading.main_thread().ident
    last, since = None, time.monotonic()
    while True:
        signal.setitimer(signal.ITIMER_REAL, seconds)
        time.sleep(step)
        frame = sys._current_frames().get(main)
        if frame is None:
            continue
        where = (id(frame), frame.f_lasti)
        now = time.monotonic()
        if where != last:
            last, since = where, now
        elif now - since >= released_factor * seconds \
                and not str(frame.f_globals.get("__name__", "")).startswith(_WAITING):
            os.kill(os.getpid(), signal.SIGALRM)


def _parent(prog: str, pid: int, note: mmap.mmap, seconds: float) -> None:
    # a signal for us is for the command: passed on (a terminal's Ctrl-C reaches both; the
    # child's handler ends it at the first), and we exit as the child did
    def pass_on(signum, frame):                    # noqa: ARG001
        try:
            os.kill(pid, signum)
        except OSError:
            pass
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, pass_on)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:                   # (PEP 475 retries; kept for old kernels)
            continue
        except ChildProcessError:
            os._exit(BAD_INPUT)
    if os.WIFEXITED(status):
        os._exit(os.WEXITSTATUS(status))
    sig = os.WTERMSIG(status)
    if sig == signal.SIGALRM:
        path = bytes(note[:]).split(b"\0", 1)[0].decode("utf-8", "replace")
        what = f"{path}: reading it" if path else "reading its input"
        line = (f"{prog}: error: {what} made no progress for {seconds:g} s (HDF5 looping on damaged "
                f"metadata?); refused (${STALL_ENV} sets the bound, 0 turns it off)\n")
        try:
            os.write(2, line.encode("utf-8", "replace"))
        except OSError:
            pass
        os._exit(BAD_INPUT)
    if sig == signal.SIGINT:
        # a Ctrl-C that came while the child was shutting down, its command done: Python
        # restores the default action for its finalization, so it died of it silently
        try:
            os.write(2, f"{prog}: interrupted\n".encode())
        except OSError:
            pass
        os._exit(128 + signal.SIGINT)
    # any other signal: end the same way, so that the shell sees what the child met
    signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
    os._exit(128 + sig)
