"""Updates the target's precision absorbs (torch-free): column UpdateAbsorbed.

An in-place update of the state a step starts from (an optimizer's `param.addcdiv_(...)`,
AdamW's decay `param.mul_(1 - lr * wd)`, Adam's `exp_avg_sq.mul_(beta2)`, an EMA's `lerp_`)
moves each element by a little. Where the move is under half the spacing of the stored dtype
at that element, rounding gives the old value back: the update is absorbed. A bfloat16 weight
near 1.0 (a LayerNorm's) sits on a grid of 2^-8 below 1 and 2^-7 above; an Adam step of 1e-3
leaves it where it is, every step. The golden (float32) learns and the target does not, while
the target's value stays within bfloat16's rounding of the golden's and every op computed right
on what it got: each row passes, and so did the run (a pure-bfloat16 AdamW at lr 1e-5 kept
97% of a linear layer's weights unchanged).

    UpdateAbsorbed = |{i: the golden changed i; the target left i at its old value; the
                        golden's change is within one spacing of the target's dtype there}|
                     / |{i: the golden changed i}|

(`UpdateChanged` is the denominator.) An element the target left unchanged while the golden
moved it by more than a spacing was not absorbed (its update was zero: the target's gradient
was, say): it counts in the denominator only. An element that is not finite on either side,
before or after, is left out. The target's old value is its record of the tensor before the
op; a load-replay's file holds none: the op got the golden's, rounded to the target's dtype
(round-to-nearest-even, as the replay's cast). The verdict fails a row whose UpdateAbsorbed
reaches the threshold UpdateAbsorbedFraction (op_policies, Origin `absorbed`).
"""

from __future__ import annotations

import math
from typing import Iterable

import numpy as np

from accucmp.compare.metrics import aligned_many
from accucmp.numformats import Format, round_to, spacing


def absorbed_update(t_out: Iterable[np.ndarray], g_out: Iterable[np.ndarray], t_in: Iterable[np.ndarray] | None,
                    g_in: Iterable[np.ndarray], fmt: Format) -> tuple[float, int]:
    """(UpdateAbsorbed, UpdateChanged) from streams of flat pieces of the four tensors (the
    target's and golden's values after and before the update; t_in None: the golden's before,
    rounded to `fmt`). Raises ValueError when the streams' lengths differ."""
    absorbed = changed = 0
    streams = (t_out, g_out, g_in) if t_in is None else (t_out, g_out, g_in, t_in)
    with np.errstate(invalid="ignore", over="ignore"):
        for pieces in aligned_many(*streams):
            to, go, gi = (np.asarray(p, dtype=np.float64) for p in pieces[:3])
            ti = round_to(gi, fmt) if t_in is None else np.asarray(pieces[3], dtype=np.float64)
            finite = np.isfinite(to) & np.isfinite(go) & np.isfinite(gi) & np.isfinite(ti)
            moved = finite & (go != gi)
            changed += int(np.count_nonzero(moved))
            absorbed += int(np.count_nonzero(moved & (to == ti) & (np.abs(go - gi) <= spacing(ti, fmt))))
    return (absorbed / changed if changed else math.nan), changed
