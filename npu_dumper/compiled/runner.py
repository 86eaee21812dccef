"""Run one AOTAutograd graph as Inductor-compiled pieces, recording each piece's outputs.

The runner is what the backend (backend.py) returns for a forward or a backward graph.
Each piece (pieces.py) is compiled by Inductor the first time the graph runs, with the
real inputs of that call as example inputs (static shapes), and kept: later calls run
the compiled code only. While a `compiled=True` dumper block is active (session.py), every
recorded node is handed to it with the values the compiled pieces produced.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch
from torch import fx

from . import session
from .naming import node_module, node_source
from .pieces import Piece, piece_module, split_graph


def _fetch_attr(gm: fx.GraphModule, target: str) -> Any:
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _value(env: dict, a: Any) -> Any:
    return fx.node.map_arg(a, lambda n: env[n])


class GraphRunner:
    """Callable with the graph's inputs as arguments (or one list of them)."""

    def __init__(self, gm: fx.GraphModule, phase: str, label: str, split: str,
                 compile_piece: Callable):
        self.gm = gm
        self.phase = phase
        self.label = label              # "forward 0": the compiled graph, in the dump
        self.split = split
        self._compile_piece = compile_piece
        g = gm.graph
        self.placeholders = [n for n in g.nodes if n.op == "placeholder"]
        # constants the trace lifted into the graph module (_tensor_constant0: a causal mask)
        self.constants = {n: _fetch_attr(gm, n.target) for n in g.nodes if n.op == "get_attr"}
        out = next(n for n in g.nodes if n.op == "output")
        self.returns = out.args[0]
        # nodes returned by the graph: they leave the dumper's sight (autograd, the user)
        self.escaping: set = set()
        fx.node.map_arg(self.returns, self.escaping.add)
        self.pieces = split_graph(g, split)
        self._compiled: list = [None] * len(self.pieces)
        # per piece, how its outputs are flattened (piece_module)
        self._shapes: list = [None] * len(self.pieces)
        # per node: (module, source) read once
        self._names = {n: (node_module(n.meta), node_source(n.meta))
                       for p in self.pieces for n in p.nodes}

    def __call__(self, *call_args) -> Any:
        # boxed (one list, which is emptied so that it no longer keeps the inputs alive)
        # or, where AOTAutograd wraps the backward, the inputs as arguments
        boxed = len(call_args) == 1 and isinstance(call_args[0], list)
        args = call_args[0] if boxed else list(call_args)
        env: dict = dict(self.constants)
        for ph, v in zip(self.placeholders, args):
            env[ph] = v
        if boxed:
            args.clear()
        rec = session.recorder()
        with torch.no_grad():
            for i, p in enumerate(self.pieces):
                if p.eager:
                    self._run_eager(p.nodes[0], env, rec)
                else:
                    self._run_piece(i, p, env, rec)
        return list(_value(env, self.returns))

    # ---- one piece ------------------------------------------------------------------
    def _run_eager(self, node: fx.Node, env: dict, rec) -> None:
        args, kwargs = _value(env, node.args), _value(env, node.kwargs)
        record = rec is not None and not rec.stopped and node.target is not operator.getitem
        module, source = self._names[node]
        if record and not rec.wants(node.target, self.phase, module):
            record = False
        if rec is not None and isinstance(node.target, torch._ops.OpOverload):
            rec.before_write(node.target, args, kwargs)
        out = env[node] = node.target(*args, **kwargs)
        if record:
            ev = rec.event(node.target, args, kwargs, phase=self.phase, module=module,
                           source=source, node_name=node.name, graph=self.label)
            rec.record(ev, out, node in self.escaping)

    def _run_piece(self, i: int, p: Piece, env: dict, rec) -> None:
        ins = [env[a] for a in p.inputs]
        ev = None
        if rec is not None and not rec.stopped and rec.replays and len(p.nodes) == 1:
            # graph-level load-replay: the node runs, compiled, on the load file's inputs
            # of the op it matches (its own error), and hands its result on
            ev = self._replay_event(p.nodes[0], env, rec)
            if ev is not None:
                ins = _piece_inputs(p.nodes[0], p.inputs, ev.args, ev.kwargs, ins)
        fn = self._compiled[i]
        if fn is None:
            sub, self._shapes[i] = piece_module(p)
            fn = self._compiled[i] = self._compile_piece(sub, ins)
        flat = fn(list(ins))
        k = 0
        for n, count in zip(p.outputs, self._shapes[i]):
            if count is None:
                env[n] = _as_traced(flat[k], n.meta.get("val"))
                k += 1
            else:
                traced = n.meta.get("val")
                traced = traced if isinstance(traced, (tuple, list)) and len(traced) == count else (None,) * count
                env[n] = tuple(_as_traced(v, t) for v, t in zip(flat[k:k + count], traced))
                k += count
        if rec is None or rec.stopped:
            return
        if rec.replays:
            if ev is not None:
                rec.record(ev, env[p.nodes[0]], p.nodes[0] in self.escaping)
            return
        for n in p.outputs:     # (split="node": the node itself; "module": what leaves it)
            module, source = self._names[n]
            if not rec.wants(n.target, self.phase, module):
                continue
            try:
                args, kwargs = _value(env, n.args), _value(env, n.kwargs)
            except KeyError:        # an input computed inside the piece: never materialised
                continue
            ev = rec.event(n.target, args, kwargs, phase=self.phase, module=module,
                           source=source, node_name=n.name, graph=self.label)
            rec.record(ev, env[n], n in self.escaping)

    def _replay_event(self, node: fx.Node, env: dict, rec):
        module, source = self._names[node]
        if not rec.wants(node.target, self.phase, module):
            return None
        ev = rec.event(node.target, _value(env, node.args), _value(env, node.kwargs),
                       phase=self.phase, module=module, source=source, node_name=node.name,
                       graph=self.label)
        rec.before(ev)
        return ev


def _as_traced(value: Any, traced: Any) -> Any:
    """A piece's output with the strides the traced graph gave its node: Inductor lays out a
    piece's outputs as it likes, and a later node run as it is (a view) may rely on the
    traced layout (T5 tiny: `view` of a piece's output refused, 'view size is not compatible
    with input tensor's size and stride'). The same values, copied into that layout."""
    if not (isinstance(value, torch.Tensor) and isinstance(traced, torch.Tensor)):
        return value
    try:
        shape, stride = tuple(int(d) for d in traced.shape), tuple(int(d) for d in traced.stride())
    except (TypeError, ValueError):         # symbolic sizes: left as it is
        return value
    if tuple(value.shape) != shape or value.stride() == stride:
        return value
    try:
        return torch.empty_strided(shape, stride, dtype=value.dtype, device=value.device).copy_(value)
    except RuntimeError:                    # a layout no copy can fill (overlapping: an expand)
        return value


def _piece_inputs(node: fx.Node, inputs: list, args: tuple, kwargs: dict, live: list) -> list:
    """The piece's inputs taken from the op's (replaced) arguments: each input node's
    value where it sits in node.args/kwargs."""
    from torch.utils._pytree import tree_flatten
    where, _ = tree_flatten((node.args, node.kwargs))
    values, _ = tree_flatten((args, kwargs))
    if len(where) != len(values):
        return live
    found = {}
    for w, v in zip(where, values):
        if isinstance(w, fx.Node) and w not in found:
            found[w] = v
    return [found.get(a, x) for a, x in zip(inputs, live)]

