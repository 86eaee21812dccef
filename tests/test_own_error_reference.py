"""The own-error reference (npu_dumper/replay/own_error.py) computed more cheaply must store the
same numbers: add / sub / mul / div of float32-exact inputs are computed in float32 (rounded
to the target they are the float64 result rounded, bit for bit), and a block whose target
equals the rounded reference skips the float64 difference. Checked against the float64
computation written out here, on inputs across the whole range (subnormals, overflow, Inf,
NaN, signed zeros)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from npu_dumper.replay import own_error

aten = torch.ops.aten
IEEE_OPS = (aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor)


def _wide_range(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """n values of `dtype` spread over its whole exponent range (subnormals included), with
    zeros of both signs, +-Inf, NaN and values near the largest finite one."""
    g = torch.Generator().manual_seed(seed)
    fi = torch.finfo(dtype)
    lo, hi = math.log2(fi.smallest_normal) - 10, math.log2(fi.max)
    e = lo + (hi - lo) * torch.rand(n, generator=g, dtype=torch.float64)
    x = torch.sign(torch.randn(n, generator=g, dtype=torch.float64)) * torch.exp2(e)
    x[:8] = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, fi.max, -fi.max, fi.smallest_normal],
                         dtype=torch.float64)
    return x.to(dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int16 if a.element_size() == 2 else torch.int32),
                                              b.view(torch.int16 if b.element_size() == 2 else torch.int32))


@pytest.mark.parametrize("op", IEEE_OPS, ids=lambda o: str(o))
@pytest.mark.parametrize("da,db", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                   (torch.float32, torch.float32), (torch.bfloat16, torch.float32)])
def test_one_ieee_operation_in_float32_rounds_to_the_float64_reference_bit_for_bit(op, da, db):
    n = 200_000
    a, b = _wide_range(n, da, 1), _wide_range(n, db, 2)
    # also operands close together (cancellation in a - b, a + (-b)) and products near the
    # underflow and overflow edges
    a[-1000:] = b[-1000:].to(da) * (1 + 2.0 ** -7)
    out_dtype = torch.promote_types(da, db)
    assert own_error._rounds_alike_in_fp32(op, (a, b), {}, out_dtype)
    for target in {out_dtype, torch.bfloat16, torch.float16}:
        want = op(a.double(), b.double()).to(target)      # the float64 reference, rounded
        got = op(a.float(), b.float()).to(target)
        assert _same_bits(want, got), f"{op} {da}/{db} -> {target}"


@pytest.mark.parametrize("args,kwargs,ok", [
    ((torch.ones(3, dtype=torch.bfloat16), torch.ones(3, dtype=torch.bfloat16)), {}, True),
    ((torch.ones(3, dtype=torch.bfloat16), torch.tensor(0.5, dtype=torch.float64)), {}, True),
    ((torch.ones(3, dtype=torch.bfloat16), torch.tensor(0.1, dtype=torch.float64)), {}, False),  # not float32-exact
    ((torch.ones(3, dtype=torch.bfloat16), torch.ones(3, dtype=torch.float64)), {}, False),
    ((torch.ones(3, dtype=torch.bfloat16), torch.ones(3, dtype=torch.int64)), {}, False),
    ((torch.ones(3, dtype=torch.bfloat16), torch.ones(3, dtype=torch.bfloat16)), {"alpha": 2}, False),
])
def test_float32_only_where_one_rounding_of_float32_exact_inputs(args, kwargs, ok):
    assert own_error._rounds_alike_in_fp32(aten.add.Tensor, args, kwargs, torch.bfloat16) is ok
    scalar = float(args[1]) if args[1].dim() == 0 else None
    if scalar is not None:          # the same number as a .Scalar overload's Python argument
        assert own_error._rounds_alike_in_fp32(aten.mul.Scalar, (args[0], scalar), kwargs,
                                               torch.bfloat16) is ok
    # and never for an op that is not one IEEE operation, nor for a float64 target
    assert not own_error._rounds_alike_in_fp32(aten.gelu.default, args[:1], {}, torch.bfloat16)
    assert not own_error._rounds_alike_in_fp32(aten.add.Tensor, args, kwargs, torch.float64)


def _float64_numbers(func, args, kwargs, out):
    """measure's numbers as the float64 computation defines them (one block)."""
    wide = [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    rr = func(*wide, **kwargs).to(out.dtype).double()
    d = out.double() - rr
    err = float(torch.linalg.vector_norm(d))
    if not math.isfinite(err):
        return None
    ref = float(torch.linalg.vector_norm(rr))
    red = err / ref if ref > 0 else (0.0 if err == 0 else math.inf)
    return [red, float(d.abs().max()), float(rr.abs().max())]


def _measured(func, args, kwargs, out):
    prepared = own_error.prepare(func, args, kwargs, {})
    got = own_error.measure(func, prepared, out)
    return None if got is None else next(iter(json.loads(got).values()))


def _cases():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 96, generator=g).to(torch.bfloat16)
    y = torch.randn(64, 96, generator=g).to(torch.bfloat16)
    w = torch.randn(96, 40, generator=g).to(torch.bfloat16)
    bias = torch.randn(40, generator=g).to(torch.bfloat16)
    h = torch.randn(64, 96, generator=g).to(torch.float16)
    yield aten.mul.Tensor, (x, y), {}
    yield aten.add.Tensor, (x, y.float()), {}
    yield aten.div.Tensor, (h, h.flip(0)), {}
    yield aten.add.Tensor, (x, y), {"alpha": 3}                  # float64 reference
    yield aten.mul.Scalar, (x, 0.5), {}
    yield aten.mul.Scalar, (x, 0.044715), {}                    # not float32-exact: float64
    yield aten.gelu.default, (x,), {}
    yield aten.mm.default, (x, w), {}
    yield aten.addmm.default, (bias, x, w), {}
    yield aten._unsafe_view.default, (x, [96, 64]), {}
    yield aten.mul.Tensor, (torch.tensor([1e30, 2.0], dtype=torch.bfloat16),
                            torch.tensor([1e30, 3.0], dtype=torch.bfloat16)), {}     # Inf: not measured


