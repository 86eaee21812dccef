"""An op's arguments and results as the record the writers take: a TensorCapture for each
tensor, Value / Named / ListOf for everything else, under their schema names.

This runs in the model's thread for every recorded op, so it is laid out for the cost
per value. What the schema says about an op overload (which argument is where, its type,
whether the op writes it, whether it holds data) is turned into a plan once per overload
(OpPlan), so that a recorded op only walks its values. Immutable scalars and int lists
(stride=[1, 1], eps=1e-05, groups=1: the same few values op after op) are shared Value
records instead of new ones: nothing changes a record once it is made.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from dumpfile import schema as S

from .opschema import OpInfo, named_args, op_info
from .snapshots import CaptureRegistry, ListOf, Named, TensorCapture, Value
from .tensors import UNSTORED_DTYPES, dtype_name

_TENSOR = torch.Tensor
_PARAMETER = torch.nn.Parameter
_NONE = type(None)
_NOT_POSITIONAL = 1 << 30
_PLAIN_NUMBERS = (int, float, bool)
# immutable scalars shared as Value records (floats apart from 0.0/-0.0 and NaN: equal
# keys, different values)
_SHARED_SCALARS = frozenset({bool, int, str, _NONE})
_MAX_SHARED = 4096
# argument kinds of an OpPlan
_K_ANY, _K_INT_LIST = 0, 1
_INT_LIST_TYPES = ("int[", "SymInt[")


class OpPlan:
    """What the walk needs to know of one op overload, read from its OpInfo once.

    `args`: (position or _NOT_POSITIONAL, name, schema type, copied now, not data, kind)
    per schema argument, in schema order (kind: _K_INT_LIST for int[] arguments, which
    the walk looks up among its shared records first, else _K_ANY); `returns`: (name,
    schema type, opaque, version bump) per schema return."""

    __slots__ = ("func", "info", "name", "args", "returns", "written", "written_outputs")

    def __init__(self, func: Any, info: OpInfo, name: str):
        self.func, self.info, self.name = func, info, name
        written, not_data = info.written, info.not_data
        self.args = tuple(
            (_NOT_POSITIONAL if kw_only else i, an, st, an in written, an in not_data,
             _K_INT_LIST if st.startswith(_INT_LIST_TYPES) else _K_ANY)
            for i, (an, st, kw_only) in enumerate(zip(info.arg_names, info.arg_types,
                                                      info.kwarg_only)))
        # a return named after a written argument is that argument (relu_'s `self`, an
        # out= op's `out`): autograd bumps its version once the op returns
        bumped = info.schema_written
        self.returns = tuple((rn, st, i in info.opaque_returns, 1 if rn in bumped else 0)
                             for i, (rn, st) in enumerate(zip(info.return_names,
                                                              info.return_types)))
        self.written = tuple(a for a in self.args if a[3])
        # written arguments recorded as outputs (an in-place op that returns no tensor)
        self.written_outputs = tuple((pos, an, st, 1 if an in bumped else 0)
                                     for pos, an, st, _, _, _ in self.args
                                     if an in info.written_outputs)


_PLANS: dict[Any, OpPlan] = {}


def op_plan(func: Any) -> OpPlan:
    """The plan of op overload `func`, made once per process (op_info's facts are cached
    per overload too; a dump block per training step would otherwise re-plan every op)."""
    info = op_info(func)
    plan = _PLANS.get(func)
    if plan is None or plan.info is not info:      # (register_op drops an op's facts)
        plan = _PLANS[func] = OpPlan(func, info, str(func))
    return plan


def _passed(pos: int, name: str, args: tuple, kwargs: dict, missing: Any) -> Any:
    if pos < len(args):
        return args[pos]
    return kwargs.get(name, missing) if kwargs else missing


_MISSING = object()


class ArgWalk:
    """Builds the records of one dump block's ops (DumpMode owns one)."""

    def __init__(self, registry: CaptureRegistry):
        self.registry = registry
        self.first_device: str | None = None
        self.dtensor_layouts: set[str] = set()   # `dtensor` attributes seen (parallel_layout)
        self._shared: dict = {}
        self._gen = registry._gen

    # ---- an op's values -------------------------------------------------------------------
    def inputs(self, plan: OpPlan, args: tuple, kwargs: dict, caps: list) -> list:
        """(name, record) of every argument passed, in schema order. Arguments the op
        writes are copied now (copy-on-write would copy them anyway, before the op);
        destination-only ones (out=, collective output buffers) are marked uninitialized."""
        out = []
        n = len(args)
        node = self.node
        shared = self._shared
        new = []        # the captures to register for copy-on-write (not the copies made now)
        for pos, name, st, written, not_data, kind in plan.args:
            if pos < n:
                v = args[pos]
            elif kwargs and name in kwargs:
                v = kwargs[name]
            else:
                continue
            tv = type(v)
            before = len(caps)
            if tv is _TENSOR or tv is _PARAMETER:
                out.append((name, self._tensor(v, st, caps, written, not_data, 0)))
                if not written:
                    new += caps[before:]
                continue
            if kind and tv is list:
                # an int[] argument (stride=[1, 1]): the same few lists op after op. Only
                # lists of exact ints are ever stored under this key (_sequence); a
                # SymInt in the list does not hash (TypeError): the general path takes it
                try:
                    rec = shared.get((st, *v))
                except TypeError:
                    rec = None
                if rec is not None:
                    out.append((name, rec))
                    continue
            out.append((name, node(v, st, caps, written, not_data, 0)))
            if not written and len(caps) > before:
                new += caps[before:]
        if new:
            # one call (one lock) per op's inputs, before the op can write them
            self.registry.add_all(new)
        return out

    def outputs(self, plan: OpPlan, out: Any, args: tuple, kwargs: dict, caps: list,
                uninit: bool) -> list:
        """(name, record) of the op's results (and of written arguments, where it returns
        no tensor)."""
        rets = plan.returns
        node = self.node
        start = len(caps)
        if len(rets) == 1:
            rn, st, opaque, bump = rets[0]
            records = [(rn, node(out, st, caps, False, uninit or opaque, bump))]
        elif isinstance(out, (tuple, list)) and len(out) == len(rets):
            records = [(rn, node(v, st, caps, False, uninit or opaque, bump))
                       for (rn, st, opaque, bump), v in zip(rets, out)]
        elif not rets and out is None:
            records = []
        else:
            info = plan.info
            records = [("result", node(out, "", caps, False, uninit or 0 in info.opaque_returns,
                                       1 if "result" in info.schema_written else 0))]
        for pos, an, st, bump in plan.written_outputs:
            v = _passed(pos, an, args, kwargs, _MISSING)
            if v is not _MISSING:
                records.append((an, node(v, st, caps, False, False, bump)))
        if len(caps) > start:
            self.registry.add_all(caps[start:])
        return records

    def write_targets(self, plan: OpPlan, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        """The tensors of the arguments the op writes."""
        out: list[torch.Tensor] = []
        for pos, name, _, _, _, _ in plan.written:
            v = _passed(pos, name, args, kwargs, None)
            if v is not None:
                tensors_in(v, out)
        return out

    # ---- one value ------------------------------------------------------------------------
    def node(self, v: Any, schema_type: str, caps: list, clone: bool, uninit: bool = False,
             bump: int = 0):
        tv = type(v)
        if tv is _TENSOR or tv is _PARAMETER or isinstance(v, _TENSOR):
            return self._tensor(v, schema_type, caps, clone, uninit, bump)
        if tv in _SHARED_SCALARS or (tv is float and v == v and v != 0.0):
            key = (tv, v, schema_type)
            rec = self._shared.get(key)
            if rec is None:
                rec = self._share(key, Value(v, schema_type))
            return rec
        if v is None or isinstance(v, (bool, int, float, complex, str)):
            return Value(v, schema_type)
        if tv is list or tv is tuple:
            return self._sequence(v, schema_type, caps, clone, bump, uninit)
        if isinstance(v, torch.dtype):
            return Named(dtype_name(v), S.TYPE_SCALAR_TYPE, schema_type)
        if isinstance(v, torch.device):
            return Named(str(v), S.TYPE_DEVICE, schema_type)
        if isinstance(v, torch.layout):
            return Named(str(v).replace("torch.", ""), S.TYPE_LAYOUT, schema_type)
        if isinstance(v, torch.memory_format):
            return Named(str(v).replace("torch.", ""), S.TYPE_MEMORY_FORMAT, schema_type)
        if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            cast = int if isinstance(v, torch.SymInt) else float if isinstance(v, torch.SymFloat) else bool
            try:
                return Value(cast(v), schema_type)
            except Exception:  # noqa: BLE001 - unbacked symbols: keep the expression
                return Value(str(v), schema_type)
        if isinstance(v, (list, tuple)):
            return self._sequence(v, schema_type, caps, clone, bump, uninit)
        return Value(f"<{tv.__name__}>", schema_type)

    def _share(self, key: tuple, rec: Value) -> Value:
        if len(self._shared) >= _MAX_SHARED:
            self._shared.clear()
        self._shared[key] = rec
        return rec

    def _sequence(self, v, schema_type: str, caps: list, clone: bool, bump: int, uninit: bool = False):
        types = tuple(map(type, v))
        if all(t in _PLAIN_NUMBERS for t in types):
            if all(t is int for t in types):
                # (the types in the key: [1, 2] == [1.0, 2.0]; an int[] argument's list,
                # which holds ints only, is also stored as (schema type, *values), the
                # key `inputs` looks up before it looks at the types)
                key = (types, tuple(v), schema_type)
                rec = self._shared.get(key)
                if rec is None:
                    rec = self._share(key, Value(list(v), schema_type))
                    if schema_type.startswith(_INT_LIST_TYPES) and tv_is_list(v):
                        self._share((schema_type, *v), rec)
                return rec
            return Value(list(v), schema_type)
        inner = schema_type[:-2] if schema_type.endswith("[]") else ""
        # (a destination-only list, FSDP2's copy-out `out`: each buffer is as unwritten as a
        # single out= tensor)
        nodes = [self.node(x, inner, caps, clone, uninit, bump) for x in v]
        tensorish = all(isinstance(x, _TENSOR) or x is None for x in v)
        return ListOf(nodes, S.TYPE_TENSOR_LIST if tensorish else S.TYPE_LIST, schema_type)

    def _tensor(self, v: torch.Tensor, schema_type: str, caps: list, clone: bool, uninit: bool,
                bump: int):
        if v.is_nested:
            # a nested tensor (nn.Transformer's fast path with a padding mask) has no
            # single shape or stride: stored as the list of its components
            return ListOf([self._tensor(c, "Tensor", caps, clone, uninit, bump) for c in v.unbind()],
                          S.TYPE_TENSOR_LIST, schema_type)
        if v.is_meta or v.dtype in UNSTORED_DTYPES:
            # no values to store: a meta tensor (deferred init, shape inference) has no
            # data, and quantized / sub-byte dtypes have no storage format. A placeholder
            # naming what it was, instead of a writer failure that stops the user's run.
            why = "meta tensor, no data" if v.is_meta else "dtype not stored"
            return Value(f"<Tensor {dtype_name(v.dtype)}{list(v.shape)} on {v.device}: {why}>", schema_type)
        cap = TensorCapture(v, self._gen, clone, uninit, bump)
        if cap.extra is not None:
            self.dtensor_layouts.add(cap.extra[S.ATTR_DTENSOR])
        caps.append(cap)
        if self.first_device is None:
            self.first_device = cap.device
        return cap


def tv_is_list(v: Any) -> bool:
    return type(v) is list


def tensors_in(v: Any, out: list) -> list:
    """The tensors in an argument or result: a tensor, or lists/tuples of them (schema
    types Tensor, Tensor?, Tensor[], Tensor?[], tuples of returns), appended to `out`."""
    if isinstance(v, _TENSOR):
        out.append(v)
    elif isinstance(v, (list, tuple)):
        for x in v:
            tensors_in(x, out)
    return out


def input_dtype_attrs(info: OpInfo, args: tuple, kwargs: dict) -> dict[str, str]:
    """The op attributes saying what the op's tensor inputs were, for a dump that does not
    store them ({} when it has none): input_dtypes (the distinct dtypes) and input_arg_dtypes
    (JSON {argument: dtype} of the top-level tensor arguments: which input had which)."""
    dtypes = tensor_dtypes(args, kwargs)
    if not dtypes:
        return {}
    by_arg = {name: dtype_name(v.dtype) for name, _, v in named_args(info, args, kwargs) if isinstance(v, _TENSOR)}
    return {S.OP_INPUT_DTYPES: dtypes, S.OP_INPUT_ARG_DTYPES: json.dumps(by_arg, separators=(",", ":"))}


def tensor_dtypes(args: tuple, kwargs: dict) -> str:
    """The distinct dtypes of the tensor arguments (lists one level deep), sorted and
    comma-joined: what an op's inputs were when the dump does not store them."""
    names = set()
    for v in (*args, *kwargs.values()):
        if isinstance(v, _TENSOR):
            names.add(dtype_name(v.dtype))
        elif isinstance(v, (list, tuple)):
            for x in v:
                if isinstance(x, _TENSOR):
                    names.add(dtype_name(x.dtype))
    return ",".join(sorted(names))
