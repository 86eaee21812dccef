"""Statistics of one tensor for statistics-only dumps (schema.STATS_FIELDS).

`tensor_stats` is the reference; `fast_tensor_stats` gives the same numbers, bit for bit,
in fewer torch calls for the common case (the writer thread's path). Both take the sum of
squares of a large float tensor from `sum_of_squares`, so that they agree.
"""

from __future__ import annotations

import math
import struct

import torch

_FAST_DTYPES = (torch.float32, torch.float64)
# Large float tensors: squares summed as norms of rows of ROW_LENGTH elements, combined
# in float64. One read of the tensor and no temporary, where (x * x).sum() writes and
# reads back a tensor of squares: on the reference 2-core machine the writer's squares of
# 4 MB weights and gradients slowed the model's own matmuls on the other core by ~2 ms a
# step (memory traffic). Relative error ~1e-9 on random data, as torch's cascade sum.
ROW_LENGTH = 256
ROWS_FROM = 1 << 15


def in_memory_order(t: torch.Tensor) -> torch.Tensor:
    """`t` with its dims permuted into storage order when that makes it contiguous (a
    transposed weight): statistics do not depend on element order, and reductions over
    a transposed 1024x1024 tensor cost ~3x those over a contiguous one."""
    if t.layout != torch.strided or t.dim() < 2 or t.is_contiguous():
        return t
    # (stride and shape read once: two calls per dimension in the sort key were ~7% of
    # the statistics writer's time on ShuffleNet, whose channel shuffle is a transpose)
    stride, shape = t.stride(), t.shape
    order = sorted(range(len(stride)), key=lambda d: (-stride[d], -shape[d]))
    p = t.permute(order)
    return p if p.is_contiguous() else t


def storage_ordered(t: torch.Tensor) -> torch.Tensor:
    """`t` as a contiguous, dense CPU tensor with conj/neg bits resolved, its elements in
    storage order (in_memory_order): what byte-level digests (content hash, exponent
    histogram) read. A copy only where the tensor is not already so."""
    if t.device.type != "cpu":
        t = t.cpu()
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    t = in_memory_order(t)
    return t if t.is_contiguous() else t.contiguous()


def sum_of_squares(x: torch.Tensor) -> float:
    """sum(x * x) of a finite float32/float64 CPU tensor, as a Python float."""
    n = x.numel()
    if n >= ROWS_FROM and x.dtype in _FAST_DTYPES and x.device.type == "cpu":
        flat = in_memory_order(x)
        if flat.is_contiguous():
            flat = flat.view(-1)
            m = n - n % ROW_LENGTH
            rows = torch.linalg.vector_norm(flat[:m].view(-1, ROW_LENGTH), dim=1).double()
            total = float(torch.dot(rows, rows))
            if m < n:
                rest = flat[m:]
                total += float((rest * rest).sum())
            return total
    return float((x * x).sum())


