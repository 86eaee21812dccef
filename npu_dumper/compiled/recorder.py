"""Hand one executed FX node of a compiled graph to the dump, through the dumper's own path.

A compiled step never reaches the dispatch mode (under a dispatch mode TorchDynamo runs
the model eagerly, so the compiled numerics would vanish). The block's DumpMode is
therefore not entered: its parts are used directly, as its __torch_dispatch__ uses
them: the op filter, the seqid counter, the argument walk (names from the op's schema,
tensor captures with copy-on-write) and `_submit` (an OpJob to the block's sink:
writer thread, writer process or statistics writer). The file is the same layout as an
eager dump's: /{aten op}/{seqid}/input|output/{schema name}.

What differs from an eager op: the phase is the graph's (forward or backward graph),
the module path and source line are the FX node's (naming.py), and two attributes say
which node of which compiled graph the record is (schema OP_FX_NODE,
OP_COMPILED_GRAPH).
"""

from __future__ import annotations

from typing import Any

import torch

from dumpfile import schema as S

from ..capture.policy import OpEvent
from ..capture.walk import op_plan

_TENSOR = torch.Tensor


class NodeRecorder:
    """Records the nodes a compiled graph runs while a `compiled=True` dumper is active."""

    def __init__(self, mode):
        self.mode = mode        # the block's DumpMode (not entered: see the module doc)

    @property
    def stopped(self) -> bool:
        w = self.mode.writer
        return w is None or w.failed

    def wants(self, func: Any, phase: str, module: str) -> bool:
        """Whether the node is recorded (the block's filters; views only with record_views)."""
        if not isinstance(func, torch._ops.OpOverload):
            return False
        plan = op_plan(func)
        if plan.info.is_view and not self.mode.record_views:
            return False
        f = self.mode.filter
        return f.trivial or f.selected(plan.name, phase, module)

    def before_write(self, func: Any, args: tuple, kwargs: dict) -> None:
        """An op the graph runs in place (an input mutation's copy_): copy what earlier
        records captured of its target before it is overwritten (copy-on-write)."""
        plan = op_plan(func)
        if plan.info.written:
            for t in self.mode.walk.write_targets(plan, args, kwargs):
                self.mode.registry.before_write(t)

    def event(self, func: Any, args: tuple, kwargs: dict, *, phase: str, module: str,
              source: str, node_name: str, graph: str) -> OpEvent:
        """The node as the policies see an op (a new seqid in the block's stream)."""
        mode = self.mode
        plan = op_plan(func)
        mode.seqid += 1
        ev = OpEvent(func, plan.name, args, kwargs, mode.seqid, phase, module,
                     "CompiledFunctionBackward" if phase == S.PHASE_BACKWARD else "")
        ev.group_attrs[S.OP_FX_NODE] = node_name
        ev.group_attrs[S.OP_COMPILED_GRAPH] = graph
        if source:
            ev.stack = source
        return ev

    @property
    def replays(self) -> bool:
        """A load file is replayed (graph-level load-replay): nodes take its inputs."""
        return any(getattr(p, "substitutes_inputs", False) for p in self.mode._before)

    def before(self, ev: OpEvent) -> None:
        """The policies' before_op: load-replay puts the recorded inputs in ev.args."""
        for p in self.mode._before:
            p.before_op(ev)

    def record(self, ev: OpEvent, out: Any, escapes: bool) -> None:
        """Record one node: `ev.args`/`ev.kwargs` the values it was given, `out` what the
        compiled code computed for it. `escapes`: the value leaves the graph (returned
        to autograd or the user, who may later write it in place): copied now."""
        mode = self.mode
        ev.outputs = out
        deciders = mode._deciders
        if deciders and not all(p.should_record(ev) for p in deciders):
            for p in mode._after:
                p.after_op(ev, recorded=False)
            return
        for p in mode._computed:     # (plain dumps: the node's own error vs float64, PlainOwnError)
            p.op_computed(ev)
        plan = op_plan(ev.func)
        caps: list = []
        if mode.record_inputs:
            inputs = mode.walk.inputs(plan, ev.args, ev.kwargs, caps)
        else:
            inputs = []
            from ..capture.walk import input_dtype_attrs
            ev.group_attrs.update(input_dtype_attrs(plan.info, ev.args, ev.kwargs))
        outputs = self._outputs(plan, out, caps, escapes) if mode.record_outputs else []
        mode._submit(ev, inputs, outputs, caps)
        for p in mode._after:
            p.after_op(ev, recorded=True)

    def _outputs(self, plan, out: Any, caps: list, clone: bool) -> list:
        """(name, record) of the node's results, named by the op's schema (walk.outputs,
        with the copy decided here: a compiled graph's outputs escape the dumper's sight)."""
        node = self.mode.walk.node
        rets = plan.returns
        start = len(caps)
        if len(rets) == 1:
            rn, st, opaque, _ = rets[0]
            records = [(rn, node(out, st, caps, clone, bool(opaque)))]
        elif isinstance(out, (tuple, list)) and len(out) == len(rets):
            records = [(rn, node(v, st, caps, clone, bool(opaque)))
                       for (rn, st, opaque, _), v in zip(rets, out)]
        elif not rets and out is None:
            records = []
        else:
            records = [("result", node(out, "", caps, clone))]
        if len(caps) > start:
            self.mode.registry.add_all(caps[start:])
        return records
