"""Metrics where one side (or both) is a statistics-only tensor: min, max, mean, std, norm
and counts instead of values (torch-free; the metrics stage, measure.py, calls them).

compare_stats gives what the statistics allow: StandardDeviation exactly, four metrics as
lower bounds, the rest NaN with a reason. stats_of computes a data tensor's statistics
the way the dumper does, for a statistics-vs-data row.
"""

from __future__ import annotations

import math
from typing import Iterable

import numpy as np

from accucmp.compare.metrics import EPS, MetricResult, fmt_std, resolve_algorithms


def compare_stats(x: dict[str, float], y: dict[str, float], algorithms: Iterable[str] | None = None
                  ) -> tuple[dict[str, MetricResult], dict[str, float]]:
    """Metrics of two statistics-only tensors (fields of schema.STATS_FIELDS).

    Exact: StandardDeviation. Lower bounds of the true value (from the triangle
    inequality and |max x - max y| <= max|x - y|): MaxAbsoluteError, MeanAbsoluteError,
    RootMeanSquareError, RelativeEuclideanDistance. The rest need the tensors.
    """
    algs = resolve_algorithms(algorithms)
    n = y.get("numel", math.nan)
    g = lambda d, k: float(d.get(k, math.nan))  # noqa: E731
    bound = "lower bound from statistics (statistics-only dump)"
    lb = {
        "MaxAbsoluteError": max(abs(g(x, "max") - g(y, "max")), abs(g(x, "min") - g(y, "min"))),
        "MeanAbsoluteError": abs(g(x, "mean") - g(y, "mean")),
        "RootMeanSquareError": abs(g(x, "norm") - g(y, "norm")) / math.sqrt(n) if n and n > 0 else math.nan,
        "RelativeEuclideanDistance": (abs(g(x, "norm") - g(y, "norm")) / g(y, "norm")
                                      if g(y, "norm") > EPS else math.nan),
    }
    out = {}
    for a in algs:
        if a == "StandardDeviation":
            out[a] = MetricResult(f"({fmt_std(g(x, 'mean'))};{fmt_std(g(x, 'std'))}),"
                                  f"({fmt_std(g(y, 'mean'))};{fmt_std(g(y, 'std'))})")
        elif a in lb and not math.isnan(lb[a]):
            out[a] = MetricResult(lb[a], bound)
        else:
            out[a] = MetricResult(math.nan, "statistics-only dump: needs the tensor data")
    tnf = g(x, "nan_count") + g(x, "inf_count")
    gnf = g(y, "nan_count") + g(y, "inf_count")
    extras = {
        "GoldenAbsMax": max(abs(g(y, "min")), abs(g(y, "max"))),
        "TargetMean": g(x, "mean"), "TargetStd": g(x, "std"),
        "GoldenMean": g(y, "mean"), "GoldenStd": g(y, "std"),
        "NonFiniteMismatch": abs(tnf - gnf) if not (math.isnan(tnf) or math.isnan(gnf)) else 0,
        "TargetNonFinite": tnf, "GoldenNonFinite": gnf,
    }
    return out, extras


def stats_of(chunks) -> dict[str, float]:
    """The statistics fields of a tensor given as chunks (for stats-vs-data rows), computed
    as the dumper computes a statistics-only dump's (npu_dumper tensor_stats, docs/FORMAT.md):
    complex tensors by magnitude, std the sample std (n-1, 0 for one element)."""
    n = nan = inf = 0
    lo, hi, s, ss = math.inf, -math.inf, 0.0, 0.0
    for c in chunks:
        c = np.asarray(c)
        if np.iscomplexobj(c):
            # the other side holds statistics of |z|; a float64 cast would keep the real part
            c = np.abs(c)
        c = c.astype(np.float64, copy=False).reshape(-1)
        fin = np.isfinite(c)
        nan += int(np.isnan(c).sum())
        inf += int(np.isinf(c).sum())
        c = c[fin]
        n += c.size
        if c.size:
            lo, hi = min(lo, float(c.min())), max(hi, float(c.max()))
            s += float(c.sum())
            ss += float(np.einsum("i,i->", c, c))
    mean = s / n if n else math.nan
    var = max((ss - n * mean * mean) / (n - 1), 0.0) if n > 1 else (0.0 if n else math.nan)
    return {"min": lo if n else math.nan, "max": hi if n else math.nan, "mean": mean,
            "std": math.sqrt(var), "norm": math.sqrt(ss) if n else math.nan,
            "nan_count": nan, "inf_count": inf, "numel": n + nan + inf}