def tensor_stats(t: torch.Tensor) -> list[float]:
    """schema.STATS_FIELDS of a tensor: min, max, mean, std, norm over finite values; counts.

    Reductions run in the tensor's own precision with torch's double accumulators on
    CPU (std_mean is Welford), so no float64 copy of a large tensor is made. Complex
    tensors: statistics of magnitudes. std is the sample std (n-1); 0 for one element.
    """
    numel = t.numel()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.layout != torch.strided:
        t = t.to_dense()
    if numel == 0:
        return [math.nan] * 5 + [0.0, 0.0, 0.0]
    nan = inf = 0
    if t.is_complex():
        x = t.abs()
    elif t.dtype in (torch.float32, torch.float64):
        x = t
    elif t.is_floating_point() or t.dtype == torch.bool:
        x = t.float()                     # exact for every narrower float and for bool
    else:
        x = t.double()                    # integers: exact below 2**53
    mn, mx = torch.aminmax(x)             # NaN/inf propagate: one pass tells if any exist
    fmn, fmx = float(mn), float(mx)
    if not (math.isfinite(fmn) and math.isfinite(fmx)):
        nan = int(torch.isnan(x).sum())
        inf = int(torch.isinf(x).sum())
        x = x[torch.isfinite(x)]
        if x.numel() == 0:
            return [math.nan] * 5 + [float(nan), float(inf), float(numel)]
        mn, mx = torch.aminmax(x)
        fmn, fmx = float(mn), float(mx)
    n = x.numel()
    # Moments from a sum and a sum of squares (torch's cascade sum; row norms combined in
    # float64 for large tensors): relative error ~1e-7 in float32 or better, no float64 copy,
    # ~6x cheaper than a float64-accumulated norm. The variance is derived by subtraction,
    # so the precision each tier can promise depends on mean^2 / var; a tier is used only
    # where it keeps std to ~1e-7 relative.
    mean = float(x.sum()) / n
    sumsq = sum_of_squares(x)
    var = (sumsq - n * mean * mean) / (n - 1) if n > 1 else 0.0
    if n > 1 and not (var >= mean * mean and math.isfinite(var)):
        # float64-accumulated norm: exact enough while the spread is not tiny against the mean
        norm64 = float(torch.linalg.vector_norm(x, dtype=torch.float64))
        sumsq = norm64 * norm64
        var = (sumsq - n * mean * mean) / (n - 1)
        if var <= 1e-4 * mean * mean or not math.isfinite(var):
            xd = x.double()          # cancellation or overflow: float64 Welford
            std_t, mean_t = torch.std_mean(xd)
            std, mean = float(std_t), float(mean_t)
            return [fmn, fmx, mean, std, float(torch.linalg.vector_norm(xd)), float(nan), float(inf),
                    float(numel)]
    std = math.sqrt(max(var, 0.0))
    return [fmn, fmx, mean, std, math.sqrt(sumsq), float(nan), float(inf), float(numel)]


# One-element tensors (a loss, BatchNorm's num_batches_tracked, a step counter: ~80 per
# ShuffleNet step) are a single value: their statistics from `.item()` in Python instead of
# the reference's eight torch calls. dtype -> whether the reference computes in float32
# (else float64); complex ones (a magnitude) take the reference.
_SCALAR_AS_FLOAT32 = {torch.float32: True, torch.float16: True, torch.bfloat16: True,
                      torch.bool: True, torch.float64: False, torch.uint8: False,
                      torch.int8: False, torch.int16: False, torch.int32: False,
                      torch.int64: False}
_F32 = struct.Struct("f")


def _one_element_stats(t: torch.Tensor) -> list[float]:
    """tensor_stats of a one-element real tensor, bit-identical: the value as the reference
    widens it (float32 for narrower floats and bool, float64 for integers: float() of a
    Python int rounds as torch's int64 -> float64 cast does), its square rounded in that
    precision (a float32's square is exact in float64, so rounding it to float32 once is
    the float32 product), std 0 (n - 1 = 0)."""
    v = float(t.item())
    if v != v:
        return [math.nan] * 5 + [1.0, 0.0, 1.0]
    if v in (math.inf, -math.inf):
        return [math.nan] * 5 + [0.0, 1.0, 1.0]
    sq = v * v
    if _SCALAR_AS_FLOAT32[t.dtype]:
        try:
            sq = _F32.unpack(_F32.pack(sq))[0]
        except OverflowError:           # rounds past float32's largest: the product is inf
            sq = math.inf
    # (mean + 0.0: the reference sums from +0.0, so the mean of -0.0 is +0.0)
    return [v, v, v + 0.0, 0.0, math.sqrt(sq), 0.0, 0.0, 1.0]


