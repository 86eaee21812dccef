"""Replay every op of an (extracted) dump from its recorded inputs through the kernel recorder.

This is `ir2tbe run output.h5 --acl-config acl.json`: the IR-to-TBE mapping with no
model at all. Inputs are rebuilt by npu_dumper.replay.recorded.load_call (shared with
load-replay and golden replay); ops it cannot rebuild are listed with the reason.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass, field

import torch

from dumpfile.read.reader import DumpFile
from npu_dumper.replay.recorded import load_call

from .acl_config import AclConfig, check_acl_dump_env
from .acl_dump import KernelDumpWriter, WrittenKernel
from .kernels import KernelMapping, lower_to_kernels


@dataclass
class OpRun:
    op: str
    seqid: int
    mapping: KernelMapping | None = None
    written: list[WrittenKernel] = field(default_factory=list)
    why_not: str | None = None


@dataclass
class RunResult:
    dump_root: str
    map_path: str
    ops: list[OpRun] = field(default_factory=list)

    @property
    def mapped(self) -> list[OpRun]:
        return [o for o in self.ops if o.mapping is not None]

    @property
    def skipped(self) -> list[OpRun]:
        return [o for o in self.ops if o.mapping is None]

    def summary(self) -> str:
        n_files = sum(len(o.written) for o in self.ops)
        lines = [f"mapped {len(self.mapped)} op(s) to {sum(len(o.mapping.kernels) for o in self.mapped)} "
                 f"kernel(s); wrote {n_files} kernel dump file(s) under {self.dump_root}"]
        if n_files:
            lines.append(f"mapping table: {self.map_path}")
        for o in self.skipped:
            lines.append(f"skipped {o.op} {o.seqid}: {o.why_not}")
        return "\n".join(lines)


def op_matches(name: str, patterns: list[str]) -> bool:
    """'aten.gelu.default' is named by itself, 'aten.gelu', 'gelu' or a glob ('*gelu*')."""
    parts = name.split(".")
    short = parts[1] if len(parts) > 1 else name
    # "layer_norm" names aten.native_layer_norm, "softmax" aten._softmax
    bare = short.lstrip("_").removeprefix("native_")
    names = {name, ".".join(parts[:2]), short, bare}
    return any(fnmatch.fnmatchcase(n, p) for p in patterns for n in names)


def device_index(device: str | torch.device) -> int:
    d = torch.device(device)
    return d.index or 0


def run_dump_file(h5_path: str | os.PathLike, config: AclConfig, *, device: str = "cpu",
                  dump_path: str | None = None, ops: list[str] | None = None) -> RunResult:
    """Map each op of `h5_path` (optionally only those named in `ops`) to kernels, writing dumps."""
    check_acl_dump_env()
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        from .acl_config import AclConfigError
        raise AclConfigError(f"{h5_path}: --device {device}: CUDA is not available on this machine")
    with DumpFile(h5_path) as df:
        df.require_inputs()
    writer = KernelDumpWriter(config, device_id=device_index(dev), dump_path=dump_path)
    result = RunResult(writer.root, writer.map_path)
    with DumpFile(h5_path) as df:
        for rec in df.ops():
            if ops and not op_matches(rec.op, ops):
                continue
            run = OpRun(rec.op, rec.seqid)
            result.ops.append(run)
            call = load_call(rec, device=dev, allow_random=True)
            if not call.ok:
                run.why_not = call.why_not
                continue
            try:
                run.mapping = lower_to_kernels(call.func, call.args, call.kwargs)
            except Exception as e:  # an op this device cannot run: say so, map the others
                run.why_not = f"failed to run on {device}: {type(e).__name__}: {' '.join(str(e).split())}"
                continue
            run.written = writer.write(run.mapping, rec.seqid, device=str(dev))
    result.dump_root, result.map_path = writer.root, writer.map_path   # the session folder as made
    return result
