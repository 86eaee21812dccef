"""Live torch tensors <-> stored records (numpy array + dumpfile.TensorMeta).

The one place that knows how each torch dtype is laid out in a dump: numpy-native
dtypes are stored as themselves, bfloat16/float8 as their raw bits (same-width
unsigned ints), complex32 as (..., 2) float16 real/imag pairs (schema.STORAGE_NUMPY_DTYPE).
Replay (npu_dumper.replay) and the ACL policy use `from_record` to rebuild inputs.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import torch

from dumpfile import schema as S
from dumpfile.write.writer import TensorMeta

# torch dtype -> name without "torch." ("bfloat16"); cached because str(dtype) is slowish.
_DTYPE_NAME: dict[torch.dtype, str] = {}
_DTYPE_BY_NAME: dict[str, torch.dtype] = {}
for _n in dir(torch):
    _d = getattr(torch, _n, None)
    if isinstance(_d, torch.dtype):
        _DTYPE_NAME.setdefault(_d, str(_d).replace("torch.", ""))
for _d, _n in _DTYPE_NAME.items():
    _DTYPE_BY_NAME[_n] = _d

# raw-bit dtypes: the unsigned int torch dtype of the same width
_RAW_BITS_TORCH = {1: torch.uint8, 2: torch.uint16}
# numpy-native dtypes (stored as themselves): torch dtype -> numpy dtype
_NUMPY_OF = {d: np.dtype(n) for d, n in _DTYPE_NAME.items() if S.STORAGE_NUMPY_DTYPE.get(n) == n}
# torch dtypes the format has no storage for (quantized, sub-byte, packed float4): their
# scale, zero point or packing is not in a plain array of the storage's bytes
UNSTORED_DTYPES = frozenset(d for d, n in _DTYPE_NAME.items() if n not in S.STORAGE_NUMPY_DTYPE)


def numpy_view(t: torch.Tensor) -> np.ndarray:
    """`t.numpy()` for a contiguous CPU tensor, without its side effect on the user's tensor.

    Tensor.numpy() marks the storage non-resizable for good, so after the writer had
    viewed a tensor the model's own `x.resize_(...)` (or an out= op resizing its output)
    failed with 'Trying to resize storage that is not resizable'. This views the same
    memory through a ctypes buffer that keeps `t` alive; the capture lock (in-place
    writes, resizes included, wait for it) keeps the memory valid while it is read.
    """
    dt = _NUMPY_OF.get(t.dtype)
    if dt is None or t.device.type != "cpu" or not t.is_contiguous():
        return t.contiguous().numpy()       # (not a user's storage: a copy made here)
    n = t.numel()
    if n == 0:
        return np.empty(tuple(t.shape), dtype=dt)
    buf = (ctypes.c_char * (n * t.element_size())).from_address(t.data_ptr())
    buf._keep = t
    return np.frombuffer(buf, dtype=dt, count=n).reshape(tuple(t.shape))


def dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAME.get(dtype)
    if name is None:
        name = _DTYPE_NAME[dtype] = str(dtype).replace("torch.", "")
    return name


def torch_dtype(name: str) -> torch.dtype:
    """Torch dtype from a stored name ("bfloat16"); raises KeyError if this torch lacks it."""
    return _DTYPE_BY_NAME[name]


def device_str(device: torch.device) -> str:
    return str(device)


def meta_of(t: torch.Tensor, *, uninitialized: bool = False) -> TensorMeta:
    return TensorMeta(dtype=dtype_name(t.dtype), shape=tuple(t.shape), stride=tuple(t.stride())
                      if t.layout == torch.strided else (), storage_offset=int(t.storage_offset())
                      if t.layout == torch.strided else 0, device=device_str(t.device),
                      uninitialized=uninitialized)


def storage_array(t: torch.Tensor) -> np.ndarray:
    """The array a dump stores for tensor `t` (logical shape, C order, storage dtype).

    Copies to host when needed; the result may share memory with `t` when `t` is
    a contiguous CPU tensor of a numpy-native dtype.
    """
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    name = dtype_name(t.dtype)
    if name in S.RAW_BIT_DTYPES:
        t = t.contiguous().view(_RAW_BITS_TORCH[t.element_size()])
    elif name == "complex32":
        t = torch.view_as_real(t.contiguous())
    # torch's copy kernel re-lays-out (e.g. transposed weights) ~2.5x faster than numpy's
    return numpy_view(t.contiguous())


def to_record(t: torch.Tensor, *, uninitialized: bool = False) -> tuple[np.ndarray, TensorMeta]:
    """Live tensor -> (array to store, metadata)."""
    return storage_array(t), meta_of(t, uninitialized=uninitialized)


def from_record(data: Any, dtype: str | TensorMeta | None = None, *,
                device: str | torch.device | None = None) -> torch.Tensor:
    """Stored (or reader-decoded) array -> torch tensor with the recorded dtype, bit-exact.

    `data` may be the raw stored array (uint16 bits for bfloat16) or what
    dumpfile.DumpFile decodes (float32 for bfloat16): both give the same tensor.
    `dtype` is the recorded torch dtype name (ValueRecord.dtype) or a TensorMeta;
    None keeps the array's own dtype.
    """
    if isinstance(dtype, TensorMeta):
        dtype = dtype.dtype
    arr = np.asarray(data)
    if not arr.flags.writeable or not arr.flags.c_contiguous:
        arr = np.array(arr, copy=True, order="C")
    if arr.dtype == np.bool_ or arr.dtype.kind in "iufcb":
        t = torch.from_numpy(arr)
    else:
        raise TypeError(f"cannot make a tensor from a {arr.dtype} array")
    if dtype:
        target = torch_dtype(dtype)
        stored = np.dtype(S.STORAGE_NUMPY_DTYPE.get(dtype, arr.dtype))
        if dtype in S.RAW_BIT_DTYPES and arr.dtype == stored:
            t = t.view(target)                      # raw bits
        elif dtype == "complex32" and arr.dtype == np.float16:
            t = torch.view_as_complex(t.float()).to(target) if t.dim() else t.to(target)
        elif t.dtype != target:
            t = t.to(target)                        # decoded values: exact for every stored dtype
    if device is not None:
        t = t.to(device)
    return t
