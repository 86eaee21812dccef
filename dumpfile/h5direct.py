"""Attribute creation through the HDF5 C library that h5py itself links (the writer's hot path),
and one read-side check (`stored_at`: where a dataset's bytes lie, for readers that read at
a catalog offset).

A dump of a model with many small ops makes ~35 attributes per op (the original layout's
DeviceType, DataType, FormatType, Type, Stride, plus dtype and shape on every tensor, and
the op group's own). Through h5py's low-level `h5a.create` + `write` one costs ~13 us on
the reference machine, of which HDF5's own work is ~6; calling the same library functions
directly (ctypes, GIL held as h5py holds it, under h5py's lock) halves it. The file is the
same: same library, same file types (h5py's own type objects), same calls h5py makes.

Only scalars and arrays of native numbers and scalar strings (variable-length UTF-8, as
h5py writes `str`) take this path; anything else, or any failure, goes through h5py, whose
exceptions carry HDF5's message. `available()` is False where the library cannot be
reached (then the writer uses h5py alone).
"""

from __future__ import annotations

import ctypes
from typing import Any

import h5py
import numpy as np
from h5py import h5a, h5t
from h5py._objects import phil

_hid = ctypes.c_int64          # hid_t since HDF5 1.10 (h5py 3 requires >= 1.10)
_H5P_DEFAULT = 0


def _fn(dll: ctypes.PyDLL, name: str, restype, *argtypes):
    f = getattr(dll, name)
    f.restype, f.argtypes = restype, list(argtypes)
    return f


class _Lib:
    def __init__(self, dll: ctypes.PyDLL):
        self.create = _fn(dll, "H5Acreate2", _hid, _hid, ctypes.c_char_p, _hid, _hid, _hid, _hid)
        self.write = _fn(dll, "H5Awrite", ctypes.c_int, _hid, _hid, ctypes.c_void_p)
        self.close = _fn(dll, "H5Aclose", ctypes.c_int, _hid)
        # a dataset's storage place, for readers checking a catalog offset (read side)
        self.oopen = _fn(dll, "H5Oopen", _hid, _hid, ctypes.c_char_p, _hid)
        self.oclose = _fn(dll, "H5Oclose", ctypes.c_int, _hid)
        self.id_type = _fn(dll, "H5Iget_type", ctypes.c_int, _hid)
        self.offset = _fn(dll, "H5Dget_offset", ctypes.c_uint64, _hid)
        self.storage_size = _fn(dll, "H5Dget_storage_size", ctypes.c_uint64, _hid)


def _load() -> _Lib | None:
    if h5py.version.hdf5_version_tuple < (1, 10, 0):
        return None
    try:
        # PyDLL: calls keep the GIL, as h5py's do (no hand-over per attribute). The
        # extension module's handle resolves the symbols of the libhdf5 it was linked with.
        return _Lib(ctypes.PyDLL(h5a.__file__))
    except (OSError, AttributeError):
        return None


_LIB = _load()
# memory type of a `char *` UTF-8 string: what H5Awrite reads for a variable-length string
_VLEN_UTF8_MEM = h5t.C_S1.copy()
_VLEN_UTF8_MEM.set_size(h5t.VARIABLE)
_VLEN_UTF8_MEM.set_cset(h5t.CSET_UTF8)


def available() -> bool:
    return _LIB is not None


_H5I_DATASET = 5
_HADDR_UNDEF = (1 << 64) - 1


def stored_at(loc: Any, name: bytes, offset: int, nbytes: int) -> bool | None:
    """Whether the dataset `name` (relative to the h5py ObjectID `loc`, or an id from
    open_object) stores exactly its
    `nbytes` bytes, contiguously, at file `offset`; None when this path is not available
    (then ask h5py). The same test as dumpfile.read.lowlevel.contiguous_offset, without
    h5py's object wrapper per open (~20 us of the ~25 a check costs through h5py: compare
    checks every small tensor it reads at a catalog offset)."""
    lib = _LIB
    if lib is None:
        return None
    with phil:
        hid = lib.oopen(loc if type(loc) is int else loc.id, name, _H5P_DEFAULT)
        if hid < 0:
            return False
        try:
            if lib.id_type(hid) != _H5I_DATASET:
                return False
            off = lib.offset(hid)
            return off != _HADDR_UNDEF and off == offset and lib.storage_size(hid) == nbytes
        finally:
            lib.oclose(hid)


def open_object(loc: Any, name: bytes) -> int:
    """The id of the object `name` relative to the h5py ObjectID `loc`, opened (close it
    with close_object); -1 when there is none or this path is not available."""
    lib = _LIB
    if lib is None:
        return -1
    with phil:
        hid = lib.oopen(loc.id, name, _H5P_DEFAULT)
    return hid if hid >= 0 else -1


def close_object(hid: int) -> None:
    with phil:
        _LIB.oclose(hid)


def attr_item(name: bytes, ftype: Any, mtype: Any, space: Any, value: Any) -> tuple:
    """One attribute prepared for create_attrs: `mtype` None for a str, whose `value` is
    its UTF-8 bytes (a list of them: a 1-d array of strings, as h5py writes a list of
    str); else `value` is a C-contiguous numpy array. The C pointers and ids
    are taken here, once: an item made for a value written object after object (a
    tensor's dtype, device, Type...) is reused as it is (numpy's `.ctypes` costs ~1 us)."""
    if mtype is None:
        if isinstance(value, list):     # an array of strings: an array of `char *`
            ptr = (ctypes.c_char_p * len(value))(*value)
            return (name, ftype.id, space.id, _VLEN_UTF8_MEM.id,
                    ctypes.addressof(ptr) if value else None, (ftype, space, ptr))
        ptr = ctypes.c_char_p(value)
        return (name, ftype.id, space.id, _VLEN_UTF8_MEM.id, ctypes.addressof(ptr),
                (ftype, space, ptr))
    buf = value.ctypes.data if value.size else None
    return (name, ftype.id, space.id, mtype.id, buf, (ftype, space, mtype, value))


def create_attrs(oid: Any, items: list[tuple]) -> list[int]:
    """Create and write attributes on the object `oid` (an h5py ObjectID).

    `items`: attr_item()s. Returns the indices of the items not written (to be done
    through h5py), after the first failure: an attribute half made (created, not
    written) is closed and reported too, so the caller overwrites it.
    """
    lib = _LIB
    if lib is None:
        return list(range(len(items)))
    loc = oid.id
    create, write, close = lib.create, lib.write, lib.close
    with phil:
        for i, (name, ftype, space, mtype, buf, _) in enumerate(items):
            aid = create(loc, name, ftype, space, _H5P_DEFAULT, _H5P_DEFAULT)
            if aid < 0:
                return list(range(i, len(items)))
            ok = buf is None or write(aid, mtype, buf) >= 0
            close(aid)
            if not ok:
                return list(range(i, len(items)))
    return []


def string_value(arr: np.ndarray) -> bytes | list[bytes] | None:
    """The UTF-8 bytes of a 0-d string array h5py would write as a variable-length string
    (a list of them for a 1-d array); None where h5py's own path must decide."""
    if arr.ndim == 1:
        items = [string_value(np.asarray(x, dtype=arr.dtype)) for x in arr]
        return None if any(b is None for b in items) else items
    if arr.ndim != 0:
        return None
    v = arr[()]
    if isinstance(v, str):
        try:
            b = v.encode("utf-8")
        except UnicodeEncodeError:      # lone surrogates: h5py's path decides
            return None
    elif isinstance(v, bytes):
        b = v
    else:
        return None
    return None if b"\0" in b else b   # (a C string ends at NUL: h5py's path decides)
