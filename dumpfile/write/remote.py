"""A DumpWriter in a separate process: HDF5 metadata work off the caller's GIL.

h5py holds the GIL for every call (groups, datasets, attributes). In a thread, that
work competes with the user's Python for the one GIL; in its own process it runs on
its own interpreter. The caller (npu_dumper's process writer) sends each op as a
small picklable record; the child makes exactly the DumpWriter calls the writer
thread would make, so the file is the same. Large tensors are *reserved* in the
child (dataset allocated, offset known) and the child replies with the offsets; the
caller writes the bytes itself with os.pwrite on its own descriptors (GIL-free, no
copy through a pipe; O_DIRECT where the file system allows: direct_io.py) and tells
the child, in op order, how many ops are complete (`release`): only those are
published at the child's flushes, as in the thread writer.

Protocol (multiprocessing.connection over a socketpair; one child per caller process,
reused across dump files):
    ("open", path, mode, root_attrs, flush_interval) -> ("ok",) | ("err", msg)
    ("op", record)                                   -> ("ok", [offsets]) | ("err", msg) | ("skip",)
    ("release", n)                                   (no reply)
    ("close", complete, extra_root_attrs)            -> ("closed", bytes_written, num_ops, err | None)
    ("ping",)                                        -> ("ok",)
Deadlock freedom (docs/FORMAT.md, "Writer in a separate process"): during a dump only
one thread of the caller (the metadata thread) ever sends, and one (the data thread)
receives, so no lock is held across a blocking send. The child's replies are read by a
thread that never waits on a send (it writes bytes and counts ops; the sending thread
tells the child). Back-pressure runs one way: a slow child stops reading, the caller's
send blocks, its queue fills and the user's thread waits in `submit`. A child that makes
no progress for WATCHDOG_S seconds (socket send/receive time-outs) is reported as a
one-line error, asked to close the file at its last flush (SIGTERM), and killed if it
does not within a few seconds.

End of file on the connection, SIGTERM, or the caller's death (e.g. SIGKILL; the kernel
signals it through PR_SET_PDEATHSIG, also when only the thread that started the child
ends: the child then checks that its parent changed) makes the child close the file as of
the ops the caller had released (`complete` False) and exit: plain HDF5 tools open it, and HDF5's
file lock is let go within one flush. The child ignores SIGINT: a Ctrl-C sent to the
terminal's process group is the caller's to act on.

Torch-free: the child imports only dumpfile, h5py and numpy.

The child's side (its serving loop, remote_child._child_main, started through
child_env.bootstrap: this dumpfile first on its path) is
remote_child.py; the protocol above is the contract between the two modules, and a change
to a message is made on both sides at once.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from .. import schema as S
from ..child_env import ROOT, bootstrap, child_environment
from ..errors import DumpWriteError
from .direct_io import TensorBytes

# the child: remote_child._child_main([socket fd]), this process's dumpfile first on its path
_CHILD = bootstrap("dumpfile.write.remote_child")

# Seconds without progress on the socket after which the child counts as hung (a send
# that moves no byte, a reply that does not come). Generous: a slow disk must slow the
# dump down, not end it. NPU_DUMPER_WRITER_TIMEOUT overrides it (the tests use ~2 s).
WATCHDOG_S = 120.0
# Seconds a new child gets for its first answer: it imports h5py and numpy first, which
# takes seconds on a loaded machine (a watchdog set to a few seconds must not count that).
START_S = 60.0
# Seconds the child gets to close the file after SIGTERM before it is killed.
CLOSE_GRACE_S = 5.0


def _watchdog_s() -> float:
    try:
        v = float(os.environ.get("NPU_DUMPER_WRITER_TIMEOUT", WATCHDOG_S))
    except ValueError:
        v = WATCHDOG_S
    return v if v > 0 else WATCHDOG_S


def _set_timeouts(sock: socket.socket, seconds: float) -> None:
    """SO_SNDTIMEO / SO_RCVTIMEO: a blocking read or write on the socket fails with EAGAIN
    after `seconds` without moving a byte (Linux applies them to read(2)/write(2), which
    multiprocessing.connection uses)."""
    tv = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)


# ---- caller side ------------------------------------------------------------------------
class _Child:
    def __init__(self):
        parent_sock, child_sock = socket.socketpair()
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, ROOT, str(child_sock.fileno())],
            pass_fds=(child_sock.fileno(),), close_fds=True, env=child_environment())
        child_sock.close()
        _set_timeouts(parent_sock, _watchdog_s())
        self.conn = Connection(parent_sock.detach())
        self.pid = os.getpid()
        self.start_s = time.perf_counter() - t0
        self.hung: str | None = None     # the watchdog's message, once it stopped the child
        self.answered = False            # (its start-up is over)

    def exchange(self, msg: tuple) -> tuple:
        """Send `msg` and return the reply. The child's first reply waits for its start-up:
        the socket time-outs are max(watchdog, START_S) for that one."""
        if self.answered:
            self.conn.send(msg)
            return self.conn.recv()
        sock = socket.socket(fileno=self.conn.fileno())
        try:
            _set_timeouts(sock, max(_watchdog_s(), START_S))
            self.conn.send(msg)
            reply = self.conn.recv()
            self.answered = True
            return reply
        finally:
            _set_timeouts(sock, _watchdog_s())
            sock.detach()

    def alive(self) -> bool:
        return self.pid == os.getpid() and self.proc.poll() is None and not self.conn.closed

    def discard(self) -> None:
        try:
            self.conn.close()       # the child sees end of file, closes the file and exits
        except OSError:
            pass

    def stop(self) -> None:
        """The child stopped answering: ask it to close the file (SIGTERM, acted on between
        two HDF5 calls), kill it when it does not within CLOSE_GRACE_S, never reuse it."""
        self.discard()
        if self.pid != os.getpid() or self.proc.poll() is not None:
            return
        try:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.send_signal(signal.SIGCONT)     # (a stopped child must run to act on it)
            self.proc.wait(timeout=CLOSE_GRACE_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        except OSError:
            pass


_pool_lock = threading.Lock()
_pooled: _Child | None = None


def _take_child() -> _Child:
    global _pooled
    with _pool_lock:
        child, _pooled = _pooled, None
    if child is None or not child.alive():
        if child is not None:
            child.discard()
        child = _Child()
    return child


def _return_child(child: _Child) -> None:
    global _pooled
    with _pool_lock:
        if _pooled is None and child.alive():
            _pooled = child
            return
    child.discard()


def spawn() -> None:
    """Start the pooled child and return without waiting for its start-up (~0.1-0.3 s: an
    interpreter importing h5py and numpy), which then runs beside whatever the caller does
    next; the next RemoteDumpWriter takes it. Load-replay's entry probes its golden in a
    child of its own first (dumpfile.read.probe): the two interpreters start together
    instead of one after the other. An OSError (no interpreter to start) is left to the
    writer's own start to meet and report."""
    try:
        child = _take_child()       # (the running one, or a new one in place of one that died)
    except OSError:
        return
    _return_child(child)


