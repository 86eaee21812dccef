"""How much a sum cancels, recomputed from the golden's recorded input (torch-free).

A load-replay hands each op the golden's recorded inputs cast to the live dtype. Rounding
each term x_i of a sum to a dtype of unit roundoff u moves the sum by at most u * sum|x_i|:
relative to the sum, by kappa * u, kappa = ||sum |x| || / ||sum x||. A bias gradient that is 0
in exact arithmetic (a layer before a normalisation, attention's key bias) has kappa ~1e8:
the replay's rounding alone leaves no correct digit, however right the kernel. Replays made
with `own_error=True` measure each op against float64 on the inputs it got (the own error:
no such excuse is needed); this is what the comparison has for replays made without it:
column `RoundedInputCancellation`, filled for an output that is a sum of one input's terms
(dumpfile.opclass.SUM_TERMS) when the replay rounded that input, and read by the verdict
(verdict.py: the relative bound grows by kappa * u; kappa * u >= 1 is ill-conditioned, not
judged).

kappa is the larger of the norm-wise ratio and max(sum |x|) / max|sum x| (the max-abs test
judges elements: the element whose terms are largest need not be the largest result).
Computed on inputs of at most `limit` elements (read whole: bias gradients are sums over a
batch of activations); larger ones, a record that does not hold, a reduction that does not
give the golden output's number of elements, or terms whose sum (or mean) is not the golden's
recorded result (CONSISTENT: a damaged or edited file): NaN (the row is judged as before).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from dumpfile.errors import DumpError

CHANNEL, TRAILING, DIM = "channel", "trailing", "dim"


def kept_axes_reduced(rule: str, ndim: int, out_ndim: int, args: dict | None) -> tuple[int, ...] | None:
    """The axes a sum of an `ndim`-dim input reduces under `rule` (dumpfile.opclass.SUM_TERMS),
    or None when the rule cannot be applied (arguments that do not fit the input)."""
    if rule == CHANNEL:
        return tuple(a for a in range(ndim) if a != 1) if ndim >= 2 else None
    if rule == TRAILING:
        return tuple(range(ndim - out_ndim)) if 0 <= out_ndim <= ndim else None
    if rule == DIM:
        dim = (args or {}).get("dim")
        if dim is None or dim == []:
            return tuple(range(ndim))
        dims = [dim] if isinstance(dim, int) and not isinstance(dim, bool) else dim
        if not isinstance(dims, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
            return None
        if not all(-ndim <= d < max(ndim, 1) for d in dims):
            return None
        return tuple(sorted({d % ndim for d in dims})) if ndim else ()
    return None


# the golden's recorded sum must be its recorded terms' sum (or mean) within this share of the
# largest sum of |terms|: a float32 sum of 16M terms is ~1e-4 off at most in practice; a terms
# record that is not what the golden summed (a damaged or edited file) gives no kappa
CONSISTENT = 1e-3


def cancellation(x: np.ndarray, axes: tuple[int, ...], out_numel: int, golden: np.ndarray | None = None) -> float:
    """kappa of the sum of `x` over `axes` (module doc); NaN when that sum does not have
    `out_numel` elements, or is not `golden` (the recorded result: a sum or a mean of `x`)."""
    s = np.sum(x, axis=axes, dtype=np.float64)
    if np.size(s) != out_numel:
        return math.nan
    a = np.sum(np.abs(x), axis=axes, dtype=np.float64)
    if golden is not None:
        g = np.asarray(golden, dtype=np.float64).reshape(-1)
        flat_s, tol = np.ravel(s), CONSISTENT * float(np.max(a)) if a.size else 0.0
        if g.size != flat_s.size or not any(
                float(np.max(np.abs(flat_s / c - g), initial=0.0)) <= tol / c for c in {1.0, x.size / max(out_numel, 1)}):
            return math.nan
    norm_a, norm_s = float(np.linalg.norm(np.ravel(a))), float(np.linalg.norm(np.ravel(s)))
    if not (math.isfinite(norm_a) and math.isfinite(norm_s)):
        return math.nan                 # (NaN/Inf terms: the comparison's own rules say it)
    if norm_a == 0.0:
        return 1.0                      # every term 0: nothing cancels, the sum is exact
    if norm_s == 0.0:
        return math.inf
    max_a, max_s = float(np.max(a)), float(np.max(np.abs(s)))
    return max(norm_a / norm_s, max_a / max_s if max_s > 0 else math.inf)


def rounded_sum_cancellation(terms: Any, rule: str, out_shape: tuple[int, ...], args: dict | None,
                             limit: int, golden: Any = None) -> float:
    """kappa of a recorded sum output from its recorded input `terms` (a value record of the
    golden; `golden`: the record of the output, whose values must be their sum or mean), or
    NaN where it is not computed (module doc)."""
    try:
        shape = tuple(int(d) for d in terms.shape)
    except (TypeError, ValueError, AttributeError):
        return math.nan
    n = math.prod(shape)
    out_numel = math.prod(out_shape)
    if n <= 0 or n > limit or out_numel <= 0:
        return math.nan
    axes = kept_axes_reduced(rule, len(shape), len(out_shape), args)
    if axes is None:
        return math.nan
    try:
        x = np.asarray(terms.read())
        g = None if golden is None else np.asarray(golden.read())
    except (DumpError, OSError, ValueError, KeyError, TypeError, RuntimeError):
        return math.nan                 # (a damaged input: no widening; the row is judged as before)
    if x.size != n or not np.issubdtype(x.dtype, np.floating):
        return math.nan
    if g is not None and (g.size != out_numel or not np.issubdtype(g.dtype, np.floating)):
        return math.nan
    with np.errstate(all="ignore"):
        return cancellation(x.reshape(shape), axes, out_numel, g)
