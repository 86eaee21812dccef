"""Whether a live op that no recorded call fits computes what recorded ops of its module did.

A port may compute one step with other ops than its recording: `F.linear` is one `addmm` on a
contiguous input and `mm` + `add` on a strided one; a fused kernel replaces a chain of pointwise
ops. Load-replay lets such a live op stand in for the recorded ops (ReplayPolicy._stood_in_for)
when two things hold:

1. `agrees`: its result, computed on the live run's inputs, holds the recorded result within
   STAND_IN_ULPS units of its own dtype (norm-wise), which the rounding of its inputs to that
   dtype explains;
2. `function_gap`: it computes the same function. The recorded ops are recomputed in float64
   from their recorded inputs (each taking the float64 result of the op before it where its
   recorded input is that op's recorded output bit for bit, `_recompute`), the live op is run
   in float64 on the same recorded inputs, and the two must agree within 16 units of the
   recording's dtype (an intermediate the recomputation could not chain is the recorded,
   rounded value; 2^-40 where the recording is float64). Check 1 alone cannot see a different
   function whose difference is below the live dtype's unit: GPT-2's `gelu_new` (the tanh
   approximation, eight recorded ops) ported as `nn.GELU()` (the erf form) differs by 8e-6 to
   2e-4 of the result, below 1/20 of a bfloat16 unit, and stood in for it; in float64 the two
   forms differ by that much, the erf form from a recorded erf form by 1e-16.

The check is made only where it can be: each floating input of the live op
paired with a recorded input of those ops that it agrees with (check 1's rule), no random
draw, no write to an argument, one floating result, a float64 kernel; otherwise the live op
stands in on check 1, as before. The recorded ops are the file's: only those whose results
are sized by their tensor inputs are recomputed (elementwise ops, views, products,
reductions, copies: no factory op, no size argument of the file's choosing), and none on a
tensor larger than the largest the records hold.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from ..capture.opschema import arg_dict, op_info
from .op_names import draws_random, resolve_op
from .recorded import _place, _retarget, value_from_record

STAND_IN_ULPS = 4.0
_FP32_NOISE = 64 * 2.0 ** -24     # another summation order of a float32 product's terms
# the function check's allowance (module doc): units of the recorded dtype (an intermediate
# value the recomputation could not chain is the recorded, rounded one), and float64's own
# rounding where the recording is float64
_RECORDED_UNITS = 16.0
_FLOAT64_FLOOR = 2.0 ** -40


def _unit(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def _red(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| of two float64 tensors (inf where b is 0 and a is not)."""
    ref = float(torch.linalg.vector_norm(b))
    err = float(torch.linalg.vector_norm(a - b))
    return err / ref if ref > 0 else (0.0 if err == 0 else float("inf"))


def agrees(live: torch.Tensor, golden: torch.Tensor) -> bool:
    """`live` holds `golden`'s values within STAND_IN_ULPS of live's dtype (norm-wise)."""
    with torch.no_grad(), _disable_current_modes():      # (the comparison is no op of the step)
        a = live.detach().reshape(-1).to(device="cpu", dtype=torch.float64)
        b = golden.reshape(-1).to(dtype=torch.float64)
        if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
            return False
        ref = float(torch.linalg.vector_norm(b))
        err = float(torch.linalg.vector_norm(a - b))
    return err <= (STAND_IN_ULPS * _unit(live.dtype) + _FP32_NOISE) * ref


def function_gap(func: Any, args: tuple, kwargs: dict, run: list[Any],
                 load: Callable[[Any], torch.Tensor]) -> tuple[float, float] | None:
    """(gap, allowed) of a live op standing in for the recorded ops `run` (their OpRecords, in
    order; module doc): `gap` the relative distance of `func` run in float64 on their recorded
    inputs from their own float64 recomputation, `allowed` what float64 and the recording's
    intermediate values can leave; None where the check cannot be made. `load` reads a
    recorded tensor."""
    info = op_info(func)
    if info.written or draws_random(func, arg_dict(info, args, kwargs)):
        return None
    leaves = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    floating = [t for t in leaves if t.is_floating_point()]
    if not floating or any(t.is_complex() or t.layout != torch.strided for t in leaves):
        return None
    try:
        with torch.no_grad(), _disable_current_modes(), torch.autocast("cpu", enabled=False):
            golden, external, rec_dtype = _recompute(run, load)
            if golden is None:
                return None
            partner: dict[int, torch.Tensor] = {}
            for t in floating:
                best = None
                for value in external:
                    if value.numel() != t.numel():
                        continue
                    value = value.reshape(t.shape)
                    if not agrees(t, value):
                        continue
                    gap = _red(t.detach().to("cpu", torch.float64).reshape(-1), value.to(torch.float64).reshape(-1))
                    if best is None or gap < best[0]:
                        best = (gap, value)
                if best is None:
                    return None                 # an input the recorded ops did not read: no check
                partner[id(t)] = best[1].to(torch.float64)
            a64, k64 = tree_map(lambda v: partner[id(v)] if isinstance(v, torch.Tensor) and id(v) in partner
                                else (v.cpu() if isinstance(v, torch.Tensor) else v), (args, kwargs))
            exact = _one_tensor(func(*a64, **k64))
            if exact is None or exact.dtype != torch.float64 or exact.numel() != golden.numel():
                return None
            exact, golden = exact.reshape(-1), golden.reshape(-1)
            if not (bool(torch.isfinite(exact).all()) and bool(torch.isfinite(golden).all())):
                return None
            gap = _red(exact, golden)
    except Exception:  # noqa: BLE001 - no float64 kernel, an unreadable record: no check
        return None
    return gap, max(_RECORDED_UNITS * _unit(rec_dtype), _FLOAT64_FLOOR)


