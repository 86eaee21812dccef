"""accucmp/compare/cancellation.py: how much a sum cancels, from the golden's recorded input,
for load-replays made without own error, and the verdict that reads it (edge cases written
out: zeros, exact cancellation, NaN, empty, arguments that do not fit, damaged records)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from accucmp.compare.cancellation import cancellation, kept_axes_reduced, rounded_sum_cancellation
from dumpfile.errors import DumpFormatError
from tests._compare_helpers import bf16
from tests.test_compare_verdict import row, verdict

U_BF16 = 2.0 ** -8


@pytest.mark.parametrize("rule,ndim,out_ndim,args,axes", [
    ("channel", 4, 1, None, (0, 2, 3)),          # conv / batch norm grad_bias over (N, H, W)
    ("channel", 2, 1, None, (0,)),               # batch norm of (N, C)
    ("channel", 1, 1, None, None),               # no channel dim: not applied
    ("trailing", 3, 1, None, (0, 1)),            # layer norm grad_bias over normalized_shape
    ("trailing", 2, 3, None, None),
    ("dim", 3, 0, None, (0, 1, 2)),              # sum of everything
    ("dim", 3, 0, {"dim": []}, (0, 1, 2)),
    ("dim", 3, 2, {"dim": [0], "keepdim": True}, (0,)),
    ("dim", 3, 2, {"dim": -1}, (2,)),
    ("dim", 3, 1, {"dim": [2, -3, 0]}, (0, 2)),
    ("dim", 3, 2, {"dim": [3]}, None),           # out of range
    ("dim", 3, 2, {"dim": [True]}, None),        # a bool is no dim
    ("dim", 3, 2, {"dim": "0"}, None),
    ("what", 3, 2, None, None),
])
def test_kept_axes(rule, ndim, out_ndim, args, axes):
    assert kept_axes_reduced(rule, ndim, out_ndim, args) == axes


def test_cancellation_values():
    one_signed = np.abs(np.random.default_rng(0).standard_normal((64, 8))).astype(np.float32)
    assert cancellation(one_signed, (0,), 8) == pytest.approx(1.0)
    assert cancellation(np.zeros((4, 3), np.float32), (0,), 3) == 1.0       # nothing to cancel
    assert cancellation(np.array([[1.0, -2.0], [-1.0, 2.0]], np.float32), (0,), 2) == math.inf  # all 0
    # one output that cancels beside one that does not: judged norm-wise and by the largest
    # elements, as the verdict's tests are (|0| is off by at most 2 u, 2 u of max |sum| = 4)
    assert cancellation(np.array([[1.0, 2.0], [-1.0, 2.0]], np.float32), (0,), 2) == pytest.approx(math.sqrt(20) / 4)
    x = np.array([[1.0, 1e-3], [-1.0 + 1e-3, 1e-3]], np.float64)             # column 0 cancels
    s, a = x.sum(0), np.abs(x).sum(0)
    want = max(np.linalg.norm(a) / np.linalg.norm(s), a.max() / np.abs(s).max())
    assert cancellation(x, (0,), 2) == pytest.approx(want)
    assert math.isnan(cancellation(np.array([[np.nan, 1.0]]), (0,), 2))
    assert math.isnan(cancellation(np.ones((4, 3)), (0,), 4))                # not the output's size


class _Record:
    def __init__(self, values=None, shape=None, error=None):
        self.values, self.error = values, error
        self.shape = shape if shape is not None else np.shape(values)

    def read(self):
        if self.error is not None:
            raise self.error
        return self.values


def test_rounded_sum_cancellation_refuses_what_does_not_hold():
    x = np.random.default_rng(1).standard_normal((16, 4)).astype(np.float32)
    ok = rounded_sum_cancellation(_Record(x), "dim", (4,), {"dim": [0]}, limit=1 << 20)
    assert ok == pytest.approx(cancellation(x, (0,), 4))
    assert math.isnan(rounded_sum_cancellation(_Record(x), "dim", (4,), {"dim": [0]}, limit=10))   # too large
    assert math.isnan(rounded_sum_cancellation(_Record(x, shape=(8, 4)), "dim", (4,), {"dim": [0]}, 1 << 20))
    assert math.isnan(rounded_sum_cancellation(_Record(x.astype(np.int64)), "dim", (4,), {"dim": [0]}, 1 << 20))
    assert math.isnan(rounded_sum_cancellation(_Record(np.zeros((0, 4), np.float32)), "dim", (4,), None, 1 << 20))
    damaged = _Record(shape=(16, 4), error=DumpFormatError("g.h5: /aten.sum/3/input/self: unreadable"))
    assert math.isnan(rounded_sum_cancellation(damaged, "dim", (4,), {"dim": [0]}, 1 << 20))
    assert math.isnan(rounded_sum_cancellation(_Record(x), "dim", (4,), {"dim": [5]}, 1 << 20))


def _sum_row(red_ulps: float, kappa: float, seqid: int = 1) -> dict:
    y = np.random.default_rng(seqid).standard_normal(256).astype(np.float32)
    # a target off by red_ulps units of bf16, spread evenly (its RED is red_ulps * u)
    x = (y * (1 + red_ulps * U_BF16)).astype(np.float32)
    return row(x, y, dtype="bfloat16", precision="bfloat16", op="aten.sum.dim_IntList", seqid=seqid,
               RoundedInputCancellation=kappa, MatchedBy="seqid")


def test_verdict_allows_what_rounding_the_terms_moves_a_sum_by():
    t = verdict(_sum_row(8, 3.0, 1), _sum_row(10, 3.0, 2), _sum_row(8, math.nan, 3))
    assert list(t["Result"]) == ["pass", "fail", "fail"]        # bound (6 + 3) u; 6 u without kappa
    assert "the replay's rounding of its terms moves it by" in t["FailReason"][1]
    assert t["DecidedBy"][1] == "RelativeEuclideanDistanceUlps"
    assert t["DecidingBound"][1] == pytest.approx(9.0)


def test_verdict_skips_a_sum_the_rounding_of_its_terms_leaves_no_digit_of():
    t = verdict(_sum_row(1e5, 1.0 / U_BF16, 1), _sum_row(0.5, 2e7, 2))
    assert list(t["Result"]) == ["skipped", "skipped"]           # whatever the difference
    assert all(r.startswith("ill-conditioned: a sum whose terms the replay rounded") for r in t["FailReason"])


def test_the_terms_must_be_what_the_golden_summed():
    """A terms record that is not what the golden's recorded sum (or mean) adds up (a damaged
    or edited file, a record of another tensor) gives no kappa: the row is judged strictly."""
    x = np.random.default_rng(2).standard_normal((32, 4)).astype(np.float32)
    total, mean = x.sum(0), x.mean(0)
    want = cancellation(x, (0,), 4)
    for golden in (total, mean):
        assert rounded_sum_cancellation(_Record(x), "dim", (4,), {"dim": [0]}, 1 << 20,
                                        golden=_Record(golden)) == pytest.approx(want)
    edited = total.copy()
    edited[2] += 0.5
    assert math.isnan(rounded_sum_cancellation(_Record(x), "dim", (4,), {"dim": [0]}, 1 << 20,
                                               golden=_Record(edited)))
    assert math.isnan(rounded_sum_cancellation(_Record(x), "dim", (4,), {"dim": [0]}, 1 << 20,
                                               golden=_Record(total[:3])))
    assert math.isnan(rounded_sum_cancellation(_Record(x), "dim", (4,), {"dim": [0]}, 1 << 20,
                                               golden=_Record(shape=(4,), error=OSError("EIO"))))
