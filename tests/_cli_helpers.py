"""Torch-free dump builders for the accucmp CLI tests (written with dumpfile.DumpWriter)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dumpfile import DumpWriter, TensorMeta
from dumpfile import schema as S


def contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= max(int(d), 1)
    return tuple(reversed(stride))


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 raw bits, round to nearest even."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


@dataclass
class Op:
    op: str
    seqid: int
    inputs: dict[str, Any] = field(default_factory=dict)
    outputs: dict[str, Any] = field(default_factory=dict)
    phase: str = S.PHASE_FORWARD
    module: str = ""
    dtype: str | None = None  # store float tensors as this torch dtype (e.g. "bfloat16")


def _store(w: DumpWriter, parent, name: str, value: Any, dtype: str | None) -> str:
    if isinstance(value, np.ndarray):
        dt = dtype if (dtype and value.dtype.kind == "f") else str(value.dtype)
        data = bf16_bits(value) if dt == "bfloat16" else value.astype(S.STORAGE_NUMPY_DTYPE[dt])
        meta = TensorMeta(dtype=dt, shape=tuple(value.shape), stride=contiguous_stride(value.shape))
        return w.write_tensor(parent, name, data, meta)
    if isinstance(value, list) and value and all(isinstance(v, np.ndarray) for v in value):
        g = w.create_list(parent, name, S.TYPE_TENSOR_LIST, len(value), "Tensor[]")
        for i, v in enumerate(value):
            _store(w, g, f"{name}_{i}", v, dtype)
        return g.name
    return w.write_value(parent, name, value)


def write_dump(path, ops: list[Op], *, mode: str = S.MODE_DUMP, root_attrs: dict | None = None) -> str:
    with DumpWriter(path, mode=mode, root_attrs={S.ROOT_DEVICE: "cpu", **(root_attrs or {})}) as w:
        for o in ops:
            g = w.begin_op(o.op, o.seqid, phase=o.phase, module=o.module)
            for name, v in o.inputs.items():
                _store(w, g[S.INPUT_GROUP], name, v, o.dtype)
            w.set_order(g[S.INPUT_GROUP], list(o.inputs))
            for name, v in o.outputs.items():
                _store(w, g[S.OUTPUT_GROUP], name, v, o.dtype)
            w.end_op()
    return str(path)


def model_ops(seed: int = 0, n_layers: int = 3, width: int = 16, batch: int = 4) -> list[Op]:
    """A small MLP step: per layer mm -> add -> relu forward, then the backward ops in reverse."""
    rng = np.random.default_rng(seed)
    ops: list[Op] = []
    seq = 1
    x = rng.standard_normal((batch, width)).astype(np.float32)
    weights = [rng.standard_normal((width, width)).astype(np.float32) / 4 for _ in range(n_layers)]
    acts = []
    for i, wt in enumerate(weights):
        h = x @ wt
        ops.append(Op("aten.mm.default", seq, {"self": x, "mat2": wt}, {"result": h}, module=f"layers.{i}"))
        seq += 1
        b = np.full((width,), 0.1, np.float32)
        h2 = h + b
        ops.append(Op("aten.add.Tensor", seq, {"self": h, "other": b, "alpha": 1}, {"result": h2},
                      module=f"layers.{i}"))
        seq += 1
        y = np.maximum(h2, 0)
        ops.append(Op("aten.relu.default", seq, {"self": h2}, {"result": y}, module=f"layers.{i}"))
        seq += 1
        acts.append((x, h2))
        x = y
    g = np.ones_like(x)
    for i in reversed(range(n_layers)):
        xin, h2 = acts[i]
        gr = g * (h2 > 0)
        ops.append(Op("aten.threshold_backward.default", seq, {"grad_output": g, "self": h2, "threshold": 0},
                      {"result": gr}, phase=S.PHASE_BACKWARD, module=f"layers.{i}"))
        seq += 1
        gx = gr @ weights[i].T
        ops.append(Op("aten.mm.default", seq, {"self": gr, "mat2": weights[i].T.copy()}, {"result": gx},
                      phase=S.PHASE_BACKWARD, module=f"layers.{i}"))
        seq += 1
        g = gx
    return ops


def perturbed(ops: list[Op], seqid: int, rel: float, *, seed: int = 1, noise: float = 0.0) -> list[Op]:
    """A copy of `ops` where op `seqid`'s outputs are scaled by (1 + rel); every other
    float output gets relative noise `noise` (a clean replay's rounding)."""
    rng = np.random.default_rng(seed)
    out = []
    for o in ops:
        outs = {}
        for k, v in o.outputs.items():
            if isinstance(v, np.ndarray) and v.dtype.kind == "f":
                v = v * (1 + rng.standard_normal(v.shape).astype(np.float32) * noise) if noise else v.copy()
                if o.seqid == seqid:
                    v = (v * (1 + rel)).astype(np.float32)
            outs[k] = v.astype(np.float32) if isinstance(v, np.ndarray) and v.dtype.kind == "f" else v
        out.append(Op(o.op, o.seqid, dict(o.inputs), outs, o.phase, o.module, o.dtype))
    return out
