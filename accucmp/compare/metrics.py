"""The ten msaccucmp metrics, computed in float64 over chunks in bounded memory.

x is the target ("my" dump), y the golden; both are flattened. Each metric is a
`Metric` in the `METRICS` registry (name, direction, the CANN-recommended threshold
where there is one). A result is a `MetricResult`: a value, or NaN plus a reason.

How the streaming works: `TensorComparison.add(x, y)` takes any number of pieces of
the two tensors (already aligned, equal length) and folds them into float64
accumulators (sums, dot products, extrema, Chan-merged variances). Only the
Kullback-Leibler divergence needs a second pass, because it min-max scales each
side by its *global* min and max; `kl_pass(x, y)` takes the same pieces again.
Pieces are processed in cache-sized blocks so each numpy pass stays in cache.

Special cases (REFERENCE.md section 4, and where this module does better, in
docs/COMPARE.md): empty -> every metric NaN with a reason; bool -> only cosine and
relative Euclidean distance; NaN/Inf equal on both sides at the same element are
left out (and said so); NaN/Inf on one side only -> no metric, a reason, and the
count in `nonfinite_mismatch` (a verdict fails it).

Metrics of statistics-only tensors are in stats_metrics.py. This module stays whole at
~480 lines: the registry is a few lines, and TensorComparison (about half of it) is one
set of accumulators that every metric shares block by block; cutting it by metric would
read each block once per metric.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import numpy as np

from dumpfile.schema import LARGEST_FINITE, OVERFLOW_THRESHOLD

EPS = float(np.finfo(np.float64).eps)          # "~0" for norms and |y|, as the reference
F32_EPS = float(np.finfo(np.float32).eps)      # KL floor, as the reference
_BLOCK = 1 << 16                               # elements per in-cache block (512 KiB float64)
# "Minus infinity" sentinels: a mask filled with torch.finfo(dtype).min (Falcon, Swin, T5, ...)
# holds each run's own dtype extreme: -3.4e38 in a float32 golden, -65504 in a float16 run
# (plus the score it is added to), -inf where a replay rounds -3.4e38 to bfloat16/float16.
# An element where one side is a float dtype's extreme finite value or inf and the other has
# the same sign and is at least 2**15 (half float16's max) means the same thing on both
# sides: counted equal. A real value is never exactly a dtype's extreme. Where the extreme is
# the target's, the golden's value must itself be a mask's: within float16's top range (a
# float16 golden's -65504 plus the score) or beyond 1e38 (bfloat16's and float32's extremes);
# a value between, 7.1e4 or 3e5, is a real one that float16 cannot hold, and the target's Inf
# there is an overflow, not a mask (it had been counted equal: an overflow that passed).
_SENTINELS = np.array([LARGEST_FINITE[d] for d in ("float16", "bfloat16", "float32", "float64")] + [np.inf])
_SENTINEL_BIG = 2.0 ** 15
_F16_TOP = OVERFLOW_THRESHOLD["float16"]     # 65520: float16's max plus half its last spacing
_HUGE = 1e38
_SQ_GATE = _SENTINEL_BIG ** 2                  # a block's sum of squares below this has no such element


def _same_sentinels(x: np.ndarray, y: np.ndarray) -> np.ndarray | None:
    """x with the elements that are the same masking sentinel as y's set to y's (a copy), or
    None when there are none."""
    ax, ay = np.abs(x), np.abs(y)
    m = (np.isin(ay, _SENTINELS) & (ax >= _SENTINEL_BIG)) | (
        np.isin(ax, _SENTINELS) & (ay >= _SENTINEL_BIG) & ((ay <= _F16_TOP) | (ay >= _HUGE)))
    m &= np.sign(x) == np.sign(y)
    m &= x != y
    if not m.any():
        return None
    x = x.copy()
    x[m] = y[m]
    return x


def _dot(a: np.ndarray, b: np.ndarray) -> float:
    # einsum's own loop, not BLAS: a multi-threaded BLAS dot on cache-sized blocks
    # spins its threads and ran 20-100x slower on a busy machine (and with jobs > 1)
    return float(np.einsum("i,i->", a, b))


@dataclass(frozen=True)
class Metric:
    name: str
    higher_is_better: bool
    default_threshold: float | None    # CANN's recommendation; not applied unless asked (verdict.py)
    needs_two_passes: bool = False
    applies_to_bool: bool = False
    numeric: bool = True               # False: the value is a display string
    description: str = ""


METRICS: dict[str, Metric] = {m.name: m for m in (
    Metric("CosineSimilarity", True, 0.99, applies_to_bool=True,
           description="sum(x*y)/(|x||y|), capped at 1"),
    Metric("MaxAbsoluteError", False, None, description="max|x-y|"),
    Metric("AccumulatedRelativeError", False, None,
           description="sum over |y|>eps of |x/y-1|"),
    Metric("RelativeEuclideanDistance", False, 0.05, applies_to_bool=True,
           description="sqrt(sum((x-y)^2)/sum(y^2))"),
    Metric("KullbackLeiblerDivergence", False, 0.005, needs_two_passes=True,
           description="KL(p||q), p/q = min-max scaled x/y floored at float32 eps, normalised"),
    Metric("StandardDeviation", False, None, numeric=False,
           description="'(mean_x;std_x),(mean_y;std_y)'"),
    Metric("MeanAbsoluteError", False, None, description="mean|x-y|"),
    Metric("RootMeanSquareError", False, None, description="sqrt(mean((x-y)^2))"),
    Metric("MaxRelativeError", False, None, description="max over |y|>eps of |x/y-1|"),
    Metric("MeanRelativeError", False, None,
           description="mean over all n of (|y|>eps ? |x/y-1| : 0)"),
)}
METRIC_NAMES: tuple[str, ...] = tuple(METRICS)


def resolve_algorithms(algorithms: Iterable[str] | None) -> tuple[str, ...]:
    """None / 'all' -> every metric; names are matched case-insensitively; unknown -> ValueError."""
    if algorithms is None:
        return METRIC_NAMES
    if isinstance(algorithms, str):
        algorithms = [a for a in algorithms.split(",") if a.strip()]
    by_lower = {n.lower(): n for n in METRIC_NAMES}
    out = []
    for a in algorithms:
        a = a.strip()
        if a.lower() == "all":
            return METRIC_NAMES
        if a.lower() not in by_lower:
            raise ValueError(f"unknown metric {a!r}; known: {', '.join(METRIC_NAMES)}")
        out.append(by_lower[a.lower()])
    # registry order, no duplicates
    return tuple(n for n in METRIC_NAMES if n in out)


@dataclass
class MetricResult:
    value: float | str
    reason: str = ""


def fmt_std(v: float) -> str:
    # the original: `%.3f` of each value, |v| < 0.001 shown as 0 -> "0.000"
    return "%.3f" % (0.0 if abs(v) < 0.001 else v)


def _as_float64(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    if np.iscomplexobj(a):
        # complex compares as interleaved (re, im) pairs
        return np.ascontiguousarray(a, dtype=np.complex128).view(np.float64)
    return a.astype(np.float64, copy=False).reshape(-1)


class _Moments:
    """Count, mean and M2 merged over blocks (Chan et al.): accurate std in one pass."""

    __slots__ = ("n", "mean", "m2")

    def __init__(self):
        self.n, self.mean, self.m2 = 0, 0.0, 0.0

    def add(self, a: np.ndarray, sum_sq: float) -> None:
        nb = a.size
        if nb == 0:
            return
        mb = float(a.sum()) / nb
        m2b = sum_sq - nb * mb * mb
        # sum of squares minus n*mean^2 cancels when mean >> std: recompute centred
        if m2b <= 1e-6 * sum_sq:
            c = a - mb
            m2b = _dot(c, c)
        n = self.n + nb
        delta = mb - self.mean
        self.mean += delta * nb / n
        self.m2 += m2b + delta * delta * self.n * nb / n
        self.n = n

    @property
    def std(self) -> float:
        return math.sqrt(max(self.m2, 0.0) / self.n) if self.n else math.nan


@dataclass
class TensorComparison:
    """Accumulators for one (target, golden) tensor pair. Feed `add`, then `kl_pass` if needed."""

    algorithms: tuple[str, ...] = METRIC_NAMES
    bool_mode: bool = False
    n: int = 0                    # elements compared (finite on both sides)
    total: int = 0                # elements seen (a complex element counts as two: re, im)
    elements: int = 0             # tensor elements seen (a complex element counts once)
    sxy: float = 0.0
    sxx: float = 0.0
    syy: float = 0.0
    sdd: float = 0.0
    max_ad: float = 0.0
    sum_ad: float = 0.0
    sum_rel: float = 0.0
    max_rel: float = 0.0
    min_x: float = math.inf
    max_x: float = -math.inf
    min_y: float = math.inf
    max_y: float = -math.inf
    golden_absmax: float = 0.0
    nonfinite_equal: int = 0      # NaN/Inf at the same element with the same value on both sides
    nonfinite_mismatch: int = 0   # NaN/Inf on one side only (or different ones)
    target_nonfinite: int = 0
    golden_nonfinite: int = 0
    # the largest |golden| where the target is NaN or +-Inf and the golden finite (NaN: none):
    # a golden value beyond the target dtype's range there is an overflow of that format (an
    # Inf, or the NaN of Inf - Inf after one), not of a kernel
    golden_where_target_nonfinite: float = math.nan
    # integer/bool on both sides: elements that differ, counted on the native values (float64
    # loses integers above 2**53, and a bool/int tensor whose golden is all zero has no
    # relative metric); -1 once a non-integer piece was seen
    exact_mismatches: int = 0
    mx: _Moments = field(default_factory=_Moments)
    my: _Moments = field(default_factory=_Moments)
    # KL second pass
    _kl_sp: float = 0.0
    _kl_sq: float = 0.0
    _kl_a: float = 0.0
    _kl_b: float = 0.0
    _kl_seen: int = 0
    # float64 scratch blocks reused across pieces: a fresh 512 KiB array per block
    # may come from mmap (page faults on every block) and took up to 10x the work
    _scratch: list = field(default_factory=list, repr=False)

    def _blocks(self, x: np.ndarray, y: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Aligned float64 blocks of at most _BLOCK elements, converted into reused buffers."""
        if np.iscomplexobj(x) or np.iscomplexobj(y):
            for s in range(0, x.size, _BLOCK):
                yield _as_float64(x[s:s + _BLOCK]), _as_float64(y[s:s + _BLOCK])
            return
        size = min(x.size, _BLOCK)
        if not self._scratch or self._scratch[0].size < size:
            self._scratch[:] = [np.empty(size) for _ in range(4)]
        bx, by = self._scratch[0], self._scratch[1]
        for s in range(0, x.size, _BLOCK):
            n = min(_BLOCK, x.size - s)
            xb, yb = bx[:n], by[:n]
            # as astype(float64); a signalling NaN (garbage in a buffer another rank fills,
            # compared by the folder compare's replica check) becomes a quiet one, which is
            # what the metrics take it for, without numpy's "invalid value" warning on stderr
            with np.errstate(invalid="ignore"):
                np.copyto(xb, x[s:s + n], casting="unsafe")
                np.copyto(yb, y[s:s + n], casting="unsafe")
            yield xb, yb

    def _work(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Two float64 scratch arrays of n elements (valid until the next block)."""
        if len(self._scratch) == 4 and self._scratch[2].size >= n:
            return self._scratch[2][:n], self._scratch[3][:n]
        return np.empty(n), np.empty(n)

    @property
    def needs_kl_pass(self) -> bool:
        return "KullbackLeiblerDivergence" in self.algorithms and not self.bool_mode

    # ---- pass 1 ------------------------------------------------------------
    def add(self, x: np.ndarray, y: np.ndarray) -> None:
        x = np.asarray(x).reshape(-1)
        y = np.asarray(y).reshape(-1)
        if x.size != y.size:
            raise ValueError(f"pieces differ in size ({x.size} vs {y.size})")
        self.elements += x.size
        if self.exact_mismatches >= 0:
            if x.dtype.kind in "iub" and y.dtype.kind in "iub":
                self.exact_mismatches += int(np.count_nonzero(x != y))
            else:
                self.exact_mismatches = -1
        for xb, yb in self._blocks(x, y):
            self._add_block(xb, yb)

    def _finite_only(self, x, y):
        fx, fy = np.isfinite(x), np.isfinite(y)
        both = fx & fy
        bad = ~both
        self.target_nonfinite += int((~fx).sum())
        self.golden_nonfinite += int((~fy).sum())
        over = ~fx & fy
        if over.any():
            m = float(np.abs(y[over]).max())
            self.golden_where_target_nonfinite = m if math.isnan(self.golden_where_target_nonfinite) \
                else max(self.golden_where_target_nonfinite, m)
        xb, yb = x[bad], y[bad]
        same = (xb == yb) | (np.isnan(xb) & np.isnan(yb))
        self.nonfinite_equal += int(same.sum())
        self.nonfinite_mismatch += int((~same).sum())
        return x[both], y[both]

    def _add_block(self, x: np.ndarray, y: np.ndarray) -> None:
        self.total += x.size
        sxx = _dot(x, x)
        syy = _dot(y, y)
        if not (sxx < _SQ_GATE and syy < _SQ_GATE) and not self.bool_mode and self.exact_mismatches < 0:
            same = _same_sentinels(x, y)
            if same is not None:
                x = same
                sxx = _dot(x, x)
        # finite sums of squares imply finite elements (float64 squares overflow only
        # above 1e154: then the exact check below runs, which is also right)
        if not (math.isfinite(sxx) and math.isfinite(syy)):
            x, y = self._finite_only(x, y)
            sxx, syy = _dot(x, x), _dot(y, y)
        if x.size == 0:
            return
        self.n += x.size
        self.sxx += sxx
        self.syy += syy
        self.sxy += _dot(x, y)
        d, ay = self._work(x.size)
        np.subtract(x, y, out=d)
        self.sdd += _dot(d, d)
        if self.bool_mode:
            return
        self.mx.add(x, sxx)
        self.my.add(y, syy)
        if self.needs_kl_pass:      # extrema only feed KL's min-max scaling
            self.min_x = min(self.min_x, float(x.min()))
            self.max_x = max(self.max_x, float(x.max()))
            self.min_y = min(self.min_y, float(y.min()))
            self.max_y = max(self.max_y, float(y.max()))
        np.abs(d, out=d)
        self.max_ad = max(self.max_ad, float(d.max()))
        self.sum_ad += float(d.sum())
        np.abs(y, out=ay)
        self.golden_absmax = max(self.golden_absmax, float(ay.max()))
        ay[ay <= EPS] = np.inf              # |y| <= eps counts 0: |d|/inf == 0
        np.divide(d, ay, out=d)             # |x/y - 1| == |x-y|/|y|
        self.sum_rel += float(d.sum())
        self.max_rel = max(self.max_rel, float(d.max()))

    # ---- pass 2 (KL) -------------------------------------------------------
    def kl_pass(self, x: np.ndarray, y: np.ndarray) -> None:
        x = np.asarray(x).reshape(-1)
        y = np.asarray(y).reshape(-1)
        for xb, yb in self._blocks(x, y):
            self._kl_block(xb, yb)

    def _kl_block(self, x, y):
        if self.target_nonfinite or self.golden_nonfinite:
            both = np.isfinite(x) & np.isfinite(y)
            x, y = x[both], y[both]
        if x.size == 0:
            return
        p, q = self._work(x.size)
        p = _scaled(x, self.min_x, self.max_x, p)
        q = _scaled(y, self.min_y, self.max_y, q)
        self._kl_sp += float(p.sum())
        self._kl_sq += float(q.sum())
        # logs written over q (no longer needed): no temporaries
        self._kl_b += _dot(p, np.log(q, out=q))
        self._kl_a += _dot(p, np.log(p, out=q))
        self._kl_seen += x.size

    # ---- results -------------------------------------------------------------
    def results(self) -> dict[str, MetricResult]:
        out: dict[str, MetricResult] = {}
        if self.total == 0:
            return {a: MetricResult(math.nan, "empty tensor (0 elements)") for a in self.algorithms}
        if self.nonfinite_mismatch:
            why = (f"{self.nonfinite_mismatch} of {self.total} elements NaN/Inf on one side only "
                   f"(target {self.target_nonfinite}, golden {self.golden_nonfinite} non-finite)")
            return {a: MetricResult(math.nan, why) for a in self.algorithms}
        if self.n == 0:
            why = f"all {self.total} elements NaN/Inf (equal on both sides)"
            return {a: MetricResult(math.nan, why) for a in self.algorithms}
        nx, ny = math.sqrt(self.sxx), math.sqrt(self.syy)
        x_zero, y_zero = nx <= EPS, ny <= EPS
        for a in self.algorithms:
            if self.bool_mode and not METRICS[a].applies_to_bool:
                out[a] = MetricResult(math.nan, f"bool tensor: {a} does not apply")
                continue
            out[a] = getattr(self, "_m_" + a)(nx, ny, x_zero, y_zero)
        if self.nonfinite_equal:
            note = f"{self.nonfinite_equal} NaN/Inf elements equal on both sides left out"
            for r in out.values():
                r.reason = f"{r.reason}; {note}" if r.reason else note
        return out

    def _m_CosineSimilarity(self, nx, ny, x_zero, y_zero):
        if x_zero and y_zero:
            return MetricResult(1.0)
        if x_zero or y_zero:
            return MetricResult(math.nan, f"{'target' if x_zero else 'golden'} is all zero: cosine undefined")
        # sqrt(sxx*syy) rather than nx*ny: identical tensors then give exactly 1
        denom = math.sqrt(self.sxx * self.syy)
        if not math.isfinite(denom) or denom == 0.0:
            denom = nx * ny
        return MetricResult(min(1.0, self.sxy / denom))

    def _m_MaxAbsoluteError(self, *_):
        return MetricResult(self.max_ad)

    def _m_AccumulatedRelativeError(self, *_):
        return MetricResult(self.sum_rel)

    def _m_RelativeEuclideanDistance(self, nx, ny, x_zero, y_zero):
        if y_zero:
            if x_zero:
                return MetricResult(0.0)
            # the reference reported 0 here, hiding a wrong non-zero target
            return MetricResult(math.nan, "golden is all zero, target is not: relative distance undefined "
                                          "(see MaxAbsoluteError)")
        return MetricResult(math.sqrt(self.sdd / self.syy))

    def _m_KullbackLeiblerDivergence(self, nx, ny, x_zero, y_zero):
        # As the original: each side is floored at float32 eps after scaling, so a constant
        # or all-zero side is uniform, never "no result": two constant tensors give 0.0
        # (cosine still says NaN where one side is all zero)
        if self._kl_seen != self.n:
            return MetricResult(math.nan, "KL second pass not run")
        sp, sq = self._kl_sp, self._kl_sq
        kl = (self._kl_a - self._kl_b) / sp - math.log(sp) + math.log(sq)
        return MetricResult(0.0 if abs(kl) < EPS else kl)

    def _m_StandardDeviation(self, *_):
        return MetricResult(f"({fmt_std(self.mx.mean)};{fmt_std(self.mx.std)}),"
                            f"({fmt_std(self.my.mean)};{fmt_std(self.my.std)})")

    def _m_MeanAbsoluteError(self, *_):
        return MetricResult(self.sum_ad / self.n)

    def _m_RootMeanSquareError(self, *_):
        return MetricResult(math.sqrt(self.sdd / self.n))

    def _m_MaxRelativeError(self, *_):
        return MetricResult(self.max_rel)

    def _m_MeanRelativeError(self, *_):
        return MetricResult(self.sum_rel / self.n)

    # ---- extras the verdict and the table use ------------------------------------
    def extras(self) -> dict[str, float]:
        finite = self.n > 0 and not self.bool_mode
        return {
            "GoldenAbsMax": self.golden_absmax if finite else math.nan,
            "TargetMean": self.mx.mean if finite else math.nan,
            "TargetStd": self.mx.std if finite else math.nan,
            "GoldenMean": self.my.mean if finite else math.nan,
            "GoldenStd": self.my.std if finite else math.nan,
            "NonFiniteMismatch": self.nonfinite_mismatch,
            "TargetNonFinite": self.target_nonfinite,
            "GoldenNonFinite": self.golden_nonfinite,
            "GoldenAbsMaxWhereTargetNonFinite": self.golden_where_target_nonfinite,
            "ExactMismatches": self.exact_mismatches if self.exact_mismatches >= 0 and self.elements else math.nan,
        }


def _scaled(a: np.ndarray, lo: float, hi: float, out: np.ndarray | None = None) -> np.ndarray:
    """Min-max scale to [0, 1], floored at float32 eps (a constant side becomes uniform)."""
    r = hi - lo
    p = np.empty_like(a) if out is None else out
    if r > 0:
        np.subtract(a, lo, out=p)
        np.multiply(p, 1.0 / r, out=p)
    else:
        p[...] = 0.0
    np.maximum(p, F32_EPS, out=p)
    return p


def aligned(a: Iterable[np.ndarray], b: Iterable[np.ndarray]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Re-cut two streams of flat pieces into pairs of equal-length pieces (lockstep).

    Raises ValueError when one stream ends before the other.
    """
    return aligned_many(a, b)


def aligned_many(*streams: Iterable[np.ndarray]) -> Iterator[tuple[np.ndarray, ...]]:
    """aligned() for any number of streams: tuples of equal-length pieces, one per stream."""
    its = [iter(s) for s in streams]
    cur: list = [np.empty(0)] * len(its)
    pos = [0] * len(its)
    while True:
        ended = 0
        for k, it in enumerate(its):
            while pos[k] >= cur[k].size:
                c = next(it, None)
                if c is None:
                    ended += 1
                    break
                cur[k], pos[k] = np.asarray(c).reshape(-1), 0
        if ended == len(its):
            return
        if ended:
            raise ValueError("one tensor has more elements than its shape says or than the other")
        n = min(c.size - p for c, p in zip(cur, pos))
        yield tuple(c[p:p + n] for c, p in zip(cur, pos))
        pos = [p + n for p in pos]


def compare_arrays(x: np.ndarray, y: np.ndarray, algorithms: Iterable[str] | None = None
                   ) -> dict[str, MetricResult]:
    """All requested metrics of two in-memory arrays (flattened; sizes must agree)."""
    tc = comparison_for(np.asarray(x).dtype, np.asarray(y).dtype, algorithms)
    x, y = np.asarray(x).reshape(-1), np.asarray(y).reshape(-1)
    if x.size != y.size:
        why = f"size mismatch: target {x.size} elements, golden {y.size}"
        return {a: MetricResult(math.nan, why) for a in tc.algorithms}
    tc.add(x, y)
    if tc.needs_kl_pass:
        tc.kl_pass(x, y)
    return tc.results()


def comparison_for(x_dtype, y_dtype, algorithms: Iterable[str] | None = None) -> TensorComparison:
    is_bool = np.dtype(x_dtype) == np.bool_ or np.dtype(y_dtype) == np.bool_
    return TensorComparison(algorithms=resolve_algorithms(algorithms), bool_mode=is_bool)

