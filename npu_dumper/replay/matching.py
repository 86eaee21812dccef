"""Which recorded call a live call of load-replay takes.

Matching (REFERENCE §3, refined): the k-th live call of op X takes the k-th recorded
call of X when their signatures agree; otherwise the first unused recorded call of X,
or of a name the op map says is equivalent, whose signature agrees. A signature is,
for each argument present on both sides, the tensor shape and dtype family (float /
int / bool / complex; Int ~ Long, float32 ~ bfloat16) or the exact non-tensor value.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from dumpfile import schema as S
from dumpfile.read.reader import OpRecord, ValueRecord

from .index import read_group


def _family(dtype_name: str) -> str:
    if dtype_name in S.FLOATING_DTYPES:
        return "float"
    if dtype_name in S.COMPLEX_DTYPES:
        return "complex"
    if dtype_name == "bool":
        return "bool"
    return "int" if dtype_name else "?"


_TORCH_FAMILY: dict[torch.dtype, str] = {}


def _torch_family(dtype: torch.dtype) -> str:
    fam = _TORCH_FAMILY.get(dtype)
    if fam is None:
        fam = _TORCH_FAMILY[dtype] = _family(str(dtype).replace("torch.", ""))
    return fam


def live_key(value: Any) -> Any:
    """What must agree between a live argument and a recorded one."""
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), _torch_family(value.dtype))
    if isinstance(value, (list, tuple)):
        return ("L", tuple(live_key(v) for v in value))
    if isinstance(value, torch.dtype):
        return ("D", str(value).replace("torch.", ""))
    if isinstance(value, (torch.device, torch.layout, torch.memory_format)):
        return None                      # placement, not numerics: never blocks a match
    if isinstance(value, bool):
        return ("B", value)
    if isinstance(value, (int, float)):
        return ("N", float(value))
    if isinstance(value, torch.SymInt):
        return ("N", float(int(value)))
    return ("V", value) if value is None or isinstance(value, str) else None


def recorded_key(rec: ValueRecord) -> Any:
    if rec.is_tensor:
        return ("T", tuple(rec.shape), _family(rec.dtype))
    if rec.is_list:
        return ("L", tuple(recorded_key(c) for c in rec.children))
    t = rec.type
    if t == S.TYPE_SCALAR_TYPE:
        return ("D", rec.read())
    if t in (S.TYPE_DEVICE, S.TYPE_LAYOUT, S.TYPE_MEMORY_FORMAT):
        return None
    v = rec.read()
    if t in (S.TYPE_INT_LIST, S.TYPE_INT_ARRAY_REF, S.TYPE_FLOAT_LIST, S.TYPE_BOOL_LIST):
        vals = v if isinstance(v, list) else [v]
        return ("L", tuple(("B", x) if isinstance(x, bool) else ("N", float(x)) for x in vals))
    if isinstance(v, bool):
        return ("B", v)
    if isinstance(v, (int, float)):
        return ("N", float(v))
    return ("V", v) if v is None or isinstance(v, str) else None


@dataclass
class Candidate:
    """A recorded op that a live call may take: its inputs read once (by the prefetch
    thread, or on demand) with the matching key of every argument, so the main thread
    makes no h5py call for it."""

    record: OpRecord
    index: int = 0
    used: bool = False
    _inputs: dict[str, ValueRecord] | None = None
    _keys: dict[str, Any] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def inputs(self) -> dict[str, ValueRecord]:
        if self._inputs is None:
            with self.lock:
                if self._inputs is None:
                    rec = self.record
                    self.set_inputs(rec.inputs() if getattr(rec.file, "is_table", False)
                                    else read_group(rec.file, f"{rec.path}/{S.INPUT_GROUP}"))
        return self._inputs

    def set_inputs(self, inputs: dict[str, ValueRecord]) -> None:
        """The recorded inputs (read_group's or read_catalog's records) and their keys."""
        keys = {}
        for name, value in inputs.items():
            try:
                keys[name] = recorded_key(value)
            except Exception:  # noqa: BLE001 - key() computes it again and reports
                pass
        self._keys = keys
        self._inputs = inputs

    def key(self, name: str) -> Any:
        if self._keys is None:
            self._keys = {}
        if name not in self._keys:
            self._keys[name] = recorded_key(self.inputs[name])
        return self._keys[name]


def find_input(inputs: dict[str, ValueRecord], name: str, renames: dict[str, tuple[str, ...]]) -> ValueRecord | None:
    rec = inputs.get(name)
    if rec is None:
        for alt in renames.get(name, ()):
            rec = inputs.get(alt)
            if rec is not None:
                break
    return rec


def mismatch(entry: Candidate, live: dict[str, Any], renames: dict, tensors_only: bool = False) -> str:
    """'' when every argument present on both sides agrees, else the first difference.
    `tensors_only`: only tensor arguments (shape and dtype family) must agree."""
    inputs = entry.inputs
    for name, value in live.items():
        rname = name if name in inputs else next((a for a in renames.get(name, ()) if a in inputs), None)
        if rname is None:
            continue
        lk = live_key(value)
        if lk is None:
            continue
        if tensors_only and lk[0] != "T":
            continue
        rk = entry.key(rname)
        if rk is None or lk == rk:
            continue
        if lk[0] == "D" and rk[0] == "D" and _describes_live_tensors(lk[1], live) \
                and _family(lk[1]) == _family(rk[1]):
            continue     # e.g. softmax_backward's input_dtype: follows the (cast) inputs
        if lk[0] == "T" and rk[0] == "T":
            if lk[1] != rk[1]:
                return f"input '{name}' shape {list(lk[1])} vs recorded {list(rk[1])}"
            return f"input '{name}' is {lk[2]} vs recorded {rk[2]}"
        return f"argument '{name}' differs from the recording"
    return ""


def _describes_live_tensors(dtype_name: str, live: dict[str, Any]) -> bool:
    """A dtype argument equal to a live tensor input's dtype describes the inputs (which
    replay casts) rather than asking for a conversion (as _to_copy's dtype does)."""
    flat, _ = tree_flatten(list(live.values()))
    return any(isinstance(t, torch.Tensor) and str(t.dtype) == f"torch.{dtype_name}" for t in flat)


def op_packet(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[:2]) if len(parts) >= 3 else name
