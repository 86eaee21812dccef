"""Write statistics-only dumps as tables (format 1.1, see dumpfile.stats_table).

`StatsDumpWriter` is a DumpWriter whose ops are index rows plus rows of the stats
table, appended in batches of ~1,024 rows (low-level h5py; per 3,000 rows 11 ms in batches of 64,
8 ms of 256, ~18% less again in batches of 1,024: the per-call cost of the set-extent and
selection; the rest is HDF5's own per-row work on the variable-length cells) and made
durable at each flush (at least every `flush_interval` seconds, and at close): no HDF5
object is created per op, where the tree layout cost ~0.5 ms of h5py work (holding the
GIL) per op.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from .. import schema as S
from ..errors import DumpWriteError
from ..stats_table import OP_ATTR_DTYPE, STATS_ROW_DTYPE, append_rows, op_attr_row, table, value_row
from . import room
from .h5objects import SpaceClaimError, claim_blocks
from .writer import _INDEX_DTYPE, DumpWriter, _scalar_type_code, set_attrs


def value_type_code(value: Any, schema_type: str | None) -> int:
    """The Type code the tree layout gives a non-tensor value (DumpWriter.write_value)."""
    if isinstance(value, (list, tuple)):
        items = list(value)
        if items and all(isinstance(v, bool) for v in items):
            return S.TYPE_BOOL_LIST
        if all(isinstance(v, int) and not isinstance(v, bool) for v in items):
            st = (schema_type or "").replace(" ", "")
            return S.TYPE_INT_ARRAY_REF if st.startswith(("int[", "SymInt[")) else S.TYPE_INT_LIST
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in items):
            return S.TYPE_FLOAT_LIST
        return S.TYPE_LIST
    return _scalar_type_code(value, schema_type)


def value_rows(seqid: int, io: int, name: str, value: Any, schema_type: str | None = None) -> list[tuple]:
    """Rows of a non-tensor value; mixed lists as a header row plus `{name}/{name}_{i}` rows."""
    code = value_type_code(value, schema_type)
    if code != S.TYPE_LIST:
        return [value_row(seqid, io, name, code, list(value) if isinstance(value, tuple) else value)]
    base = name.rsplit("/", 1)[-1]
    rows = [value_row(seqid, io, name, S.TYPE_LIST, len(value))]
    for i, v in enumerate(value):
        rows += value_rows(seqid, io, f"{name}/{base}_{i}", v)
    return rows


class StatsDumpWriter(DumpWriter):
    """A statistics-only dump: `add_op(...)` per op; rows land in the file in batches of
    about ROWS_PER_WRITE (from the writer thread, while the model computes, so that little
    is left for the close) and become durable at the next flush."""

    ROWS_PER_WRITE = 1024

    def __init__(self, path, *, defer_open: bool = False, **kw):
        """`defer_open=True`: the file is created by `open()` (the dumper's writer thread
        calls it, so that ~2 ms of HDF5 file set-up overlap the model's first ops)."""
        kw.setdefault("direct_write", False)
        kw.setdefault("reserve_bytes", 1 << 20)    # the final flush of a table needs little
        self.path = os.fspath(path)
        self._root = {k: v for k, v in (kw.pop("root_attrs", None) or {}).items() if v is not None}
        self._open_kw = kw
        self._opened = False
        self._reserve = None
        self.num_ops = 0
        self.bytes_written = 0
        # the tables are made at the first write of rows (by the writer thread)
        self._stats_ds = None
        self._attrs_ds = None                      # made when an op has extra attributes
        self._pending_rows: list[tuple] = []
        self._pending_attrs: list[tuple] = []
        self._op_ends: list[tuple[int, int]] = []  # per pending op: its rows' and attributes' ends
        if not defer_open:
            self.open()

    def open(self) -> None:
        """Create the file (once). Raises DumpWriteError as DumpWriter does."""
        if self._opened:
            return
        super().__init__(self.path, **self._open_kw)
        set_attrs(self._f, self._root)            # low level: several times faster
        self._opened = True

    @property
    def file(self):
        """The open h5py.File, or None when open() never succeeded."""
        return self._f if self._opened else None

    def close(self, complete: bool = True) -> None:
        if self._opened:
            super().close(complete)

    def add_op(self, op: str, seqid: int, rows: list[tuple], *, phase: str = S.PHASE_FORWARD,
               module: str = "", grad_fn: str = "", attrs: dict[str, Any] | None = None) -> None:
        """One op: its value rows (dumpfile.stats_table.tensor_row / value_row) and extra attributes."""
        self._pending_rows.extend(rows)
        for k, v in (attrs or {}).items():
            if v is not None:
                self._pending_attrs.append(op_attr_row(int(seqid), k, v))
        self._pending_index.append(
            (int(seqid), op, S.PHASE_CODES.get(phase, -1), module or "", grad_fn or ""))
        self._op_ends.append((len(self._pending_rows), len(self._pending_attrs)))
        self.num_ops += 1
        if len(self._pending_rows) >= self.ROWS_PER_WRITE:
            self._write_rows()
        self.maybe_flush()

    def begin_op(self, *a, **kw):
        raise DumpWriteError(f"{self.path}: a statistics table file has no op groups (use add_op)")

    def _write_rows(self) -> None:
        """Pending value rows, then the index rows of their ops, into the datasets (HDF5's
        cache; durable at the next flush, as every op of the tree layout).

        Where room is tight (room.py), the space is claimed first. When not all pending
        ops fit, those that do are written and flushed at once (the file's own size then
        replaces the estimate) and the rest tried again; when not one more fits, the rest
        are dropped and the writer stops with the claim's error (its last flush lists every
        op written). The room left shrinks by a factor each round: a few rounds."""
        fit, no_room = self._room_for_pending()
        while fit < len(self._pending_index):
            rest = self._take_pending_after(fit)
            self._write_pending()
            self.num_ops -= len(rest[2])
            if fit == 0:
                # (as DumpWriter.reserve_tensor: the caller's fail() finds the claim behind it
                # and leaves the file open for a last flush of the ops written)
                raise DumpWriteError(f"{self.path}: write failed ({no_room})") from no_room
            DumpWriter.flush(self)         # (DurableFile's: the rows are written)
            self.num_ops += len(rest[2])
            self._pending_rows, self._pending_attrs, self._pending_index, self._op_ends = rest
            fit, no_room = self._room_for_pending()
        self._write_pending()

    def _write_pending(self) -> None:
        try:
            if self._stats_ds is None:
                self._stats_ds = table(self._f, S.STATS_TABLE_PATH, STATS_ROW_DTYPE)
            append_rows(self._stats_ds, self._pending_rows, STATS_ROW_DTYPE)
            if self._pending_attrs:
                if self._attrs_ds is None:
                    self._attrs_ds = table(self._f, S.OP_ATTRS_PATH, OP_ATTR_DTYPE)
                append_rows(self._attrs_ds, self._pending_attrs, OP_ATTR_DTYPE)
        except (OSError, RuntimeError) as e:
            raise self.fail(e) from e
        if self._pending_rows or self._pending_index:
            self._unflushed = True
        self.bytes_written += len(self._pending_rows) * STATS_ROW_DTYPE.itemsize
        self._pending_rows.clear()
        self._pending_attrs.clear()
        if self._pending_index:
            try:
                append_rows(self._index, self._pending_index, _INDEX_DTYPE)
            except (OSError, RuntimeError) as e:
                raise self.fail(e) from e
            self._pending_index.clear()
        self._op_ends.clear()

    def _take_pending_after(self, k: int) -> tuple[list, list, list, list]:
        """The pending ops after the first k, taken out (rows, attributes, index rows, ends)."""
        rows, attrs = self._op_ends[k - 1] if k else (0, 0)
        rest = (self._pending_rows[rows:], self._pending_attrs[attrs:], self._pending_index[k:],
                [(r - rows, a - attrs) for r, a in self._op_ends[k:]])
        del self._pending_rows[rows:], self._pending_attrs[attrs:], self._pending_index[k:]
        del self._op_ends[k:]
        return rest

    def _room_for_pending(self) -> tuple[int, SpaceClaimError | None]:
        """How many of the pending ops (whole, in order) have room, their space claimed:
        all of them unless room is tight (room.TIGHT_ROOM); then with the claim's error
        when not all fit. The estimate (room.py) is taken room.ESTIMATE_FACTOR times: what
        HDF5 allocates besides (partly used heap collections, chunk index nodes)."""
        n = len(self._pending_index)
        if not n or not self._claim_blocks or self._failed is not None:
            return n, None
        try:
            fd = self._f.id.get_vfd_handle()
        except Exception:  # noqa: BLE001 - not a plain POSIX file: nothing to claim
            return n, None
        if not isinstance(fd, int) or fd < 0:
            return n, None
        left = room.room_left(fd)
        if left is None or left > room.TIGHT_ROOM:
            return n, None
        heap_rows = np.cumsum([0] + room.heap_bytes_per_row(self._pending_rows, STATS_ROW_DTYPE))
        heap_attrs = np.cumsum([0] + room.heap_bytes_per_row(self._pending_attrs, OP_ATTR_DTYPE))
        heap_index = np.cumsum([0] + room.heap_bytes_per_row(self._pending_index, _INDEX_DTYPE))
        base = self._f.id.get_filesize() + self._flush_headroom() + room.HEAP_SLACK

        def cost(k: int) -> int:        # the first k pending ops' rows, as stored
            if k == 0:
                return 0
            rows, attrs = self._op_ends[k - 1]
            return int(room.ESTIMATE_FACTOR * (room.chunk_growth(self._stats_ds, STATS_ROW_DTYPE, rows)
                                               + room.chunk_growth(self._attrs_ds, OP_ATTR_DTYPE, attrs)
                                               + room.chunk_growth(self._index, _INDEX_DTYPE, k)
                                               + heap_rows[rows] + heap_attrs[attrs] + heap_index[k]))

        def claim(k: int) -> SpaceClaimError | None:
            size = os.fstat(fd).st_size
            want = base + cost(k)
            if want > size:
                try:
                    if not claim_blocks(fd, size, want - size):
                        self._claim_blocks = False
                except SpaceClaimError as e:
                    return e
            return None
        try:
            error = claim(n)
            if error is None:
                return n, None
            lo, hi = 0, n - 1           # the most whole ops that fit: lo (claimed)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if claim(mid) is None:
                    lo = mid
                else:
                    hi = mid - 1
        except OSError:
            return n, None              # (fstat: the flush reports what is wrong)
        return lo, error

    def _tables(self) -> list:
        return super()._tables() + [self._stats_ds, self._attrs_ds]

    def flush(self, *, final: bool = False) -> None:
        if self._failed is not None and (self._frozen or not final):
            raise self._failed
        self._write_rows()     # rows before index rows: an op in the index has its values
        super().flush(final=final)
