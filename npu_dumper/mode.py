"""The TorchDispatchMode that sees every op of the block and runs the policy pipeline.

One instance per dumper block (npu_dumper.dumper owns it, like flop_counter's
FlopCounterMode owns its mode). Order per eligible op is documented in policy.py.
"""

from __future__ import annotations

import os
import traceback
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dumpfile import schema as S
from dumpfile.errors import DumpError
from dumpfile.opfilter import OpSelection

from . import hints
from .dynamo_skip import no_dynamo_import
from .capture import CaptureRegistry, ListOf, Named, StorageGuard, TensorCapture, Value, \
    named_args, named_returns, op_info
from .module_tracking import ModuleTracker, backward_module
from .policy import OpEvent, Policy
from .tensors import UNSTORED_DTYPES, dtype_name
from .sinks.protocol import OpJob, Sink

_current_node = torch._C._current_autograd_node
_graph_task_id = torch._C._current_graph_task_id
_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(os.path.abspath(__file__))


class OpFilter(OpSelection):
    """include/exclude op patterns, module-path prefixes, phases. Decided once per op name."""

    def __init__(self, include=None, exclude=None, modules=None, phases=None):
        phase_list = _as_list(phases, "phases") if phases is not None else None
        super().__init__(_as_list(include, "include"), _as_list(exclude, "exclude"),
                         _as_list(modules, "modules"), phase_list)
        if self.phases is not None and not self.phases <= set(S.PHASES):
            from .errors import DumperError
            raise DumperError(f"phases must be a subset of {S.PHASES}, got {sorted(self.phases)}")


def _as_list(v, name: str = "option") -> list[str]:
    if v is None:
        return []
    if isinstance(v, str):
        return [v]
    try:
        items = list(v)
    except TypeError:
        items = None
    if items is None or not all(isinstance(x, str) for x in items):
        from .errors import DumperError
        raise DumperError(f"{name} must be a string or a list of strings, got {v!r}")
    return items


def user_stack_line() -> str:
    """The innermost frame outside torch and npu_dumper: 'file:line in func: code'."""
    for fr in reversed(traceback.extract_stack()):
        f = os.path.abspath(fr.filename)
        if f.startswith(_TORCH_DIR) or f.startswith(_OWN_DIR):
            continue
        return f"{fr.filename}:{fr.lineno} in {fr.name}: {(fr.line or '').strip()}"
    return ""


def _overriding(policies: list[Policy], hook: str) -> list[Policy]:
    base = getattr(Policy, hook)
    return [p for p in policies if getattr(type(p), hook) is not base]


