"""Rebuild a call from a recorded op: the OpOverload, and its args read back as torch values.

Used by golden replay (npu_dumper.replay.golden), load-replay (npu_dumper.replay) and
`ir2tbe run`. The entry point is `load_call(op_record)`, which never raises for an op
it cannot rebuild: it returns a RecordedCall whose `why_not` says why (random op,
missing input, a device-naming argument, statistics-only dump, unknown op ...).

Values are placed by the op's schema: positional arguments positionally (until the
first one that is absent and has a default), the rest and kw-only ones as kwargs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import h5py
import numpy as np
import torch

from dumpfile import schema as S
from dumpfile.errors import DumpError, DumpFormatError
from dumpfile.read.h5util import view_base
from dumpfile.read.values import check_stored_dtype
from dumpfile.read.reader import OpRecord, ValueRecord, check_kind

from ..capture.opschema import op_info
from .matching import find_input
from .op_names import draws_random, resolve_op

# torch dtype name -> torch dtype, for every dtype the format stores
_TORCH_DTYPES = {name: getattr(torch, name) for name in S.DATA_TYPE_CODES if hasattr(torch, name)}
# numpy dtype whose bits are reinterpreted as a raw-bit torch dtype (same width, signed:
# torch.from_numpy rejects some unsigned widths on older torch builds)
_RAW_VIEW_NUMPY = {1: np.int8, 2: np.int16}


class NotReplayable(Exception):
    """Internal: carries the reason an op cannot be rebuilt (becomes RecordedCall.why_not)."""


@dataclass
class RecordedCall:
    """A recorded op ready to run: `call()` == func(*args, **kwargs)."""

    op: str                        # the recorded name, e.g. "aten.addmm.default"
    seqid: int
    func: Any = None               # torch._ops.OpOverload, or None when unresolved
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    why_not: str | None = None     # None when the call can be run
    arg_names: dict[str, Any] = field(default_factory=dict)  # schema name -> value (placed)

    @property
    def ok(self) -> bool:
        return self.why_not is None

    def call(self) -> Any:
        if self.why_not is not None:
            raise RuntimeError(f"{self.op} {self.seqid}: {self.why_not}")
        return self.func(*self.args, **self.kwargs)


# ---- values --------------------------------------------------------------------
def torch_dtype(name: str) -> torch.dtype:
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise NotReplayable(f"dtype {name!r} is not known to this torch") from None


def tensor_from_record(rec: ValueRecord, *, device: str | torch.device = "cpu",
                       dtype: torch.dtype | None = None, keep_strides: bool = False,
                       base_cache: dict | None = None, read_base: Callable | None = None) -> torch.Tensor:
    """A stored tensor as a torch tensor, exact in its recorded dtype, then cast to `dtype`.

    bfloat16 / float8 are rebuilt from their stored bits. With keep_strides the result
    has the recorded strides when they describe a non-overlapping layout (else contiguous).
    `read_base(dataset)`: a view's base values as _stored_tensor gives them, read another
    way (load-replay reads them raw), or None for the h5py read.
    """
    if rec.is_stats:
        raise NotReplayable(f"{rec.name}: statistics-only dump holds no tensor values")
    name = rec.dtype
    tdtype = torch_dtype(name) if name else None
    if rec.type == S.TYPE_TENSOR_VIEW:
        try:
            t = _view_tensor(rec, base_cache, read_base)
        except DumpFormatError as e:          # its layout attributes do not hold (a damaged file)
            raise NotReplayable(f"{rec.name}: {e}") from None
    elif rec.type == S.TYPE_TENSOR and name in S.RAW_BIT_DTYPES:
        t = _raw_bits_tensor(rec.file.h5[rec.path][()], tdtype)
    elif name == "complex32":
        vals = rec.read()                             # complex64, exact
        t = torch.from_numpy(np.ascontiguousarray(vals)).to(torch.complex32)
    else:
        vals = np.asarray(rec.read())
        if vals.dtype == object:
            raise NotReplayable(f"{rec.name}: cannot read tensor data")
        t = torch.from_numpy(np.ascontiguousarray(vals))
        if tdtype is not None and t.dtype != tdtype:
            if name not in S.RAW_BIT_DTYPES:
                # only raw-bit dtypes come back decoded to another dtype; any other
                # disagreement is a dtype attribute that is not what was stored (a
                # float tensor replayed as int64 failed inside the kernel: exit 3)
                raise NotReplayable(f"{rec.name}: stored as {vals.dtype}, but its dtype attribute says {name}")
            t = t.to(tdtype)                          # decoded float32 -> bf16/float8: exact
    shape = rec.shape
    if tuple(t.shape) != tuple(shape) and t.numel() == int(np.prod(shape, dtype=np.int64)):
        t = t.reshape(shape)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if keep_strides:
        stride = S.live_stride(rec.attrs)
        t = with_strides(t, stride, device)
    elif torch.device(device) != t.device:
        t = t.to(device)
    return t


def _raw_bits_tensor(raw: np.ndarray, tdtype: torch.dtype) -> torch.Tensor:
    raw = np.ascontiguousarray(raw)
    return torch.from_numpy(raw.view(_RAW_VIEW_NUMPY[raw.dtype.itemsize])).view(tdtype)


def _stored_tensor(ds: Any) -> torch.Tensor:
    """A plain stored dataset as a tensor in its recorded dtype (exact)."""
    if isinstance(ds, h5py.Group):
        # the records come from the catalog (read at the entry instead of the groups): a file
        # edited since may hold a group where it says tensor (the fuzzer's kind swap)
        check_kind(ds.file.filename, ds.name, S.TYPE_TENSOR, True)
    name = ds.attrs.get(S.ATTR_DTYPE, "")
    name = name.decode() if isinstance(name, bytes) else str(name)
    data = ds[()]
    try:
        check_stored_dtype(data.dtype, "")
    except DumpFormatError:
        try:            # (named only now: h5py's .name searches the file, h5util.view_base)
            check_stored_dtype(data.dtype, ds.name)
        except DumpFormatError as e:
            raise NotReplayable(str(e)) from None
    if name in S.RAW_BIT_DTYPES:
        return _raw_bits_tensor(data, torch_dtype(name))
    if name == "complex32":
        pairs = torch.from_numpy(np.ascontiguousarray(data)).float()
        return torch.view_as_complex(pairs).to(torch.complex32)
    t = torch.from_numpy(np.ascontiguousarray(data))
    return t.to(torch_dtype(name)) if name and t.dtype != torch_dtype(name) else t


def _view_tensor(rec: ValueRecord, base_cache: dict | None = None,
                 read_base: Callable | None = None) -> torch.Tensor:
    """A Type-VIEW record rebuilt in torch: the base's elements are put back where they
    lay in storage (base Stride/storage_offset), then the view is read with its own
    strides. Every index is bounds-checked (attributes come from files); errors are
    reasons, not crashes. (dumpfile.view_of does the same in numpy, far slower on
    large bases: it proves density with np.unique.)"""
    h5 = rec.file.h5
    try:
        base = view_base(h5, rec.file.path, h5[rec.path], rec.attrs.get(S.ATTR_BASE), rec.path)
    except DumpFormatError as e:
        raise NotReplayable(f"{rec.name}: {e}") from None
    key = hash(base.id)
    cached = base_cache.get(key) if base_cache is not None else None
    if cached is None:
        cached = _base_storage(rec, base, None if read_base is None else read_base(base))
        if base_cache is not None:
            base_cache[key] = cached
    storage, boff = cached
    n = storage.numel()
    shape = rec.shape
    stride = S.live_stride(rec.attrs)
    rel = S.storage_offset(rec.attrs, rec.path) - boff
    if len(stride) != len(shape) or any(d < 0 for d in shape) or any(s < 0 for s in stride):
        raise NotReplayable(f"{rec.name}: bad view shape/stride")
    if int(np.prod(shape, dtype=np.int64)) == 0:
        return torch.empty(shape, dtype=storage.dtype)
    last = rel + sum((d - 1) * s for d, s in zip(shape, stride))
    if rel < 0 or last >= n:
        raise NotReplayable(f"{rec.name}: view reaches outside the data of its base")
    return storage.as_strided(shape, stride, rel)


def _base_storage(rec: ValueRecord, base: Any, stored: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, int]:
    """The flat storage a view's base dataset occupied, and the base's storage offset.
    `stored`: the base dataset's values already read (as _stored_tensor would give them)."""
    bt = _stored_tensor(base) if stored is None else stored
    bstride = S.live_stride(base.attrs)
    try:
        boff = S.storage_offset(base.attrs)
    except DumpFormatError:     # (named only now: h5py's .name searches the file)
        boff = S.storage_offset(base.attrs, getattr(base, "name", rec.path))
    if len(bstride) != bt.dim():
        bstride = tuple(torch.empty(bt.shape).stride())
    n = bt.numel()
    if n and (any(s < 0 for s in bstride) or not non_overlapping(tuple(bt.shape), bstride)
              or sum((d - 1) * s for d, s in zip(bt.shape, bstride)) != n - 1):
        raise NotReplayable(f"{rec.name}: the base of this view is not dense")
    if not n:
        return torch.empty(0, dtype=bt.dtype), boff
    # Dense: permuting the dims into storage order (outermost = largest stride) and making
    # that contiguous *is* the storage. A contiguous-destination copy with strided reads is
    # markedly faster than scattering into a strided destination (transposed weights).
    order = sorted(range(bt.dim()), key=lambda d: (-bstride[d], -d))
    storage = bt.permute(order).contiguous().reshape(-1)
    return storage, boff


