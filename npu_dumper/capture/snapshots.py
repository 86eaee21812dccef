"""Op-time snapshots of an op's arguments and results.

A tensor is captured as a *detached alias* (a new TensorImpl sharing the storage,
so autograd's reference counts on the user's tensor are untouched) plus its layout
and the storage's version. The data is copied only when needed: by the writer
thread when it writes, or by the main thread (copy-on-write) right before an op
that writes the storage. `CaptureRegistry` tracks which captures are still pending.

One module (~410 lines) because capture, copy-on-write and the storage guard are one
protocol over the same state: a capture is valid only while the registry and the guard
see every write and resize of its storage, and the dedup keys read their generations.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from dumpfile import schema as S

from .tensors import _DTYPE_NAME, UNSTORED_DTYPES, dtype_name


# ---- captured values -------------------------------------------------------------
# device -> (name, has data (not meta), its tensors are rebuilt from their storage)
_DEVICE_FACTS: dict[torch.device, tuple[str, bool, bool]] = {}
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
# devices whose tensors are exactly (storage, offset, shape, stride, dtype)
_REBUILT_DEVICES = frozenset({"cpu", "cuda"})
_STRIDED = torch.strided
_DK_NEG = torch._C.DispatchKey.Negative
_DK_CONJ = torch._C.DispatchKey.Conjugate


# dispatch key set (raw) -> 1 if it has the conjugate bit, + 2 if the negative bit. Read from
# the key set: `is_neg()` releases the GIL.
_KEY_BITS: dict[int, int] = {}


def _key_bits(raw: int) -> int:
    keys = torch._C.DispatchKeySet.from_raw_repr(raw)
    bits = (1 if keys.has(_DK_CONJ) else 0) | (2 if keys.has(_DK_NEG) else 0)
    if len(_KEY_BITS) < 4096:
        _KEY_BITS[raw] = bits
    return bits


_DTENSOR_TYPE: list = []


def _is_dtensor(t: torch.Tensor) -> bool:
    if not _DTENSOR_TYPE:
        try:
            from torch.distributed.tensor import DTensor
        except Exception:  # noqa: BLE001 - a build without distributed has no DTensor
            DTensor = ()
        _DTENSOR_TYPE.append(DTensor)
    return bool(_DTENSOR_TYPE[0]) and isinstance(t, _DTENSOR_TYPE[0])


def _unwrap(t: torch.Tensor) -> torch.Tensor:
    """A wrapper subclass with no storage of its own and one inner tensor (functional
    collectives' AsyncCollectiveTensor, a DTensor's local shard while its collective runs):
    the inner tensor, once its collective has finished. Others are captured as they are."""
    try:
        t.untyped_storage().data_ptr()
        return t
    except (RuntimeError, NotImplementedError):
        pass
    wait = getattr(t, "trigger_wait", None)
    if wait is not None:
        try:
            return _unwrap(wait())
        except Exception:  # noqa: BLE001 - captured as it is below
            return t
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is not None:
        try:
            names, _ = flatten()
            if len(names) == 1:
                return _unwrap(getattr(t, names[0]))
        except Exception:  # noqa: BLE001
            pass
    return t


def _placement_str(p) -> str:
    """Shard(0) / Replicate() / Partial(sum) / _StridedShard(0,sf=2): the placement's repr,
    normalised (torch spells Shard as 'Shard(dim=0)')."""
    return repr(p).replace("dim=", "").replace("reduce_op=", "").replace("split_factor=", "sf=")


def dtensor_spec_json(t) -> str:
    """The `dtensor` attribute: what a reader needs to put this rank's local shard back into
    the global tensor (docs/FORMAT.md, DTensor arguments)."""
    spec = t._spec
    # (the global shape and stride in the key too: a spec without tensor_meta hashes only
    # its mesh and placements)
    key = (spec, tuple(t.shape), tuple(t.stride()))
    try:
        text = _SPEC_JSON.get(key)
    except TypeError:
        text = None
    if text is not None:
        return text
    text = _spec_json(t, spec)
    if len(_SPEC_JSON) > 4096:
        _SPEC_JSON.clear()
    try:
        _SPEC_JSON[key] = text
    except TypeError:
        pass
    return text


_SPEC_JSON: dict = {}


def _spec_json(t, spec) -> str:
    import json
    mesh = spec.mesh
    offset = None
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        offset = list(compute_local_shape_and_global_offset(tuple(t.shape), mesh, spec.placements)[1])
    except Exception:  # noqa: BLE001 - strided shards etc.: the placements still say it
        pass
    coord = mesh.get_coordinate()
    return json.dumps({
        "mesh_shape": list(mesh.shape),
        "mesh_dim_names": list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
        "mesh_ranks": mesh.mesh.flatten().tolist(),
        "coordinate": list(coord) if coord is not None else None,
        "placements": [_placement_str(p) for p in spec.placements],
        "global_shape": list(t.shape), "global_stride": list(t.stride()),
        "global_offset": offset,
    }, separators=(",", ":"))


class TensorCapture:
    """A tensor as it was at op time: its storage (or an alias of it) until materialised.

    `tensor` gives the op-time view of the data; `materialize()` makes it a private copy.
    """

    __slots__ = ("_tensor", "_storage", "ptr", "gen", "version", "dtype", "shape", "stride",
                 "offset", "device", "nbytes", "uninitialized", "owner", "lock", "done",
                 "_torch_dtype", "extra", "__weakref__")

    def __init__(self, t: torch.Tensor, gen: dict, clone: bool = False, uninitialized: bool = False,
                 version_bump: int = 0):
        # Called with the dispatch mode off: detach()/clone() here are not recorded.
        # On the common path (a plain CPU/CUDA tensor) everything read from `t` keeps the
        # GIL. `.data`, `.detach()`, `is_inference()`, `is_neg()` and dispatcher calls
        # release it, and with the writer thread waiting, each release costs the model's
        # thread a hand-over (40-170 us each, measured with a busy second thread on the
        # reference 2-core machine). This runs for every tensor of every recorded op:
        # each call into torch here costs ~0.1-0.5 us.
        extra = None
        plain = type(t) in _PLAIN_TENSOR_TYPES
        if not plain:
            if _is_dtensor(t):
                # a DTensor: its data is the local shard (a plain tensor); the layout that
                # makes it part of a global tensor is written as the `dtensor` attribute
                extra = {S.ATTR_DTENSOR: dtensor_spec_json(t)}
                t = t._local_tensor
            if type(t) not in _PLAIN_TENSOR_TYPES:
                t = _unwrap(t)
            plain = type(t) in _PLAIN_TENSOR_TYPES
        self.extra = extra
        device = t.device
        facts = _DEVICE_FACTS.get(device)
        if facts is None:       # str(device) and device.type cost ~0.3 us each, per tensor
            facts = _DEVICE_FACTS[device] = (str(device), device.type != "meta",
                                             device.type in _REBUILT_DEVICES)
        numel = t.numel()
        strided = t.layout is _STRIDED and facts[1]
        storage = t.untyped_storage() if strided and numel else None
        try:
            ptr = storage.data_ptr() if storage is not None else 0
        except RuntimeError:    # a wrapper subclass with no storage of its own
            storage, ptr = None, 0
        self.ptr = ptr
        # Dedup keys are valid while the storage lives (its address cannot be reused).
        # Storage Python objects are preserved with their StorageImpl, so a weakref to one
        # dies exactly when the storage is freed; it holds no reference autograd could see.
        self.owner = weakref.ref(storage) if storage is not None else None
        # the negative / conjugate bits, from the dispatch key set (read once per distinct
        # key set: each call into the key set object costs ~0.5 us in the model's thread)
        raw = torch._C._dispatch_keys(t).raw_repr()
        bits = _KEY_BITS.get(raw)
        if bits is None:
            bits = _key_bits(raw)
        if bits or extra is not None:
            # `gen` is part of the writers' dedup and view keys: a conj/neg view of a storage
            # holds other values than the storage (x and x.conj() must not share a dataset),
            # and the same local shard under another DTensor layout is another record
            self.gen = (gen.get(ptr, 0), bool(bits & 1), bool(bits & 2),
                        extra[S.ATTR_DTENSOR] if extra else None)
        else:
            self.gen = gen.get(ptr, 0)
        # an inference tensor has no version counter (reading it raises): writes to it are
        # still seen through the registry's write generation
        # `version_bump`: the output of an in-place or out= op is captured below autograd's
        # ADInplaceOrView kernel, which bumps the version only after the op returns; the
        # data captured is that of the bumped version, which the next op reads
        try:
            self.version = t._version + version_bump
        except RuntimeError:
            self.version = 0
        self._torch_dtype = dt = t.dtype
        self.dtype = _DTYPE_NAME.get(dt) or dtype_name(dt)
        self.shape = tuple(t.shape)
        if strided:
            self.stride = t.stride()        # (a tuple already)
            self.offset = t.storage_offset()
        else:
            self.stride, self.offset = (), 0
        self.device = facts[0]
        self.nbytes = numel * t.element_size()
        self.uninitialized = uninitialized
        self.lock = threading.Lock()
        self.done = False
        if storage is not None and not clone and plain and facts[2] and not bits \
                and dt not in UNSTORED_DTYPES:
            # Keep the storage; the writer thread rebuilds the view (`tensor`). Holding
            # the storage, like an alias, leaves autograd's counts on `t` untouched.
            self._storage = storage
            self._tensor = None
        else:
            # Conj/neg views, quantized tensors (their scale lives on the tensor),
            # subclasses and other devices (an NPU tensor's format lives on the tensor)
            # keep an alias: `.data` (no autograd history) for a plain tensor; a
            # subclass decides what its detach() means.
            alias = t.data if plain else t.detach()
            self._storage = None
            self._tensor = alias.clone() if clone else alias

    @property
    def tensor(self) -> torch.Tensor | None:
        """The captured data as a tensor (None once written)."""
        t = self._tensor
        if t is None and self._storage is not None:
            st = self._storage
            t = torch.empty(0, dtype=self._torch_dtype, device=st.device)
            t.set_(st, self.offset, self.shape, self.stride)
            self._tensor = t
        return t

    @tensor.setter
    def tensor(self, value: torch.Tensor | None) -> None:
        self._tensor = value
        self._storage = None

    def take_bytes(self, dst_address: int) -> bool:
        """Copy the op-time bytes of a dense CPU capture still held as its storage to
        `dst_address` (elements offset .. offset + numel of the storage: storage order)
        and let the capture go (`done`). Under the lock, so copy-on-write (materialize)
        either ran before (then this returns False: the capture holds its own copy now,
        read it through `tensor`) or waits for the copy. False, copying nothing, for any
        other capture (an alias, one already written). The caller checks density
        (plan.is_dense): these bytes are the elements only when they fill the range.
        The statistics writer stages small tensors this way, without a torch call each."""
        with self.lock:
            src = None if self.done else self.storage_address()
            if src is None:
                return False
            ctypes.memmove(dst_address, src, self.nbytes)
            self.done = True
            self._tensor = None
            self._storage = None
        return True

    def storage_address(self) -> int | None:
        """The address of the op-time bytes of a CPU capture still held as its storage
        (element `offset` of the storage; the caller checks density, plan.is_dense, before
        it reads `nbytes` from there as the elements in storage order); None for any other
        capture. Valid while the caller holds `lock` and the capture is not done."""
        st = self._storage
        if st is None or self.device != "cpu":
            return None
        return st.data_ptr() + self.offset * self._torch_dtype.itemsize

    def storage_elements(self) -> torch.Tensor:
        """The elements of a dense capture held as its storage (storage_address is not
        None), as a 1-d tensor over the storage in storage order: what statistics and
        hashes read (they do not depend on element order), without in_memory_order's
        calls. Under `lock`, like `tensor`."""
        t = torch.empty(0, dtype=self._torch_dtype)
        t.set_(self._storage, self.offset, (self.nbytes // self._torch_dtype.itemsize,), (1,))
        return t

    def materialize(self) -> None:
        """Copy the data now (before an op overwrites it), unless the writer already wrote it."""
        with self.lock:
            if not self.done:
                t = self.tensor
                if t is not None:       # (None: the writer is letting it go, nothing to keep)
                    self.tensor = t.clone()


@dataclass
class Value:
    """A non-tensor argument (None, number, bool, str, int/float lists)."""

    value: Any
    schema_type: str = ""


@dataclass
class Named:
    """dtype / device / layout / memory_format, stored by name with its Type code."""

    value: str
    type_code: int
    schema_type: str = ""


@dataclass
class ListOf:
    items: list
    type_code: int
    schema_type: str = ""


class CaptureRegistry:
    """Pending (not yet written) tensor captures by storage, for copy-on-write.

    Also keeps a per-storage write generation: every op that writes a storage bumps
    it, so dedup keys of data captured before the write can never match after it,
    even when the write bypassed the version counter (`.data`, hidden writes).
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._pending: dict[int, list[TensorCapture]] = {}
        self._gen: dict[int, int] = {}
        # called with a storage's address before it is written (or resized): work that still
        # reads that storage off the model's thread (own-error measurements,
        # replay/measure_worker.py) finishes first
        self.write_listeners: list = []

    def generation(self, ptr: int) -> int:
        return self._gen.get(ptr, 0)

    def add(self, cap: TensorCapture) -> None:
        if cap.ptr:
            with self._lock:
                self._pending.setdefault(cap.ptr, []).append(cap)

    def add_all(self, caps: list[TensorCapture]) -> None:
        """add() of each of `caps` (those of one op), under one lock."""
        with self._lock:
            pending = self._pending
            for cap in caps:
                ptr = cap.ptr
                if ptr:
                    lst = pending.get(ptr)
                    if lst is None:
                        pending[ptr] = [cap]
                    else:
                        lst.append(cap)

    def discard(self, cap: TensorCapture) -> None:
        if cap.ptr:
            self.discard_all((cap,))

    def discard_all(self, caps) -> None:
        """discard() of each of `caps` (those of one op), under one lock."""
        with self._lock:
            pending = self._pending
            for cap in caps:
                lst = pending.get(cap.ptr) if cap.ptr else None
                if lst is not None:
                    try:
                        lst.remove(cap)
                    except ValueError:
                        pass
                    if not lst:
                        del pending[cap.ptr]

    def before_storage_change(self, storage) -> None:
        """`storage` is about to be resized (freed, regrown) outside the dispatcher (FSDP2's
        `untyped_storage().resize_(0)` after a block's forward): copy its pending
        captures while they still hold the op-time bytes, and bump its generation so that
        no dedup key made before matches what lives at that address afterwards."""
        try:
            ptr = storage.data_ptr()
        except RuntimeError:
            return
        if not ptr:
            return
        caps = self._invalidate(ptr)
        if caps:
            # called from user code (FSDP2's hooks), not from inside the dispatch mode: the
            # copies must not be recorded as ops, whose captures would alias the storage
            # about to be freed
            with _disable_current_modes():
                for cap in caps:
                    cap.materialize()

    def before_write(self, t: torch.Tensor) -> None:
        """`t`'s storage is about to be written: copy pending captures of it, bump its generation."""
        if type(t) not in _PLAIN_TENSOR_TYPES:
            t = t._local_tensor if _is_dtensor(t) else _unwrap(t)
        if t.layout != torch.strided or t.is_nested:
            return
        try:
            ptr = t.untyped_storage().data_ptr()
        except RuntimeError:    # a wrapper subclass with no storage of its own
            return
        if not ptr:
            return
        for cap in self._invalidate(ptr):
            cap.materialize()

    def _invalidate(self, ptr: int) -> list:
        """The storage at `ptr` changes: bump its generation (no dedup key made before
        matches it afterwards) and return the captures still pending on it."""
        self._gen[ptr] = self._gen.get(ptr, 0) + 1
        for listener in self.write_listeners:
            listener(ptr)
        with self._lock:
            return list(self._pending.get(ptr, ()))


# ---- storage changes the dispatcher does not see -------------------------------------
_guarded: list[CaptureRegistry] = []


def _guarded_resize(self, size):
    # UntypedStorage.resize_ is a C method of StorageBase, not an aten op: FSDP2 frees and
    # regrows parameter storages with it, under captures that still alias them
    if _guarded:
        _guarded[-1].before_storage_change(self)
    return torch._C.StorageBase.resize_(self, size)


class StorageGuard:
    """While a dump block runs, `torch.UntypedStorage.resize_` first saves the pending
    captures of the storage (CaptureRegistry.before_storage_change)."""

    def __init__(self, registry: CaptureRegistry):
        self.registry = registry

    def __enter__(self):
        if not _guarded:
            torch.UntypedStorage.resize_ = _guarded_resize
        _guarded.append(self.registry)
        return self

    def __exit__(self, *exc):
        _guarded.remove(self.registry)
        if not _guarded and torch.UntypedStorage.__dict__.get("resize_") is _guarded_resize:
            del torch.UntypedStorage.resize_
        return False