def fast_tensor_stats(t: torch.Tensor, scratch: dict | None = None) -> list[float]:
    """tensor_stats, bit-identical, in fewer torch calls for the common case (finite
    float32/float64 on CPU whose spread is not tiny against its mean): the reductions come
    back in one .tolist(). Every torch call releases and retakes the GIL, and each
    hand-over costs the model's thread time; anything else takes the full path.
    `scratch` (dtype -> buffer, one thread's own) holds the squares of small contiguous
    tensors: a fresh tensor per call is page faults, taken under the process's memory lock
    that the model's thread needs too."""
    n = t.numel()
    if n == 1 and t.dtype in _SCALAR_AS_FLOAT32 and t.is_cpu and t.layout is torch.strided:
        return _one_element_stats(t)
    if t.dtype not in _FAST_DTYPES or n < 2 or t.device.type != "cpu" or t.layout != torch.strided:
        return tensor_stats(t)
    mn, mx = torch.aminmax(t)
    if n >= ROWS_FROM:
        fmn, fmx, total = torch.stack((mn, mx, t.sum())).tolist()
        if not (math.isfinite(fmn) and math.isfinite(fmx)):
            return tensor_stats(t)
        sumsq = sum_of_squares(t)
    else:
        if scratch is not None and t.is_contiguous():
            buf = scratch.get(t.dtype)
            if buf is None or buf.numel() < n:
                buf = scratch[t.dtype] = torch.empty(max(n, ROWS_FROM), dtype=t.dtype)
            sq = torch.mul(t, t, out=buf[:n].view(t.shape))
        else:
            sq = t * t
        fmn, fmx, total, sumsq = torch.stack((mn, mx, t.sum(), sq.sum())).tolist()
        if not (math.isfinite(fmn) and math.isfinite(fmx)):
            return tensor_stats(t)
    mean = total / n
    var = (sumsq - n * mean * mean) / (n - 1)
    if not (var >= mean * mean and math.isfinite(var)):
        return tensor_stats(t)
    return [fmn, fmx, mean, math.sqrt(max(var, 0.0)), math.sqrt(sumsq), 0.0, 0.0, float(n)]


# ---- many small tensors at once ---------------------------------------------------------
# A model of many small ops hands the statistics writer hundreds of tensors of a few
# thousand elements per step; each one's reductions above are five torch calls (and five
# GIL hand-overs with the model's thread). Small tensors of the same dtype and size (a
# layer's activations, gradients and their repeats: few distinct sizes per model) are
# instead stacked into one matrix and reduced along its rows: six torch calls per group.
# A row reduction of a contiguous matrix runs the same inner loop as the reduction of one
# contiguous tensor, so the numbers are bit-identical to fast_tensor_stats (and so to
# tensor_stats; tests/test_dump_stats_table.py checks sizes, dtypes and thread counts).
# The reference reduces float16/bfloat16/bool tensors as float32 and integers as float64
# (tensor_stats' `x`): their matrix is stacked in its own dtype and converted once, which
# gives the same rows as converting each tensor (an exact elementwise widening). Rows with
# NaN/Inf, or whose spread is tiny against their mean, are recomputed from their copy by
# the reference. Complex tensors (statistics of magnitudes) stay per tensor: a vectorised
# abs of one matrix need not round as that of each tensor does.
# Min and max per row: amin(1) and amax(1), not aminmax(dim=1), whose row loop is scalar
# (8 rows of 6144 floats: 106 us against 7 us; min and max are exact either way).
# (One flat buffer reduced per segment was tried first: segment_reduce's min/max is a
# scalar loop, its float64 sums are not the reference's, and building segment ids for a
# scatter cost more than the calls saved.)
BATCH_BELOW = ROWS_FROM
# dtype -> the dtype its statistics are computed in (tensor_stats' `x`)
BATCH_AS = {torch.float32: torch.float32, torch.float64: torch.float64,
             torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.bool: torch.float32,
             torch.uint8: torch.float64, torch.int8: torch.float64, torch.int16: torch.float64,
             torch.int32: torch.float64, torch.int64: torch.float64}
_STRIDED = torch.strided


def batchable(t: torch.Tensor) -> bool:
    """Whether `t` goes through the batched path (a small dense CPU tensor of a real dtype)."""
    return batchable_description(t.dtype, t.numel(), t.is_cpu, t.layout is _STRIDED)


def batchable_description(dtype: torch.dtype, numel: int, cpu: bool, strided: bool) -> bool:
    """batchable() of a tensor so described (a writer asks it of a capture's metadata,
    before it touches the data)."""
    return dtype in BATCH_AS and 2 <= numel < BATCH_BELOW and cpu and strided


def stack_for_stats(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, list[int]]]:
    """Copies of batchable tensors, one matrix per (dtype, size), in the dtype their
    statistics are computed in: [(rows, indices)]. The copy is the snapshot: the caller
    holds the tensors' capture locks only for this."""
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.dtype, t.numel()), []).append(i)
    out = []
    for (dt, n), idx in groups.items():
        members = [tensors[i] for i in idx]
        shape = members[0].shape
        if all(t.shape == shape and t.is_contiguous() for t in members):
            # (the common case: one stack and a view, not a reshape per tensor)
            m = torch.stack(members).view(len(members), n)
        else:
            m = torch.stack([in_memory_order(t).reshape(-1) for t in members])
        as_dt = BATCH_AS[dt]
        out.append((m if as_dt is dt else m.to(as_dt), idx))
    return out