@pytest.mark.parametrize("case", range(11))
@pytest.mark.parametrize("fault", [False, True])
def test_measured_own_error_is_the_float64_one(case, fault):
    func, args, kwargs = list(_cases())[case]
    out = func(*args, **kwargs)
    if fault:       # a kernel that is off: the full path (a copy: the live output stays the op's)
        out = out.clone()
        out.view(-1)[::7] *= 1.01
    want = _float64_numbers(func, args, kwargs, out)
    got = _measured(func, args, kwargs, out)
    assert got == want


@pytest.mark.parametrize("op", IEEE_OPS + (aten.add.Scalar, aten.sub.Scalar, aten.mul.Scalar, aten.div.Scalar),
                         ids=lambda o: str(o))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_an_op_with_a_number_rounds_alike_too(op, dtype):
    # a Python number (a .Scalar overload, or a 0-dim float64 tensor as a .Tensor call gets
    # it): the kernel may divide by multiplying with the reciprocal, which would be two
    # roundings; this checks the reference gets the one
    a = _wide_range(200_000, dtype, 4)
    for number in (3.0, 0.5, -7.0, *(float(torch.tensor(v, dtype=torch.float32)) for v in (1.7, 1e-30, 3e38))):
        other = torch.tensor(number, dtype=torch.float64) if "Tensor" in str(op) else number
        assert own_error._rounds_alike_in_fp32(op, (a, other), {}, dtype)
        want = op(a.double(), other).to(dtype)
        got = op(a.float(), other.float() if isinstance(other, torch.Tensor) else other).to(dtype)
        assert _same_bits(want, got), f"{op} {dtype} by {number}"


