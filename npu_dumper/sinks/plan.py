"""What each captured tensor becomes in the dump: the one planning step every sink runs.

`StoragePlan.place(cap)` decides, for one TensorCapture, before anything is written:

- `NEW`: data not seen before. A full dump stores it (its bytes written inline, or by the
  data thread into a dataset reserved now: `deferred_dtype`); a statistics dump computes
  its statistics row.
- `LINK`: the same data as something stored earlier (same storage, same write state, same
  layout; for statistics the same element set, as W and W.t() share statistics and
  hashes): a hard link to that dataset, or the statistics it had.
- `VIEW`: a re-striding of stored data (the stored tensor dense, non-overlapping and
  covering the elements): a Type 40 view entry naming the stored dataset. Full dumps only.

The sink executes the placement and reports what it stored with `stored(placement, ref,
cap)`: the path of the dataset (or the statistics) that later captures link to. The thread
writer, the process writer and the statistics writer all plan through this class, so the
file holds the same links and views whichever of them wrote it.

The dedup maps and their invalidation live here. A key holds the storage's address, its
write generation (CaptureRegistry bumps it at every write of the storage the dumper sees,
hidden writes and storage resizes included; conj/neg bits and a DTensor's layout are part
of it, as a conj view holds other values than its storage), the version counter, the
dtype and the layout. An entry is valid while the storage it was made from lives
(`cap.owner`, a weak reference: the address cannot be reused before the storage dies).
Dead entries are dropped when met and in a sweep each time the maps have doubled: a long
dump reuses a few allocator addresses for thousands of storages, and a list of dead bases
per address made each op's view lookup walk every earlier op of that address (the exit
cost per op grew with the op count).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from dumpfile import schema as S
from dumpfile.write.writer import DIRECT_WRITE_MIN_BYTES

from ..capture import TensorCapture

NEW = "new"
LINK = "link"
VIEW = "view"


class Placement(NamedTuple):
    kind: str           # NEW, LINK or VIEW
    ref: Any            # LINK: what the earlier capture stored; VIEW: the base dataset's path
    key: tuple | None   # the dedup key (None: never deduplicated)


_NEVER = Placement(NEW, None, None)
# place()'s key argument when the caller has not made the capture's key
KEY_UNKNOWN = object()


def is_dense(shape: tuple, stride: tuple) -> bool:
    """Non-overlapping and dense: the elements fill a contiguous storage range."""
    dims = sorted((st, sz) for sz, st in zip(shape, stride) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True


def extent(shape: tuple, stride: tuple, offset: int) -> tuple[int, int]:
    """[first, last] storage element a strided tensor touches (non-negative strides)."""
    return offset, offset + sum((d - 1) * s for d, s in zip(shape, stride))


_NUMPY_STORAGE: dict[str, np.dtype] = {}


def storage_dtype(dtype_name: str) -> np.dtype | None:
    """The numpy dtype a tensor of this torch dtype is stored as (schema.STORAGE_NUMPY_DTYPE)."""
    dt = _NUMPY_STORAGE.get(dtype_name)
    if dt is None:
        name = S.STORAGE_NUMPY_DTYPE.get(dtype_name)
        if name is None:
            return None
        dt = _NUMPY_STORAGE[dtype_name] = np.dtype(name)
    return dt


def deferred_dtype(cap: TensorCapture, t: torch.Tensor) -> np.dtype | None:
    """The stored dtype when NEW data's bytes can be written later by the data thread
    (a dataset reserved now, its bytes moved with os.pwrite without the GIL): a strided
    tensor of a natively stored dtype, large enough for the direct path. None: the data
    is written with its dataset (small tensors, complex32, other layouts)."""
    if not cap.stride or cap.dtype == "complex32" or t.layout != torch.strided \
            or cap.nbytes < DIRECT_WRITE_MIN_BYTES:
        return None
    dt = storage_dtype(cap.dtype)
    return dt if dt is not None and dt.isnative else None


class StoragePlan:
    """Dedup state of one dump: which captures are new data, links or views.

    `dedup=False`: every capture is NEW. `views=False` (statistics dumps): keys ignore
    element order (W and W.t() are one LINK) and no VIEW is planned.
    Used from one thread (the sink's metadata thread); not locked.
    """

    def __init__(self, *, dedup: bool = True, views: bool = True):
        self.dedup = dedup
        self.views = views
        self._exact: dict[tuple, tuple[Any, Any]] = {}     # key -> (ref, owner)
        self._unwritten: dict[tuple, Any] = {}               # key of an uninitialized capture -> owner
        # (ptr, gen, version, dtype) -> [(first, last element, base path, owner)], oldest first
        self._bases: dict[tuple, list[tuple[int, int, str, Any]]] = {}
        self._sweep_at = 1024
        self.num_links = 0
        self.num_views = 0
        self.num_datasets = 0

    def key(self, cap: TensorCapture) -> tuple | None:
        """The capture's dedup key; None when it is never deduplicated (no storage)."""
        if not self.dedup or not cap.ptr or cap.owner is None:
            return None
        if self.views:
            return (cap.ptr, cap.gen, cap.version, cap.dtype, cap.shape, cap.stride, cap.offset)
        # statistics do not depend on element order, and hashes are of storage order
        return (cap.ptr, cap.gen, cap.version, cap.dtype,
                tuple(sorted(zip(cap.shape, cap.stride))), cap.offset)

    def earlier(self, key: tuple | None) -> Any:
        """What an earlier, still valid capture of the same key stored (None: nothing)."""
        if key is None:
            return None
        hit = self._exact.get(key)
        if hit is None:
            return None
        if hit[1]() is None:
            del self._exact[key]
            return None
        return hit[0]

    def place(self, cap: TensorCapture, key: Any = KEY_UNKNOWN) -> Placement:
        """`key`: the capture's key when the caller has it already (self.key(cap))."""
        if key is KEY_UNKNOWN:
            key = self.key(cap)
        if key is None:
            return _NEVER
        ref = self.earlier(key)
        if ref is not None:
            return Placement(LINK, ref, key)
        if not cap.uninitialized:
            owner = self._unwritten.get(key)
            if owner is not None and owner() is not None:
                cap.uninitialized = True    # the storage an uninitialized capture left (stored)
        if self.views and cap.stride and all(s >= 0 for s in cap.stride):
            bases = self._bases.get(key[:4])
            if bases:
                lo, hi = extent(cap.shape, cap.stride, cap.offset)
                for b_lo, b_hi, b_path, b_owner in bases:
                    if b_lo <= lo and hi <= b_hi and b_owner() is not None:
                        return Placement(VIEW, b_path, key)
        return Placement(NEW, None, key)

    def stored(self, p: Placement, ref: Any, cap: TensorCapture) -> None:
        """The sink executed `p`: `ref` is what later captures of the same data link to
        (the dataset's path, or the statistics)."""
        kind, key = p.kind, p.key
        if kind is LINK:
            self.num_links += 1
            return
        if kind is VIEW:
            self.num_views += 1
        else:
            self.num_datasets += 1
        if key is None:
            return
        if cap.uninitialized:
            # an uninitialized capture (an empty-like op's result, an out= buffer) is no
            # link target: a later read of that storage at the same version may see what a
            # write no dispatched op makes put there (torch.tensor([...]) fills its `empty`
            # by a memcpy the dispatcher never sees: DDP's bucket sizes), so it is stored as
            # that op read it, and flagged uninitialized still (place: it may be garbage)
            self._unwritten[key] = cap.owner
            if len(self._unwritten) >= self._sweep_at:
                self._sweep()
            return
        self._exact[key] = (ref, cap.owner)
        if kind is NEW and self.views and cap.stride and is_dense(cap.shape, cap.stride) \
                and all(s >= 0 for s in cap.stride):
            lo, hi = extent(cap.shape, cap.stride, cap.offset)
            bases = self._bases.setdefault(key[:4], [])
            if bases:       # (the dead ones first: an address reused by later storages)
                bases[:] = [b for b in bases if b[3]() is not None]
            bases.append((lo, hi, ref, cap.owner))
        if len(self._exact) >= self._sweep_at:
            self._sweep()

    def _sweep(self) -> None:
        """Drop the entries of storages that died (they can never match again)."""
        self._exact = {k: v for k, v in self._exact.items() if v[1]() is not None}
        self._unwritten = {k: v for k, v in self._unwritten.items() if v() is not None}
        live = {}
        for k, bases in self._bases.items():
            kept = [b for b in bases if b[3]() is not None]
            if kept:
                live[k] = kept
        self._bases = live
        self._sweep_at = max(1024, 2 * len(self._exact), 2 * len(self._unwritten))