def prestart() -> float:
    """Start the pooled child now (its start-up, ~0.1-0.3 s, is otherwise paid by the
    first dump file). Returns the seconds the start took (0 when one was running)."""
    child = _take_child()
    t0 = time.perf_counter()
    child.exchange(("ping",))
    took = child.start_s + time.perf_counter() - t0 if child.start_s else 0.0
    child.start_s = 0.0
    _return_child(child)
    return took


class RemoteDumpWriter:
    """The caller's handle on a DumpWriter in the child process (see module doc).

    Not a DumpWriter: it offers what the dumper's writer uses — `path`, `send` of op
    records, `recv` of their replies, `write_at` (local pwrite), `release_ops`, `close` —
    and no h5py objects (no `file`; the dumper's ProcessWriter, written for it, calls
    nothing else).
    Not locked: one thread sends and one receives (see the module doc); close() runs
    after both have stopped.
    """

    def __init__(self, path: str | os.PathLike, *, mode: str = S.MODE_DUMP,
                 root_attrs: dict[str, Any] | None = None, flush_interval: float = 1.0):
        self.path = os.fspath(path)
        self.bytes_written = 0
        self.durable_ops = 0        # ops the closed file keeps (the child's count)
        self.extra_root_attrs: dict[str, Any] = {}
        self._child = _take_child()
        self._fd = -1
        try:
            reply = self._child.exchange(("open", self.path, mode, dict(root_attrs or {}), flush_interval))
        except (OSError, EOFError) as e:
            self._child.discard()
            if isinstance(e, OSError) and e.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                waited = max(_watchdog_s(), START_S) if not self._child.answered else _watchdog_s()
                raise DumpWriteError(f"{self.path}: dump writer process (pid {self._child.proc.pid}) "
                                     f"did not answer within {waited:g} s") from e
            raise DumpWriteError(f"{self.path}: dump writer process failed ({e})") from e
        if reply[0] != "ok":
            _return_child(self._child)
            raise DumpWriteError(reply[1])
        try:
            self._fd = os.open(self.path, os.O_WRONLY)
        except OSError as e:
            self._fail_close()
            raise DumpWriteError(f"{self.path}: cannot open for writing ({e})") from e
        self._bytes = TensorBytes(self.path, self._fd)    # (O_DIRECT where it can)

    def send(self, msg: tuple) -> None:
        child = self._child
        if child is None:
            raise DumpWriteError(f"{self.path}: dump writer process already stopped")
        try:
            child.conn.send(msg)
        except (OSError, EOFError) as e:
            raise self._lost(e) from e

    def recv(self) -> tuple:
        child = self._child
        if child is None:
            raise DumpWriteError(f"{self.path}: dump writer process already stopped")
        try:
            return child.conn.recv()
        except (OSError, EOFError) as e:
            raise self._lost(e) from e

    def _lost(self, e: BaseException, child: "_Child | None" = None) -> DumpWriteError:
        """The child is gone (killed, out of memory) or hung: say so, with how it ended,
        rather than the pipe's 'Connection reset by peer'."""
        child = child if child is not None else self._child
        if isinstance(e, OSError) and e.errno in (errno.EAGAIN, errno.EWOULDBLOCK) \
                and child is not None:
            # the watchdog: no byte moved for the socket time-out
            child.hung = (f"{self.path}: dump writer process (pid {child.proc.pid}) stopped "
                          f"answering for {_watchdog_s():g} s and was stopped")
            child.stop()
            return DumpWriteError(child.hung)
        if child is not None and getattr(child, "hung", None):
            # the other writer thread, on the connection the watchdog just closed: the same cause
            return DumpWriteError(child.hung)
        code = child.proc.poll() if child is not None else None
        if code is None and child is not None:
            try:
                code = child.proc.wait(timeout=0.5)
            except Exception:  # noqa: BLE001 - still running: the pipe itself failed
                code = None
        if code is not None and code < 0:
            try:
                how = f"killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"killed by signal {-code}"
        elif code is not None:
            how = f"exited with status {code}"
        else:
            how = f"connection lost: {e}"
        return DumpWriteError(f"{self.path}: dump writer process died ({how})")

    def release_ops(self, n: int) -> None:
        if n > 0:
            self.send(("release", n))

    def write_at(self, offset: int, data: Any) -> None:
        self._bytes.write(offset, data)

    def _fail_close(self) -> None:
        try:
            self.send(("close", False, {}))
            self._child.conn.recv()
            _return_child(self._child)
        except (OSError, EOFError):
            self._child.discard()

    def close(self, complete: bool = True) -> None:
        if self._child is None:
            return
        child, self._child = self._child, None
        if self._fd >= 0:
            self._bytes.close()
            os.close(self._fd)
            self._fd = -1
        try:
            child.conn.send(("close", bool(complete), self.extra_root_attrs))
            reply = child.conn.recv()
        except (OSError, EOFError) as e:
            err = self._lost(e, child)
            child.discard()
            self.durable_ops = self._ops_in_file(child)
            raise err from e
        _return_child(child)
        _, self.bytes_written, self.durable_ops, err = reply
        if err:
            raise DumpWriteError(err)

    def _ops_in_file(self, child: "_Child") -> int:
        """The child is gone or going: the ops its last flush or close left in the file."""
        try:
            child.proc.wait(timeout=CLOSE_GRACE_S)
        except Exception:  # noqa: BLE001 - still running: stop it (it closes the file)
            child.stop()
        try:
            import h5py
            with h5py.File(self.path, "r") as f:
                return int(f.attrs.get(S.ROOT_NUM_OPS, 0))
        except Exception:  # noqa: BLE001 - unreadable: none kept that we can vouch for
            return 0

    def discard(self) -> None:
        """After a protocol failure: drop the child (it exits), never reuse it."""
        if self._child is not None:
            self._child.discard()
            self._child = None
        if self._fd >= 0:
            self._bytes.close()
            os.close(self._fd)
            self._fd = -1
