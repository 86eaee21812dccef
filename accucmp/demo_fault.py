"""Where `accucmp demo` plants its fault: the --fault value read, or a site chosen from the
golden dump itself (a non-cube forward op inside a module, about halfway through the
forward pass), so it works on any model without a list of op names.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass

from dumpfile.errors import DumpError


DEFAULT_REL = 0.05


FAULT_AUTO = "auto"


FAULT_NONE = "none"


class DemoError(DumpError):
    """The demo could not run (unknown model, bad --fault, unusable output directory)."""


@dataclass(frozen=True)
class FaultSite:
    """Where a planted fault goes: the `call`-th call of `op` (golden seqid `seqid`)."""
    op: str
    call: int | None
    rel: float = DEFAULT_REL
    seqid: int | None = None     # the golden dump's seqid of that call, when known

    def describe(self) -> str:
        which = f"call {self.call} of " if self.call else "every call of "
        at = f" (seqid {self.seqid})" if self.seqid else ""
        return f"{which}{self.op}{at}, {self.rel:g} relative"


def _floating(rec) -> bool:
    from dumpfile import schema as S
    return rec.is_tensor and rec.dtype in S.FLOATING_DTYPES and rec.numel > 0 and not rec.uninitialized


def _leaves(values: dict) -> list:
    out = []
    for rec in values.values():
        out.extend(_leaves({c.name: c for c in rec.children}) if rec.is_list else [rec])
    return out


def pick_fault_site(golden_path: str | os.PathLike, rel: float = DEFAULT_REL) -> FaultSite:
    """A non-cube forward op inside the model, about halfway through the forward pass.

    Chosen from the dump, not from a list of names, so it works on any model: the op
    must run inside a module, read and write floating tensors, not write its inputs,
    and not be a cube op (those are the emulation's float16 ops) nor a random one.
    """
    from dumpfile.read.reader import DumpFile
    from npu_dumper.replay.emulation import is_cube_op
    from npu_dumper.replay.op_names import is_random, resolve_op

    calls: Counter = Counter()
    candidates: list[FaultSite] = []
    with DumpFile(golden_path) as df:
        for rec in df.ops():
            calls[rec.op] += 1
            if rec.phase != "forward" or not rec.module:
                continue
            try:
                func = resolve_op(rec.op)
            except Exception:  # noqa: BLE001 - an op this torch lacks is no candidate
                func = None
            if func is None or is_cube_op(func) or is_random(func) or _writes_args(func):
                continue
            if any(map(_floating, _leaves(rec.inputs()))) and any(map(_floating, _leaves(rec.outputs()))):
                candidates.append(FaultSite(rec.op, calls[rec.op], rel, rec.seqid))
    if not candidates:
        raise DemoError(f"{golden_path}: no non-cube forward op inside a module to plant a fault in; "
                        "name one with --fault OP[:REL[:CALL]]")
    return candidates[len(candidates) // 2]


def _writes_args(func) -> bool:
    schema = getattr(func, "_schema", None)
    return bool(schema) and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def resolve_fault(fault: str | None, golden_path: str | os.PathLike) -> FaultSite | None:
    """--fault value -> FaultSite: 'auto', 'none', or OP[:REL[:CALL]]."""
    from npu_dumper.replay.emulation import parse_fault

    if fault is None or fault.strip().lower() in (FAULT_NONE, "", "off", "no"):
        return None
    if fault.strip().lower() == FAULT_AUTO:
        return pick_fault_site(golden_path)
    spec = parse_fault(fault.strip())
    return FaultSite(spec["op"], spec.get("call"), spec.get("rel", DEFAULT_REL),
                     _golden_seqid(golden_path, spec["op"], spec.get("call")))


def _golden_seqid(golden_path, op: str, call: int | None) -> int | None:
    if call is None:
        return None
    from dumpfile.read.reader import DumpFile

    with DumpFile(golden_path) as df:
        seqids = [r.seqid for r in df.ops() if r.op == op]
    return seqids[call - 1] if len(seqids) >= call else None
