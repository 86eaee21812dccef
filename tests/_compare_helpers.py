"""Write small dumps with dumpfile.DumpWriter (no torch) for the compare tests."""

from __future__ import annotations

import h5py
import numpy as np

from dumpfile import DumpWriter, TensorMeta
from dumpfile import schema as S


def _store(arr: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        bits = np.asarray(arr, dtype=np.float32).view(np.uint32)
        # round to nearest even, as torch does
        bits = bits + (0x7FFF + ((bits >> 16) & 1))
        return (bits >> 16).astype(np.uint16)
    return np.asarray(arr, dtype=S.STORAGE_NUMPY_DTYPE.get(dtype, dtype))


def bf16(arr) -> np.ndarray:
    """Values rounded to bfloat16, returned as float32."""
    return (_store(arr, "bfloat16").astype(np.uint32) << 16).view(np.float32)


def write_dump(path, ops, *, mode: str = S.MODE_DUMP, stats_only: bool = False):
    """ops: list of dicts {op, seqid, phase?, module?, attrs?, inputs: {name: value}, outputs: {...}}.

    A value is a numpy array (stored as its dtype, or `(array, dtype_name)` to force a
    torch dtype such as "bfloat16"), a list of arrays (a tensor list), a dict
    {"stats": [...], "dtype":, "shape":} for statistics, or a Python scalar.
    """
    with DumpWriter(path, mode=mode, root_attrs={S.ROOT_STATS_ONLY: stats_only}) as w:
        for o in ops:
            g = w.begin_op(o["op"], o["seqid"], phase=o.get("phase", "forward"), module=o.get("module", ""),
                           attrs=o.get("attrs"))
            for grp_name in ("inputs", "outputs"):
                grp = g[S.INPUT_GROUP if grp_name == "inputs" else S.OUTPUT_GROUP]
                w.set_order(grp, list(o.get(grp_name, {})))
                for name, v in o.get(grp_name, {}).items():
                    _write(w, grp, name, v, o.get("uninitialized", False) and grp_name == "outputs")
            w.end_op()


def _write(w, grp, name, v, uninit=False):
    if isinstance(v, list):
        lg = w.create_list(grp, name, S.TYPE_TENSOR_LIST, len(v))
        for i, item in enumerate(v):
            _write(w, lg, f"{name}_{i}", item)
        return
    if isinstance(v, dict):
        w.write_stats(grp, name, v["stats"], TensorMeta(v.get("dtype", "float32"), tuple(v["shape"])))
        return
    if isinstance(v, tuple):
        arr, dtype = v
    elif isinstance(v, np.ndarray):
        arr, dtype = v, str(v.dtype)
    else:
        w.write_value(grp, name, v)
        return
    arr = np.asarray(arr)
    w.write_tensor(grp, name, _store(arr, dtype), TensorMeta(dtype, tuple(arr.shape), uninitialized=uninit))


_DELETE = object()


def overwrite_op_attr(path, name: str, value=_DELETE) -> None:
    """Every op group's attribute `name` set to `value`, or deleted when no value is given
    (a damaged or hostile file, an older dumper's file)."""
    with h5py.File(path, "r+") as f:
        for op in f:
            if isinstance(f[op], h5py.Group):
                for g in f[op].values():
                    if isinstance(g, h5py.Group) and name in g.attrs:
                        if value is _DELETE:
                            del g.attrs[name]
                        else:
                            g.attrs[name] = value
