"""An op's own error in a load-replay: the target's result against float64 on the inputs it got.

A load-replay hands each target op the golden's recorded inputs cast to the live dtype. When
that cast rounds (an fp32 recording replayed into a bf16/fp16 model), part of the target's
difference from the golden is explained by the rounding of its inputs, not by the op: a
BatchNorm `save_mean` behind a zero-bias layer, a LayerNorm `rstd`, a bias gradient that is 0
in exact arithmetic, all move by far more than a few bf16 units when their inputs move by one,
although the kernel computed exactly what it was given. So, for every replayed op whose inputs
were rounded, the op is run a second time in float64 on the same (rounded) inputs, below every
other dispatch mode (a planted fault or an emulation must not reach the reference), and the
target's outputs are measured against it. The numbers go into the op group's attribute
`own_error` (dumpfile.schema.OP_OWN_ERROR), JSON: {output name: [relative Euclidean distance,
max |target - ref|, max |ref|(, kappa)]} (kappa: how much a sum cancels, dumpfile/opclass.py), ref being the float64
result rounded to the target's output dtype (the rounding any correct kernel must do); `accucmp compare` reads them into the columns
OwnErrorVsFp64 / OwnMaxErrorVsFp64 and the verdict judges the op by them (docs/COMPARE.md).
Under the key "#rounding" (schema.OWN_ERROR_ROUNDING_KEY) the same JSON holds, per output,
[elements off ref, those nearer zero, those above it] (_Errors._count_sides): columns
OwnInexact / OwnTowardZero / OwnUpward, the verdict's RoundingBias.

Matrix products and pointwise ops, which write no input, compute the float64 reference after
the live op in blocks (_BLOCKED, _BlockedPointwise, below), so no float64 copy of a large
operand or result exists at once; add / sub / mul / div of float32-exact inputs compute it in
float32, which rounds to the same reference bit for bit (_ONE_IEEE_OPERATION, below), and a
block whose target equals the rounded reference skips the float64 difference (_Errors). Matrix
products stay float64: a float32 reference, even in blocks of the inner dimension, rounds as
many elements the other way as the kernel it judges (docs/REPLAY.md, "Own error").
For an op that writes an argument (an in-place op,
batch norm's running statistics) the float64 copies of the arguments are taken before the
live op runs; other ops' arguments are copied when measured (`_Deferred`). Eager CPU ops are
measured on a worker thread (measure_worker.py), which keeps what it reads unwritten until
it is done. Ops left out (no attribute; the verdict then
judges the error against the golden as before): views (their result is their input), ops
that draw random numbers, collectives, and ops without a float64 kernel.
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from dumpfile import departures as D
from dumpfile import schema as S
from dumpfile.opclass import is_cast, sum_outputs

from ..capture.opschema import named_args, named_returns, op_info
from ..capture.policy import OpEvent, Policy
from . import heap
from .layout import CollectiveWrites, StorageMap, bitwise_equal, storage_key
from .op_names import draws_random

_REF_DTYPE = {True: torch.complex128, False: torch.float64}


def rounds(src: torch.dtype, live: torch.dtype) -> bool:
    """Whether casting a recorded `src` tensor to the live dtype loses precision."""
    if not (src.is_floating_point or src.is_complex) or not (live.is_floating_point or live.is_complex):
        return False
    return torch.finfo(live).eps > torch.finfo(src).eps


def _upcast(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        if v.is_floating_point() or v.is_complex():
            return v.detach().to(_REF_DTYPE[v.is_complex()], copy=True)
        return v.detach().clone()       # (an op may write it: the live one must not change)
    if isinstance(v, torch.dtype) and v.is_floating_point:
        return torch.float64           # a cast to bf16 becomes exact: the cast's rounding is its error
    return v


def prepare(func: Any, args: tuple, kwargs: dict, named_args: dict[str, Any]) -> tuple | None:
    """Float64 copies of the op's arguments, taken BEFORE the live op runs (an in-place op
    or batch norm's running statistics change them), or None when the op is not measured."""
    info = op_info(func)
    if info.is_view or info.uninitialized or info.collective or info.work_returns:
        return None
    if draws_random(func, named_args):
        return None
    blocked = _BLOCKED.get(func)
    if blocked is not None:
        ref = blocked(args, kwargs)
        if ref is not None:
            return ref
    if torch.Tag.pointwise in info.tags and not info.written and len(info.return_names) == 1:
        return _BlockedPointwise(func, args, kwargs)
    if not info.written:
        # the op writes none of its arguments: they are copied when measured, after it ran
        # (on the measurement worker, measure_worker.py, whose callers keep them unwritten)
        return _Deferred(args, kwargs, same_dtype=func in _MOVES_ELEMENTS and _one_floating_dtype(args, kwargs))
    with torch.no_grad(), _disable_current_modes():
        return tree_map(_upcast, args), tree_map(_upcast, kwargs)


class _Deferred:
    """The arguments of an op that writes none of them: float64 copies taken at measure time
    (`same_dtype`: none; the reference is run in their own dtype, _MOVES_ELEMENTS)."""

    def __init__(self, args: tuple, kwargs: dict, same_dtype: bool = False):
        self.args, self.kwargs, self.same_dtype = args, kwargs, same_dtype


# Ops whose result's elements are their inputs' elements, moved (no arithmetic). Run again in
# the inputs' own floating dtype, they give the float64 reference rounded to that dtype bit for
# bit (the float64 elements are the inputs' values, which that dtype holds), so the measurement
# skips the float64 copies: the numbers are the same (_Errors sees the same rounded reference).
# Only when every floating tensor argument has one dtype (a cat of bf16 and fp32 promotes).
_MOVES_ELEMENTS = frozenset({torch.ops.aten._unsafe_view.default, torch.ops.aten.clone.default,
                             torch.ops.aten.cat.default, torch.ops.aten.stack.default})


def _one_floating_dtype(args: tuple, kwargs: dict) -> bool:
    dtypes = {v.dtype for v in tree_flatten((args, kwargs))[0]
              if isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())}
    return len(dtypes) == 1


def alias_of(v: Any) -> Any:
    return v.data if isinstance(v, torch.Tensor) else v


def aliased(prepared: Any) -> Any:
    """`prepared` holding aliases (`.data`: other tensor objects on the same storages) instead
    of the step's tensor objects, for a measurement made later: a reference held to the
    object itself changes what autograd does with it (AccumulateGrad steals a gradient only
    nobody else holds; held, it copies it, new ops in the dump). The dump's writer holds
    storages the same way (capture/snapshots.py)."""
    fields = _TENSOR_FIELDS.get(type(prepared))
    if fields is None:                  # (the float64 copies: (args, kwargs))
        return tree_map(alias_of, prepared)
    out = copy.copy(prepared)
    for name in fields:
        setattr(out, name, tree_map(alias_of, getattr(prepared, name)))
    return out


