"""The dump writer with its HDF5 work in a separate process (`dumper(..., writer="process")`).

Same pipeline as WriterThread (capture, copy-on-write, deduplication, bounded queue,
errors re-raised in the user's thread), but the metadata thread makes no h5py call:
it turns each op into a small picklable record (deduplication decided here, where the
captures and their storages live) and sends it to a dumpfile.write.remote child,
which makes the DumpWriter calls on its own GIL. The child replies with the file
offsets of the large tensors it reserved; the data thread writes their bytes with
os.pwrite on this process's own descriptor (GIL-free, as in the thread writer), then
counts the op complete, and the metadata thread tells the child (`release`), in op
order; only complete ops are published at the child's flushes. The file is the one
WriterThread writes.

Only the metadata thread sends to the child and only the data thread reads its replies:
the data thread never waits on a send, so a slow child (a slow disk) slows the dump
down and cannot deadlock it (with the data thread sending releases under a lock the
metadata thread held inside a blocking send, both sides ended up blocked in a send).
"""

from __future__ import annotations

import ctypes

from dumpfile import schema as S
from dumpfile.errors import DumpError, DumpWriteError
from dumpfile.write.remote import RemoteDumpWriter
from dumpfile.write.writer import DIRECT_WRITE_MIN_BYTES

from ..capture import ListOf, Named, TensorCapture, Value
from ..capture.tensors import storage_array
from .plan import LINK, VIEW, deferred_dtype, storage_dtype
from .protocol import OpJob
from .thread import WriterThread


def _plain(v):
    """Values as plain Python types, so unpickling in the child never imports torch."""
    t = type(v)
    if t in (int, float, bool, str, complex) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    for cast in (bool, int, float, complex, str):
        if isinstance(v, cast):
            return cast(v)
    return str(v)


def meta_record(cap: TensorCapture) -> tuple:
    """The TensorMeta of a capture as the child takes it (remote_child.tensor_meta): a
    tuple pickles in a fraction of a dataclass's time and bytes."""
    return (cap.dtype, cap.shape, cap.stride, cap.offset, cap.device, bool(cap.uninitialized),
            cap.extra or None)


_DIRECT = DIRECT_WRITE_MIN_BYTES


def _small_bytes(cap: TensorCapture) -> bytes | None:
    """The bytes a small tensor is stored as, copied from its storage (call under
    cap.lock), or None where that does not apply. Applies to a capture still holding its
    CPU storage (a plain tensor, no conj/neg bit: TensorCapture keeps the storage only
    then), laid out in C order, of a dtype stored as its own bytes (every stored dtype
    but complex32, whose stored array has another shape): the stored array's bytes are
    then exactly the storage's bytes from the tensor's offset."""
    st = cap._storage
    if st is None or cap.device != "cpu" or cap.nbytes >= _DIRECT or cap.dtype == "complex32":
        return None
    dt = storage_dtype(cap.dtype)
    if dt is None or not dt.isnative:
        return None
    expected = 1
    for n, s in zip(reversed(cap.shape), reversed(cap.stride)):
        if n != 1 and s != expected:
            return None
        expected *= n
    if len(cap.stride) != len(cap.shape) or dt.itemsize * expected != cap.nbytes:
        return None
    if not cap.nbytes:
        return b""
    return ctypes.string_at(st.data_ptr() + cap.offset * dt.itemsize, cap.nbytes)


