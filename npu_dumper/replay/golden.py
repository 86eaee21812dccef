"""Golden replay: recompute every recorded op on its own, from its recorded inputs, in float64.

    result = npu_dumper.golden_replay("npu.h5", "golden.h5")          # or: accucmp golden -i ... -o ...
    # then: accucmp compare -m npu.h5 -g golden.h5

Each op sees exactly the inputs it saw on the device, so the comparison shows each op's
own error against the (nearly) exact answer, never error inherited from earlier ops,
and no second device is needed. Floating tensors (and floating dtype arguments, so a
cast to bfloat16 becomes the exact value) are upcast; integer and bool data stay.

Outputs are written under the same /{op}/{seqid} with the recorded output names and the
group attributes phase/module/grad_fn/stack. Ops that cannot be replayed are listed with
their reason in the result and in the file (/_npu_dumper/not_replayed, see
dumpfile.golden_info), never silently dropped.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from dumpfile import schema as S
from dumpfile import golden_info
from dumpfile.bookkeeping import is_bookkeeping
from dumpfile.errors import DumpError
from dumpfile.read.reader import DumpFile, OpRecord, ValueRecord
from dumpfile.write.writer import DumpWriter, TensorMeta

from ..capture.opschema import COLLECTIVE_NAMESPACES, COLLECTIVE_REASON, op_info
from ..errors import DumperError
from .recorded import load_call, tensor_to_storage

# Group attributes carried over from the recorded op (the rest describe the recording).
_CARRIED_ATTRS = (S.OP_PHASE, S.OP_MODULE, S.OP_GRAD_FN, S.OP_STACK)
_PROGRESS_MIN_OPS = 200


@dataclass
class GoldenResult:
    source: str
    path: str
    compute_dtype: str
    total: int = 0
    replayed: int = 0
    not_replayed: list[tuple[str, int, str]] = field(default_factory=list)  # (op, seqid, reason)

    @property
    def skipped(self) -> int:
        return len(self.not_replayed)

    def summary(self, limit: int = 5) -> str:
        line = (f"golden replay: {self.replayed}/{self.total} ops recomputed in {self.compute_dtype}"
                f" -> {self.path}")
        if self.not_replayed:
            reasons: dict[str, list[str]] = {}
            for op, seqid, why in self.not_replayed:
                reasons.setdefault(why, []).append(f"{op}/{seqid}")
            parts = [f"{len(v)} x {why} (e.g. {', '.join(v[:2])})"
                     for why, v in list(reasons.items())[:limit]]
            line += f"; {self.skipped} not replayed: " + "; ".join(parts)
        return line


def replay(dump_h5: str | os.PathLike, out_h5: str | os.PathLike, device: str = "cpu",
           dtype: torch.dtype | str = torch.float64, *, remap_devices: bool = False,
           dump_inputs: bool = True, progress: bool | None = None) -> GoldenResult:
    """Recompute every op of `dump_h5` into `out_h5` (mode "golden").

    device/dtype: where and in which floating dtype ops are recomputed.
    remap_devices: run ops whose arguments name a device on `device` instead of listing them.
    dump_inputs: also write the (upcast) inputs, so compare rows for inputs have a partner
      (default; False halves the file).
    progress: rich progress bar on stderr; default: when there are >= 200 ops.
    """
    dtype = _as_dtype(dtype)
    src, dst = os.fspath(dump_h5), os.fspath(out_h5)
    if os.path.abspath(src) == os.path.abspath(dst):
        raise DumperError(f"{dst}: golden output would overwrite the dump it replays")
    _check_device(device, src)
    dtype_name = str(dtype).replace("torch.", "")
    result = GoldenResult(source=src, path=dst, compute_dtype=dtype_name)
    with DumpFile(src) as dump:
        if dump.stats_only:
            raise DumperError(f"{src}: statistics-only dump holds no tensor values to replay")
        try:
            dump.require_inputs()
        except DumpError as e:
            raise DumperError(str(e)) from None
        ops = dump.ops()
        result.total = len(ops)
        root = {S.ROOT_LOAD_FILE: os.path.abspath(src), S.ROOT_COMPUTE_DTYPE: dtype_name,
                S.ROOT_DEVICE: str(device), S.ROOT_TORCH_VERSION: str(torch.__version__)}
        for key in (S.ROOT_RANK, S.ROOT_WORLD_SIZE, S.ROOT_STEP, S.ROOT_PARALLEL_LAYOUT):
            if key in dump.attrs:
                root[key] = dump.attrs[key]
        show = progress if progress is not None else len(ops) >= _PROGRESS_MIN_OPS
        with DumpWriter(dst, mode=S.MODE_GOLDEN, root_attrs=root) as writer, \
                _Progress(show, len(ops), os.path.basename(src)) as bar:
            for rec in ops:
                if is_bookkeeping(rec.op):    # a profiler label an older dump recorded: no numerics
                    bar.advance()
                    continue
                why = _replay_one(rec, writer, device, dtype, remap_devices, dump_inputs)
                if why is None:
                    result.replayed += 1
                else:
                    result.not_replayed.append((rec.op, rec.seqid, why))
                bar.advance()
            golden_info.write_not_replayed(writer.file, result.not_replayed)
    return result


def _check_device(device: str, src: str) -> None:
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError, ValueError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DumperError(f"{src}: cannot replay on device {device!r}: {msg}") from None


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).replace("torch.", ""), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise DumperError(f"--dtype {dtype}: not a floating torch dtype (e.g. float64)")
    return value


def _replay_one(rec: OpRecord, writer: DumpWriter, device, dtype: torch.dtype,
                remap_devices: bool, dump_inputs: bool) -> str | None:
    if rec.op.split(".", 1)[0] in COLLECTIVE_NAMESPACES:
        # (needs the process group and the other ranks' data; a rank's other ops, DTensor
        # ones included, are recomputed from its own recorded local shards)
        return COLLECTIVE_REASON
    call = load_call(rec, device=device, dtype=dtype, retarget_dtype_args=True,
                     remap_devices=remap_devices)
    if not call.ok:
        return call.why_not
    recorded_outputs = rec.outputs()
    inputs = call.arg_names
    if dump_inputs and op_info(call.func).written:
        # in-place / out= arguments and hidden writes (training-mode batch norm's
        # running_mean/var, which the schema does not mark) are overwritten by the call:
        # keep the inputs as they were. Every tensor input, not only the written ones: a
        # recorded view of a written tensor shares its storage and would change too.
        inputs = {n: _snapshot(v) for n, v in inputs.items()}
    try:
        with torch.no_grad():
            out = call.call()
    except Exception as e:  # an op that cannot run in this dtype/device is listed, not fatal
        return f"failed to run in {str(dtype).replace('torch.', '')} on {device}: " \
               f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    # Every tensor converted before the op's group is begun: one that cannot be stored
    # lists the op with the reason instead of aborting the replay with a half-written group.
    values = _output_values(out)
    stored: dict[int, tuple[Any, str]] = {}
    try:
        for t in tree_flatten((list(inputs.values()) if dump_inputs else [], values))[0]:
            if isinstance(t, torch.Tensor) and id(t) not in stored:
                stored[id(t)] = tensor_to_storage(t)
    except Exception as e:  # noqa: BLE001 - listed with its reason, as a failed run is
        return f"result cannot be stored: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    attrs = {k: rec.attrs[k] for k in _CARRIED_ATTRS if k in rec.attrs}
    attrs[S.OP_COMPUTE_DTYPE] = str(dtype).replace("torch.", "")
    writer.begin_op(rec.op, rec.seqid, phase=attrs.pop(S.OP_PHASE, S.PHASE_FORWARD) or S.PHASE_FORWARD,
                    module=attrs.pop(S.OP_MODULE, ""), grad_fn=attrs.pop(S.OP_GRAD_FN, ""),
                    attrs=attrs)
    ins, outs = writer.io_groups()
    if dump_inputs:
        names = []
        for name, value in inputs.items():
            _write_value(writer, ins, name, value, device, stored)
            names.append(name)
        writer.set_order(ins, names)
    names = _output_names(call.func, recorded_outputs, out)
    for name, value in zip(names, values):
        _write_value(writer, outs, name, value, device, stored)
    writer.set_order(outs, names[:len(values)])
    writer.end_op()
    return None


def _snapshot(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.clone()
    if isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v):
        return type(v)(x.clone() if isinstance(x, torch.Tensor) else x for x in v)
    return v


def _output_values(out: Any) -> list[Any]:
    return list(out) if isinstance(out, tuple) else [out]


def _output_names(func, recorded: dict[str, ValueRecord], out: Any) -> list[str]:
    """The recorded output names when the recording has them (so compare pairs rows),
    else schema return names, else result / result0, result1, ..."""
    n = len(_output_values(out))
    if len(recorded) == n:
        return list(recorded)
    names = [r.name for r in func._schema.returns]
    if len(names) == n and all(names) and len(set(names)) == n:
        return names
    return ["result"] if n == 1 else [f"result{i}" for i in range(n)]


def _write_value(writer: DumpWriter, parent, name: str, value: Any, device,
                 stored: dict[int, tuple[Any, str]] | None = None) -> None:
    if isinstance(value, torch.Tensor):
        data, dtype_name = (stored or {}).get(id(value)) or tensor_to_storage(value)
        strided = value.layout == torch.strided      # sparse results are stored dense, no strides
        meta = TensorMeta(dtype=dtype_name, shape=tuple(value.shape),
                          stride=tuple(value.stride()) if strided else (),
                          storage_offset=int(value.storage_offset()) if strided else 0, device=str(value.device))
        writer.write_tensor(parent, name, data, meta)
    elif isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        g = writer.create_list(parent, name, S.TYPE_TENSOR_LIST, len(value))
        for i, v in enumerate(value):
            _write_value(writer, g, f"{name}_{i}", v, device, stored)
    elif isinstance(value, torch.dtype):
        writer.write_named(parent, name, str(value).replace("torch.", ""), S.TYPE_SCALAR_TYPE)
    elif isinstance(value, torch.device):
        writer.write_named(parent, name, str(value), S.TYPE_DEVICE)
    elif isinstance(value, torch.layout):
        writer.write_named(parent, name, str(value).replace("torch.", ""), S.TYPE_LAYOUT)
    elif isinstance(value, torch.memory_format):
        writer.write_named(parent, name, str(value).replace("torch.", ""), S.TYPE_MEMORY_FORMAT)
    else:
        flat, _ = tree_flatten(value)
        if any(isinstance(v, torch.Tensor) for v in flat):
            return  # nested structures of tensors are not part of the format
        try:
            writer.write_value(parent, name, value)
        except TypeError:
            # an object the format has no type for (a ScriptObject such as the handle
            # profiler._record_function_enter_new returns): its type name, as the dumper does
            writer.write_value(parent, name, f"<{type(value).__name__}>")


class _Progress:
    """A rich progress bar on stderr, or nothing."""

    def __init__(self, show: bool, total: int, label: str):
        self._bar = None
        if show:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn
            self._bar = Progress("golden replay", BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                 console=Console(file=sys.stderr), transient=True)
            self._task = self._bar.add_task(label, total=total)

    def __enter__(self):
        if self._bar is not None:
            self._bar.start()
        return self

    def advance(self) -> None:
        if self._bar is not None:
            self._bar.advance(self._task)

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.stop()


__all__ = ["replay", "GoldenResult", "DumpError"]
