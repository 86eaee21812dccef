"""Orderings around a dump writer's end that a kill test meets only by chance (issue 15),
forced here: what the writer does after HDF5 lets go of the file, a reader racing it, the
writer child's last messages when its caller dies, and the thread that started the child."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import h5py
import numpy as np
import torch

import npu_dumper
from dumpfile import DumpFile
from dumpfile.read import recovery
from dumpfile.write import remote
from dumpfile.write.writer import DumpWriter

ROOT = Path(__file__).resolve().parents[1]


def _ops(w: DumpWriter, n: int, start: int = 1) -> None:
    for seqid in range(start, start + n):
        w.begin_op("aten.neg.default", seqid)
        w.write_value(w.io_groups()[0], "alpha", float(seqid))
        w.end_op()


def test_the_file_size_is_hdf5s_own_before_hdf5_lets_go_and_unchanged_after(tmp_path):
    """The disk space claimed past HDF5's end of allocation at each flush is given back
    while HDF5 still holds its lock; nothing changes the file's size after HDF5's close.
    Before: the file stayed headroom-long past HDF5's end whenever HDF5's close did not
    truncate it, and was cut after the close, under a reader that had looked at its size."""
    p = str(tmp_path / "d.h5")
    w = DumpWriter(p, flush_interval=0.0)
    _ops(w, 30)
    seen = {}
    hdf5_close = w._f.close

    def close_and_look():
        seen["size"], seen["hdf5_size"] = os.path.getsize(p), w._f.id.get_filesize()
        hdf5_close()
        seen["after"] = os.path.getsize(p)

    w._f.close = close_and_look
    w.close(complete=False)
    assert seen["size"] <= seen["hdf5_size"], seen      # the headroom was gone already
    assert os.path.getsize(p) == seen["after"] == recovery.stored_eoa(p)[1], seen
    with h5py.File(p, "r") as f:
        assert int(f.attrs["num_ops"]) == 30 and not f.attrs["complete"]


def test_a_reader_survives_a_file_cut_short_that_shrinks_before_it_opens(tmp_path, monkeypatch):
    """DumpFile of an incomplete file past its recorded end of allocation raises that end
    to the file's size (dumpfile.read.recovery). A file that shrank between that look and
    the open (a writer closing it) failed with "truncated file: eof = N, stored_eof = N +
    what was cut": the failure of the process-writer kill test in 1 of ~6 full runs."""
    p = str(tmp_path / "d.h5")
    w = DumpWriter(p)
    _ops(w, 5)
    w.close(complete=False)
    eoa = recovery.stored_eoa(p)[1]
    os.truncate(p, eoa + 41984)             # the headroom a writer claims past it
    looked = recovery.is_cut_short

    def look_then_writer_trims(path):
        cut = looked(path)
        os.truncate(path, eoa)              # a writer giving that space back meanwhile
        return cut

    monkeypatch.setattr(recovery, "is_cut_short", look_then_writer_trims)
    with DumpFile(p) as f:
        assert [o.seqid for o in f.ops()] == [1, 2, 3, 4, 5]
    os.truncate(p, eoa + 4096)              # and one still cut short opens as before
    monkeypatch.setattr(recovery, "is_cut_short", looked)
    with DumpFile(p) as f:
        assert f._source is not None and len(f.ops()) == 5


def test_the_writer_child_keeps_the_message_it_received_as_its_caller_died(tmp_path):
    """SIGTERM (the caller's death) arriving while the child receives an op: that op and
    the ones after it are written. Before, it was dropped, the next op's hard link to its
    tensor failed ("component not found") and froze the file at its last flush: the ops
    released since were lost (4 kills in ~100 of the kill test's workload)."""
    p = tmp_path / "d.h5"
    code = textwrap.dedent(f"""
        import socket
        import numpy as np
        from multiprocessing.connection import Connection
        from dumpfile import schema as S
        from dumpfile.write import remote_child

        a, b = socket.socketpair()
        caller, conn = Connection(a.detach()), Connection(b.detach())
        x = np.arange(16, dtype=np.float32)
        first = S.op_group_path("aten.neg.default", 1) + "/" + S.INPUT_GROUP + "/self"

        def op(seqid, node):
            return ("op", ("aten.neg.default", seqid, "forward", "", "", {{}}, [("self", node)], []))

        for m in [("open", {str(p)!r}, S.MODE_DUMP, {{}}, 100.0),
                  op(1, ("tensor", x, ("float32", (16,), (1,), 0, "cpu", False, None))), ("release", 1),
                  op(2, ("link", first)), ("release", 1)]:
            caller.send(m)
        server = remote_child._Server(conn)
        recv = conn.recv

        def recv_as_the_caller_dies():
            msg = recv()
            if msg[0] == "op":
                server.parent_gone = True       # what the SIGTERM handler sets
            return msg

        conn.recv = recv_as_the_caller_dies
        server.serve()      # closes the file and exits
    """)
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(ROOT)),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    with h5py.File(p, "r") as f:
        assert int(f.attrs["num_ops"]) == 2 and not f.attrs["complete"]
    with DumpFile(p) as f:
        ops = f.ops()
        assert [o.seqid for o in ops] == [1, 2]
        np.testing.assert_array_equal(ops[1].inputs()["self"].read(), np.arange(16, dtype=np.float32))


def test_the_writer_child_outlives_the_thread_that_started_it(tmp_path):
    """PR_SET_PDEATHSIG fires when the *thread* that started the child ends. A pooled child
    started from a thread (here prestart(); a dumper block run in a thread does the same)
    closed the file of a later dump the moment that thread ended, and the dump failed
    ("dump writer process died"). Only the caller's process ending stops it now."""
    with remote._pool_lock:
        old, remote._pooled = remote._pooled, None
    if old is not None:
        old.discard()
    started, finish = threading.Event(), threading.Event()

    def starter():
        remote.prestart()       # the pooled child, started from this thread
        started.set()
        finish.wait(600)

    t = threading.Thread(target=starter)
    t.start()
    assert started.wait(600)
    p = tmp_path / "t.h5"
    with npu_dumper.dumper(use_dump=True, dump_path=str(p), writer="process",
                           flush_interval=0.2) as d:
        x = torch.ones(8)
        for _ in range(20):
            x = x.neg()
        finish.set()
        t.join()
        time.sleep(0.5)         # (the child's signal comes now; it acts between messages)
        for _ in range(20):
            x = x.neg()
    assert d.summary["ops_kept"] == d.summary["ops_recorded"] >= 40
    with h5py.File(p, "r") as f:
        assert f.attrs["complete"] and int(f.attrs["num_ops"]) >= 40
