"""Write a KernelMapping as CANN-layout kernel dump files plus the mapping table.

    {dump_path}/{time}/{deviceid}/{model_id}/{data_index}/{op_type}.{op_name}.{taskid}.{stream_id}.{timestamp}
    {dump_path}/{time}/ir2tbe_map.csv

time: YYYYmmddHHMMSS when the session started; deviceid: the device index (0 on
CPU); model_id: the IR op's seqid (each replayed IR op is its own single-op
"model", as in ACL's single-op mode); data_index: 0 (one step). op_type is the
kernel's op ("prims_mul_default"), op_name "{IR op}_{seqid}_{kernel order}";
`.`, `/`, `\\` and spaces become `_` as in CANN.

Outputs follow dumpfile.safe_output: the session folder {time} is always a new folder
(a second session in the same second gets {time}_1, and a folder or link already there
is never written into); each kernel dump is created exclusively (O_EXCL, never through a
link); the mapping table is appended with O_NOFOLLOW.
"""

from __future__ import annotations

import csv
import fnmatch
import os
import re
import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from dumpfile.errors import DumpWriteError
from dumpfile.safe_output import new_dir, open_append_nofollow, output_dir

from npu_dumper.capture.tensors import numpy_view

from .acl_config import AclConfig
from .dump_data import FORMAT_NCHW, FORMAT_ND, TensorToWrite, write_kernel_dump
from .kernels import KernelMapping, KernelRecord

MAP_FILE_NAME = "ir2tbe_map.csv"
MAP_COLUMNS = (
    "ir_op", "seqid", "kernel_order", "kernel_op_type", "kernel_op", "depth", "decomposed_from",
    "file", "input_shapes", "input_dtypes", "output_shapes", "output_dtypes", "device",
    "native_kernels", "decomposed_vs_native_max_abs_diff", "notes",
)
_UNSAFE_NAME_CHARS = re.compile(r"[./\\ ]")

# dtypes numpy has no type for: stored as raw bits of this width, named for the reader
_RAW_BITS = {torch.bfloat16: (torch.int16, np.uint16, "bfloat16")}
for _name, _cann in (("float8_e5m2", "float8_e5m2"), ("float8_e4m3fn", "float8_e4m3fn")):
    if hasattr(torch, _name):
        _RAW_BITS[getattr(torch, _name)] = (torch.uint8, np.uint8, _cann)


def sanitize(name: str) -> str:
    """CANN's rule for op_type/op_name in file names."""
    return _UNSAFE_NAME_CHARS.sub("_", name)


def tensor_to_write(t: torch.Tensor) -> TensorToWrite:
    t = t.detach().to("cpu").contiguous()
    fmt = FORMAT_NCHW if t.dim() == 4 else FORMAT_ND
    if t.dtype in _RAW_BITS:
        view_dtype, np_dtype, name = _RAW_BITS[t.dtype]
        return TensorToWrite(numpy_view(t.view(view_dtype)).view(np_dtype), name, fmt)
    if t.dtype == torch.complex32:          # no CANN code: widen exactly
        t = t.to(torch.complex64)
    elif t.dtype not in (torch.float32, torch.float16, torch.float64, torch.int8, torch.uint8,
                         torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64,
                         torch.complex128, torch.uint16, torch.uint32, torch.uint64):
        t = t.to(torch.float32)             # other exotic dtypes (float8 variants): exact in float32
    return TensorToWrite(numpy_view(t), "", fmt)   # (t may be the model's own tensor)


def _describe(tensors: list[torch.Tensor]) -> tuple[str, str]:
    shapes = ";".join("x".join(str(d) for d in t.shape) or "scalar" for t in tensors)
    dtypes = ";".join(str(t.dtype).replace("torch.", "") for t in tensors)
    return shapes, dtypes


def _names(op: str) -> list[str]:
    parts = op.split(".")
    names = [op, ".".join(parts[:2])] if len(parts) >= 2 else [op]
    if len(parts) >= 2:
        names.append(parts[1])
    return names


@dataclass
class WrittenKernel:
    ir_op: str
    seqid: int
    kernel: KernelRecord
    path: str


