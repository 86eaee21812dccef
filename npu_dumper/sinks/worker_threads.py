"""Background threads kept for the next dumper block instead of started anew.

A dumper block runs one to three background threads (writer, data, replay prefetch).
Starting one costs ~0.3-0.8 ms on the reference 2-core machine (the new thread must
take the GIL and signal back before `start()` returns), and a training loop that dumps
every step pays it per block. A thread that finished its task here waits a while
(IDLE_SECONDS) for the next one and runs it under the new name.

`run_in_thread(target, name)` returns a handle with `join()` and `is_alive()`, the part
of threading.Thread the dumper uses. Tasks never share a thread at the same time; a
task that raises leaves the thread usable (the writer's tasks keep their own errors).
After a fork the inherited idle threads do not exist: the pool is per process.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from typing import Callable

IDLE_SECONDS = 30.0
# while waiting for work (accucmp.compare.pipeline forks its workers past threads of this name)
IDLE_NAME = "npu_dumper-idle"

_lock = threading.Lock()
_idle: deque["_Worker"] = deque()
_pid = os.getpid()


class TaskHandle:
    """What `threading.Thread` offers the dumper for one task: join() and is_alive()."""

    def __init__(self):
        self._done = threading.Event()
        self.thread: threading.Thread | None = None

    def join(self, timeout: float | None = None) -> None:
        self._done.wait(timeout)

    def is_alive(self) -> bool:
        return not self._done.is_set()

    @property
    def ident(self) -> int | None:
        return self.thread.ident if self.thread is not None else None


class _Worker:
    def __init__(self):
        self._cv = threading.Condition()
        self._task: tuple[Callable[[], None], str, TaskHandle] | None = None
        self._retired = False
        self.thread = threading.Thread(target=self._loop, name=IDLE_NAME, daemon=True)

    def give(self, target: Callable[[], None], name: str, handle: TaskHandle) -> bool:
        """Hand over a task; False when the thread has retired meanwhile."""
        with self._cv:
            if self._retired:
                return False
            self._task = (target, name, handle)
            handle.thread = self.thread
            self._cv.notify()
            return True

    def _loop(self) -> None:
        me = threading.current_thread()
        while True:
            with self._cv:
                if self._task is None:
                    self._cv.wait(IDLE_SECONDS)
                if self._task is None:          # idle too long: end (removed from the pool)
                    self._retired = True
                    with _lock:
                        try:
                            _idle.remove(self)
                        except ValueError:
                            pass
                    return
                target, name, handle = self._task
                self._task = None
            me.name = name
            try:
                target()
            except BaseException:  # noqa: BLE001 - a task reports its own errors; keep the thread
                pass
            finally:
                me.name = IDLE_NAME
                # back in the pool before the task is seen as done, so the next block's
                # start finds this thread
                with _lock:
                    if os.getpid() == _pid:
                        _idle.append(self)
                handle._done.set()


def run_in_thread(target: Callable[[], None], name: str) -> TaskHandle:
    """Run `target` on a pooled daemon thread (a new one when none is idle)."""
    global _pid
    handle = TaskHandle()
    while True:
        with _lock:
            if os.getpid() != _pid:             # forked: the parent's threads are not here
                _idle.clear()
                _pid = os.getpid()
            worker = _idle.pop() if _idle else None
        if worker is None:
            worker = _Worker()
            worker.give(target, name, handle)
            worker.thread.start()
            return handle
        if worker.give(target, name, handle):
            return handle