def tensors_read(prepared: Any) -> tuple:
    """What a prepared measurement reads of the step's tensors (and its float64 copies): the
    measurement worker keeps them unwritten until it is done."""
    fields = _TENSOR_FIELDS.get(type(prepared))
    return prepared if fields is None else tuple(getattr(prepared, name) for name in fields)


def measure(func: Any, prepared: tuple, out: Any) -> str | None:
    """JSON of {output name: [RED, max abs error, max |ref|]} against float64, or None."""
    try:
        return _measure(func, prepared, out)
    finally:
        _trim_after(out)


def _trim_after(out: Any) -> None:
    """The float64 results just measured count toward giving the heap's free pages back
    (heap.py: they raise glibc's mmap threshold; GPT-2's peak RSS grew ~36 MB a layer)."""
    flat, _ = tree_flatten(out)
    heap.allocated(sum(t.numel() for t in flat if isinstance(t, torch.Tensor)) * 8)


def results_of(info: Any, out: Any, args: tuple, kwargs: dict) -> Any:
    """What an op's own error is measured on: its return value, or for an in-place op that
    returns nothing (the foreach ops: `_foreach_mul_`, `_foreach_addcdiv_`) {argument: value}
    of the arguments it wrote (the op's `args` / `kwargs`; named only for such an op)."""
    if out is None and info.written and not info.return_names:
        return {n: v for n, _, v in named_args(info, args, kwargs) if n in info.written and n not in info.out_args}
    return out


def _results(info: Any, out: Any, ref: Any, ref_args: tuple, ref_kwargs: dict):
    """(name as the dump names it, live tensor, float64 reference) of each result: a list's
    members one by one (`result/result_0`, `self/self_3`: an optimizer's foreach op holds
    every parameter's), an in-place op that returns nothing by the arguments it wrote
    (results_of), against what the reference wrote into its float64 copies."""
    if isinstance(out, dict):
        refs = {n: v for n, _, v in named_args(info, ref_args, ref_kwargs)}
        items = [(n, v, refs.get(n)) for n, v in out.items()]
    else:
        items = [(n, live, r) for (n, _, live), (_, _, r) in zip(named_returns(info, out), named_returns(info, ref))]
    for name, live, r in items:
        if isinstance(live, (list, tuple)) and isinstance(r, (list, tuple)) and len(live) == len(r):
            for k, (a, b) in enumerate(zip(live, r)):
                yield f"{name}/{name}_{k}", a, b
        else:
            yield name, live, r


def _measure(func: Any, prepared: tuple, out: Any) -> str | None:
    info = op_info(func)
    if isinstance(prepared, (_BlockedProduct, _BlockedPointwise, _GroupedProduct)):
        return prepared.measure(info, out)
    if isinstance(prepared, _Deferred):
        if prepared.same_dtype:
            prepared = prepared.args, prepared.kwargs
        else:
            with torch.no_grad(), _disable_current_modes():
                prepared = tree_map(_upcast, prepared.args), tree_map(_upcast, prepared.kwargs)
    ref_args, ref_kwargs = prepared
    try:
        with torch.no_grad(), _disable_current_modes():
            ref = func(*ref_args, **ref_kwargs)
    except Exception:  # noqa: BLE001 - no float64 kernel (or no such call in fp64): nothing to say
        return None
    errors: dict[str, list[float]] = {}
    sides: dict[str, Any] = {}
    with torch.no_grad(), _disable_current_modes():
        for name, live, r in _results(info, out, ref, ref_args, ref_kwargs):
            if not (isinstance(live, torch.Tensor) and isinstance(r, torch.Tensor)):
                continue
            if not (live.is_floating_point() or live.is_complex()) or live.shape != r.shape or live.numel() == 0:
                continue
            if not (live.is_complex() or r.is_complex()):
                acc = _Errors()          # (one block: the same numbers as below, quicker)
                acc.add(live.detach(), r)
                got = acc.result()
                if got is not None:
                    errors[name] = got
                    sides[name] = acc.rounding()
                continue
            # the reference rounded to the target's output dtype: the final rounding (and an
            # underflow, a float16 result below 6e-5) is what any correct kernel must do; the
            # error measured is what the op adds beyond it
            rr = r.to(live.dtype).to(_REF_DTYPE[r.is_complex()])
            d = live.detach().to(rr.dtype, copy=True)
            d -= rr
            if d.is_complex():
                d = d.abs()
            # |d| is not formed (real d): the 2-norm of d is that of |d| (the same squares) and
            # max |d| is max(-min d, max d) (one aminmax pass, ~4x quicker than abs + max or
            # the inf-norm). A NaN/Inf in d makes its 2-norm NaN/Inf, and no finite d
            # overflows it in float64 (|d| < 2^129, n < 2^63): the check that needed a pass of
            # its own (isfinite) is read off the norm
            err_norm = float(torch.linalg.vector_norm(d))
            if not math.isfinite(err_norm):
                continue                # NaN/Inf: compare's own NaN/Inf handling says it
            ref_norm = float(torch.linalg.vector_norm(rr))
            red = err_norm / ref_norm if ref_norm > 0 else (0.0 if err_norm == 0 else math.inf)
            errors[name] = [red, _max_abs(d), _max_abs(rr)]
    combined = _COMBINED_TERMS.get(".".join(str(func).split(".")[:2]), {})
    for name, terms_of in combined.items():
        if name not in errors:
            continue
        try:
            with torch.no_grad(), _disable_current_modes():
                terms = terms_of({n: v for n, _, v in named_args(info, ref_args, ref_kwargs)})
                r = dict((n, v) for n, _, v in named_returns(info, ref)).get(name)
                if terms is not None and isinstance(r, torch.Tensor) and terms.shape == r.shape:
                    num, den = float(torch.linalg.vector_norm(terms)), float(torch.linalg.vector_norm(r))
                    errors[name].append(num / den if den > 0 else math.inf)
        except Exception:  # noqa: BLE001 - no kappa: the row is judged without it
            pass
    sums = [n for n in sum_outputs(str(func)) if n in errors and n not in combined]
    if sums:
        # a sum whose terms cancel: kappa = ||the same sum of |terms| || / ||sum|| (the op run
        # once more on |inputs|: for a sum of one tensor's elements that is sum |x_i|), the
        # factor by which any rounding of its partial sums grows relative to the result
        try:
            abs_args, abs_kwargs = _only_outputs(info, tree_map(_abs, ref_args), tree_map(_abs, ref_kwargs),
                                                 set(sums))
            with torch.no_grad(), _disable_current_modes():
                abs_ref = func(*abs_args, **abs_kwargs)
            for (name, _, a), (_, _, r) in zip(named_returns(info, abs_ref), named_returns(info, ref)):
                if name in sums and isinstance(a, torch.Tensor) and isinstance(r, torch.Tensor):
                    num, den = float(torch.linalg.vector_norm(a)), float(torch.linalg.vector_norm(r))
                    errors[name].append(num / den if den > 0 else math.inf)
        except Exception:  # noqa: BLE001 - no kappa: the row is judged without it
            pass
    return _with_rounding(errors, sides)


