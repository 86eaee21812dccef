"""The dump writer process: a DumpWriter serving one caller over a socket (remote.py).

Started by the caller as `python -c BOOTSTRAP ROOT FD` (child_env.py: the caller's dumpfile
first on the path, ahead of the working folder; never a fork of a
process with torch threads) and reused for the caller's later dump files. It makes
exactly the DumpWriter calls the writer thread would make for each op record, replies
with the file offsets of the tensors it reserved, and publishes an op only once the
caller says its bytes are written (`release`). The protocol, and why no side can
deadlock, are in remote.py's docstring; both ends change together.

End of file on the connection, the caller's death (the kernel sends PARENT_DEATH_SIGNAL
through PR_SET_PDEATHSIG, acted on once our parent changed: it comes too when only the
thread that started us ends) or SIGTERM (the caller's watchdog stops a hung child) makes
it close
the file as of the ops the caller released (`complete` False) and exit, between two
messages, never inside an HDF5 call. It ignores SIGINT: a Ctrl-C sent to the terminal's
process group is the caller's to act on.

Torch-free: imports only dumpfile, h5py and numpy.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from multiprocessing.connection import Connection

import numpy as np

from ..errors import DumpWriteError, writer_error_message
from .writer import DumpWriter, TensorMeta

# TensorMeta per distinct record: ops repeat a few tensor descriptions step after step
_METAS: dict[tuple, TensorMeta] = {}


def tensor_meta(rec: tuple) -> TensorMeta:
    """The TensorMeta of a record's tensor: (dtype, shape, stride, storage offset, device,
    uninitialized, extra attributes or None), as npu_dumper.sinks.process sends it."""
    if rec[6] is not None:
        return TensorMeta(rec[0], tuple(rec[1]), tuple(rec[2]), rec[3], rec[4],
                          uninitialized=rec[5], extra=dict(rec[6]))
    meta = _METAS.get(rec)
    if meta is None:
        if len(_METAS) >= 8192:
            _METAS.clear()
        meta = _METAS[rec] = TensorMeta(rec[0], tuple(rec[1]), tuple(rec[2]), rec[3], rec[4],
                                        uninitialized=rec[5])
    return meta


class _Server:
    def __init__(self, conn: Connection, caller_pid: int | None = None):
        self.conn = conn
        self.w = None
        self.error: str | None = None
        self.flush_interval = 1.0
        self.caller_pid = caller_pid if caller_pid is not None else os.getppid()

    parent_gone = False     # set by SIGTERM (the caller died, or its watchdog asks us to stop)

    def _stop_asked(self) -> bool:
        # (getppid: the caller's death also when a signal was missed; one cheap syscall)
        return self.parent_gone or os.getppid() != self.caller_pid

    def serve(self) -> None:
        conn = self.conn
        while True:
            if self._stop_asked():
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
                # the message just received is the first the caller sent before it died:
                # dropping it lost that op, and the ops after it that link to its tensors
                # failed ("component not found") and froze the file at its last flush
                # (issue 15: ~4 kills in 100)
                self._caller_gone(msg)
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

    def _caller_gone(self, pending: tuple | None = None) -> None:
        """Close the file as of the ops the caller released (never marked complete), so
        that plain HDF5 tools open it and its lock is let go, then exit. Exiting without
        closing left the metadata HDF5 had evicted since the last flush pointing past the
        end of allocation the superblock records (4 and 9 files in 10 did not open)."""
        try:
            if self.w is not None:
                self._drain(pending)
                self._close(False, {})
        finally:
            os._exit(0)

    def _drain(self, pending: tuple | None = None) -> None:
        """The messages the caller sent before it died (`pending`, received already, first):
        SIGTERM comes at once, while its last ops and releases may still wait in the
        socket (a kill lost up to a flush interval of ops that way)."""
        conn = self.conn
        try:
            while pending is not None or conn.poll(0):
                msg, pending = (pending if pending is not None else conn.recv()), None
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
            self.w = DumpWriter(path, mode=mode, root_attrs=root_attrs,
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
        if kind == "bytes":
            _, raw, dtype, shape, meta = node
            arr = np.frombuffer(raw, dtype=dtype).reshape(shape)
            w.write_tensor(parent, name, arr, tensor_meta(meta))
        elif kind == "reserve":
            _, shape, dtype, meta = node
            r = w.reserve_tensor(parent, name, shape, np.dtype(dtype), tensor_meta(meta))
            if r is None:
                raise DumpWriteError(f"{w.path}: {parent.name}/{name}: cannot reserve a "
                                     "contiguous dataset for the dump writer process")
            offsets.append(r[1])
        elif kind == "link":
            w.link(parent, name, node[1])
        elif kind == "view":
            w.write_view(parent, name, node[1], tensor_meta(node[2]))
        elif kind == "tensor":
            w.write_tensor(parent, name, node[1], tensor_meta(node[2]))
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


# The signal the kernel sends us when our parent ends (PR_SET_PDEATHSIG).
PARENT_DEATH_SIGNAL = signal.SIGUSR1


def _child_main(argv: list[str]) -> None:
    """Serve the caller on socket `argv[0]` (a descriptor number) until it is done."""
    fd = int(argv[0])
    # fault injection for the tests: a start-up as slow as a loaded machine's
    delay = os.environ.get("DUMPFILE_TEST_START_DELAY_S")
    if delay:
        time.sleep(float(delay))
    caller = os.getppid()       # our parent, the caller, while it lives
    server = _Server(Connection(fd), caller)
    try:    # stop with the caller (Linux): no orphan writing after a SIGKILL
        import ctypes

        def _stop(signum, frame):
            server.parent_gone = True       # acted on between two messages (serve)

        def _parent_died(signum, frame):
            # PR_SET_PDEATHSIG fires when the *thread* that started us ends, not only the
            # caller's process: a dump run from a thread (or prestart() called from one)
            # whose thread ended while a later dump used this pooled child had its file
            # closed under it. Only a caller gone (we were reparented) ends the dump.
            if os.getppid() != server.caller_pid:
                server.parent_gone = True

        signal.signal(signal.SIGTERM, _stop)    # the caller's watchdog, or anyone: stop
        signal.signal(PARENT_DEATH_SIGNAL, _parent_died)
        # a Ctrl-C reaches the whole process group: the caller decides what it means
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        ctypes.CDLL(None).prctl(1, int(PARENT_DEATH_SIGNAL))     # PR_SET_PDEATHSIG
        if caller == 1 or os.getppid() != caller:      # it died before prctl
            os._exit(0)
    except Exception:  # noqa: BLE001 - end of file on the connection still ends us
        pass
    server.serve()


if __name__ == "__main__":
    _child_main(sys.argv[1:])
