"""Histograms of log2|x| for statistics-only dumps (`stats_histogram=True`, format 1.7).

`accucmp whatif` predicts what a cast to bf16/fp16/fp8 would do from how a tensor's
magnitudes spread over binades: which values fall below a format's smallest subnormal,
into its subnormals, or past its largest finite value. A statistics dump cannot hold the
values, so it can hold this: for every finite nonzero element, floor(log2|x|) (its binary
exponent), counted per exponent. Stored sparse, as int64 pairs [e0, n0, e1, n1, ...] with
e ascending: a tensor spans tens of binades, not the ~280 of float32's range.

The exponent is read from the bits (one shift and mask, one bincount) for float32,
float64, float16 and bfloat16; float8 tensors are widened to float32 first (exactly),
complex ones give the histogram of their magnitudes, integer and bool tensors none.
Subnormals of the tensor's own dtype (exponent field 0, not zero) are rare and take
frexp. Cost: ~4 passes over the tensor, in the writer thread; off by default.
"""

from __future__ import annotations

import numpy as np
import torch

from .tensor_stats import storage_ordered

_EMPTY = np.zeros(0, dtype=np.int64)
# dtype -> (same-width integer view, mantissa bits, exponent field mask, exponent bias)
_FIELDS = {
    torch.float32: (torch.int32, 23, 0xFF, 127),
    torch.float64: (torch.int64, 52, 0x7FF, 1023),
    torch.float16: (torch.int16, 10, 0x1F, 15),
    torch.bfloat16: (torch.int16, 7, 0xFF, 127),
}


def log2_histogram(t: torch.Tensor) -> np.ndarray:
    """int64 pairs [e, count, ...] of floor(log2|x|) over the finite nonzero elements of `t`
    (complex: of |x|); empty for integer/bool/empty tensors."""
    if t.is_complex():
        t = t.abs()
    if not t.is_floating_point() or t.numel() == 0:
        return _EMPTY
    if t.dtype not in _FIELDS:
        t = t.float()                       # float8 formats: exact in float32
    t = storage_ordered(t)                  # element order does not matter to a histogram
    ity, mbits, mask, bias = _FIELDS[t.dtype]
    flat = t.reshape(-1)
    field = torch.bitwise_and(torch.bitwise_right_shift(flat.view(ity), mbits), mask)
    counts = torch.bincount(field, minlength=mask + 1).tolist()
    exps: dict[int, int] = {f - bias: n for f, n in enumerate(counts[1:mask], start=1) if n}
    if counts[0]:                           # zeros and this dtype's subnormals
        sub = flat[(field == 0) & (flat != 0)]
        if sub.numel():
            e = torch.frexp(sub.double()).exponent - 1
            lo = int(e.min())
            for i, n in enumerate(torch.bincount(e - lo).tolist()):
                if n:
                    exps[lo + i] = exps.get(lo + i, 0) + n
    if not exps:
        return _EMPTY
    out = np.empty(2 * len(exps), dtype=np.int64)
    keys = sorted(exps)
    out[0::2] = keys
    out[1::2] = [exps[k] for k in keys]
    return out