@no_dynamo_import
class DumpMode(TorchDispatchMode):
    """Intercepts ops; numbering, attribution, snapshots; hands records to the writer thread."""

    def __init__(self, *, writer: Sink | None, registry: CaptureRegistry,
                 policies: list[Policy], op_filter: OpFilter, tracker: ModuleTracker,
                 dump_mode: str = "all", record_views: bool = False, record_stack: bool = False):
        super().__init__()
        self.writer = writer
        self.registry = registry
        self.policies = policies or [Policy()]
        self.filter = op_filter
        self.tracker = tracker
        self.record_inputs = dump_mode in ("input", "all")
        self.record_outputs = dump_mode in ("output", "all")
        self.record_views = record_views
        self.record_stack = record_stack
        self.seqid = 0
        self.num_recorded = 0
        self.first_device: str | None = None
        self.dtensor_layouts: set[str] = set()   # `dtensor` attributes seen (parallel_layout)
        self._names: dict[Any, str] = {}
        # id(func) -> (func, OpInfo, name): one lookup per op (OpOverload.__hash__ is Python;
        # the entry holds func, so its id is not reused while the table lives)
        self._ops: dict[int, tuple] = {}
        self._filter_trivial = op_filter.trivial
        # Only the hooks a policy overrides are called (the plain dump's Policy() has none).
        self._runners = _overriding(self.policies, "run_op")
        self._before = _overriding(self.policies, "before_op")
        self._deciders = _overriding(self.policies, "should_record")
        self._after = _overriding(self.policies, "after_op")

    def __enter__(self):
        # FSDP2 frees and regrows storages outside the dispatcher: saved first (capture.py)
        self._guard = StorageGuard(self.registry).__enter__()
        try:
            return super().__enter__()
        except BaseException:
            self._guard.__exit__(None, None, None)
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._guard.__exit__(None, None, None)

    # ---- snapshots -------------------------------------------------------------
    def _node(self, v: Any, schema_type: str, caps: list, clone: bool, uninit: bool = False,
              bump: int = 0):
        if isinstance(v, torch.Tensor):
            if v.is_nested:
                # a nested tensor (nn.Transformer's fast path with a padding mask) has no
                # single shape or stride: stored as the list of its components
                return ListOf([self._node(c, "Tensor", caps, clone, uninit, bump) for c in v.unbind()],
                              S.TYPE_TENSOR_LIST, schema_type)
            if v.is_meta or v.dtype in UNSTORED_DTYPES:
                # no values to store: a meta tensor (deferred init, shape inference) has no
                # data, and quantized / sub-byte dtypes have no storage format. A placeholder
                # naming what it was, instead of a writer failure that stops the user's run.
                why = "meta tensor, no data" if v.is_meta else "dtype not stored"
                return Value(f"<Tensor {dtype_name(v.dtype)}{list(v.shape)} on {v.device}: {why}>", schema_type)
            cap = TensorCapture(v, self.registry._gen, clone=clone, uninitialized=uninit,
                                version_bump=bump)
            if cap.extra is not None:
                self.dtensor_layouts.add(cap.extra[S.ATTR_DTENSOR])
            if not clone:
                self.registry.add(cap)
            caps.append(cap)
            if self.first_device is None:
                self.first_device = cap.device
            return cap
        if v is None or isinstance(v, (bool, int, float, complex, str)):
            return Value(v, schema_type)
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
            items = list(v)
            if all(type(x) in (int, float, bool) for x in items):
                return Value(items, schema_type)
            inner = schema_type[:-2] if schema_type.endswith("[]") else ""
            nodes = [self._node(x, inner, caps, clone, bump=bump) for x in items]
            tensorish = all(isinstance(x, torch.Tensor) or x is None for x in items)
            return ListOf(nodes, S.TYPE_TENSOR_LIST if tensorish else S.TYPE_LIST, schema_type)
        return Value(f"<{type(v).__name__}>", schema_type)

    def _write_targets(self, info, args, kwargs) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for name, _, v in named_args(info, args, kwargs):
            if name in info.written:
                _tensors_in(v, out)
        return out

    def _name(self, func) -> str:
        n = self._names.get(func)
        if n is None:
            n = self._names[func] = str(func)
        return n

    # ---- the pipeline ----------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        writer = self.writer
        if writer is not None and writer.failed:
            # the writer's first failure stopped recording; the user's step goes on and
            # the block raises it at exit (docs/FORMAT.md, "Durability")
            out = func(*args, **kwargs)
            hints.pop_compute_dtype()
            return out
        op = self._ops.get(id(func))
        if op is None:
            op = self._ops[id(func)] = (func, op_info(func), self._name(func))
        _, info, name = op
        if info.is_view and not self.record_views:
            out = func(*args, **kwargs)
            hints.pop_compute_dtype()
            return out
        self.seqid += 1
        node = _current_node()
        tracker = self.tracker
        if node is None:
            tracker.tag_pending()
            if _graph_task_id() != -1 and not tracker.in_forward:
                # run by the autograd engine but by no node: a tensor/grad hook or a callback
                # queued for the end of backward (the DDP reducer copying bucket views back
                # into .grad, its last allreduce): part of the backward pass
                phase, grad_fn, module = S.PHASE_BACKWARD, "", ""
            else:
                phase, grad_fn, module = S.PHASE_FORWARD, "", tracker.current
            recompute = False
        else:
            phase, grad_fn, module = S.PHASE_BACKWARD, node.name(), backward_module(node)
            recompute = tracker.in_forward
            if recompute:
                # a module's forward runs inside backward: activation checkpointing re-running
                # it. Its ops are attributed to that module, not to the node that asked.
                module = tracker.current
        # A compute-dtype note belongs to the op that made it: one left by an op that was
        # skipped or filtered (or raised) must not be written on the next recorded op.
        hints.pop_compute_dtype()
        if not self._filter_trivial and not self.filter.selected(name, phase, module):
            if info.written:
                for t in self._write_targets(info, args, kwargs):
                    self.registry.before_write(t)
            out = func(*args, **kwargs)
            hints.pop_compute_dtype()
            if phase == S.PHASE_FORWARD or recompute:
                self._note_forward_outputs(out, module)
            return out

        ev = OpEvent(func=func, name=name, args=args, kwargs=kwargs, seqid=self.seqid,
                     phase=phase, module=module, grad_fn=grad_fn)
        if recompute:
            ev.group_attrs[S.OP_RECOMPUTE] = True
        if self.record_stack:
            ev.stack = user_stack_line()
        for p in self._before:
            p.before_op(ev)
        args, kwargs = ev.args, ev.kwargs
        caps: list[TensorCapture] = []
        inputs = []
        written = info.written
        if self.record_inputs:
            # destination-only arguments (out=, collective output buffers) hold no data
            # the op reads: marked uninitialized, like opaque workspaces
            not_data = info.not_data
            for an, st, v in named_args(info, args, kwargs):
                inputs.append((an, self._node(v, st, caps, clone=an in written,
                                              uninit=an in not_data)))
        else:
            dtypes = _tensor_dtypes(args, kwargs)
            if dtypes:
                ev.group_attrs[S.OP_INPUT_DTYPES] = dtypes
        if written:
            for t in self._write_targets(info, args, kwargs):
                self.registry.before_write(t)
        size_before = args[0].numel() if info.resizes and args and isinstance(args[0], torch.Tensor) else None
        try:
            out = NotImplemented
            for p in self._runners:
                out = p.run_op(ev)
                if out is not NotImplemented:
                    break
            if out is NotImplemented:
                out = func(*args, **kwargs)
        except Exception as e:
            # (the dumper's own errors, DumperError and its kinds, are DumpErrors)
            if writer is not None and not self._deciders and self.record_inputs \
                    and not isinstance(e, DumpError):
                # the op the run died in: its inputs as it got them, the error it raised
                self._record_raised(ev, inputs, caps, e)
            else:
                for c in caps:
                    self.registry.discard(c)
            raise
        except BaseException:       # KeyboardInterrupt, SystemExit: not the op's doing
            for c in caps:
                self.registry.discard(c)
            raise
        ev.outputs = out
        if info.work_returns and self.record_outputs:
            _wait_for_collective(out, info.work_returns)
        elif info.waits_tensor and self.record_outputs:
            _wait_for_tensors(out)
        compute_dtype = hints.pop_compute_dtype()
        if compute_dtype is not None:
            ev.group_attrs[S.OP_COMPUTE_DTYPE] = compute_dtype
        outputs = []
        if self.record_outputs:
            uninit, opaque = info.uninitialized, info.opaque_returns
            if size_before is not None and isinstance(out, torch.Tensor) and out.numel() > size_before:
                uninit = True       # resize_ grew the tensor: the new elements are garbage
            # a return named after a written argument is that argument (relu_'s `self`, an
            # out= op's `out`): autograd bumps its version once the op returns
            bumped = info.schema_written
            for i, (rn, st, v) in enumerate(named_returns(info, out)):
                outputs.append((rn, self._node(v, st, caps, clone=False,
                                               uninit=uninit or i in opaque,
                                               bump=1 if rn in bumped else 0)))
            if info.written_outputs:     # (an in-place op that returns no tensor)
                for an, st, v in named_args(info, args, kwargs):
                    if an in info.written_outputs:
                        outputs.append((an, self._node(v, st, caps, clone=False,
                                                       bump=1 if an in bumped else 0)))
        if phase == S.PHASE_FORWARD or recompute:     # (a re-run's graph may be backpropagated)
            self._note_forward_outputs(out, module)
        record = not self._deciders or all(p.should_record(ev) for p in self._deciders)
        if record and writer is not None:
            self._submit(ev, inputs, outputs, caps)
        else:
            for c in caps:
                self.registry.discard(c)
        for p in self._after:
            p.after_op(ev, recorded=record)
        return out

    def _record_raised(self, ev: OpEvent, inputs: list, caps: list, error: Exception) -> None:
        """Record an op that raised: its inputs, no outputs, and `raised` (the error's type
        and first line). The dump is then closed incomplete by the block's exit; the op is
        in it, so the inputs that made the op fail can be read back and replayed."""
        text = str(error).strip().splitlines()
        ev.group_attrs[S.OP_RAISED] = f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
        try:
            self._submit(ev, inputs, [], caps)
        except Exception:  # noqa: BLE001 - the user's error is the one to report
            for c in caps:
                self.registry.discard(c)

    def _submit(self, ev: OpEvent, inputs: list, outputs: list, caps: list) -> None:
        """Hand one op's record to the writer."""
        attrs = dict(ev.group_attrs) if ev.group_attrs else {}
        if ev.stack:
            attrs[S.OP_STACK] = ev.stack
        nbytes = 0
        for c in caps:
            nbytes += c.nbytes
        self.writer.submit(OpJob(ev.store_op, ev.store_seqid, ev.phase, ev.module, ev.grad_fn,
                                 attrs, inputs, outputs, captures=caps, nbytes=nbytes))
        self.num_recorded += 1

    def _note_forward_outputs(self, out, module: str) -> None:
        if not torch.is_grad_enabled():
            return
        if isinstance(out, torch.Tensor):
            self.tracker.note_outputs([out], module)
        elif isinstance(out, (tuple, list)):
            self.tracker.note_outputs(_tensors_in(out, []), module)