def _batch_norm_grad_input_terms(a: dict) -> torch.Tensor | None:
    """The |terms| of batch norm backward's grad_input in training, (g - mean(g) - xhat *
    mean(g * xhat)) * invstd * w (means over the batch and the spatial dims), in float64:
    ||them|| / ||grad_input|| is how much that combination cancels, as a sum's kappa. Over
    2 values a channel (timm's ghostnet at 32x32: 1x1 maps, batch 2) it cancels 31-fold, and
    the CPU kernel's 12.6 u of bf16 against float64 was blamed as its own error. None in
    eval mode (grad_input = g * invstd * w: nothing cancels)."""
    g, x = a.get("grad_out"), a.get("input")
    mean, invstd = a.get("save_mean"), a.get("save_invstd")
    if not a.get("train") or not all(isinstance(v, torch.Tensor) for v in (g, x, mean, invstd)) or x.dim() < 2:
        return None
    shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
    dims = [0] + list(range(2, x.dim()))
    mean, invstd = mean.reshape(shape), invstd.reshape(shape)
    w = a.get("weight")
    scale = (invstd * w.reshape(shape)).abs() if isinstance(w, torch.Tensor) else invstd.abs()
    xhat = (x - mean) * invstd
    return (g.abs() + g.mean(dims, keepdim=True).abs() + (xhat * (g * xhat).mean(dims, keepdim=True)).abs()) * scale


# op packet -> {output: its |terms| from the float64 arguments by name}: outputs that combine
# terms which may cancel, other than a plain sum of one input's elements (whose |terms| the op
# gives on |inputs|, below); listed in dumpfile.opclass.SUM_OUTPUTS as well (the verdict's
# bound for them is kappa x u)
_COMBINED_TERMS: dict[str, dict[str, Any]] = {
    "aten.native_batch_norm_backward": {"result0": _batch_norm_grad_input_terms},
}


def _only_outputs(info: Any, args: tuple, kwargs: dict, wanted: set[str]) -> tuple[tuple, dict]:
    """The call computing only the outputs named in `wanted`, where its schema has a
    per-output `output_mask` (the norm and convolution backward ops: kappa needs only their
    bias gradient; ConvNeXt-tiny's float64 convolution_backward on |inputs| cost ~1.5 s of
    a replay step computing the input and weight gradients too); else the call as it is."""
    pos = info.positions.get("output_mask")
    names = list(info.return_names)
    if pos is None:
        return args, kwargs
    in_args = pos < len(args)
    mask = args[pos] if in_args else kwargs.get("output_mask")
    if not isinstance(mask, (list, tuple)) or len(mask) != len(names) \
            or not all(isinstance(m, bool) for m in mask):
        return args, kwargs
    only = [bool(m) and n in wanted for m, n in zip(mask, names)]
    if in_args:
        args = (*args[:pos], only, *args[pos + 1:])
    else:
        kwargs = {**kwargs, "output_mask": only}
    return args, kwargs


def _max_abs(t: torch.Tensor) -> float:
    """max |t| of a real tensor (as float(t.abs().max())), from one aminmax pass."""
    if t.is_complex():
        return float(t.abs().max())
    lo, hi = torch.aminmax(t)
    return max(-float(lo), float(hi)) + 0.0     # (+ 0.0: never -0.0, as abs gives)


# ---- matrix products in blocks ---------------------------------------------------------
# A float64 copy of a large operand (GPT-2's 50257 x 768 output embedding: 309 MB) and a
# float64 result, with the temporaries of the comparison, made each large product's
# measurement cost several times the memory of the op itself, at the moments the step's
# memory peaks. mm / addmm / bmm write none of their inputs (so nothing need be copied before
# the live op runs) and split exactly: the reference is computed in blocks of rows or columns
# of the result (the same float64 dot products as one call; only the order of the float64
# sums of the two norms differs, by ~1e-16 relative), or, when the result is the smallest
# full-size operand, over the inner dimension into one float64 result (float64 partial sums:
# the reference moves by float64 rounding, ~K 2^-53 relative, far below what rounding it to
# the target's 2^-8 / 2^-11 can resolve). The largest float64 block is _BLOCK_ELEMENTS.
_BLOCK_ELEMENTS = 1 << 20


