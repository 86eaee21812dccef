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

The float64 copies of the arguments are taken before the live op runs (an in-place op, or
batch norm's running statistics, change them). Ops left out (no attribute; the verdict then
judges the error against the golden as before): views (their result is their input), ops
that draw random numbers, collectives, and ops without a float64 kernel.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from dumpfile import schema as S
from dumpfile.opclass import is_cast, sum_outputs

from ..capture.opschema import named_args, named_returns, op_info
from ..capture.policy import OpEvent, Policy
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
    with torch.no_grad(), _disable_current_modes():
        return tree_map(_upcast, args), tree_map(_upcast, kwargs)


def measure(func: Any, prepared: tuple, out: Any) -> str | None:
    """JSON of {output name: [RED, max abs error, max |ref|]} against float64, or None."""
    info = op_info(func)
    ref_args, ref_kwargs = prepared
    try:
        with torch.no_grad(), _disable_current_modes():
            ref = func(*ref_args, **ref_kwargs)
    except Exception:  # noqa: BLE001 - no float64 kernel (or no such call in fp64): nothing to say
        return None
    errors: dict[str, list[float]] = {}
    with torch.no_grad(), _disable_current_modes():
        for (name, _, live), (_, _, r) in zip(named_returns(info, out), named_returns(info, ref)):
            if not (isinstance(live, torch.Tensor) and isinstance(r, torch.Tensor)):
                continue
            if not (live.is_floating_point() or live.is_complex()) or live.shape != r.shape or live.numel() == 0:
                continue
            # the reference rounded to the target's output dtype: the final rounding (and an
            # underflow, a float16 result below 6e-5) is what any correct kernel must do; the
            # error measured is what the op adds beyond it
            rr = r.to(live.dtype).to(_REF_DTYPE[r.is_complex()])
            d = (live.detach().to(rr.dtype) - rr).abs()
            if not bool(torch.isfinite(d).all()):
                continue                # NaN/Inf: compare's own NaN/Inf handling says it
            ref_norm = float(torch.linalg.vector_norm(rr))
            err_norm = float(torch.linalg.vector_norm(d))
            red = err_norm / ref_norm if ref_norm > 0 else (0.0 if err_norm == 0 else math.inf)
            errors[name] = [red, float(d.max()), float(rr.abs().max())]
    sums = [n for n in sum_outputs(str(func)) if n in errors]
    if sums:
        # a sum whose terms cancel: kappa = ||the same sum of |terms| || / ||sum|| (the op run
        # once more on |inputs|: for a sum of one tensor's elements that is sum |x_i|), the
        # factor by which any rounding of its partial sums grows relative to the result
        try:
            with torch.no_grad(), _disable_current_modes():
                abs_ref = func(*tree_map(_abs, ref_args), **tree_map(_abs, ref_kwargs))
            for (name, _, a), (_, _, r) in zip(named_returns(info, abs_ref), named_returns(info, ref)):
                if name in sums and isinstance(a, torch.Tensor) and isinstance(r, torch.Tensor):
                    num, den = float(torch.linalg.vector_norm(a)), float(torch.linalg.vector_norm(r))
                    errors[name].append(num / den if den > 0 else math.inf)
        except Exception:  # noqa: BLE001 - no kappa: the row is judged without it
            pass
    return json.dumps(errors) if errors else None


def _abs(v: Any) -> Any:
    return v.abs() if isinstance(v, torch.Tensor) and v.is_floating_point() else v


# ---- plain dumps: each op's own error, measured as it runs --------------------------------

def _coarser_than_fp32(d: Any) -> bool:
    return isinstance(d, torch.dtype) and (d.is_floating_point or d.is_complex) \
        and torch.finfo(d).eps > _FP32_EPS


_FP32_EPS = torch.finfo(torch.float32).eps


def _plain_value(v: Any) -> bool:
    """A number, bool, string or list of them: an argument whose value two runs should share.
    (dtypes, devices and layouts are left out: autocast and a device change them by design)"""
    if isinstance(v, (bool, int, float, str)):
        return True
    if isinstance(v, (list, tuple)) and v and len(v) <= 16:
        return all(isinstance(x, (bool, int, float)) for x in v)
    return False


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr() or None
    except Exception:  # noqa: BLE001 - wrapper subclasses, meta tensors: no address to follow
        return None


class PlainOwnError(Policy):
    """Plain dump (`use_dump=True`) of a run that computes in reduced precision: every op from
    the first one that touches a floating dtype coarser than float32 (a bf16/fp16 model, an
    autocast cast) on is run a second time in float64 on the inputs it got, and its outputs'
    distance from that reference goes into the op attribute `own_error`, as load-replay does.
    An independent compare (this dump against an fp32 golden dump) then judges each op by
    what it added to what it was given: the rest of its distance from the golden is inherited
    (docs/COMPARE.md, "Caused here vs inherited"). Each op also says which of its tensor
    inputs an earlier op of the block wrote (`made_inputs`): the others are leaves
    (parameters, buffers, the batch), whose difference from the golden is the run's own.
    A float32 run pays nothing (nothing is measured before a reduced-precision op)."""

    def __init__(self):
        self._low = False
        self._made: set[int] = set()        # storages an op of the block wrote

    def run_op(self, ev: OpEvent) -> Any:
        info = op_info(ev.func)
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
        if not self._low:
            leaves = tree_flatten([v for _, _, v in named])[0]
            self._low = any(_coarser_than_fp32(v.dtype if isinstance(v, torch.Tensor) else v) for v in leaves)
        if not self._low:
            return NotImplemented
        made = []
        for name, _, v in named:
            if name in info.not_data:
                continue
            if isinstance(v, torch.Tensor):
                if _storage_key(v) in self._made:
                    made.append(name)
            elif isinstance(v, (list, tuple)):
                made += [f"{name}/{name}_{i}" for i, x in enumerate(v)
                         if isinstance(x, torch.Tensor) and _storage_key(x) in self._made]
        if made:
            ev.group_attrs[S.OP_MADE_INPUTS] = json.dumps(made)
        else:
            ev.group_attrs[S.OP_MADE_INPUTS] = "[]"
        try:
            prepared = prepare(ev.func, ev.args, ev.kwargs, {n: v for n, _, v in named})
        except Exception:  # noqa: BLE001 - arguments with no float64 copy (a tensor subclass): not measured
            prepared = None
        out = ev.func(*ev.args, **ev.kwargs)       # (the run's own errors are the run's)
        if prepared is not None:
            try:
                measured = measure(ev.func, prepared, out)
            except Exception:  # noqa: BLE001 - an output that cannot be measured: the row is judged as before
                measured = None
            if measured is not None:
                ev.group_attrs[S.OP_OWN_ERROR] = measured
        return out

    def after_op(self, ev: OpEvent, recorded: bool) -> None:
        info = op_info(ev.func)
        named = named_args(info, ev.args, ev.kwargs)
        if is_cast(ev.name) and not any(isinstance(v, torch.Tensor) and _storage_key(v) in self._made
                                        for _, _, v in named):
            return      # a cast of a leaf stays a leaf (autocast's bf16 copy of a weight)
        written = [v for n, _, v in named if n in info.written]
        for t in tree_flatten((ev.outputs, written))[0]:
            if isinstance(t, torch.Tensor):
                key = _storage_key(t)
                if key is not None:
                    self._made.add(key)
