"""Split an AOTAutograd graph (ATen ops) into the pieces Inductor compiles one by one.

Inductor's CPU code calls no hook between its kernels (its intermediate hooks are not
generated for the C++ path: 0 calls on a small MLP), so the values a compiled step
computes are made visible by compiling the graph in pieces: each piece is a graph of
its own, compiled by Inductor as a whole graph would be (its decompositions, pattern
passes, lowerings, fusions and rounding inside the piece), and its outputs are
materialised where the pieces meet. Splitting changes one thing: nothing fuses across
a cut, so a value that Inductor would have kept in registers (or recomputed) between
two kernels is written to memory in its dtype at the cut. Finer cuts localise better
and reproduce cross-op fusion less; see docs/COMPILED.md.

Granularity (`split=`):
  "node"    every ATen op is its own piece (views and tuple indexing run as they are:
            they compute nothing). Each op's output as Inductor computes that op.
  "module"  consecutive ops of one nn.Module path form a piece: fusion inside a module
            kept; the ops whose values leave the piece are recorded (their inputs are
            materialised for that), the values inside it are not.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from ..capture.walk import op_plan
from .naming import node_module

SPLITS = ("node", "module")
_KEPT_META = ("nn_module_stack", "fwd_nn_module_stack", "stack_trace", "seq_nr", "original_aten")
# Nodes that compute nothing (or only rebind): run as they are, never handed to Inductor.
_PASSTHROUGH_TARGETS = {operator.getitem}


def runs_eagerly(node: fx.Node) -> bool:
    """A node executed by calling its target directly: tuple indexing, views (no
    arithmetic), in-place writes into graph inputs (the epilogue of an input mutation),
    anything that is not an ATen op overload."""
    t = node.target
    if t in _PASSTHROUGH_TARGETS or not isinstance(t, torch._ops.OpOverload):
        return True
    info = op_plan(t).info
    return bool(info.is_view or info.written)


def writes_input(node: fx.Node) -> bool:
    t = node.target
    return isinstance(t, torch._ops.OpOverload) and bool(op_plan(t).info.written)


@dataclass
class Piece:
    """Nodes compiled together; `inputs`: the outside nodes they read, `outputs`: the
    nodes they produce that are read outside (or returned)."""

    nodes: list
    eager: bool = False
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)


def split_graph(graph: fx.Graph, split: str = "node") -> list[Piece]:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    pieces: list[Piece] = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        last = pieces[-1] if pieces else None
        if split == "module" and not writes_input(node) and last is not None and not last.eager \
                and node_module(last.nodes[-1].meta) == node_module(node.meta):
            last.nodes.append(node)     # (views and tuple indexing too: inside the piece)
        elif runs_eagerly(node):
            pieces.append(Piece([node], eager=True))
        else:
            pieces.append(Piece([node]))
    for p in pieces:
        members = set(p.nodes)
        seen = set()
        for n in p.nodes:
            for a in n.all_input_nodes:
                if a not in members and a not in seen:
                    seen.add(a)
                    p.inputs.append(a)
        leaving = {n for n in p.nodes if any(u not in members for u in n.users)}
        # the op computing each leaving value (through views: a weight's gradient leaves
        # as the transpose of an mm) is recorded; it and its inputs are materialised, so
        # that its record holds them (one more store each, the values computed as fused)
        computing = {_through_views(n, members) for n in leaving}
        needed = {a for n in computing for a in n.all_input_nodes if a in members}
        p.outputs = [n for n in p.nodes if n in leaving or n in computing or n in needed]
    return pieces


def _through_views(n: fx.Node, members: set) -> fx.Node:
    while runs_eagerly(n) and not writes_input(n) and n.args and isinstance(n.args[0], fx.Node) \
            and n.args[0] in members:
        n = n.args[0]
    return n


def _flat_count(val) -> int | None:
    """Number of results of a multi-output node (its meta value a tuple), else None."""
    if isinstance(val, (tuple, list)):
        return len(val)
    return None


def piece_module(piece: Piece) -> tuple[fx.GraphModule, list]:
    """The piece as a graph of its own: placeholders for its inputs, its outputs
    flattened (a multi-output node's results one by one). Returns the module and, per
    piece output, how many flat results it has (None: one tensor)."""
    g = fx.Graph()
    env: dict = {}
    for i, a in enumerate(piece.inputs):
        env[a] = g.placeholder(f"in_{i}")
    for n in piece.nodes:
        new = g.node_copy(n, lambda a: env[a])
        # the names only: the outer trace's fake values belong to its own fake mode
        # (Inductor traces the piece again from the real inputs)
        new.meta = {k: n.meta[k] for k in _KEPT_META if k in n.meta}
        env[n] = new
    flat, shapes = [], []
    for n in piece.outputs:
        k = _flat_count(n.meta.get("val"))
        shapes.append(k)
        if k is None:
            flat.append(env[n])
        else:
            flat += [g.call_function(operator.getitem, (env[n], i)) for i in range(k)]
    g.output(tuple(flat))
    return fx.GraphModule(torch.nn.Module(), g), shapes
