"""A DumpWriter in a separate process: HDF5 metadata work off the caller's GIL.

h5py holds the GIL for every call (groups, datasets, attributes). In a thread, that
work competes with the user's Python for the one GIL; in its own process it runs on
its own interpreter. The caller (npu_dumper's process writer) sends each op as a
small picklable record; the child makes exactly the DumpWriter calls the writer
thread would make, so the file is the same. Large tensors are *reserved* in the
child (dataset allocated, offset known) and the child replies with the offsets; the
caller writes the bytes itself with os.pwrite on its own descriptor (GIL-free, no
copy through a pipe) and tells the child, in op order, how many ops are complete
(`release`): only those are published at the child's flushes, as in the thread writer.

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

End of file on the connection or SIGTERM (the caller died, e.g. SIGKILL; the kernel
sends SIGTERM through PR_SET_PDEATHSIG) makes the child close the file as of the ops the
caller had released (`complete` False) and exit: plain HDF5 tools open it, and HDF5's
file lock is let go within one flush. The child ignores SIGINT: a Ctrl-C sent to the
terminal's process group is the caller's to act on.

Torch-free: the child imports only dumpfile, h5py and numpy.

Why one module of ~510 lines: both ends of the connection (the caller's RemoteDumpWriter
and the child's loop) and the watchdog share the protocol above; kept together, a
change to a message is made on both sides at once.
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
from ..errors import DumpWriteError, writer_error_message
from .writer import pwrite_all

# Seconds without progress on the socket after which the child counts as hung (a send
# that moves no byte, a reply that does not come). Generous: a slow disk must slow the
# dump down, not end it. NPU_DUMPER_WRITER_TIMEOUT overrides it (the tests use ~2 s).
WATCHDOG_S = 120.0
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
            [sys.executable, "-m", "dumpfile.write.remote", str(child_sock.fileno())],
            pass_fds=(child_sock.fileno(),), close_fds=True)
        child_sock.close()
        _set_timeouts(parent_sock, _watchdog_s())
        self.conn = Connection(parent_sock.detach())
        self.pid = os.getpid()
        self.start_s = time.perf_counter() - t0
        self.hung: str | None = None     # the watchdog's message, once it stopped the child

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


def prestart() -> float:
    """Start the pooled child now (its start-up, ~0.1-0.3 s, is otherwise paid by the
    first dump file). Returns the seconds the start took (0 when one was running)."""
    child = _take_child()
    t0 = time.perf_counter()
    child.conn.send(("ping",))
    child.conn.recv()
    took = child.start_s + time.perf_counter() - t0 if child.start_s else 0.0
    child.start_s = 0.0
    _return_child(child)
    return took


class RemoteDumpWriter:
    """The caller's handle on a DumpWriter in the child process (see module doc).

    Not a DumpWriter: it offers what the dumper's writer uses — `path`, `send` of op
    records, `recv` of their replies, `write_at` (local pwrite), `release_ops`, `close` —
    and no h5py objects (the dumper's ProcessWriter, written for it, calls nothing else).
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
            self._child.conn.send(("open", self.path, mode, dict(root_attrs or {}), flush_interval))
            reply = self._child.conn.recv()
        except (OSError, EOFError) as e:
            self._child.discard()
            raise DumpWriteError(f"{self.path}: dump writer process failed ({e})") from e
        if reply[0] != "ok":
            _return_child(self._child)
            raise DumpWriteError(reply[1])
        try:
            self._fd = os.open(self.path, os.O_WRONLY)
        except OSError as e:
            self._fail_close()
            raise DumpWriteError(f"{self.path}: cannot open for writing ({e})") from e

    file = None

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
        pwrite_all(self._fd, data, offset, self.path)

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
            os.close(self._fd)
            self._fd = -1


# ---- child side ---------------------------------------------------------------------------
class _Server:
    def __init__(self, conn: Connection):
        import numpy as np
        from .writer import DumpWriter
        self.np = np
        self.DumpWriter = DumpWriter
        self.conn = conn
        self.w = None
        self.error: str | None = None
        self.flush_interval = 1.0

    parent_gone = False     # set by SIGTERM (the caller died, or its watchdog asks us to stop)

    def serve(self) -> None:
        conn = self.conn
        while True:
            if self.parent_gone:
                # Only here, between DumpWriter calls: stopping inside a flush (as a
                # SIGKILL would) could leave HDF5's metadata half written.
                self._caller_gone()
            try:
                if self.w is not None and not conn.poll(self.flush_interval):
                    if not self.parent_gone:
                        self._idle_flush()
                    continue
                msg = conn.recv()
            except (EOFError, OSError):
                self._caller_gone()
            if self.parent_gone:
                self._caller_gone()
            kind = msg[0]
            if kind == "op":
                self._reply(self._op(msg[1]))
            elif kind == "release":
                # bytes written: publish even after a failure (the final flush, after the
                # disk-space reserve is given back, may still make them durable)
                if self.w is not None:
                    self.w.release_ops(msg[1])
                    if self.error is None:
                        self._maybe_flush()     # as promptly as the thread writer
            elif kind == "open":
                self._reply(self._open(*msg[1:]))
            elif kind == "close":
                self._reply(self._close(*msg[1:]))
            elif kind == "ping":
                self._reply(("ok",))

    def _reply(self, msg: tuple) -> None:
        try:
            self.conn.send(msg)
        except (OSError, EOFError):     # the caller is gone
            self._caller_gone()

    def _caller_gone(self) -> None:
        """Close the file as of the ops the caller released (never marked complete), so
        that plain HDF5 tools open it and its lock is let go, then exit. Exiting without
        closing left the metadata HDF5 had evicted since the last flush pointing past the
        end of allocation the superblock records (4 and 9 files in 10 did not open)."""
        try:
            if self.w is not None:
                self._drain()
                self._close(False, {})
        finally:
            os._exit(0)

    def _drain(self) -> None:
        """The messages the caller sent before it died: SIGTERM comes at once, while its
        last ops and releases may still wait in the socket (a kill lost up to a flush
        interval of ops that way)."""
        conn = self.conn
        try:
            while conn.poll(0):
                msg = conn.recv()
                if msg[0] == "op" and self.error is None:
                    self._op(msg[1])
                elif msg[0] == "release" and self.w is not None:
                    self.w.release_ops(msg[1])
        except (EOFError, OSError):
            pass

    def _open(self, path, mode, root_attrs, flush_interval):
        self.error = None
        self.flush_interval = flush_interval
        try:
            self.w = self.DumpWriter(path, mode=mode, root_attrs=root_attrs,
                                     flush_interval=flush_interval)
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            self.w = None
            return ("err", writer_error_message(e, path))
        return ("ok",)

    def _fail(self, e: BaseException) -> None:
        """Every failure in the child: a failed write freezes the file as its last good
        flush left it (DumpWriter.fail); anything else drops the half-written op. The
        first one is reported at the next op and at the close."""
        w = self.w
        if isinstance(e, (OSError, RuntimeError, DumpWriteError)):
            msg = str(w.fail(e))
        else:
            w.abort_op()
            msg = writer_error_message(e, w.path)
        if self.error is None:
            self.error = msg

    def _maybe_flush(self) -> None:
        try:
            self.w.maybe_flush()
        except BaseException as e:  # noqa: BLE001 - reported at the next op or the close
            self._fail(e)

    def _idle_flush(self) -> None:
        if self.error is None:
            try:
                self.w.flush()
            except BaseException as e:  # noqa: BLE001 - reported at the next op or the close
                self._fail(e)

    def _op(self, rec):
        w = self.w
        if w is None:
            return ("skip",)
        if self.error is not None:      # (a failed flush): the caller learns it at once
            return ("err", self.error)
        op, seqid, phase, module, grad_fn, attrs, inputs, outputs = rec
        offsets: list[int] = []
        try:
            w.begin_op(op, seqid, phase=phase, module=module, grad_fn=grad_fn, attrs=attrs)
            for parent, entries in zip(w.io_groups(), (inputs, outputs)):
                for name, node in entries:
                    self._node(parent, name, node, offsets)
                if len(entries) > 1:
                    w.set_order(parent, [n for n, _ in entries])
            w.end_op(deferred=True)
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            self._fail(e)
            return ("err", self.error)
        return ("ok", offsets)

    def _node(self, parent, name: str, node: tuple, offsets: list) -> None:
        w = self.w
        kind = node[0]
        if kind == "reserve":
            _, shape, dtype, meta = node
            r = w.reserve_tensor(parent, name, shape, self.np.dtype(dtype), meta)
            if r is None:
                raise DumpWriteError(f"{w.path}: {parent.name}/{name}: cannot reserve a "
                                     "contiguous dataset for the dump writer process")
            offsets.append(r[1])
        elif kind == "link":
            w.link(parent, name, node[1])
        elif kind == "view":
            w.write_view(parent, name, node[1], node[2])
        elif kind == "tensor":
            w.write_tensor(parent, name, node[1], node[2])
        elif kind == "value":
            w.write_value(parent, name, node[1], node[2])
        elif kind == "named":
            w.write_named(parent, name, node[1], node[2], schema_type=node[3])
        elif kind == "list":
            _, type_code, schema_type, items = node
            grp = w.create_list(parent, name, type_code, len(items), schema_type)
            for item_name, item in items:
                self._node(grp, item_name, item, offsets)
        else:
            raise DumpWriteError(f"{w.path}: unknown record kind {kind!r}")

    def _close(self, complete, extra_attrs):
        w, self.w = self.w, None
        if w is None:
            return ("closed", 0, 0, self.error)
        err = self.error
        if w.num_deferred:      # ops whose bytes were not written: not in the file
            w.release_reserve()
            w.drop_deferred()
        try:
            for k, v in extra_attrs.items():
                w.file.attrs[k] = v
        except Exception:  # noqa: BLE001 - e.g. disk full: close() below reports
            pass
        try:
            w.close(complete=bool(complete) and err is None)
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            if err is None:
                err = writer_error_message(e, w.path)
        # (the ops the file keeps: all of them after a good close, else the last flush's)
        return ("closed", w.bytes_written, w.durable_ops, err)


def _main() -> None:
    fd = int(sys.argv[1])
    server = _Server(Connection(fd))
    try:    # stop with the caller (Linux): no orphan writing after a SIGKILL
        import ctypes

        def _parent_gone(signum, frame):
            server.parent_gone = True       # acted on between two messages (serve)

        signal.signal(signal.SIGTERM, _parent_gone)
        # a Ctrl-C reaches the whole process group: the caller decides what it means
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)     # PR_SET_PDEATHSIG
        if os.getppid() == 1:
            os._exit(0)
    except Exception:  # noqa: BLE001 - end of file on the connection still ends us
        pass
    server.serve()


if __name__ == "__main__":
    _main()