class ProcessWriter(WriterThread):
    def __init__(self, writer: RemoteDumpWriter, registry, **kw):
        kw.pop("stats_only", None)
        super().__init__(writer, registry, stats_only=False, **kw)

    # ---- metadata thread: records instead of HDF5 calls -----------------------------
    def _write_job(self, job: OpJob) -> None:
        base = S.op_group_path(job.op, job.seqid)
        groups = []
        for group_name, entries in ((S.INPUT_GROUP, job.inputs), (S.OUTPUT_GROUP, job.outputs)):
            gpath = f"{base}/{group_name}"
            groups.append([(name, self._record(gpath, name, node)) for name, node in entries])
        attrs = {k: _plain(v) if not hasattr(v, "dtype") else v for k, v in job.attrs.items()}
        self._release_written()     # ops the data thread completed meanwhile
        self.writer.send(("op", (job.op, int(job.seqid), job.phase, job.module, job.grad_fn,
                                 attrs, groups[0], groups[1])))
        job._sent = True

    def _record(self, gpath: str, name: str, node):
        if isinstance(node, TensorCapture):
            return self._tensor_record(gpath, name, node)
        if isinstance(node, Value):
            return ("value", _plain(node.value), node.schema_type or None)
        if isinstance(node, Named):
            return ("named", node.value, node.type_code, node.schema_type or None)
        if isinstance(node, ListOf):
            lpath = f"{gpath}/{name}"
            return ("list", node.type_code, node.schema_type or None,
                    [(f"{name}_{i}", self._record(lpath, f"{name}_{i}", item))
                     for i, item in enumerate(node.items)])
        return ("value", str(node), None)   # pragma: no cover - capture builds only the above

    def _tensor_record(self, gpath: str, name: str, cap: TensorCapture):
        """The plan's placement of one capture as a record for the child (the paths the
        child will create are known here: `{group}/{name}`)."""
        path = f"{gpath}/{name}"
        p = self.plan.place(cap)
        if p.kind is LINK:
            self.plan.stored(p, path, cap)
            return ("link", p.ref)
        if p.kind is VIEW:
            self.plan.stored(p, path, cap)
            return ("view", p.ref, meta_record(cap))
        with cap.lock:
            raw = _small_bytes(cap)
            if raw is not None:
                # the stored bytes read straight from the kept storage (no tensor rebuilt,
                # no numpy array pickled); the capture is written from here on
                rec = ("bytes", raw, storage_dtype(cap.dtype).str, cap.shape, meta_record(cap))
                cap.done = True
                cap.tensor = None
                self.plan.stored(p, path, cap)
                return rec
            t = cap.tensor
            dt = deferred_dtype(cap, t)
            if dt is not None:
                rec = ("reserve", cap.shape, dt.str, meta_record(cap))
                self._pieces.append((cap, None, cap.nbytes))   # the data thread writes the bytes
            else:
                # a copy: storage_array may view the live tensor, and the record is pickled
                # only when the whole op is sent; once `done` is set, copy-on-write no longer
                # saves this capture, so a later in-place op could change what is sent
                rec = ("tensor", storage_array(t).copy(), meta_record(cap))
                cap.done = True
                cap.tensor = None
        self.plan.stored(p, path, cap)
        return rec

    def _idle_flush(self) -> None:
        self._release_written()     # the child flushes on its own clock

    def _fail_file(self, e: BaseException) -> None:
        # the child keeps the file: a failure it reported has frozen it there already
        # (DumpWriter.fail); after one here (a lost child, a failed pwrite) the close tells
        # it the dump is incomplete, and its last flush keeps every op released before
        pass

    def _release_due(self) -> bool:
        # wake the (idle) metadata thread as soon as the data thread completed an op: it
        # alone sends, and the child publishes an op only once told
        return self._error is None and self._data_ok > self._released

    def _finish_data(self) -> None:
        with self._cv:
            self._data_queue.append(None)
            self._cv.notify_all()
        self._data_thread.join()
        try:
            self._release_written()     # even after a failure: the ops before it are whole
        except BaseException as e:  # noqa: BLE001 - raised at block exit
            self._fail(e)

    # ---- data thread ------------------------------------------------------------------------
    def _write_pieces(self, job, pieces: list, ok: bool) -> bool:
        """The child's reply (the offsets it reserved), then the bytes."""
        offsets = []
        if getattr(job, "_sent", False):
            reply = self.writer.recv()
            if reply[0] == "ok":
                offsets = reply[1]
                if len(offsets) != len(pieces):
                    raise DumpError(f"{self.writer.path}: dump writer process reserved "
                                    f"{len(offsets)} tensors for {len(pieces)}")
            else:
                ok = False
                if reply[0] == "err":
                    self._fail(DumpWriteError(reply[1]))
        if ok and not self._data_failed:
            for (cap, _, nbytes), offset in zip(pieces, offsets):
                self._write_bytes(cap, offset, nbytes)
        return ok