def _recompute(run: list[Any], load: Callable[[Any], torch.Tensor]) -> tuple[Any, list, torch.dtype]:
    """(the last op's result recomputed in float64 from the run's recorded inputs, each op
    taking the float64 result of the op before it where the recording shows it read that
    op's result (its recorded input equals that recorded output bit for bit), else the
    recorded value; the floating recorded inputs no op of the run made; the last result's
    recorded dtype). (None, [], float64) when an op cannot be recomputed."""
    made: list[tuple[torch.Tensor, torch.Tensor]] = []       # (recorded result, float64 result)
    external: list[torch.Tensor] = []
    last, rec_dtype = None, torch.float64
    # the file is input from outside: only ops whose results are sized by their tensor inputs
    # run (no factory op, no size or repeat argument of the file's choosing), and none on
    # tensors larger than the largest the run's records hold (an `expand` to a size the file
    # declares stays a view until an op computes on it)
    try:
        bound = max((load(r).numel() for record in run
                     for r in (*_leaves(record.inputs()), *_leaves(record.outputs()))), default=0)
    except Exception:  # noqa: BLE001 - an unreadable record: no recomputation
        return None, [], rec_dtype

    def convert(rec: Any) -> Any:
        if rec.is_list:
            return [convert(c) for c in rec.children]
        if not rec.is_tensor:
            return value_from_record(rec, dtype=torch.float64)
        value = load(rec)
        for recorded, exact in reversed(made):
            if recorded.shape == value.shape and recorded.dtype == value.dtype and torch.equal(recorded, value):
                return exact
        if value.is_floating_point() and not value.is_complex():
            external.append(value)
            return value.to(torch.float64)
        return value

    for record in run:
        f = resolve_op(record.op)
        if f is None or op_info(f).written or not _sized_by_inputs(f):
            return None, [], rec_dtype
        a, k, named = _place(f, record.inputs(), {}, convert)
        if draws_random(f, named) or any(isinstance(t, torch.Tensor) and t.numel() > bound
                                         for t in tree_flatten((a, k))[0]):
            return None, [], rec_dtype
        a = tuple(_retarget(v, torch.float64) for v in a)
        k = {n: _retarget(v, torch.float64) for n, v in k.items()}
        results = [t for t in tree_flatten(f(*a, **k))[0] if isinstance(t, torch.Tensor)]
        recorded = [r for r in record.outputs().values() if r.is_tensor]
        if len(results) != len(recorded):
            return None, [], rec_dtype
        for r, t in zip(recorded, results):
            made.append((load(r), t))
        if len(results) == 1:
            last, rec_dtype = results[0], made[-1][0].dtype
    if last is None or not rec_dtype.is_floating_point or last.dtype != torch.float64:
        return None, [], rec_dtype
    return last, external, rec_dtype


# ops whose results are sized by their tensor inputs alone, besides elementwise ops and views
_PRODUCTS_AND_REDUCTIONS = frozenset(f"aten.{n}" for n in (
    "mm", "bmm", "addmm", "addmv", "mv", "dot", "matmul", "linear", "sum", "mean", "_softmax", "softmax",
    "_log_softmax", "log_softmax", "_softmax_backward_data", "_log_softmax_backward_data",
    "_unsafe_view", "clone", "_to_copy"))


def _sized_by_inputs(f: Any) -> bool:
    """Whether op `f`'s results are no larger than its tensor inputs say: an elementwise op
    (torch.Tag.pointwise), a view, a product, a reduction or a copy."""
    packet = ".".join(str(f).split(".")[:2])
    return torch.Tag.pointwise in getattr(f, "tags", ()) or bool(getattr(f, "is_view", False)) \
        or packet in _PRODUCTS_AND_REDUCTIONS


def _leaves(values: dict) -> list:
    return [leaf for rec in values.values() for leaf in (rec.children if rec.is_list else (rec,)) if leaf.is_tensor]


def _one_tensor(out: Any) -> torch.Tensor | None:
    flat = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    return flat[0] if len(flat) == 1 and flat[0].is_floating_point() else None
