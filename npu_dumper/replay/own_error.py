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
max |target - ref|, max |ref|]}, ref being the float64
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
from torch.utils._pytree import tree_map

from ..capture.opschema import named_returns, op_info
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
            d = live.detach().to(rr.dtype, copy=True)
            d -= rr
            if d.is_complex():
                d = d.abs()
            # |d| is not formed (real d): the 2-norm of d is that of |d| (the same squares) and its
            # inf-norm is max |d|. A NaN/Inf in d makes its 2-norm NaN/Inf, and no finite d
            # overflows it in float64 (|d| < 2^129, n < 2^63): the check that needed a pass of
            # its own (isfinite) is read off the norm
            err_norm = float(torch.linalg.vector_norm(d))
            if not math.isfinite(err_norm):
                continue                # NaN/Inf: compare's own NaN/Inf handling says it
            ref_norm = float(torch.linalg.vector_norm(rr))
            red = err_norm / ref_norm if ref_norm > 0 else (0.0 if err_norm == 0 else math.inf)
            errors[name] = [red, float(torch.linalg.vector_norm(d, math.inf)),
                            float(torch.linalg.vector_norm(rr, math.inf))]
    return json.dumps(errors) if errors else None
