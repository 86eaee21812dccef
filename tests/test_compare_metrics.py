"""Each metric on hand-checked values and the edge cases of REFERENCE.md section 4."""

import math

import numpy as np
import pytest

from accucmp.compare.metrics import (F32_EPS, METRIC_NAMES, METRICS, TensorComparison, aligned, compare_arrays,
                             resolve_algorithms)
from accucmp.compare.stats_metrics import compare_stats


def vals(x, y, algs=None):
    return {k: r.value for k, r in compare_arrays(np.asarray(x), np.asarray(y), algs).items()}


def reasons(x, y, algs=None):
    return {k: r.reason for k, r in compare_arrays(np.asarray(x), np.asarray(y), algs).items()}


def test_registry_names_and_directions():
    assert METRIC_NAMES == ("CosineSimilarity", "MaxAbsoluteError", "AccumulatedRelativeError",
                            "RelativeEuclideanDistance", "KullbackLeiblerDivergence", "StandardDeviation",
                            "MeanAbsoluteError", "RootMeanSquareError", "MaxRelativeError", "MeanRelativeError")
    assert METRICS["CosineSimilarity"].higher_is_better
    assert not METRICS["RelativeEuclideanDistance"].higher_is_better
    assert METRICS["KullbackLeiblerDivergence"].needs_two_passes
    assert METRICS["CosineSimilarity"].default_threshold == 0.99
    assert resolve_algorithms("relativeeuclideandistance,CosineSimilarity") == (
        "CosineSimilarity", "RelativeEuclideanDistance")
    with pytest.raises(ValueError):
        resolve_algorithms(["Cosine"])


def test_hand_checked_values():
    v = vals([1.0, 2.0, 3.0], [1.0, 2.0, 4.0])
    assert v["CosineSimilarity"] == pytest.approx(17 / math.sqrt(14 * 21), rel=1e-15)
    assert v["MaxAbsoluteError"] == 1.0
    assert v["AccumulatedRelativeError"] == pytest.approx(0.25)
    assert v["RelativeEuclideanDistance"] == pytest.approx(math.sqrt(1 / 21), rel=1e-15)
    assert v["MeanAbsoluteError"] == pytest.approx(1 / 3)
    assert v["RootMeanSquareError"] == pytest.approx(math.sqrt(1 / 3))
    assert v["MaxRelativeError"] == pytest.approx(0.25)
    assert v["MeanRelativeError"] == pytest.approx(0.25 / 3)
    # mean 2, std sqrt(2/3); mean 7/3, std sqrt(42/27)
    assert v["StandardDeviation"] == "(2.000;0.816),(2.333;1.247)"
    # KL: p = (eps, .5, 1)/(1.5+eps), q = (eps, 1/3, 1)/(4/3+eps)
    e = F32_EPS
    p = [e / (1.5 + e), 0.5 / (1.5 + e), 1 / (1.5 + e)]
    q = [e / (4 / 3 + e), (1 / 3) / (4 / 3 + e), 1 / (4 / 3 + e)]
    assert v["KullbackLeiblerDivergence"] == pytest.approx(sum(a * math.log(a / b) for a, b in zip(p, q)), rel=1e-12)


def test_std_shows_small_values_as_zero():
    v = vals([0.0001, -0.0001], [5.0, 7.0])
    # the original's formatting: %.3f of each value, |v| < 0.001 as 0 -> "0.000"
    assert v["StandardDeviation"] == "(0.000;0.000),(6.000;1.000)"


def test_scalar_and_sign():
    assert vals([2.0], [3.0])["CosineSimilarity"] == 1.0
    # the formula itself gives -1 for opposite signs (the reference printed 1)
    assert vals([-2.0], [3.0])["CosineSimilarity"] == -1.0
    assert vals(np.float32(2.0), np.float32(2.0))["RelativeEuclideanDistance"] == 0.0


