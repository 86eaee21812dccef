"""Low-level h5py reads shared by the fast readers (and the writer's catalog).

`obj.attrs[name]` costs tens of microseconds (it builds high-level objects each time);
compare and load-replay read a few attributes of thousands of objects, so they open
attributes by id and read them here, getting what `attrs[name]` would have returned.
"""

from __future__ import annotations

from typing import Any

import h5py
import numpy as np
from h5py import h5t

UNSUPPORTED = object()   # compound, array or enum attributes: read them the high-level way

_MTYPES: dict[np.dtype, Any] = {}     # numeric attribute dtype -> HDF5 memory type (made once)


def read_open_attr(aid) -> Any:
    """An open attribute's value as `attrs[name]` returns it, or UNSUPPORTED."""
    shape = aid.shape
    dtype = aid.dtype
    if shape is None:                       # empty dataspace, as h5py returns it
        return h5py.Empty(dtype)
    if dtype.subdtype is not None or dtype.kind not in "biufOS":
        return UNSUPPORTED
    arr = np.zeros(shape, dtype=dtype)
    if dtype.kind in "OS":
        aid.read(arr, mtype=h5t.py_create(dtype))
        sinfo = h5t.check_string_dtype(dtype)
        if sinfo is not None and sinfo.length is None:
            arr = np.array([b.decode("utf-8", "surrogateescape") if isinstance(b, bytes) else b
                            for b in arr.flat], dtype=object).reshape(shape)
    else:
        mtype = _MTYPES.get(dtype)
        if mtype is None:
            mtype = _MTYPES[dtype] = h5t.py_create(dtype)
        aid.read(arr, mtype=mtype)
    return arr[()] if arr.ndim == 0 else arr


def contiguous_offset(dsid, nbytes: int) -> int | None:
    """File offset of a dataset whose stored bytes are exactly its `nbytes`-byte array
    (contiguous, allocated, unfiltered: what can be read or written with pread/pwrite
    at that offset), else None."""
    try:
        off = dsid.get_offset()
        if off is None or dsid.get_storage_size() != nbytes:
            return None
        return int(off)
    except (AttributeError, TypeError, ValueError, RuntimeError):
        return None
