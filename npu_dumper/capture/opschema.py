"""The one place that knows an op's schema, and the per-op policy that amends it.

Every mode names an op's arguments the same way (the dump, load-replay, golden replay,
overflow check, emulation, the recorded-call loader): by the schema argument each value
is, not by position. `op_info(func)` reads the OpOverload's schema once and caches:
argument names, types and which are keyword-only or optional, which arguments the op
writes (`alias_info.is_write`, plus the hidden writes below), `out=` arguments, views
(`func.is_view`), tags (`nondeterministic_seeded`), defaults, and the names its results
are stored under.

Where the schema does not tell the truth (batch norm writes its running stats without
`(a!)`, c10d collectives write their tensors, `empty` returns garbage) the facts are
amended from registries keyed by op overload packet, kept as data (as
torch/utils/flop_counter.py keeps its formulas); `register_op` adds to them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from dumpfile.bookkeeping import BOOKKEEPING_NAMESPACES
from dumpfile.overwritten import EMPTY_LIKE, OVERWRITES_SELF

# ---- per-op policy as data ---------------------------------------------------
# Ops that write inputs their schema does not mark as written (training-mode batch norm
# updates running stats in place). Keyed by overload packet; values: argument names.
HIDDEN_WRITES: dict[Any, tuple[str, ...]] = {}
# Ops whose outputs hold uninitialised memory: recorded, marked `uninitialized`.
UNINITIALIZED_OUTPUTS: set[Any] = set()
# In-place resizes: the elements past the old size are uninitialised memory, so the
# output is marked `uninitialized` when the op made its tensor larger.
RESIZE_OPS: set[Any] = set()
# Opaque backend buffers (RNN workspaces): bytes with no numeric meaning, possibly
# uninitialised. Packet -> return indices / argument names marked `uninitialized`.
OPAQUE_RETURNS: dict[Any, tuple[int, ...]] = {}
OPAQUE_ARGS: dict[Any, tuple[str, ...]] = {}


def _register_defaults() -> None:
    aten = torch.ops.aten
    for name in ("native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm",
                 "_batch_norm_with_update", "_native_batch_norm_legit",
                 "_batch_norm_impl_index", "batch_norm"):
        pkt = getattr(aten, name, None)
        if pkt is not None:
            HIDDEN_WRITES[pkt] = ("running_mean", "running_var")
    for name in EMPTY_LIKE:
        pkt = getattr(aten, name, None)
        if pkt is not None:
            UNINITIALIZED_OUTPUTS.add(pkt)
    # in-place ops that overwrite every element of `self` without reading it: its content
    # before the op is whatever the buffer held (DeepSeek-V2 copies into new_empty_strided;
    # dropout draws its mask with bernoulli_ into an empty_like buffer), a destination like
    # out=, not data. The schema marks `self` written (alias_info.is_write) but cannot say
    # that the op does not read it: this list does.
    for name in OVERWRITES_SELF:
        pkt = getattr(aten, name, None)
        if pkt is not None:
            OUT_BUFFERS[pkt] = ("self",)
    for name in ("resize_", "resize_as_", "_resize_output_"):
        pkt = getattr(aten, name, None)
        if pkt is not None:
            RESIZE_OPS.add(pkt)
    for name, returns, arg in (("mkldnn_rnn_layer", (3,), None),
                               ("mkldnn_rnn_layer_backward", (), "workspace"),
                               ("_cudnn_rnn", (3,), None), ("_cudnn_rnn_backward", (), "reserve"),
                               ("miopen_rnn", (3,), None), ("miopen_rnn_backward", (), "reserve"),
                               # CTC's log_alpha: allocated with empty() and filled only where
                               # a target can be; the rest is garbage that differs run to run
                               ("_ctc_loss", (1,), None), ("_ctc_loss_backward", (), "log_alpha")):
        pkt = getattr(aten, name, None)
        if pkt is not None:
            if returns:
                OPAQUE_RETURNS[pkt] = returns
            if arg:
                OPAQUE_ARGS[pkt] = (arg,)


# c10d collectives write tensors their schemas do not mark as written (`Tensor[] tensors`,
# no `(a!)`): overload packet name -> written arguments. Recorded before the op (copy on
# write) like any written input and, where the op returns no tensor (only a Work), after
# it as outputs (OpInfo.written_outputs) once the collective has finished.
C10D_WRITES: dict[str, tuple[str, ...]] = {
    "allreduce_": ("tensors",), "allreduce_coalesced_": ("tensors",), "reduce_": ("tensors",),
    "broadcast_": ("tensors",), "recv_": ("tensors",), "recv_any_source_": ("tensors",),
    "allgather_": ("output_tensors",), "allgather_coalesced_": ("output_lists",),
    "allgather_into_tensor_coalesced_": ("outputs",), "_allgather_base_": ("output_tensor",),
    "reduce_scatter_": ("output_tensors",), "reduce_scatter_tensor_coalesced_": ("outputs",),
    "_reduce_scatter_base_": ("output_tensor",), "gather_": ("output_tensors",),
    "scatter_": ("output_tensors",), "alltoall_": ("output_tensors",), "alltoall_base_": ("output",),
}


# Arguments that are only a destination: their content before the op is whatever the buffer
# held (an empty() bucket, a reused all-gather buffer), not data the op reads. Recorded as
# inputs, marked `uninitialized`, never judged by compare. (Schema `out=` arguments, the
# `is_out` flag, are found from the schema; these are the ones whose schema does not say.)
C10D_OUT_BUFFERS: dict[str, tuple[str, ...]] = {
    "allgather_": ("output_tensors",), "allgather_coalesced_": ("output_lists",),
    "allgather_into_tensor_coalesced_": ("outputs",), "_allgather_base_": ("output_tensor",),
    "reduce_scatter_": ("output_tensors",), "reduce_scatter_tensor_coalesced_": ("outputs",),
    "_reduce_scatter_base_": ("output_tensor",), "gather_": ("output_tensors",),
    "scatter_": ("output_tensors",), "alltoall_": ("output_tensors",), "alltoall_base_": ("output",),
    "recv_": ("tensors",), "recv_any_source_": ("tensors",),
}
# FSDP2's own ops (torch.distributed.fsdp, namespace "fsdp"): all_gather_copy_in copies this
# rank's shard into `all_gather_output` (schema: not written) and returns that buffer with
# the other ranks' slots still unfilled. qualified name -> (hidden writes, out buffers,
# returns holding uninitialised parts)
LATE_OPS: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[int, ...]]] = {
    "fsdp::all_gather_copy_in": (("all_gather_output",), ("all_gather_output",), (1,)),
    # FSDP2's copy-out: `out` (kwarg-only Tensor(a!)[], not an `is_out` argument) receives the
    # unsharded parameters; before the op it is memory nobody wrote (two identical runs differ)
    "fsdp::split_with_sizes_copy": ((), ("out",), ()),
}
OUT_BUFFERS: dict[Any, tuple[str, ...]] = {}
# Op namespaces whose ops communicate: their results depend on the other ranks, so replay
# (load-replay and golden replay) runs them live or skips them with this reason.
COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional",
                                   "_c10d_functional_autograd"})
COLLECTIVE_REASON = "collective: its result depends on the other ranks; not replayed"
# Functional collectives (DTensor's redistribute, torch.distributed._functional_collectives)
# return their output tensor while the collective may still run; it holds the result only
# after `_c10d_functional.wait_tensor`. The mode waits before it records the outputs.
FUNCTIONAL_COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional"})
_late_registered: set[str] = set()


def _register_late(ns: str) -> None:
    """(Called by op_info at the first op of a namespace that torch.distributed registers
    late: c10d, fsdp.)"""
    if ns in _late_registered:
        return
    _late_registered.add(ns)
    try:
        if ns == "c10d":
            c10d = torch.ops.c10d
            for name, written in C10D_WRITES.items():
                pkt = getattr(c10d, name, None)
                if pkt is not None:
                    HIDDEN_WRITES[pkt] = written
            for name, bufs in C10D_OUT_BUFFERS.items():
                pkt = getattr(c10d, name, None)
                if pkt is not None:
                    OUT_BUFFERS[pkt] = bufs
        for qual, (writes, bufs, rets) in LATE_OPS.items():
            q_ns, name = qual.split("::")
            if q_ns != ns:
                continue
            pkt = getattr(getattr(torch.ops, q_ns), name, None)
            if pkt is not None:
                HIDDEN_WRITES[pkt] = writes
                OUT_BUFFERS[pkt] = bufs
                OPAQUE_RETURNS[pkt] = rets
    except Exception:  # noqa: BLE001 - a build without distributed has no such ops
        pass


_register_defaults()


def _schema_type(t: Any) -> str:
    """Schema type in the C++ schema spelling ("int[]", "Scalar?", "Tensor?[]")."""

    def conv(s: str) -> str:
        if s.startswith("Optional[") and s.endswith("]"):
            return conv(s[9:-1]) + "?"
        if s.startswith("List[") and s.endswith("]"):
            return conv(s[5:-1]) + "[]"
        return {"number": "Scalar"}.get(s, s)

    return conv(str(t))


@dataclass(frozen=True)
class OpInfo:
    """Schema facts about one OpOverload, computed once and cached."""

    arg_names: tuple[str, ...]
    arg_types: tuple[str, ...]
    kwarg_only: tuple[bool, ...]
    written: frozenset[str]        # argument names the op writes (schema or hidden)
    return_names: tuple[str, ...]
    return_types: tuple[str, ...]
    uninitialized: bool
    is_view: bool
    opaque_returns: frozenset[int] = frozenset()
    opaque_args: frozenset[str] = frozenset()
    # destination-only arguments (schema `out=`, collective output buffers): their content
    # before the op is not data; recorded as inputs marked `uninitialized`
    out_args: frozenset[str] = frozenset()
    collective: bool = False       # COLLECTIVE_NAMESPACES
    # dumpfile.bookkeeping.BOOKKEEPING_NAMESPACES (profiler labels): run, never recorded
    bookkeeping: bool = False
    waits_tensor: bool = False     # FUNCTIONAL_COLLECTIVE_NAMESPACES: wait_tensor before recording
    # returns that are a c10d Work: the collective may still be running when the op returns
    # (gloo, NCCL and async_op=True), so the outputs are what it will have written only
    # after Work.wait(); the mode waits before it records them
    work_returns: tuple[int, ...] = ()
    # Written arguments also recorded as outputs (after the op, under their own names, as
    # the original names an in-place op's result `self`) where the op returns no tensor:
    # foreach and fused-optimizer ops (`_foreach_mul_` in clip_grad_norm_), custom ops with
    # mutates_args, collectives that return only a Work. Else their result would be lost.
    written_outputs: tuple[str, ...] = ()
    resizes: bool = False          # RESIZE_OPS: uninitialized when the tensor grew
    # arguments the schema marks written (`Tensor(a!)`): autograd bumps their version after
    # the op (hidden writes it does not know of)
    schema_written: frozenset[str] = frozenset()
    # opaque_args | out_args: inputs recorded `uninitialized` (computed once, not per op)
    not_data: frozenset[str] = frozenset()
    # -- beyond what the dump mode reads (not compared, not hashed) --
    # positional argument name -> index (keyword-only arguments are absent)
    positions: dict[str, int] = field(default_factory=dict, compare=False, hash=False)
    optional: tuple[bool, ...] = field(default=(), compare=False, hash=False)
    has_default: tuple[bool, ...] = field(default=(), compare=False, hash=False)
    defaults: tuple[Any, ...] = field(default=(), compare=False, hash=False)
    tags: frozenset = field(default=frozenset(), compare=False, hash=False)

    @property
    def is_random(self) -> bool:
        """The op draws from a random generator (tag nondeterministic_seeded)."""
        return torch.Tag.nondeterministic_seeded in self.tags


_OP_INFO: dict[Any, OpInfo] = {}


def op_info(func) -> OpInfo:
    info = _OP_INFO.get(func)
    if info is not None:
        return info
    schema = func._schema
    args = schema.arguments
    written = {a.name for a in args if a.alias_info is not None and a.alias_info.is_write}
    schema_written = frozenset(written)
    packet = getattr(func, "overloadpacket", None)
    ns = schema.name.split("::", 1)[0]
    if ns in ("c10d", "fsdp") and ns not in _late_registered:
        _register_late(ns)         # (registered lazily: torch.distributed loads them)
    written |= set(HIDDEN_WRITES.get(packet, ()))
    # return names: the original's rule (result / result{i} / named field / self for in-place)
    alias_owner = {}
    for a in args:
        if a.alias_info is not None and a.alias_info.is_write:
            for s in a.alias_info.before_set:
                alias_owner[s] = a.name
    rets = schema.returns
    names = []
    for i, r in enumerate(rets):
        owner = None
        if r.alias_info is not None and r.alias_info.is_write:
            owner = next((alias_owner[s] for s in r.alias_info.before_set if s in alias_owner), None)
        if owner is not None:
            names.append(owner)
        elif r.name:
            names.append(r.name)
        else:
            names.append("result" if len(rets) == 1 else f"result{i}")
    # two returns aliasing the same argument cannot share a name
    seen: dict[str, int] = {}
    for i, n in enumerate(names):
        if n in seen:
            names[i] = f"{n}{i}"
        seen[n] = i
    opaque_args = frozenset(OPAQUE_ARGS.get(packet, ()))
    out_args = frozenset({a.name for a in args if getattr(a, "is_out", False)}
                         | set(OUT_BUFFERS.get(packet, ())))
    info = OpInfo(
        arg_names=tuple(a.name for a in args),
        arg_types=tuple(_schema_type(a.type) for a in args),
        kwarg_only=tuple(a.kwarg_only for a in args),
        written=frozenset(written),
        return_names=tuple(names),
        return_types=tuple(_schema_type(r.type) for r in rets),
        uninitialized=packet in UNINITIALIZED_OUTPUTS,
        is_view=bool(func.is_view),
        opaque_returns=frozenset(OPAQUE_RETURNS.get(packet, ())),
        opaque_args=opaque_args,
        collective=ns in COLLECTIVE_NAMESPACES,
        bookkeeping=ns in BOOKKEEPING_NAMESPACES,
        waits_tensor=ns in FUNCTIONAL_COLLECTIVE_NAMESPACES and schema.name.split("::")[1] != "wait_tensor"
        and any("Tensor" in str(r.type) for r in rets),
        out_args=out_args,
        not_data=opaque_args | out_args,
        work_returns=tuple(i for i, r in enumerate(rets) if str(r.type).endswith("c10d.Work")),
        written_outputs=(tuple(a.name for a in args if a.name in written)
                         if not any("Tensor" in str(r.type) for r in rets) else ()),
        resizes=packet in RESIZE_OPS,
        schema_written=schema_written,
        positions={a.name: i for i, a in enumerate(args) if not a.kwarg_only},
        optional=tuple(isinstance(a.type, torch.OptionalType) for a in args),
        has_default=tuple(a.has_default_value() for a in args),
        defaults=tuple(a.default_value if a.has_default_value() else None for a in args),
        tags=frozenset(getattr(func, "tags", ())),
    )
    _OP_INFO[func] = info
    return info


def named_args(info: OpInfo, args: tuple, kwargs: dict) -> list[tuple[str, str, Any]]:
    """(name, schema type, value) of every argument the caller passed, in schema order."""
    out = []
    n = len(args)
    for i, name in enumerate(info.arg_names):
        if i < n and not info.kwarg_only[i]:
            out.append((name, info.arg_types[i], args[i]))
        elif name in kwargs:
            out.append((name, info.arg_types[i], kwargs[name]))
    return out


def named_returns(info: OpInfo, out: Any) -> list[tuple[str, str, Any]]:
    names = info.return_names
    if len(names) == 1:
        return [(names[0], info.return_types[0], out)]
    if isinstance(out, (tuple, list)) and len(out) == len(names):
        return list(zip(names, info.return_types, out))
    if not names:
        return [] if out is None else [("result", "", out)]
    return [("result", "", out)]


def arg_dict(info: OpInfo, args: tuple, kwargs: dict) -> dict[str, Any]:
    """{schema argument name: value} of the arguments the caller passed."""
    return {name: value for name, _, value in named_args(info, args, kwargs)}


def register_op(packet: Any, *, hidden_writes: tuple[str, ...] = (), uninitialized: bool = False,
                resizes: bool = False, opaque_returns: tuple[int, ...] = (),
                opaque_args: tuple[str, ...] = (), out_buffers: tuple[str, ...] = ()) -> None:
    """Amend what an op's schema says (see the registries above) for every overload of
    `packet` (e.g. torch.ops.mylib.fused_norm): a custom op that writes arguments its
    schema does not mark, returns uninitialised memory, or takes destination buffers.
    Call it before the op is first seen: facts are cached per overload."""
    if hidden_writes:
        HIDDEN_WRITES[packet] = tuple(hidden_writes)
    if uninitialized:
        UNINITIALIZED_OUTPUTS.add(packet)
    if resizes:
        RESIZE_OPS.add(packet)
    if opaque_returns:
        OPAQUE_RETURNS[packet] = tuple(opaque_returns)
    if opaque_args:
        OPAQUE_ARGS[packet] = tuple(opaque_args)
    if out_buffers:
        OUT_BUFFERS[packet] = tuple(out_buffers)
    for func in [f for f in _OP_INFO if getattr(f, "overloadpacket", None) is packet]:
        del _OP_INFO[func]
