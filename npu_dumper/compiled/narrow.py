"""Narrow a compiled op's error down to the compiler pass or decomposition that makes it.

    from npu_dumper.compiled import narrow_recorded_op
    narrow_recorded_op("eager.h5", "aten.silu.default", 2)      # (op None: whatever #2 is)
    # BisectionResult(backend='aot_eager_decomp_partition', subsystem='decomposition',
    #                 bisect_number=3, debug_info="<OpOverload(op='aten.silu', ...)>")

The op named by `accucmp compare -m compiled.h5 -g eager.h5` is rebuilt alone from the eager
dump's recorded inputs (npu_dumper.replay.recorded.load_call: the smallest graph, one node,
on the inputs the eager run gave it), compiled with torch.compile and checked against the
same op run eagerly; PyTorch's compiler bisector (torch._inductor.compiler_bisector,
not rewritten here) then bisects the backends (eager, aot_eager, aot_eager with Inductor's
decompositions, inductor) and, in the first that breaks it, the subsystems (decompositions,
pre/joint/post-grad passes, lowerings, precision casts) down to the one application that
does. None: the op alone compiles right (its fault needs its neighbours: narrow a module
with `narrow(fn, args)`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

# A compiled result "still matches" eager while its relative Euclidean distance stays
# within this many unit roundoffs of its dtype (a single op compiled differently rounds
# differently by about one).
MATCH_ULPS = 4


def matches(out: Any, ref: Any, ulps: float = MATCH_ULPS) -> bool:
    """Every floating tensor of `out` within `ulps` unit roundoffs (RED) of `ref`'s."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    refs = ref if isinstance(ref, (tuple, list)) else (ref,)
    for o, r in zip(outs, refs):
        if not (isinstance(o, torch.Tensor) and isinstance(r, torch.Tensor)) or not r.is_floating_point():
            continue
        eps = torch.finfo(r.dtype).eps / 2
        o64, r64 = o.double(), r.double()
        if not torch.isfinite(o64).equal(torch.isfinite(r64)):
            return False
        ok = torch.isfinite(r64)
        denom = r64[ok].norm()
        red = (o64[ok] - r64[ok]).norm() / denom if denom > 0 else (o64[ok] - r64[ok]).norm()
        if red > ulps * eps:
            return False
    return True


def narrow(fn: Callable, args: tuple, kwargs: dict | None = None, *, ulps: float = MATCH_ULPS):
    """Bisect torch.compile on `fn(*args, **kwargs)` against its eager result: the
    compiler bisector's BisectionResult (backend, subsystem, application number, debug
    info), or None when the compiled result matches."""
    import torch._dynamo
    import torch._inductor.config as icfg
    from torch._inductor.compiler_bisector import CompilerBisector

    kwargs = kwargs or {}
    with torch.no_grad():
        ref = fn(*args, **kwargs)

    def still_matches() -> bool:
        torch._dynamo.reset()
        with torch.no_grad():
            return matches(torch.compile(fn)(*args, **kwargs), ref, ulps)

    # (the FX graph cache's key does not cover what the bisector switches off)
    with icfg.patch(fx_graph_cache=False):
        try:
            if still_matches():
                return None
            return CompilerBisector.do_bisect(still_matches)
        finally:
            torch._dynamo.reset()


def narrow_recorded_op(eager_dump, op: str | None, seqid: int, *, ulps: float = MATCH_ULPS):
    """narrow() on one recorded op of an eager dump (its inputs as recorded): the op with
    `seqid`, which must be `op` when given (its full name, `aten.silu.default`, or its
    packet, `aten.silu`)."""
    return _narrow_recorded(eager_dump, op, seqid, ulps)[1]


def narrow_line(eager_dump, op: str | None, seqid: int, *, ulps: float = MATCH_ULPS) -> tuple[str, bool]:
    """narrow_recorded_op as one line (what the command prints) and whether the op's
    compiled result differs from eager."""
    name, result = _narrow_recorded(eager_dump, op, seqid, ulps)
    return describe(result, f"{name} #{seqid}"), result is not None


def _narrow_recorded(eager_dump, op: str | None, seqid: int, ulps: float):
    from ..load import load
    from ..replay.recorded import load_call
    from ..errors import DumperError

    with load(eager_dump) as f:
        rec = next((o for o in f.ops() if o.seqid == seqid), None)
        if rec is None:
            raise DumperError(f"{eager_dump}: no op with seqid {seqid}")
        if op is not None and op not in (rec.op, _packet(rec.op)):
            raise DumperError(f"{eager_dump}: seqid {seqid} is {rec.op}, not {op}")
        call = load_call(rec)
    if not call.ok:
        raise DumperError(f"{eager_dump}: {rec.op} #{seqid} cannot be rebuilt: {call.why_not}")
    func = call.func
    return rec.op, narrow(lambda *a, **k: func(*a, **k), call.args, call.kwargs, ulps=ulps)


def _packet(op: str) -> str:
    """'aten.silu.default' -> 'aten.silu'."""
    parts = op.split(".")
    return ".".join(parts[:2]) if len(parts) >= 3 else op


def describe(result, what: str) -> str:
    """One line for narrow()'s result on `what` (an op and its seqid)."""
    if result is None:
        return (f"{what}: compiled alone it matches eager (within {MATCH_ULPS} u): its fault needs its "
                "neighbours; narrow their module with npu_dumper.compiled.narrow(fn, args)")
    found = f"{what}: the compiler bisector names backend {result.backend}"
    if result.subsystem:
        found += f", subsystem {result.subsystem}"
    if result.bisect_number is not None:
        found += f", application {result.bisect_number}"
    if result.debug_info:
        found += f": {result.debug_info}"
    return found
