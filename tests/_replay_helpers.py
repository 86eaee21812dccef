"""Helpers for helper B's tests: write small dumps without the dispatch mode."""

from __future__ import annotations

import torch

from dumpfile import schema as S
from dumpfile.write.writer import DumpWriter, TensorMeta
from npu_dumper.replay.recorded import tensor_to_storage


def write_arg(writer, parent, name, value, schema_type=None):
    if isinstance(value, torch.Tensor):
        data, dtype = tensor_to_storage(value)
        writer.write_tensor(parent, name, data, TensorMeta(
            dtype=dtype, shape=tuple(value.shape), stride=tuple(value.stride()), device=str(value.device)))
    elif isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) or v is None for v in value):
        g = writer.create_list(parent, name, S.TYPE_TENSOR_LIST, len(value), schema_type)
        for i, v in enumerate(value):
            write_arg(writer, g, f"{name}_{i}", v)
    elif isinstance(value, torch.dtype):
        writer.write_named(parent, name, str(value).replace("torch.", ""), S.TYPE_SCALAR_TYPE)
    elif isinstance(value, torch.device):
        writer.write_named(parent, name, str(value), S.TYPE_DEVICE)
    elif isinstance(value, torch.layout):
        writer.write_named(parent, name, str(value).replace("torch.", ""), S.TYPE_LAYOUT)
    else:
        writer.write_value(parent, name, value, schema_type)


def record(path, calls, mode=S.MODE_DUMP):
    """calls: [(func, args, kwargs)]; runs each and writes inputs (schema names) and outputs."""
    results = []
    with DumpWriter(path, mode=mode) as w:
        for seqid, (func, args, kwargs) in enumerate(calls, start=1):
            g = w.begin_op(str(func), seqid, module="m")
            names = []
            sargs = func._schema.arguments
            for a, v in zip(sargs, args):
                write_arg(w, g["input"], a.name, v, str(a.type))
                names.append(a.name)
            for k, v in kwargs.items():
                write_arg(w, g["input"], k, v)
                names.append(k)
            w.set_order(g["input"], names)
            out = func(*args, **kwargs)
            outs = list(out) if isinstance(out, tuple) else [out]
            onames = ["result"] if len(outs) == 1 else [f"result{i}" for i in range(len(outs))]
            for n, v in zip(onames, outs):
                write_arg(w, g["output"], n, v)
            w.set_order(g["output"], onames)
            w.end_op()
            results.append(out)
    return results