def with_strides(t: torch.Tensor, stride: tuple[int, ...], device: Any = None) -> torch.Tensor:
    """Copy `t` into a fresh tensor laid out with `stride` (contiguous when it cannot be)."""
    device = t.device if device is None else device
    if len(stride) != t.dim() or tuple(t.stride()) == stride and torch.device(device) == t.device:
        return t.to(device)
    if any(s <= 0 for s, n in zip(stride, t.shape) if n > 1):
        return t.to(device)     # expanded / broadcast layouts cannot be written into
    try:
        out = torch.empty_strided(tuple(t.shape), stride, dtype=t.dtype, device=device)
        # an overlapping layout would silently lose elements: check it is a permutation
        if out.numel() > 1 and not non_overlapping(tuple(t.shape), stride):
            return t.to(device)
        return out.copy_(t)
    except RuntimeError:
        return t.to(device)


def non_overlapping(shape, stride) -> bool:
    """No two elements of this layout share memory (so it can be written into)."""
    dims = sorted((s, n) for s, n in zip(stride, shape) if n > 1)
    span = 1
    for s, n in dims:
        if s < span:
            return False
        span = s * n
    return True


def value_from_record(rec: ValueRecord, *, device="cpu", dtype: torch.dtype | None = None,
                      keep_strides: bool = False, floating_only: bool = True,
                      remap_devices: bool = False) -> Any:
    """Any stored argument as the torch/Python value the op expects."""
    if rec.is_tensor:
        return tensor_from_record(rec, device=device, keep_strides=keep_strides,
                                  dtype=_cast_target(rec.dtype, dtype, floating_only))
    if rec.is_list:
        return [value_from_record(c, device=device, dtype=dtype, keep_strides=keep_strides,
                                  floating_only=floating_only, remap_devices=remap_devices)
                for c in rec.children]
    t = rec.type
    if t == S.TYPE_SCALAR_TYPE:
        return torch_dtype(rec.read())
    if t == S.TYPE_LAYOUT:
        return _named_torch_attr(rec, "layout")
    if t == S.TYPE_MEMORY_FORMAT:
        return _named_torch_attr(rec, "memory_format")
    if t == S.TYPE_DEVICE:
        named = torch.device(str(rec.read()))
        target = torch.device(device)
        if named.type != target.type and not remap_devices:
            raise NotReplayable(f"argument '{rec.name}' names device {named}, replaying on {target}")
        return target
    v = rec.read()
    if t in (S.TYPE_INT_LIST, S.TYPE_INT_ARRAY_REF, S.TYPE_FLOAT_LIST, S.TYPE_BOOL_LIST):
        return list(v) if isinstance(v, (list, tuple)) else [v]
    return v