class _BlockedProduct:
    """beta * C + alpha * (A @ B) (C None: A @ B), A [..., M, K], B [..., K, N], measured in blocks."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None, beta: Any, alpha: Any):
        self.a, self.b, self.c, self.beta, self.alpha = a, b, c, beta, alpha

    def _ref(self, a, b, c) -> torch.Tensor:
        a, b = a.to(torch.float64), b.to(torch.float64)
        if self.c is None:
            return torch.matmul(a, b) if self.alpha == 1 else torch.matmul(a, b).mul_(self.alpha)
        return torch.addmm(c.to(torch.float64), a, b, beta=self.beta, alpha=self.alpha)

    def measure(self, info: Any, out: Any) -> str | None:
        rets = list(named_returns(info, out))
        if len(rets) != 1 or not isinstance(rets[0][2], torch.Tensor):
            return None
        name, _, live = rets[0]
        a, b = self.a, self.b
        m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
        batch = a.numel() // max(m * k, 1)
        if not live.is_floating_point() or tuple(live.shape[-2:]) != (m, n) or live.numel() == 0:
            return None
        c = None if self.c is None else self.c.expand(m, n)
        try:
            with torch.no_grad(), _disable_current_modes():
                # the full-size float64 operand left: A (blocks of columns), B (of rows), the
                # result (over K): the smallest
                whole = {"cols": m * k, "rows": k * n, "inner": m * n}
                how = min(whole, key=whole.get)
                if how == "inner":
                    step = max(1, _BLOCK_ELEMENTS // max(batch * (m + n), 1))
                    ref = None
                    for k0 in range(0, k, step):
                        ak, bk = a[..., k0:k0 + step], b[..., k0:k0 + step, :]
                        if ref is None:
                            ref = self._ref(ak, bk, c)
                        elif self.c is None:
                            ref.add_(torch.matmul(ak.to(torch.float64), bk.to(torch.float64)), alpha=self.alpha)
                        else:
                            ref.addmm_(ak.to(torch.float64), bk.to(torch.float64), alpha=self.alpha)
                    if ref is None:
                        return None
                    acc = _Errors()
                    acc.add(live, ref)
                elif how == "cols":
                    step = max(1, _BLOCK_ELEMENTS // max(batch * (k + m), 1))
                    a = a.to(torch.float64)         # (once, not in every block: the same values)
                    acc = _Errors()
                    for j in range(0, n, step):
                        acc.add(live[..., j:j + step], self._ref(a, b[..., j:j + step], None if c is None else c[:, j:j + step]))
                else:
                    step = max(1, _BLOCK_ELEMENTS // max(batch * (k + n), 1))
                    b = b.to(torch.float64)
                    acc = _Errors()
                    for i in range(0, m, step):
                        acc.add(live[..., i:i + step, :], self._ref(a[..., i:i + step, :], b, None if c is None else c[i:i + step]))
        except Exception:  # noqa: BLE001 - no float64 kernel for it: nothing to say, as measure
            return None
        got = acc.result()
        return None if got is None else _with_rounding({name: got}, {name: acc.rounding()})


_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}   # an element's bits, by its size
_SIDES_SAMPLE = 1 << 16          # _Errors._count_sides: elements of a block counted at most (about)


class _Errors:
    """measure's numbers accumulated over blocks of one output (the same definitions), and
    on which side of the correctly rounded result its inexact elements lie (`rounding`)."""

    def __init__(self):
        self.errs: list[float] = []         # each block's 2-norms (math.hypot joins them: one
        self.refs: list[float] = []         # block gives exactly its norm)
        self.max_err = self.max_ref = 0.0
        self.finite = True
        # elements off the rounded reference (its normal range), those nearer zero, those above
        self.inexact = self.toward_zero = self.upward = 0

    def add(self, live: torch.Tensor, r: torch.Tensor) -> None:
        if not self.finite:
            return
        # the rounded reference is not widened into a float64 copy of its own: its norm is
        # taken with dtype=float64 (the float64 copy's norm, bit for bit), its largest
        # magnitude in its own dtype (exact), and the subtraction widens its elements as it
        # reads them (exactly, as .to(float64) does): the same numbers, three passes over
        # float64 fewer
        rr = r.to(live.dtype)
        max_ref = _max_abs(rr)
        if bitwise_equal(live, rr) and math.isfinite(max_ref):
            # the target is the reference rounded, element for element (a correctly rounded
            # pointwise kernel, a copy): the difference is all zeros, so its norm and max are 0
            # without forming it in float64 (about half the time). An Inf makes the full path's
            # difference NaN (Inf - Inf), a NaN makes max_ref NaN: that block takes the full
            # path below, as before. (Bits, not values: -0.0 against +0.0 takes the full path,
            # whose difference is 0 all the same; the integer compare is ~1.7x quicker.)
            err = max_err = 0.0
        else:
            d = live.detach().to(torch.float64, copy=True)
            d -= rr
            err = float(torch.linalg.vector_norm(d))
            if not math.isfinite(err):
                self.finite = False
                return
            max_err = _max_abs(d)
            self._count_sides(live, rr)
        self.errs.append(err)
        self.refs.append(float(torch.linalg.vector_norm(rr, dtype=torch.float64)))
        self.max_err = max(self.max_err, max_err)
        self.max_ref = max(self.max_ref, max_ref)

    def _count_sides(self, live: torch.Tensor, rr: torch.Tensor) -> None:
        """Count the elements of a block whose target `live` is not the rounded reference `rr`
        (both of the target's dtype), and of those the ones nearer zero and the ones above it
        (of a block of more than _SIDES_SAMPLE elements, a sample of about that many).
        A kernel that rounds to nearest is off only where its own arithmetic crossed a
        rounding boundary, either way alike; one that truncates puts every such element
        nearer zero (compare's RoundingBias). Elements whose reference is below the smallest
        normal are left out: a flush to zero there is underflow, which compare says apart."""
        if rr.is_complex():
            return
        # a block over _SIDES_SAMPLE elements is counted on every k-th element along its longest
        # dimension (a view): the share on each side is what the rule reads, and a kernel that
        # rounds one way does so at every element (counting all of GPT-2 small's step cost its
        # own-error thread 18% more time)
        k = -(-live.numel() // _SIDES_SAMPLE)
        if k > 1 and live.dim() and live.shape == rr.shape:
            dim = max(range(live.dim()), key=lambda i: live.shape[i])
            every = (slice(None),) * dim + (slice(None, None, min(k, live.shape[dim])),)
            live, rr = live[every], rr[every]
        # compared by their bits, then only the inexact elements widened: a product rounding
        # to nearest has a few per 10,000
        off = live.view(_BITS[live.element_size()]) != rr.view(_BITS[rr.element_size()]) \
            if live.dtype == rr.dtype and live.element_size() in _BITS else live != rr
        if not int(torch.count_nonzero(off)):
            return
        t, r = live[off].to(torch.float64), rr[off].to(torch.float64)
        keep = t != r                       # (bits differ, values not: -0.0 against +0.0)
        t, r = t[keep], r[keep]
        tiny = S.SMALLEST_NORMAL.get(str(rr.dtype).removeprefix("torch."))
        if tiny:
            normal = r.abs() >= tiny
            t, r = t[normal], r[normal]
        d = t - r
        self.inexact += d.numel()
        self.toward_zero += int(torch.count_nonzero(d.mul_(r) < 0))
        self.upward += int(torch.count_nonzero(t > r))

    def result(self) -> list[float] | None:
        if not self.finite:
            return None
        err, ref = math.hypot(*self.errs), math.hypot(*self.refs)
        red = err / ref if ref > 0 else (0.0 if err == 0 else math.inf)
        return [red, self.max_err, self.max_ref]

    def rounding(self) -> list[int] | None:
        """[inexact, toward zero, upward] element counts (schema.OWN_ERROR_ROUNDING_KEY), None
        when no element of the normal range is off the rounded reference."""
        return [self.inexact, self.toward_zero, self.upward] if self.finite and self.inexact else None


def _with_rounding(errors: dict[str, list[float]], sides: dict[str, Any]) -> str | None:
    """The own_error attribute's JSON: {output: [RED, max abs, max |ref|(, kappa)]} and, under
    schema.OWN_ERROR_ROUNDING_KEY, {output: [inexact, toward zero, upward]} (a dict: readers
    that take only the lists skip it)."""
    if not errors:
        return None
    sides = {k: v for k, v in sides.items() if k in errors and v is not None}
    return json.dumps({**errors, S.OWN_ERROR_ROUNDING_KEY: sides} if sides else errors)


def _real_float(*ts: Any) -> bool:
    return all(isinstance(t, torch.Tensor) and t.is_floating_point() and t.layout == torch.strided
               and not t.is_conj() and not t.is_neg() for t in ts)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _mm(args: tuple, kwargs: dict) -> _BlockedProduct | None:
    if len(args) != 2 or kwargs or not _real_float(*args) or args[0].dim() != 2 or args[1].dim() != 2:
        return None
    return _BlockedProduct(args[0], args[1], None, 0, 1)


def _bmm(args: tuple, kwargs: dict) -> _BlockedProduct | None:
    if len(args) != 2 or kwargs or not _real_float(*args) or args[0].dim() != 3 or args[1].dim() != 3:
        return None
    return _BlockedProduct(args[0], args[1], None, 0, 1)


def _addmm(args: tuple, kwargs: dict) -> _BlockedProduct | None:
    named = dict(zip(("self", "mat1", "mat2"), args))
    named.update(kwargs)
    c, a, b = named.get("self"), named.get("mat1"), named.get("mat2")
    beta, alpha = named.get("beta", 1), named.get("alpha", 1)
    if len(args) > 3 or set(named) - {"self", "mat1", "mat2", "beta", "alpha"} or not _real_float(c, a, b) \
            or a.dim() != 2 or b.dim() != 2 or not (_number(beta) and _number(alpha)):
        return None
    try:
        c.expand(a.shape[0], b.shape[1])
    except RuntimeError:
        return None
    return _BlockedProduct(a, b, c, beta, alpha)


class _GroupedProduct:
    """aten._grouped_mm (a mixture of experts' products: one matrix product a group, the
    groups cut by `offs` out of the rows of A (2-D x 3-D), the inner dimension (2-D x 2-D) or
    the columns of B (3-D x 2-D); 3-D x 3-D without offs is a batch): measured group by group
    in float64, which no _grouped_mm kernel takes (CPU's: float32, bf16, fp16). Rows or
    columns past the last offset are not the op's (left unwritten) and not measured."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None, bias: torch.Tensor | None):
        self.a, self.b, self.offs, self.bias = a, b, offs, bias

    def _pieces(self, live: torch.Tensor) -> list | None:
        """(live block, A block, B block, bias row or None) of each group; None when the
        shapes are none of the four forms."""
        a, b, bias = self.a, self.b, self.bias
        if self.offs is None:
            if a.dim() != 3 or b.dim() != 3 or live.shape != (a.shape[0], a.shape[1], b.shape[2]):
                return None
            return [(live[g], a[g], b[g], None if bias is None else bias[g]) for g in range(a.shape[0])]
        ends = [int(e) for e in self.offs.tolist()]
        starts = [0] + ends[:-1]
        if any(e < s for s, e in zip(starts, ends)):
            return None
        if a.dim() == 2 and b.dim() == 3 and len(ends) == b.shape[0] and ends[-1] <= a.shape[0] \
                and live.shape == (a.shape[0], b.shape[2]):
            return [(live[s:e], a[s:e], b[g], None if bias is None else bias[g])
                    for g, (s, e) in enumerate(zip(starts, ends))]
        if a.dim() == 2 and b.dim() == 2 and ends[-1] <= min(a.shape[1], b.shape[0]) \
                and live.shape == (len(ends), a.shape[0], b.shape[1]):
            return [(live[g], a[:, s:e], b[s:e], None if bias is None else bias[g])
                    for g, (s, e) in enumerate(zip(starts, ends))]
        if a.dim() == 3 and b.dim() == 2 and len(ends) == a.shape[0] and ends[-1] <= b.shape[1] \
                and live.shape == (a.shape[1], b.shape[1]):
            return [(live[:, s:e], a[g], b[:, s:e], None if bias is None else bias[g])
                    for g, (s, e) in enumerate(zip(starts, ends))]
        return None

    def measure(self, info: Any, out: Any) -> str | None:
        rets = list(named_returns(info, out))
        if len(rets) != 1 or not isinstance(rets[0][2], torch.Tensor) or not rets[0][2].is_floating_point():
            return None
        name, _, live = rets[0]
        try:
            with torch.no_grad(), _disable_current_modes():
                pieces = self._pieces(live)
                if pieces is None:
                    return None
                acc = _Errors()
                for lv, ab, bb, cb in pieces:
                    if lv.numel() == 0:
                        continue
                    ref = torch.matmul(ab.to(torch.float64), bb.to(torch.float64))
                    if cb is not None:
                        ref += cb.to(torch.float64)
                    acc.add(lv, ref)
        except Exception:  # noqa: BLE001 - shapes it cannot take: nothing to say, as measure
            return None
        got = acc.result() if acc.errs else None
        return None if got is None else _with_rounding({name: got}, {name: acc.rounding()})


def _grouped_mm(args: tuple, kwargs: dict) -> _GroupedProduct | None:
    named = dict(zip(("self", "mat2", "offs", "bias", "out_dtype"), args))
    named.update(kwargs)
    a, b, offs, bias = named.get("self"), named.get("mat2"), named.get("offs"), named.get("bias")
    if set(named) - {"self", "mat2", "offs", "bias", "out_dtype"} or not _real_float(a, b) \
            or (bias is not None and not _real_float(bias)) \
            or (offs is not None and (not isinstance(offs, torch.Tensor) or offs.dim() != 1
                                      or offs.is_floating_point())):
        return None
    return _GroupedProduct(a, b, offs, bias)


_BLOCKED = {torch.ops.aten.mm.default: _mm, torch.ops.aten.bmm.default: _bmm,
            torch.ops.aten.addmm.default: _addmm}
if hasattr(torch.ops.aten, "_grouped_mm"):
    _BLOCKED[torch.ops.aten._grouped_mm.default] = _grouped_mm


class _BlockedPointwise:
    """A pointwise op (tag `pointwise`: each result element from the same-place elements of
    its inputs, broadcast) that writes none of its inputs: its float64 reference is computed
    after the live op, in blocks of the result's first dimension (inputs sliced alike, or
    taken whole where they broadcast over it): the same float64 elements as one call, without
    a float64 copy of every input and of the result at once (an fp32 gradient sum of GPT-2's
    50257 x 768 embedding: 3 x 309 MB). Not blockable (a single row, an input that is neither
    sliced nor broadcast): one block, as measure does it."""

    def __init__(self, func: Any, args: tuple, kwargs: dict):
        self.func, self.args, self.kwargs = func, args, kwargs

    def measure(self, info: Any, out: Any) -> str | None:
        (name, _, live), = named_returns(info, out)
        if not isinstance(live, torch.Tensor) or not (live.is_floating_point() or live.is_complex()) \
                or live.numel() == 0:
            return None
        if self.func in _MOVES_ELEMENTS and _one_floating_dtype(self.args, self.kwargs):
            wide = _as_is               # (its own dtype: the same rounded reference, _MOVES_ELEMENTS)
        elif _rounds_alike_in_fp32(self.func, self.args, self.kwargs, live.dtype):
            wide = _to_fp32
        else:
            wide = _upcast
        rows = live.shape[0] if live.dim() else 1
        flat, _ = tree_flatten((self.args, self.kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        cut = live.dim() > 0 and all(t.dim() < live.dim() or t.shape[0] in (1, rows) for t in tensors)
        per_row = max(live.numel() // max(rows, 1), 1)
        step = max(1, _BLOCK_ELEMENTS // per_row) if cut else rows

        def block(v: Any, i: int) -> Any:
            if isinstance(v, torch.Tensor) and cut and v.dim() == live.dim() and v.shape[0] == rows and rows > 1:
                v = v[i:i + step]
            return wide(v)
        acc = _Errors()
        try:
            with torch.no_grad(), _disable_current_modes():
                for i in range(0, rows, step):
                    r = self.func(*tree_map(lambda v: block(v, i), self.args),
                                  **tree_map(lambda v: block(v, i), self.kwargs))
                    part = live[i:i + step] if cut and step < rows else live
                    if not isinstance(r, torch.Tensor) or r.shape != part.shape:
                        return None
                    acc.add(part, r)
        except Exception:  # noqa: BLE001 - no float64 kernel (or no such call in fp64): nothing to say
            return None
        got = acc.result()
        return None if got is None else _with_rounding({name: got}, {name: acc.rounding()})


# each kind of prepared measurement: the attributes holding the step's tensors it reads
_TENSOR_FIELDS: dict[type, tuple[str, ...]] = {
    _BlockedProduct: ("a", "b", "c"), _BlockedPointwise: ("args", "kwargs"), _Deferred: ("args", "kwargs"),
    _GroupedProduct: ("a", "b", "offs", "bias")}


# ---- ops whose float32 result, rounded to the target, is the float64 one rounded ------------
# The reference stored is the float64 result rounded to the target's dtype, and PyTorch rounds
# float64 to bfloat16 / float16 through float32 (c10's conversions take a float: measured,
# 1 + 2^-8 + 2^-30 -> 1, not 1 + 2^-7), so what is stored is fl32(fl64(x)) rounded on. For one
# IEEE operation x = a op b (+, -, *, /) on float32 numbers (bf16 and fp16 are subsets),
# rounding twice, to float64 (53 bits) and then to float32 (24), gives the float32 result of
# rounding once, because 53 >= 2 * 24 + 2 (Figueroa, "When is double rounding innocuous?",
# SIGNUM 1995; in float32's subnormal range a +- b is exact in float64, and a product or
# quotient there still has 53 bits against at most 23), and over- and underflow thresholds are
# float64 numbers. So such an op computed in float32, on inputs that are float32-exact, is the
# same reference bit for bit: half the bytes of the float64 one, and a kernel that rounds
# correctly equals it (the fast path of _Errors). The .Tensor and .Scalar overloads of the four:
# an `alpha` other than 1 (a + alpha * b: two roundings) or a Python number that float32
# cannot hold keeps float64.
_ONE_IEEE_OPERATION = frozenset(getattr(getattr(torch.ops.aten, op), overload)
                                for op in ("add", "sub", "mul", "div") for overload in ("Tensor", "Scalar"))
_FP32_SUBSETS = (torch.float32, torch.bfloat16, torch.float16)


def _fp32_exact(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        if v.dtype in _FP32_SUBSETS:
            return True
        # (a Python number the op was called with arrives as a 0-dim float64 tensor)
        return v.dim() == 0 and v.is_floating_point() and float(v.to(torch.float32)) == float(v)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return float(torch.tensor(v, dtype=torch.float32)) == v
    except (OverflowError, RuntimeError):
        return False


def _rounds_alike_in_fp32(func: Any, args: tuple, kwargs: dict, out_dtype: torch.dtype) -> bool:
    """Whether `func(*args, **kwargs)` computed in float32, rounded to `out_dtype`, is its float64
    result rounded to `out_dtype`, bit for bit (the argument above)."""
    if func not in _ONE_IEEE_OPERATION or out_dtype not in _FP32_SUBSETS:
        return False
    if set(kwargs) - {"alpha"} or kwargs.get("alpha", 1) != 1 or len(args) != 2:
        return False
    return all(_fp32_exact(v) for v in args)


def _to_fp32(v: Any) -> Any:
    """A float32 argument of the reference (exact: bf16/fp16 widen exactly; a float32 tensor
    is handed on as it is, the op writes none of its inputs)."""
    if isinstance(v, torch.Tensor):
        return v.detach().to(torch.float32)
    return v


def _as_is(v: Any) -> Any:
    return v


def _abs(v: Any) -> Any:
    return v.abs() if isinstance(v, torch.Tensor) and v.is_floating_point() else v


# ---- plain dumps: each op's own error, measured as it runs --------------------------------

def _coarser_than_fp32(d: Any) -> bool:
    return isinstance(d, torch.dtype) and (d.is_floating_point or d.is_complex) \
        and torch.finfo(d).eps > _FP32_EPS


_FP32_EPS = torch.finfo(torch.float32).eps


def computes_coarse(name: str, outputs: list) -> bool:
    """Whether op `name`, not a cast, made a tensor of a dtype coarser than float32: the run
    computes in that precision from here on, and its casts round by design (a bf16 model, an
    autocast region), unlike a float32 run's round trip (`cast_rounded`; load-replay's
    departures.ROUNDED)."""
    return not is_cast(name) and any(isinstance(t, torch.Tensor) and _coarser_than_fp32(t.dtype) for t in outputs)


# the longest list of numbers kept in scalar_args: an optimizer's foreach op takes one step
# size per parameter (`_foreach_addcdiv_.ScalarList`, 40 for GPT-2 small's 148 tensors in
# groups); at 16 a doubled learning rate went unrecorded and its parameter updates passed as
# inherited. 1024 numbers keep the attribute well inside HDF5's 64 KiB compact limit.
MAX_SCALAR_LIST = 1024


def _plain_value(v: Any) -> bool:
    """A number, bool, string or list of them: an argument whose value two runs should share.
    (dtypes, devices and layouts are left out: autocast and a device change them by design)"""
    if isinstance(v, (bool, int, float, str)):
        return True
    if isinstance(v, (list, tuple)) and v and len(v) <= MAX_SCALAR_LIST:
        return all(isinstance(x, (bool, int, float)) for x in v)
    return False


# ops that copy values from their source arguments into their results (or the tensors they
# write): their results are what the sources were (PlainOwnError.after_op)
_COPIES = frozenset({"aten.copy_", "aten.clone", "aten._foreach_copy_"})


def _tensor_items(name: str, v: Any) -> list:
    """(the dump's name, tensor) of an argument: itself, or a list's members (`self/self_3`)."""
    if isinstance(v, torch.Tensor):
        return [(name, v)]
    if isinstance(v, (list, tuple)):
        return [(f"{name}/{name}_{i}", x) for i, x in enumerate(v) if isinstance(x, torch.Tensor)]
    return []


def _whole_storage(t: torch.Tensor) -> bool:
    """Whether `t` covers every byte of its storage."""
    try:
        return t.untyped_storage().nbytes() == t.numel() * t.element_size() and t.is_contiguous()
    except (RuntimeError, NotImplementedError):
        return False


def _cast_rounding(named: list, outputs: list, rounded: StorageMap) -> torch.dtype | None:
    """The dtype a cast's result went through when the cast rounds an op's result (its output
    dtype is coarser than its floating input's) or carries on such a rounding (`rounded` holds
    the input's): the coarser of the two; None for a cast that rounds nothing (autocast's
    float32 copy of a bfloat16 product: the product's own precision)."""
    ins = [v for _, _, v in named if isinstance(v, torch.Tensor) and v.is_floating_point()]
    outs = [t for t in outputs if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not ins or not outs:
        return None
    src, dst = ins[0], outs[0]
    carried = rounded.get(src)
    down = dst.dtype if torch.finfo(dst.dtype).eps > torch.finfo(src.dtype).eps else None
    if carried is None:
        return down
    if down is None:
        return carried
    return down if torch.finfo(down).eps > torch.finfo(carried).eps else carried


class PlainOwnError(Policy):
    """Plain dump (`use_dump=True`) of a run that computes in reduced precision: every op from
    the first one that touches a floating dtype coarser than float32 (a bf16/fp16 model, an
    autocast cast) on is run a second time in float64 on the inputs it got, and its outputs'
    distance from that reference goes into the op attribute `own_error`, as load-replay does.
    An independent compare (this dump against an fp32 golden dump) then judges each op by
    what it added to what it was given: the rest of its distance from the golden is inherited
    (docs/COMPARE.md, "Caused here vs inherited"). Each op also says which of its tensor
    inputs an earlier op of the block wrote (`made_inputs`): the others are leaves
    (parameters, buffers, the batch), whose difference from the golden is the run's own; a
    cast or a copy of a leaf is that leaf. And which made inputs a cast rounded to a coarser
    dtype while the run computed nothing below float32 (`cast_rounded`: a float32 run's
    `h.to(bfloat16).float()`).
    A float32 run pays nothing (nothing is measured before a reduced-precision op). A compiled
    dump (op_computed) measures every node, float32 included."""

    def __init__(self):
        self._low = False
        self._after_backward = False        # a backward op has run (an optimizer step may follow)
        self._made = StorageMap()           # storages an op of the block wrote
        # leaves' casts back from a coarser dtype: storage -> the coarsest dtype it went through
        self._leaf_rounded = StorageMap()
        # the same for what an op made and casts carried on (schema.OP_CAST_ROUNDED), while no
        # op but a cast has computed in a dtype coarser than float32 (a float32 run: a bf16
        # model or an autocast region computes in bf16 by design, its round trips too)
        self._cast_rounded = StorageMap()
        self._computed_coarse = False
        # storages only constant ops wrote (op attribute constant): True
        self._constant = StorageMap()
        self._collective = CollectiveWrites()     # storages a collective wrote last
        # storages an op of the block allocated (its results that are no input's storage):
        # the others existed before the block, the state the step starts from and ends with
        self._born = StorageMap()
        self._measurer = None               # eager ops' measurements (measure_worker.py)

    def begin(self, session: Any) -> None:
        from .measure_worker import MeasureWorker
        heap.reset()
        self._measurer = MeasureWorker(getattr(session, "registry", None))

    def end(self, session: Any) -> None:
        if self._measurer is not None:
            self._measurer.close(cancel=True)

    def run_op(self, ev: OpEvent) -> Any:
        info = op_info(ev.func)
        named = self._note_arguments(ev, info)
        if info.written and D.is_in_place_update(ev.name):
            self._note_persistent_writes(ev, info, named)
        leaves = tree_flatten([v for _, _, v in named])[0]
        self._note_constant(ev, leaves)
        if not self._low:
            self._low = any(_coarser_than_fp32(v.dtype if isinstance(v, torch.Tensor) else v) for v in leaves)
        if ev.phase == S.PHASE_BACKWARD:
            self._after_backward = True
        elif not self._low and self._after_backward and D.is_in_place_update(ev.name):
            # an update after the backward (an optimizer's step, a clipping) in a float32 run:
            # Adam's first step is about sign(g), which flips on gradients at rounding level,
            # so another summation order upstream (SDPA against eager attention) moved its
            # result 1e4 u; measured, that passes as inherited and a wrong update still fails
            return self._measured(ev, info, named)
        if not self._low:
            return NotImplemented
        self._note_made_inputs(ev, info, named)
        return self._measured(ev, info, named)

    def _measured(self, ev: OpEvent, info: Any, named: list) -> Any:
        """The op run, and its own error against float64 on its inputs into its attributes."""
        try:
            prepared = prepare(ev.func, ev.args, ev.kwargs, {n: v for n, _, v in named})
        except Exception:  # noqa: BLE001 - arguments with no float64 copy (a tensor subclass): not measured
            prepared = None
        out = ev.func(*ev.args, **ev.kwargs)       # (the run's own errors are the run's)
        self._measure_into(ev, prepared, results_of(info, out, ev.args, ev.kwargs), self._measurer)
        return out

    def op_computed(self, ev: OpEvent) -> None:
        """A node of a torch.compile'd graph (npu_dumper/compiled/), already computed by the
        compiled code: its arguments and made inputs noted as run_op notes them, and its own
        error measured in every dtype, float32 included. Compiled code rounds differently from
        eager in any precision (another reduction order, decomposition, fusion), so against an
        eager dump only the node's distance from float64 on its own inputs tells rounding from
        a fault: a sum that is 0 in exact arithmetic (an attention key bias's gradient) holds
        rounding noise in both runs, 100% apart. The node wrote none of its inputs (the graph
        is functional; its in-place epilogues are not measured), so their float64 copies
        taken now are what it read."""
        info = op_info(ev.func)
        named = self._note_arguments(ev, info)
        self._note_made_inputs(ev, info, named)
        if info.written:
            return
        try:
            prepared = prepare(ev.func, ev.args, ev.kwargs, {n: v for n, _, v in named})
        except Exception:  # noqa: BLE001 - as run_op: not measured
            prepared = None
        self._measure_into(ev, prepared, ev.outputs)

    @staticmethod
    def _note_arguments(ev: OpEvent, info: Any) -> list:
        """The op's named arguments; their plain values into `scalar_args`."""
        named = named_args(info, ev.args, ev.kwargs)
        scalars = {n: v for n, _, v in named if _plain_value(v)}
        passed = {n for n, _, _ in named}
        for i, n in enumerate(info.arg_names):      # defaults too: both runs' effective values
            if n not in passed and info.has_default[i] and _plain_value(info.defaults[i]):
                scalars[n] = info.defaults[i]
        if scalars:
            # (every op, the float32 golden's too: compare tells an op whose eps, scale or
            # approximate differs between two runs, which its own error cannot show)
            ev.group_attrs[S.OP_SCALAR_ARGS] = json.dumps(scalars)
        if info.is_random and draws_random(ev.func, {n: v for n, _, v in named}):
            # its result depends on the generator's state too: two runs that drew other
            # numbers differ here, which is no kernel's error (compare, "Random ops")
            ev.group_attrs[S.OP_RANDOM] = True
        return named

    def _note_constant(self, ev: OpEvent, leaves: list) -> None:
        """An op that reads no value of the run (no tensor argument, or only tensors constant
        ops made: `arange`, `zeros`, a mask built from them) is marked constant: it computes
        from shapes and numbers. (A random op reads the generator's state: never constant.)
        `leaves`: its arguments, flattened."""
        if ev.group_attrs.get(S.OP_RANDOM):
            return
        if D.op_packet(ev.name) in D.VALUE_FREE:       # (zeros_like reads its input's shape only)
            ev.group_attrs[S.OP_CONSTANT] = True
            return
        if all(self._constant.get(t) is True for t in leaves if isinstance(t, torch.Tensor)):
            ev.group_attrs[S.OP_CONSTANT] = True

    def _note_persistent_writes(self, ev: OpEvent, info: Any, named: list) -> None:
        """The floating tensors an in-place update writes that no op of the block allocated
        (parameters, optimizer state, buffers: what the next step starts from), by the dump's
        names, into `persistent_writes`. Compare checks there whether the target's precision
        absorbed an update the golden made (docs/COMPARE.md, "Updates the target's precision
        absorbs"); a tensor the step made and drops (Adam's denominator, its `+ eps`) is not
        state, and what rounding drops from it is judged by the usual rules."""
        kept = [key for name, _, v in named if name in info.written
                for key, t in _tensor_items(name, v)
                if t.is_floating_point() and self._born.get(t) is None]
        if kept:
            ev.group_attrs[S.OP_PERSISTENT_WRITES] = json.dumps(kept)

    def _note_made_inputs(self, ev: OpEvent, info: Any, named: list) -> None:
        if self._collective.copied_into(ev.name, info, named):
            # a copy into a collective's output buffer (gloo's reduce-scatter copies its result
            # in from a tensor it made itself): what it copies is the collective's result
            ev.group_attrs[S.OP_MADE_INPUTS] = json.dumps(
                [name for name, _, v in named if isinstance(v, torch.Tensor) and name not in info.not_data])
            return
        made, rounded, cast_rounded = [], {}, {}
        for name, _, v in named:
            if name in info.not_data:
                continue
            for key, t in _tensor_items(name, v):
                if t in self._made:
                    made.append(key)
                    via = self._cast_rounded.get(t)
                    if via is not None and t.is_floating_point() \
                            and torch.finfo(via).eps > torch.finfo(t.dtype).eps:
                        cast_rounded[key] = str(via).replace("torch.", "")
                elif (via := self._leaf_rounded.get(t)) is not None:
                    rounded[key] = str(via).replace("torch.", "")
        ev.group_attrs[S.OP_MADE_INPUTS] = json.dumps(made)
        if rounded:
            ev.group_attrs[S.OP_LEAF_ROUNDED] = json.dumps(rounded)
        if cast_rounded and not is_cast(ev.name):
            ev.group_attrs[S.OP_CAST_ROUNDED] = json.dumps(cast_rounded)

    def _note_leaf_rounding(self, named: list, outputs: list) -> None:
        """The outputs of a leaf's cast to a finer dtype than one its values went through (a
        bfloat16 weight's float32 copy; autocast's bf16 copy cast back): that coarsest dtype."""
        coarsest = None
        for _, _, v in named:
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                for d in (v.dtype, self._leaf_rounded.get(v)):
                    if d is not None and (coarsest is None or torch.finfo(d).eps > torch.finfo(coarsest).eps):
                        coarsest = d
        if coarsest is None:
            return
        for t in outputs:
            if isinstance(t, torch.Tensor) and t.is_floating_point() \
                    and torch.finfo(coarsest).eps > torch.finfo(t.dtype).eps:
                self._leaf_rounded.set(t, coarsest)

    def _note_born(self, named: list, outputs: Any) -> None:
        """The op's results that are no input's storage (not a view of one, not one it wrote)
        were allocated in the block."""
        outs = [t for t in tree_flatten(outputs)[0] if isinstance(t, torch.Tensor)]
        if not outs:
            return
        ins = {storage_key(t) for t in tree_flatten([v for _, _, v in named])[0] if isinstance(t, torch.Tensor)}
        for t in outs:
            if storage_key(t) not in ins:
                self._born.set(t, True)

    @staticmethod
    def _measure_into(ev: OpEvent, prepared: Any, out: Any, measurer: Any = None) -> None:
        """The op's own error into its attributes: now, or (`measurer`, eager ops) a Future of
        it that the writer waits for (measure_worker.py)."""
        if prepared is None:
            return
        try:
            measured = measure(ev.func, prepared, out) if measurer is None \
                else measurer.measure(ev.func, prepared, out)
        except Exception:  # noqa: BLE001 - an output that cannot be measured: the row is judged as before
            measured = None
        if measured is not None:
            ev.group_attrs[S.OP_OWN_ERROR] = measured

    def after_op(self, ev: OpEvent, recorded: bool) -> None:
        info = op_info(ev.func)
        named = named_args(info, ev.args, ev.kwargs)
        written = [v for n, _, v in named if n in info.written]
        flat = tree_flatten((ev.outputs, written))[0]
        self._collective.note(ev.name, flat)
        self._note_born(named, ev.outputs)
        constant = bool(ev.group_attrs.get(S.OP_CONSTANT))
        for t in flat:
            # what a constant op makes is constant; what another op writes no longer is
            if isinstance(t, torch.Tensor) and (constant or self._constant.get(t) is True):
                self._constant.set(t, constant)
        copies = D.op_packet(ev.name) in _COPIES
        if (is_cast(ev.name) or copies) and not any(
                isinstance(v, torch.Tensor) and v in self._made
                for n, _, v in (named if not copies else [a for a in named if a[0] not in info.written])):
            # a cast of a leaf stays a leaf (autocast's bf16 copy of a weight); one back to a
            # finer dtype holds the values rounded to the coarsest dtype they went through. So
            # does a copy of one, whatever its destination held: a weight overwritten in the
            # step from a tensor no op made (load_state_dict's copy_) is that tensor, a leaf,
            # judged where it is read (before: made by an op, passed as inherited, while the
            # copy, unpaired by design, was judged nowhere)
            if copies:
                for t in tree_flatten(flat)[0]:
                    if isinstance(t, torch.Tensor) and _whole_storage(t):
                        # (a copy into part of a buffer leaves what ops made in the rest)
                        self._made.discard(t)
            self._note_leaf_rounding(named, flat)
            return
        # an op's result that a cast rounds (to a coarser floating dtype than its own) carries
        # that dtype on through later casts; what a computing op makes is its own precision
        if computes_coarse(ev.name, flat):
            self._computed_coarse = True
        via = _cast_rounding(named, flat, self._cast_rounded) \
            if is_cast(ev.name) and not self._computed_coarse else None
        for t in flat:
            if isinstance(t, torch.Tensor):
                self._made.set(t, True)
                if via is not None and t.is_floating_point():
                    self._cast_rounded.set(t, via)
                else:
                    self._cast_rounded.discard(t)