def _tensors_in(v: Any, out: list) -> list:
    """The tensors in an argument or result: a tensor, or lists/tuples of them (schema
    types Tensor, Tensor?, Tensor[], Tensor?[], tuples of returns), appended to `out`."""
    if isinstance(v, torch.Tensor):
        out.append(v)
    elif isinstance(v, (list, tuple)):
        for x in v:
            _tensors_in(x, out)
    return out


def _wait_for_collective(out: Any, work_returns: tuple[int, ...]) -> None:
    """Wait for the c10d Work an op returned, so that its outputs are recorded reduced (or
    gathered...), not as they were when the collective was launched. A blocking call
    (async_op=False) waits right after the op anyway; with async_op=True the dump gives
    up the overlap of that collective with compute, to record true values."""
    items = out if isinstance(out, (tuple, list)) else (out,)
    for i in work_returns:
        work = items[i] if i < len(items) else None
        wait = getattr(work, "wait", None)
        if wait is not None:
            wait()


def _wait_for_tensors(out: Any) -> None:
    """A functional collective's outputs are written when the collective finishes:
    `wait_tensor` first (as _wait_for_collective), so the recorded values are its result.
    Waiting again later (the model's own wait) finds nothing pending and returns."""
    wait = torch.ops._c10d_functional.wait_tensor
    flat, _ = tree_flatten(out)
    for t in flat:
        if isinstance(t, torch.Tensor):
            wait(t)


def _tensor_dtypes(args: tuple, kwargs: dict) -> str:
    """The distinct dtypes of the tensor arguments (lists one level deep), sorted and
    comma-joined: what an op's inputs were when the dump does not store them."""
    names = set()
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            names.add(dtype_name(v.dtype))
        elif isinstance(v, (list, tuple)):
            for x in v:
                if isinstance(x, torch.Tensor):
                    names.add(dtype_name(x.dtype))
    return ",".join(sorted(names))