class KernelDumpWriter:
    """Writes kernel dumps for one session under `{dump_path}/{time}/`."""

    def __init__(self, config: AclConfig, *, device_id: int = 0, dump_path: str | None = None,
                 data_index: int = 0):
        self.config = config
        self.dump_path = dump_path or config.dump_path
        self.device_id = int(device_id)
        self.data_index = int(data_index)
        self.session_time = time.strftime("%Y%m%d%H%M%S")
        self.root = os.path.join(self.dump_path, self.session_time)   # made (maybe _N) at the first write
        self._root_made = False
        self.task_id = 0
        self._last_timestamp = 0
        self._map_started = False
        self._warned_off = False
        self.written: list[WrittenKernel] = []

    @property
    def map_path(self) -> str:
        return os.path.join(self.root, MAP_FILE_NAME)

    # ---- filtering ------------------------------------------------------------
    def _matches(self, names: list[str]) -> bool:
        return any(fnmatch.fnmatchcase(n, pat) or fnmatch.fnmatchcase(sanitize(n), pat)
                   for pat in self.config.dump_list for n in names)

    def selected_kernels(self, mapping: KernelMapping, seqid: int) -> list[KernelRecord]:
        if not self.config.dump_list:
            return list(mapping.kernels)
        ir_names = _names(mapping.ir_op) + [f"{mapping.ir_op}/{seqid}"]
        if self._matches(ir_names):
            return list(mapping.kernels)
        return [k for k in mapping.kernels if self._matches(_names(k.name))]

    # ---- writing -------------------------------------------------------------
    def _timestamp(self) -> int:
        now = time.time_ns() // 1000
        self._last_timestamp = max(now, self._last_timestamp + 1)
        return self._last_timestamp

    def write(self, mapping: KernelMapping, seqid: int, *, device: str = "cpu",
              stream_id: int = 0) -> list[WrittenKernel]:
        if not self.config.enabled:
            if not self._warned_off:
                warnings.warn(f"{self.config.source or 'acl.json'}: dump_op_switch is \"off\": "
                              "no kernel dumps are written", stacklevel=2)
                self._warned_off = True
            return []
        kernels = self.selected_kernels(mapping, seqid)
        if not kernels:
            return []
        if not self._root_made:
            self.root = new_dir(output_dir(self.dump_path), self.session_time)
            self._root_made = True
        folder = os.path.join(self.root, str(self.device_id), str(int(seqid)), str(self.data_index))
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            raise DumpWriteError(f"{folder}: cannot create kernel dump directory: {e.strerror or e}") from e
        written, rows = [], []
        for k in kernels:
            self.task_id += 1
            op_type = sanitize(k.name)
            op_name = sanitize(f"{mapping.ir_op}_{seqid}_{k.order}")
            stamp = self._timestamp()
            path = os.path.join(folder, f"{op_type}.{op_name}.{self.task_id}.{stream_id}.{stamp}")
            ins = [tensor_to_write(t) for t in k.inputs] if self.config.dump_inputs else []
            outs = [tensor_to_write(t) for t in k.outputs] if self.config.dump_outputs else []
            for o in outs:
                o.original_op = mapping.ir_op
            write_kernel_dump(path, k.name, ins, outs, dump_time=stamp)
            written.append(WrittenKernel(mapping.ir_op, int(seqid), k, path))
            in_shapes, in_dtypes = _describe(k.inputs)
            out_shapes, out_dtypes = _describe(k.outputs)
            diff = mapping.max_abs_diff
            rows.append({
                "ir_op": mapping.ir_op, "seqid": int(seqid), "kernel_order": k.order,
                "kernel_op_type": op_type, "kernel_op": k.name, "depth": k.depth,
                "decomposed_from": " > ".join(k.decomposed_from),
                "file": os.path.relpath(path, self.root), "input_shapes": in_shapes,
                "input_dtypes": in_dtypes, "output_shapes": out_shapes, "output_dtypes": out_dtypes,
                "device": device, "native_kernels": ";".join(mapping.device_kernels),
                "decomposed_vs_native_max_abs_diff": "" if diff is None else repr(diff),
                "notes": " | ".join(mapping.notes),
            })
        self._append_rows(rows)
        self.written.extend(written)
        return written

    def _append_rows(self, rows: list[dict]) -> None:
        try:
            with open_append_nofollow(self.map_path) as f:
                w = csv.DictWriter(f, fieldnames=MAP_COLUMNS)
                if not self._map_started and f.tell() == 0:
                    w.writeheader()
                self._map_started = True
                w.writerows(rows)
        except OSError as e:
            raise DumpWriteError(f"{self.map_path}: cannot write mapping table: {e.strerror or e}") from e


def read_map(path: str | os.PathLike) -> list[dict[str, str]]:
    """Rows of an ir2tbe_map.csv (file paths are relative to the csv's folder)."""
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))