def test_zero_sides():
    both = compare_arrays(np.zeros(4), np.zeros(4))
    assert both["CosineSimilarity"].value == 1.0
    assert both["RelativeEuclideanDistance"].value == 0.0
    # as the original: the float32-eps floor makes an all-zero (or constant) side uniform
    assert both["KullbackLeiblerDivergence"].value == 0.0
    assert compare_arrays(np.full(5, 2.0), np.full(5, 2.0))["KullbackLeiblerDivergence"].value == 0.0
    assert compare_arrays(np.full(5, -3.0), np.full(5, 7.0))["KullbackLeiblerDivergence"].value == 0.0
    t0 = compare_arrays(np.zeros(3), np.array([1.0, 2.0, 3.0]))
    assert math.isnan(t0["CosineSimilarity"].value) and "target is all zero" in t0["CosineSimilarity"].reason
    assert t0["RelativeEuclideanDistance"].value == pytest.approx(1.0)
    # one side all zero: the original's formula still gives a number (p uniform)
    p = np.full(3, F32_EPS) / (3 * F32_EPS)
    q = np.maximum(np.array([0.0, 0.5, 1.0]), F32_EPS)
    q = q / q.sum()
    assert t0["KullbackLeiblerDivergence"].value == pytest.approx(float((p * np.log(p / q)).sum()), rel=1e-9)
    g0 = compare_arrays(np.array([1.0, 0.0]), np.zeros(2))
    assert math.isnan(g0["RelativeEuclideanDistance"].value)
    assert "golden is all zero" in g0["RelativeEuclideanDistance"].reason
    assert g0["MaxAbsoluteError"].value == 1.0
    # |y| <= eps counts 0 in relative errors, but n still counts it
    assert g0["MaxRelativeError"].value == 0.0


def test_relative_errors_skip_tiny_golden():
    v = vals([5.0, 3.0], [0.0, 2.0])
    assert v["AccumulatedRelativeError"] == pytest.approx(0.5)
    assert v["MaxRelativeError"] == pytest.approx(0.5)
    assert v["MeanRelativeError"] == pytest.approx(0.25)


def test_bool_only_cosine_and_red():
    r = compare_arrays(np.array([True, False, True, True]), np.array([True, False, False, True]))
    assert r["CosineSimilarity"].value == pytest.approx(2 / math.sqrt(3 * 2))
    assert r["RelativeEuclideanDistance"].value == pytest.approx(math.sqrt(1 / 2))
    for name in METRIC_NAMES:
        if name not in ("CosineSimilarity", "RelativeEuclideanDistance"):
            assert "bool tensor" in r[name].reason
            assert not isinstance(r[name].value, float) or math.isnan(r[name].value)


def test_nan_inf_equal_on_both_sides_left_out():
    x = np.array([1.0, np.nan, np.inf, 2.0])
    y = np.array([1.0, np.nan, np.inf, 4.0])
    r = compare_arrays(x, y)
    assert r["MaxAbsoluteError"].value == 2.0
    assert r["RelativeEuclideanDistance"].value == pytest.approx(2 / math.sqrt(17))
    assert "2 NaN/Inf elements equal" in r["MaxAbsoluteError"].reason


def test_nan_on_one_side_gives_no_metric_and_a_reason():
    tc = TensorComparison()
    tc.add(np.array([1.0, np.nan, 3.0, -np.inf]), np.array([1.0, 2.0, 3.0, np.inf]))
    r = tc.results()
    assert all(math.isnan(v.value) for v in r.values())
    assert "2 of 4 elements NaN/Inf on one side only" in r["CosineSimilarity"].reason
    assert tc.extras()["NonFiniteMismatch"] == 2


def test_empty_and_size_mismatch():
    r = compare_arrays(np.zeros(0), np.zeros(0))
    assert all(math.isnan(v.value) and "empty" in v.reason for v in r.values())
    r = compare_arrays(np.zeros(3), np.zeros(4))
    assert all("size mismatch" in v.reason for v in r.values())