# ---- ops that only move elements: the reference in their own dtype (issue 34) ---------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", ["_unsafe_view", "clone", "cat", "stack"])
@pytest.mark.parametrize("live_kind", ["right", "wrong", "nonfinite"])
def test_element_moving_ops_measure_as_in_float64(case, dtype, live_kind):
    from npu_dumper.replay.own_error import _Deferred
    g = torch.Generator().manual_seed(3)
    a = (torch.randn(6, 40, generator=g) * 100).to(dtype)
    b = (torch.randn(6, 40, generator=g)).to(dtype)
    if live_kind == "nonfinite":
        a[0, 0], a[1, 1], b[2, 2] = float("inf"), float("nan"), -0.0
    aten = torch.ops.aten
    func, args = {"_unsafe_view": (aten._unsafe_view.default, (a, [40, 6])),
                  "clone": (aten.clone.default, (a,)),
                  "cat": (aten.cat.default, ([a, b], 1)),
                  "stack": (aten.stack.default, ([a, b],))}[case]
    out = func(*args)
    if live_kind == "wrong":
        out = out.clone()
        out.view(-1)[::7] += 1              # a faulty kernel's elements
    prepared = own_error.prepare(func, args, {}, {})
    got = own_error.measure(func, prepared, out)
    if isinstance(prepared, _Deferred):
        assert prepared.same_dtype
        prepared.same_dtype = False         # the float64 copies, as before
        before = own_error.measure(func, prepared, out)
    else:                                   # (clone is tagged pointwise: measured in blocks)
        real = own_error._MOVES_ELEMENTS
        own_error._MOVES_ELEMENTS = frozenset()
        try:
            before = own_error.measure(func, prepared, out)
        finally:
            own_error._MOVES_ELEMENTS = real
    assert got == before
    if live_kind == "wrong":
        assert json.loads(got)["result"][0] > 0


def test_a_cat_of_two_dtypes_keeps_the_float64_reference():
    from npu_dumper.replay.own_error import _Deferred
    a, b = torch.randn(3, 4).bfloat16(), torch.randn(3, 4)
    prepared = own_error.prepare(torch.ops.aten.cat.default, ([a, b],), {}, {})
    assert isinstance(prepared, _Deferred) and not prepared.same_dtype


@pytest.mark.parametrize("op", ["conv", "layer_norm"])
def test_kappa_of_a_bias_gradient_is_that_of_its_sum_of_absolute_terms(op):
    """OwnCancellation of a backward op's bias gradient is ||sum |grad_output| || / ||sum
    grad_output|| over the reduced dims, in float64 (computed here from the recorded values
    directly); the op's kappa run computes only that output (its output_mask), and the
    input and weight gradients measured beside it keep their own errors."""
    g = torch.Generator().manual_seed(0)
    if op == "conv":
        x = torch.randn(2, 6, 9, 9, generator=g).bfloat16()
        w = torch.randn(8, 6, 3, 3, generator=g).bfloat16()
        go = (torch.randn(2, 8, 9, 9, generator=g) + 0.05).bfloat16()   # a bias gradient that nearly cancels
        func = torch.ops.aten.convolution_backward.default
        args = (go, x, w, [8], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, True])
        dims = (0, 2, 3)
    else:
        x = torch.randn(4, 16, 32, generator=g)
        mean, rstd = x.mean(-1, keepdim=True), torch.rsqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-5)
        go = (torch.randn(4, 16, 32, generator=g) + 0.05)
        w, b = torch.randn(32, generator=g), torch.randn(32, generator=g)
        func = torch.ops.aten.native_layer_norm_backward.default
        args = (go, x, [32], mean, rstd, w, b, [True, True, True])
        dims = (0, 1)
    out = func(*args)
    named = dict(zip(("grad_output",), args))
    prepared = own_error.prepare(func, args, {}, named)
    got = json.loads(own_error.measure(func, prepared, out))
    g64 = go.double()
    kappa = float(torch.linalg.vector_norm(g64.abs().sum(dims))) / float(torch.linalg.vector_norm(g64.sum(dims)))
    assert len(got["result2"]) == 4 and got["result2"][3] == pytest.approx(kappa, rel=1e-12)
    assert len(got["result0"]) == 3 and len(got["result1"]) == 3      # (no kappa: not sums)
    assert got["result2"][0] < 0.02 and got["result0"][0] < 0.02       # their own errors, measured
