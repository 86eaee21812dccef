"""Content hashes of tensors for statistics-only dumps (format 1.7, column `hash`).

Two runs on the same device and dtype are bit-identical exactly where their hashes
agree (up to a 2^-64 chance), so a statistics dump answers "is my run deterministic, and
where does it stop being so" without storing data (`accucmp compare --bitwise`).

The hash is xxHash's XXH3-64 (seed 0) of the tensor's bytes in storage order: the
elements of `in_memory_order(t)` (a transposed weight hashes as its untransposed
storage, so W and W.t() share a hash as they share statistics), conj and neg bits
resolved, little-endian as CPUs store them. Equal values in different memory layouts
hash differently; two runs of one program lay tensors out alike. XXH3 reads ~10-80 GB/s,
several times faster than the statistics' own reductions; hashlib's fastest (sha1) was
~40x slower on the reference machine.
"""

from __future__ import annotations

import ctypes

import torch
import xxhash

from .tensor_stats import storage_ordered
from .tensors import _NUMPY_OF, numpy_view

HASH_ALGORITHM = "xxh3_64"


_STRIDED = torch.strided
_TENSOR = torch.Tensor


def bytes_hash(buffer) -> int:
    """The content hash of element bytes already in storage order (any buffer: a row of a
    writer's staging matrix), as an unsigned 64-bit int."""
    return xxhash.xxh3_64_intdigest(buffer)


def content_hash(t: torch.Tensor) -> int:
    """XXH3-64 of `t`'s element bytes in storage order (see the module docstring), as an
    unsigned 64-bit int."""
    if type(t) is _TENSOR and t.is_cpu and t.layout is _STRIDED and t.is_contiguous() \
            and not t.is_conj() and not t.is_neg():
        # the common case (the statistics writer hashes every tensor of the dump): the
        # bytes as they lie, through a ctypes buffer (xxhash reads any buffer), without
        # storage_ordered's checks or a numpy array
        n = t.numel() * t.element_size()
        if not n:
            return xxhash.xxh3_64_intdigest(b"")
        return xxhash.xxh3_64_intdigest((ctypes.c_char * n).from_address(t.data_ptr()))
    t = storage_ordered(t)
    if t.numel() == 0:
        return xxhash.xxh3_64_intdigest(b"")
    if t.dtype in _NUMPY_OF:
        # contiguous on the CPU (storage_ordered): its bytes as they lie, without the two
        # torch calls of a byte view (each releases the GIL the model's thread then waits for)
        return xxhash.xxh3_64_intdigest(numpy_view(t))
    flat = t.reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    # numpy_view, not .numpy(): `t` may view the user's own storage (the writer rebuilds
    # captures from it), and .numpy() would leave that storage non-resizable for good
    return xxhash.xxh3_64_intdigest(numpy_view(flat))
