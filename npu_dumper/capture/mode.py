"""The TorchDispatchMode that sees every op of the block and runs the policy pipeline.

One instance per dumper block (npu_dumper.dumper owns it, like flop_counter's
FlopCounterMode owns its mode). Order per eligible op is documented in policy.py.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dumpfile import schema as S
from dumpfile.errors import DumpError

from . import hints
from .dynamo_skip import no_dynamo_import
from .module_tracking import ModuleTracker, backward_module
from .policy import OpEvent, Policy
from .selection import OpFilter, user_stack_line
from .snapshots import CaptureRegistry, StorageGuard, TensorCapture
from .walk import ArgWalk, OpPlan, input_dtype_attrs, op_plan, tensors_in
from ..sinks.protocol import OpJob, Sink

_current_node = torch._C._current_autograd_node
_graph_task_id = torch._C._current_graph_task_id
_is_grad_enabled = torch.is_grad_enabled
_TENSOR = torch.Tensor
_FORWARD, _BACKWARD = S.PHASE_FORWARD, S.PHASE_BACKWARD


_top_saved_tensors_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def _rerunning_forward(node) -> bool:
    """Backward is running a checkpointed forward again (asked only where grad mode is on,
    which the engine turns off for backward's own ops unless create_graph): the reentrant
    checkpoint's backward node, or the non-reentrant one's saved-tensor hooks on top."""
    try:
        if node.name() == "CheckpointFunctionBackward":
            return True
        hooks = _top_saved_tensors_hooks(False) if _top_saved_tensors_hooks is not None else None
        return hooks is not None and getattr(hooks[0], "__module__", "") == "torch.utils.checkpoint"
    except Exception:  # noqa: BLE001 - another torch's internals: not taken for a re-run
        return False


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
        self.walk = ArgWalk(registry)
        self.record_inputs = dump_mode in ("input", "all")
        self.record_outputs = dump_mode in ("output", "all")
        self.record_views = record_views
        self.record_stack = record_stack
        self.seqid = 0
        self.num_recorded = 0
        self.raised_in: int | None = None    # seqid of the op that raised, if one did
        # id(func) -> OpPlan: one lookup per op (OpOverload.__hash__ is Python; the plan
        # holds func, so its id is not reused while the table lives)
        self._ops: dict[int, OpPlan] = {}
        self._filter_trivial = op_filter.trivial
        # Only the hooks a policy overrides are called (the plain dump's Policy() has none).
        self._runners = _overriding(self.policies, "run_op")
        # a policy whose before_op others read (Policy.before_others: the loss scaler's
        # roles, which load-replay reads) runs first, wherever it sits in the list
        self._before = sorted(_overriding(self.policies, "before_op"),
                              key=lambda p: not getattr(p, "before_others", False))
        self._deciders = _overriding(self.policies, "should_record")
        self._after = _overriding(self.policies, "after_op")
        self._computed = _overriding(self.policies, "op_computed")

    @property
    def first_device(self) -> str | None:
        """The device of the first tensor recorded."""
        return self.walk.first_device

    @property
    def dtensor_layouts(self) -> set[str]:
        """The `dtensor` attributes recorded (parallel_layout)."""
        return self.walk.dtensor_layouts

    def __enter__(self):
        # FSDP2 frees and regrows storages outside the dispatcher: saved first (snapshots.py)
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

    def _plan(self, func) -> OpPlan:
        plan = self._ops[id(func)] = op_plan(func)
        return plan

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
        plan = self._ops.get(id(func)) or self._plan(func)
        info = plan.info
        if (info.is_view and not self.record_views) or info.bookkeeping:
            # (bookkeeping: a profiler label, no numerics; dumpfile/bookkeeping.py)
            out = func(*args, **kwargs)
            hints.pop_compute_dtype()
            return out
        self.seqid += 1
        node = _current_node()
        tracker = self.tracker
        stack = tracker.stack
        if node is None:
            if tracker.untagged:
                tracker.tag_pending()
            if not stack and _graph_task_id() != -1:
                # run by the autograd engine but by no node: a tensor/grad hook or a callback
                # queued for the end of backward (the DDP reducer copying bucket views back
                # into .grad, its last allreduce): part of the backward pass
                phase, grad_fn, module = _BACKWARD, "", ""
            else:
                phase, grad_fn, module = _FORWARD, "", stack[-1] if stack else ""
            recompute = False
        else:
            phase, grad_fn, module = _BACKWARD, node.name(), backward_module(node)
            recompute = bool(stack)
            if recompute:
                # a module's forward runs inside backward: activation checkpointing re-running
                # it. Its ops are attributed to that module, not to the node that asked.
                module = stack[-1]
            elif _is_grad_enabled() and _rerunning_forward(node):
                # a re-run with no module hook around it (Hugging Face checkpoints a layer's
                # `forward`, not its call): the layer's own ops, a residual add
                recompute = True
        # A compute-dtype note belongs to the op that made it: one left by an op that was
        # skipped or filtered (or raised) must not be written on the next recorded op.
        if hints._noted:
            hints.pop_compute_dtype()
        name = plan.name
        walk = self.walk
        if not self._filter_trivial and not self.filter.selected(name, phase, module):
            if info.written:
                for t in walk.write_targets(plan, args, kwargs):
                    self.registry.before_write(t)
            out = func(*args, **kwargs)
            hints.pop_compute_dtype()
            if phase == _FORWARD or recompute:
                self._note_forward_outputs(out, module)
            return out

        ev = OpEvent(func, name, args, kwargs, self.seqid, phase, module, grad_fn)
        if recompute:
            ev.group_attrs[S.OP_RECOMPUTE] = True
        elif node is None and not stack and tracker.optimizers:
            ev.group_attrs[S.OP_OPTIMIZER] = tracker.optimizers[-1]
        if self.record_stack:
            ev.stack = user_stack_line()
        for p in self._before:
            p.before_op(ev)
        args, kwargs = ev.args, ev.kwargs
        caps: list[TensorCapture] = []
        if self.record_inputs:
            inputs = walk.inputs(plan, args, kwargs, caps)
        else:
            inputs = []
            ev.group_attrs.update(input_dtype_attrs(info, args, kwargs))
        if info.written:
            for t in walk.write_targets(plan, args, kwargs):
                self.registry.before_write(t)
        size_before = args[0].numel() if info.resizes and args and isinstance(args[0], _TENSOR) else None
        try:
            out = NotImplemented
            for p in self._runners:
                out = p.run_op(ev)
                if out is not NotImplemented:
                    break
            if out is NotImplemented:
                out = func(*args, **kwargs)
        except Exception as e:
            self.raised_in = self.seqid      # the block's exit says where the step raised
            # (the dumper's own errors, DumperError and its kinds, are DumpErrors)
            if writer is not None and not self._deciders and self.record_inputs \
                    and not isinstance(e, DumpError):
                # the op the run died in: its inputs as it got them, the error it raised
                self._record_raised(ev, inputs, caps, e)
            else:
                self._discard(caps)
            raise
        except BaseException:       # KeyboardInterrupt, SystemExit: not the op's doing
            self._discard(caps)
            raise
        ev.outputs = out
        if self.record_outputs:
            if info.work_returns:
                _wait_for_collective(out, info.work_returns)
            elif info.waits_tensor:
                _wait_for_tensors(out)
        if hints._noted:
            compute_dtype = hints.pop_compute_dtype()
            if compute_dtype is not None:
                ev.group_attrs[S.OP_COMPUTE_DTYPE] = compute_dtype
        if self.record_outputs:
            uninit = info.uninitialized
            if size_before is not None and isinstance(out, _TENSOR) and out.numel() > size_before:
                uninit = True       # resize_ grew the tensor: the new elements are garbage
            outputs = walk.outputs(plan, out, args, kwargs, caps, uninit)
        else:
            outputs = []
        if phase == _FORWARD or recompute:     # (a re-run's graph may be backpropagated)
            self._note_forward_outputs(out, module)
        record = not self._deciders or all(p.should_record(ev) for p in self._deciders)
        if record and writer is not None:
            self._submit(ev, inputs, outputs, caps)
        else:
            self._discard(caps)
        for p in self._after:
            p.after_op(ev, recorded=record)
        return out

    def _discard(self, caps: list) -> None:
        for c in caps:
            self.registry.discard(c)

    def _record_raised(self, ev: OpEvent, inputs: list, caps: list, error: Exception) -> None:
        """Record an op that raised: its inputs, no outputs, and `raised` (the error's type
        and first line). The dump is then closed incomplete by the block's exit; the op is
        in it, so the inputs that made the op fail can be read back and replayed."""
        text = str(error).strip().splitlines()
        ev.group_attrs[S.OP_RAISED] = f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
        try:
            self._submit(ev, inputs, [], caps)
        except Exception:  # noqa: BLE001 - the user's error is the one to report
            self._discard(caps)

    def _submit(self, ev: OpEvent, inputs: list, outputs: list, caps: list) -> None:
        """Hand one op's record to the writer."""
        attrs = dict(ev.group_attrs) if ev.group_attrs else {}
        if ev.stack:
            attrs[S.OP_STACK] = ev.stack
        nbytes = 0
        for c in caps:
            nbytes += c.nbytes
        self.writer.submit(OpJob(ev.store_op, ev.store_seqid, ev.phase, ev.module, ev.grad_fn,
                                 attrs, inputs, outputs, nbytes, caps))
        self.num_recorded += 1

    def _note_forward_outputs(self, out, module: str) -> None:
        if not module or not _is_grad_enabled():
            return          # (ModuleTracker.note_outputs tags nothing outside a module)
        if isinstance(out, _TENSOR):
            self.tracker.note_outputs([out], module)
        elif isinstance(out, (tuple, list)):
            self.tracker.note_outputs(tensors_in(out, []), module)


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
