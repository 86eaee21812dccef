"""SIGINT and SIGTERM while a dumper block closes its file: noted, then acted on once the
file is closed (used by npu_dumper/dumper.py)."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any


class SignalsNoted:
    """While a dumper block closes its file: SIGINT and SIGTERM are noted instead of acted
    on, so that no second Ctrl-C (a terminal sends it to the whole process group) breaks
    the close half way; the first one also stops the writer's drain (`arm`). After the
    close, a noted SIGTERM is sent again to the restored handler (`deliver`: the default
    ends the process) and a SIGINT becomes KeyboardInterrupt (in __exit__). Only in the
    main thread (where Python runs signal handlers); elsewhere nothing changes."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signals: list[int] = []
        self._old: dict[int, Any] = {}
        self._on_first = None

    def arm(self, on_first) -> None:
        self._on_first = on_first
        if self.signals:
            on_first()

    def _note(self, signum, frame) -> None:
        self.signals.append(signum)
        if self._on_first is not None and len(self.signals) == 1:
            self._on_first()

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                try:
                    self._old[sig] = signal.signal(sig, self._note)
                except (ValueError, OSError):
                    pass
        return self

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        return False

    def deliver(self) -> None:
        if signal.SIGTERM in self.signals and self._old:
            os.kill(os.getpid(), signal.SIGTERM)
