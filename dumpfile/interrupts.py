"""Ctrl-C for the command-line programs (accucmp, ir2tbe): exit 130 with one line, at any
moment, with no traceback and no half-written file left (issue 32).

Python's default turns SIGINT into a KeyboardInterrupt raised wherever the main thread
happens to be: inside an import (a traceback from typer's, before any boundary was in
place), inside a finalizer or weakref callback ("Exception ignored in
WeakValueDictionary ... KeyboardInterrupt", and the interrupt lost: the compare ran to
its end), or through code that catches BaseException. Here the handler does not raise:
it removes the temporary files of outputs being written (dumpfile.safe_output keeps
their names), writes `PROG: interrupted` (naming the outputs already complete, when
some are) and leaves with os._exit(130). Outputs are written to a temporary name and
renamed when complete, so every output left is whole; the line says which ones exist.

`install(prog)` is the first thing the entry points do (accucmp/cli/entry.py,
`python -m accucmp.cli`, ir2tbe's main), before typer or numpy are imported. A process
forked from the program (compare's workers) leaves silently with 130: its parent speaks.
Stdlib only: it must be importable before anything else is.
"""

from __future__ import annotations

import os
import signal
import sys

_PROG = ""
_MAIN_PID = -1
INTERRUPTED = 130          # 128 + SIGINT, as a shell reports a Ctrl-C'd tool


def install(prog: str) -> None:
    """Handle SIGINT as described above in this process (the main thread must call it)."""
    global _PROG, _MAIN_PID
    _PROG, _MAIN_PID = prog, os.getpid()
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        return                 # started in the background with SIGINT ignored: keep it so
    signal.signal(signal.SIGINT, _on_sigint)
    # A launcher may start us with SIGINT blocked (tests/test_cli_interrupt.py does, so that
    # no interrupt lands in the interpreter's own start-up, before this code runs): one
    # that arrived meanwhile is delivered now, to this handler.
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def installed() -> bool:
    return signal.getsignal(signal.SIGINT) is _on_sigint


def _on_sigint(signum, frame) -> None:          # noqa: ARG001
    if os.getpid() != _MAIN_PID:
        os._exit(INTERRUPTED)
    written: list[str] = []
    outputs = sys.modules.get("dumpfile.safe_output")
    if outputs is not None:
        for tmp in list(getattr(outputs, "IN_PROGRESS", ())):
            try:
                os.unlink(tmp)
            except OSError:
                pass
        written = [os.path.basename(p) for p in getattr(outputs, "WRITTEN", ())]
    note = ""
    if written:
        shown = ", ".join(written[:4]) + (f" and {len(written) - 4} more" if len(written) > 4 else "")
        note = f" (complete outputs written before it: {shown}; the others were not written)"
    try:
        sys.stdout.flush()
    except Exception:          # noqa: BLE001 - a flush cut by the signal itself, a closed pipe
        pass
    try:
        os.write(2, f"{_PROG}: interrupted{note}\n".encode("utf-8", "replace"))
    except OSError:
        pass
    os._exit(INTERRUPTED)