def _named_torch_attr(rec: ValueRecord, kind: str) -> Any:
    name = str(rec.read()).replace("torch.", "")
    value = getattr(torch, name, None)
    if value is None:
        raise NotReplayable(f"argument '{rec.name}': unknown {kind} {name!r}")
    return value


def _cast_target(stored: str, dtype: torch.dtype | None, floating_only: bool) -> torch.dtype | None:
    """Which dtype a stored tensor becomes: `dtype` for floating (and complex) data only."""
    if dtype is None:
        return None
    if stored in S.FLOATING_DTYPES:
        return dtype if (dtype.is_floating_point or not floating_only) else None
    if stored in S.COMPLEX_DTYPES and dtype.is_floating_point:
        return torch.complex128 if dtype == torch.float64 else None
    return None if floating_only else dtype


# ---- calls ---------------------------------------------------------------------
def load_call(op_record: OpRecord, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
              *, keep_strides: bool = False, func: Any = None,
              arg_renames: dict[str, tuple[str, ...]] | None = None,
              retarget_dtype_args: bool = False, remap_devices: bool = False,
              allow_random: bool = False) -> RecordedCall:
    """Rebuild `op_record` as a call on `device`, floating tensors cast to `dtype` if given.

    func: run this OpOverload instead of the recorded name (op-map matches); its schema
      argument names are looked up in the record, then under `arg_renames[name]`.
    retarget_dtype_args: ScalarType args naming a floating dtype become `dtype` too
      (golden replay: a cast to bfloat16 recomputed in float64 gives the exact value).
    remap_devices: Device args are replaced by `device` instead of refusing the op.
    allow_random: do not refuse ops tagged nondeterministic_seeded.
    """
    rc = RecordedCall(op=op_record.op, seqid=op_record.seqid)
    rc.func = func if func is not None else resolve_op(op_record.op)
    if rc.func is None:
        rc.why_not = f"unknown op {op_record.op!r} (not registered in this torch)"
        return rc
    try:
        inputs = op_record.inputs()
        rc.args, rc.kwargs, rc.arg_names = _place(
            rc.func, inputs, arg_renames or {},
            lambda rec: value_from_record(rec, device=device, dtype=dtype, keep_strides=keep_strides,
                                          remap_devices=remap_devices))
        if retarget_dtype_args and dtype is not None and dtype.is_floating_point:
            rc.args = tuple(_retarget(a, dtype) for a in rc.args)
            rc.kwargs = {k: _retarget(v, dtype) for k, v in rc.kwargs.items()}
        if not allow_random and draws_random(rc.func, rc.arg_names):
            rc.why_not = "random op (nondeterministic_seeded): its seed is not recorded"
    except NotReplayable as e:
        rc.why_not = str(e)
    except DumpError as e:
        rc.why_not = f"unreadable input: {e}"
    return rc