def rows_stats(m: torch.Tensor) -> list[list[float]]:
    """fast_tensor_stats of each row of the contiguous float32/float64 matrix `m` (rows of
    >= 2 elements, fewer than ROWS_FROM), bit-identical: see the note above. Rows the
    first tier cannot take (a constant tensor, BatchNorm's weights and running variances:
    ~130 tensors per ShuffleNet step) go through the reference's later tiers together
    (_later_tiers), NaN/Inf rows through the reference.
    (The first tier's arithmetic stays in Python floats: done in numpy for all rows at
    once it cost ~50 us more per matrix, and a batch has matrices of a few rows each.)"""
    n = m.shape[1]
    rows = torch.stack((m.amin(1), m.amax(1), m.sum(1), (m * m).sum(1)), dim=1).tolist()
    out: list = [None] * len(rows)
    later = []
    for i, (fmn, fmx, total, sumsq) in enumerate(rows):
        if not (math.isfinite(fmn) and math.isfinite(fmx)):
            out[i] = tensor_stats(m[i])
            continue
        mean = total / n
        var = (sumsq - n * mean * mean) / (n - 1)
        if var >= mean * mean and math.isfinite(var):          # the reference's first tier
            out[i] = [fmn, fmx, mean, math.sqrt(max(var, 0.0)), math.sqrt(sumsq), 0.0, 0.0, float(n)]
        else:
            later.append((i, fmn, fmx, mean))
    if len(later) == 1:
        out[later[0][0]] = tensor_stats(m[later[0][0]])
    elif later:
        for (i, *_), stats in zip(later, _later_tiers(m, later)):
            out[i] = stats
    return out


def _later_tiers(m: torch.Tensor, later: list[tuple]) -> list[list[float]]:
    """tensor_stats' second and third tiers for the finite rows of `m` in `later` ((row,
    min, max, mean) each) whose spread the first tier cannot resolve, bit-identical: a
    float64-accumulated norm, and where the spread is still tiny, float64 Welford
    (std_mean). Row-wise over a contiguous matrix of rows below the intra-op grain size,
    both run the same serial loop as over one tensor (tests/test_stats_staged.py)."""
    n = m.shape[1]
    sub = m[torch.tensor([r[0] for r in later])]
    norms64 = torch.linalg.vector_norm(sub, dim=1, dtype=torch.float64).tolist()
    out: list = [None] * len(later)
    third = []
    for j, ((i, fmn, fmx, mean), norm64) in enumerate(zip(later, norms64)):
        sumsq = norm64 * norm64
        var = (sumsq - n * mean * mean) / (n - 1)
        if var <= 1e-4 * mean * mean or not math.isfinite(var):
            third.append(j)
        else:
            out[j] = [fmn, fmx, mean, math.sqrt(max(var, 0.0)), math.sqrt(sumsq), 0.0, 0.0, float(n)]
    if third:
        xd = (sub[torch.tensor(third)] if len(third) < len(later) else sub).double()
        std_t, mean_t = torch.std_mean(xd, dim=1)
        norms = torch.linalg.vector_norm(xd, dim=1).tolist()
        for j, std, mean_w, norm in zip(third, std_t.tolist(), mean_t.tolist(), norms):
            fmn, fmx = later[j][1], later[j][2]
            out[j] = [fmn, fmx, mean_w, std, norm, 0.0, 0.0, float(n)]
    return out


def batch_tensor_stats(tensors: list[torch.Tensor]) -> list[list[float]]:
    """Statistics of many tensors: batchable ones stacked per (dtype, size), the rest one by one."""
    out: list = [None] * len(tensors)
    small = [i for i, t in enumerate(tensors) if batchable(t)]
    taken = set(small)
    for i, t in enumerate(tensors):
        if i not in taken:
            out[i] = fast_tensor_stats(in_memory_order(t))
    for m, idx in stack_for_stats([tensors[i] for i in small]):
        for j, stats in zip(idx, rows_stats(m)):
            out[small[j]] = stats
    return out