def test_streamed_equals_whole_with_different_chunkings():
    rng = np.random.default_rng(1)
    y = rng.standard_normal(300_001).astype(np.float32)
    x = (y + rng.standard_normal(y.size).astype(np.float32) * 1e-3).astype(np.float32)
    whole = compare_arrays(x, y)
    tc = TensorComparison()
    xa = [x[i:i + 70_000] for i in range(0, x.size, 70_000)]
    ya = [y[i:i + 33_333] for i in range(0, y.size, 33_333)]
    for a, b in aligned(xa, ya):
        tc.add(a, b)
    for a, b in aligned(xa, ya):
        tc.kl_pass(a, b)
    streamed = tc.results()
    for name in METRIC_NAMES:
        if name == "StandardDeviation":
            assert streamed[name].value == whole[name].value
        else:
            assert streamed[name].value == pytest.approx(whole[name].value, rel=1e-9), name
    # against plain float64 numpy
    X, Y = x.astype(np.float64), y.astype(np.float64)
    assert whole["RelativeEuclideanDistance"].value == pytest.approx(np.linalg.norm(X - Y) / np.linalg.norm(Y), rel=1e-12)


def test_aligned_detects_length_mismatch():
    with pytest.raises(ValueError):
        list(aligned([np.zeros(3)], [np.zeros(2)]))


def test_std_is_accurate_when_mean_dominates():
    x = 1e8 + np.array([1.0, -1.0, 1.0, -1.0])
    tc = TensorComparison()
    tc.add(x, x)
    assert tc.extras()["TargetStd"] == pytest.approx(1.0, rel=1e-9)


def test_integer_and_complex_inputs():
    v = vals(np.array([1, 2, 3], dtype=np.int64), np.array([1, 2, 4], dtype=np.int32))
    assert v["MaxAbsoluteError"] == 1.0
    c = vals(np.array([1 + 1j, 2 + 0j]), np.array([1 + 1j, 2 + 0j]))
    assert c["RelativeEuclideanDistance"] == 0.0


def test_stats_lower_bounds():
    x = {"min": -1.0, "max": 3.0, "mean": 1.0, "std": 1.0, "norm": 10.0, "nan_count": 0, "inf_count": 0, "numel": 100}
    y = {"min": -1.0, "max": 2.0, "mean": 1.0, "std": 1.0, "norm": 8.0, "nan_count": 0, "inf_count": 0, "numel": 100}
    res, extras = compare_stats(x, y)
    assert res["RelativeEuclideanDistance"].value == pytest.approx(0.25)
    assert "lower bound" in res["RelativeEuclideanDistance"].reason
    assert res["MaxAbsoluteError"].value == 1.0
    assert res["RootMeanSquareError"].value == pytest.approx(0.2)
    assert math.isnan(res["CosineSimilarity"].value)
    assert extras["GoldenAbsMax"] == 2.0


def test_masking_sentinels_of_each_dtype_count_equal():
    # an attention mask filled with finfo(dtype).min: -3.4e38 in the float32 golden; the
    # float16 run's -65504 (+ a score added to it), a replay's bf16 rounding to -inf
    f32min = float(np.finfo(np.float32).min)
    y = np.array([0.0, f32min, f32min, f32min, 1.5], dtype=np.float32)
    x = np.array([0.0, -65504.0, -65503.2, -np.inf, 1.5], dtype=np.float32)
    v = vals(x, y)
    assert v["MaxAbsoluteError"] == 0.0 and v["RelativeEuclideanDistance"] == 0.0
    # not a sentinel: a large golden value, an opposite sign, a small target value
    assert vals(np.array([-1e5], np.float32), np.array([-3e38], np.float32))["MaxAbsoluteError"] > 1e38
    assert vals(np.array([65504.0], np.float32), np.array([f32min], np.float32))["MaxAbsoluteError"] > 1e38
    assert vals(np.array([-100.0], np.float32), np.array([f32min], np.float32))["MaxAbsoluteError"] > 1e38


def test_signalling_nan_counts_as_nan_without_a_warning():
    """Garbage in a buffer (FSDP2's all-gather slots, compared by the folder compare's
    replica check) can hold a signalling NaN: converting it to float64 raised numpy's
    "invalid value encountered in cast" on stderr. It is a NaN on both sides, left out as
    any NaN both sides hold."""
    import warnings
    snan = np.array([0x7F800001], dtype=np.uint32).view(np.float32)[0]
    x = np.array([1.0, snan, 3.0], dtype=np.float32)
    y = np.array([1.0, snan, 3.5], dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = compare_arrays(x, y)
    assert r["MaxAbsoluteError"].value == 0.5
