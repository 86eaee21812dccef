"""A recorded tensor handed to a live op as the live argument would have been: its dtype,
device and (for plain layouts) strides, without a copy when nothing differs, and whether
the live tensor already holds the recorded bits (load_replay.py's substitution uses these);
and which storages a collective wrote last (CollectiveWrites: the replay's departure log and
the plain dump's provenance both ask whether a copy reads a collective's result).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from dumpfile.departures import is_by_design_op, is_collective_op

from ..sinks.plan import is_dense
from .recorded import non_overlapping


def usable_as_is(live: torch.Tensor, src: torch.Tensor, keep_strides: bool) -> bool:
    """`src` already has what the op would have seen of `live` but the values: dtype,
    device and (when kept) strides; `like_live` returns it without a copy."""
    return src.dtype == live.dtype and src.device == live.device and (
        not keep_strides or src.stride() == live.stride() or live.numel() <= 1)


def like_live(live: torch.Tensor, src: torch.Tensor, keep_strides: bool) -> torch.Tensor:
    """`src`'s values with `live`'s dtype, device and (when it is a plain layout) strides."""
    if usable_as_is(live, src, keep_strides):
        return src                       # already what the op would have seen: no copy
    if keep_strides and live.layout == torch.strided and dense_non_overlapping(live):
        out = torch.empty_strided(live.shape, live.stride(), dtype=live.dtype, device=live.device)
        return out.copy_(src)
    return src.to(device=live.device, dtype=live.dtype).contiguous()


_SAME_WIDTH_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bitwise_equal(live: torch.Tensor, src: torch.Tensor) -> bool:
    """Same dtype, shape and bits (so -0.0 != 0.0 and NaN payloads count). Two CPU tensors
    laid out alike over one dense span each are compared with libc's memcmp (which stops at
    the first difference, so inputs that differ, the usual case across devices, cost little;
    equal ones, a weight compared with its recording, ~7 GB/s against torch.equal's 1.8-3.4
    on integer views, measured on 77-154 MB tensors); others with torch.equal on same-width
    integer views."""
    if live.dtype != src.dtype or live.shape != src.shape or live.device != src.device \
            or live.layout != torch.strided or live.is_conj() or live.is_neg() \
            or src.is_conj() or src.is_neg() or live.dtype.is_complex:
        return False
    as_int = _SAME_WIDTH_INT.get(live.element_size())
    if as_int is None:
        return False
    if _memcmp is not None and live.device.type == "cpu" and live.stride() == src.stride() \
            and type(live) in _PLAIN and type(src) in _PLAIN and is_dense(tuple(live.shape), live.stride()):
        # same strides over a dense span (any order of the dims: a transposed weight's is):
        # element i lies at the same byte of both spans
        n = live.numel() * live.element_size()
        return n == 0 or _memcmp(live.data_ptr(), src.data_ptr(), n) == 0
    try:
        return bool(torch.equal(live.detach().view(as_int), src.view(as_int)))
    except RuntimeError:
        return False


def _libc_memcmp():
    """libc's memcmp through ctypes (which releases the interpreter lock for the call), or
    None where there is no C library to load by that name."""
    try:
        f = ctypes.CDLL(None).memcmp
    except (OSError, AttributeError, TypeError):
        return None
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return f


_memcmp = _libc_memcmp()
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def dense_non_overlapping(t: torch.Tensor) -> bool:
    return non_overlapping(tuple(t.shape), tuple(t.stride()))


def storage_key(t: torch.Tensor) -> int | None:
    """The address of a tensor's storage (None: no storage to follow: a wrapper subclass, a
    meta or empty tensor). It names "the same data" only while the storage lives: a freed
    storage's address is the next allocation's. What outlives the tensors it was taken from
    is kept in a StorageMap."""
    try:
        return t.untyped_storage().data_ptr() or None
    except Exception:  # noqa: BLE001 - wrapper subclasses, meta tensors: no address to follow
        return None


class StorageMap:
    """A value per storage, for what a block learns of its storages as its ops run (which op
    made one, whether a collective wrote it last): keyed by address, each entry holding a
    weak reference to its storage, so that a lookup through another storage at that address
    finds nothing. An address alone is no identity: a freed activation's address goes to the
    next allocation of its size. In timm's Swin under autocast the bf16 copy of a changed
    weight landed where an activation had been, read as made by an op, and the changed
    weight passed as an inherited difference. The weak reference keeps the storage's
    control block (not its bytes) alive, so no other storage takes its identity meanwhile."""

    __slots__ = ("_entries", "_prune_at")

    def __init__(self):
        self._entries: dict[int, tuple[StorageWeakRef, Any]] = {}
        self._prune_at = 4096

    @staticmethod
    def _storage(t: Any):
        try:
            st = t.untyped_storage()
            return (st.data_ptr() or None), st
        except Exception:  # noqa: BLE001 - as storage_key: no storage to follow
            return None, None

    def _find(self, t: Any):
        """(address, storage, the entry of this very storage or None)."""
        ptr, st = self._storage(t)
        entry = self._entries.get(ptr) if ptr is not None else None
        if entry is not None and entry[0].cdata != st._cdata:
            entry = None            # another storage, freed, had this address
        return ptr, st, entry

    def get(self, t: torch.Tensor, default: Any = None) -> Any:
        entry = self._find(t)[2]
        return default if entry is None else entry[1]

    def __contains__(self, t: torch.Tensor) -> bool:
        return self._find(t)[2] is not None

    def set(self, t: torch.Tensor, value: Any) -> None:
        ptr, st, entry = self._find(t)
        if ptr is None:
            return
        if entry is not None:
            self._entries[ptr] = (entry[0], value)
            return
        self._entries[ptr] = (StorageWeakRef(st), value)
        if len(self._entries) > self._prune_at:
            # storages freed since: their entries (and control blocks) go
            self._entries = {k: e for k, e in self._entries.items() if not e[0].expired()}
            self._prune_at = max(4096, 2 * len(self._entries))

    def discard(self, t: torch.Tensor) -> None:
        ptr, _, entry = self._find(t)
        if entry is not None:
            del self._entries[ptr]

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


class CollectiveWrites:
    """The storages whose last writer was a collective, and whether an op copies into one.

    gloo's reduce-scatter copies its result into the output buffer from a tensor it made
    itself (a `copy_` after the collective): the copy's source is no parameter, buffer or
    batch tensor but the collective's result. Load-replay's departure log and the plain
    dump's provenance (`made_inputs`) both ask this, after noting every op's writes."""

    def __init__(self):
        self._storages = StorageMap()

    def note(self, op_name: str, written: list) -> None:
        """An op wrote the tensors `written` (its outputs and written arguments)."""
        collective = is_collective_op(op_name)
        for t in written:
            if isinstance(t, torch.Tensor):
                if collective:
                    self._storages.set(t, True)
                elif self._storages:
                    self._storages.discard(t)

    def copied_into(self, op_name: str, info, named: list) -> bool:
        """`op_name` (its OpInfo and named arguments) is a copy that writes into a storage a
        collective wrote last."""
        return bool(self._storages) and is_by_design_op(op_name) and any(
            isinstance(v, torch.Tensor) and name in info.written and v in self._storages
            for name, _, v in named)