def _retarget(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.dtype) and value.is_floating_point:
        return dtype
    return value


def _place(func: Any, inputs: dict[str, ValueRecord], renames: dict[str, tuple[str, ...]],
           convert: Callable[[ValueRecord], Any]) -> tuple[tuple, dict, dict]:
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    named: dict[str, Any] = {}
    positional_open = True
    info = op_info(func)
    for i, name in enumerate(info.arg_names):
        rec = find_input(inputs, name, renames)
        if rec is None:
            if info.has_default[i]:
                positional_open = False       # later args must go by name
                continue
            if info.optional[i]:
                value = None                  # an optional stored as "absent"
            else:
                raise NotReplayable(f"input '{name}' is not in the dump")
        else:
            value = convert(rec)
        named[name] = value
        if positional_open and not info.kwarg_only[i]:
            args.append(value)
        else:
            positional_open = False
            kwargs[name] = value
    return tuple(args), kwargs, named


# ---- outputs -------------------------------------------------------------------
def tensor_to_storage(t: torch.Tensor) -> tuple[np.ndarray, str]:
    """A torch tensor as (numpy array in the file's storage dtype, dtype name)."""
    name = str(t.dtype).replace("torch.", "")
    t = t.detach()
    if t.layout != torch.strided:        # sparse / mkldnn results: the dense values, as the dumper stores them
        t = t.to_dense()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if name in S.RAW_BIT_DTYPES:
        width = t.element_size()
        arr = t.view(torch.int16 if width == 2 else torch.int8).numpy()
        return arr.view(np.uint16 if width == 2 else np.uint8), name
    if name == "complex32":
        return torch.view_as_real(t.to(torch.complex64)).to(torch.float16).numpy(), name
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t.numpy(), name
