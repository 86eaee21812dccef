"""AclDumpPolicy: the `load_with_acl_dump=True` part of the dumper.

    with torch.utils.dumper(use_load=True, dump_path="./", load_file_path="./output.h5",
                            load_with_acl_dump=True):
        one model step

The dumper's ReplayPolicy substitutes recorded inputs into each live op that matches
an op of output.h5 (it sets ev.notes["replay_matched"]). This policy runs exactly
those ops through the kernel recorder (ir2tbe.kernels), writes one CANN-layout dump
per kernel as acl.json says, and hands the native result back to the model, so the
step computes what it would without the tool. Unmatched ops run untouched.

acl.json is read from the working directory unless `acl_config=` names it; the
environment variable ACL_DUMP_DATA=1 is refused at block entry, as in the original.

On an Ascend NPU with torch_npu, the real ACL dump (torch_npu's init_dump/set_dump,
driven by the same acl.json) is switched on around each matched op in addition;
that path is written to torch_npu's documented API but untested here (no NPU).
"""

from __future__ import annotations

import os
from typing import Any

from npu_dumper.errors import DumperError
from npu_dumper.capture.policy import OpEvent, Policy, register_policy

from .acl_config import AclConfig, AclConfigError, check_acl_dump_env, load_acl_config


class AclDumpError(DumperError):
    """load_with_acl_dump cannot start (acl.json, ACL_DUMP_DATA)."""


def _first_device(ev: OpEvent):
    import torch
    from torch.utils._pytree import tree_flatten

    for x in tree_flatten((ev.args, ev.kwargs))[0]:
        if isinstance(x, torch.Tensor):
            return x.device
    return torch.device("cpu")


class _NpuAclDump:
    """torch_npu's own ACL dump around one op. Untested: no NPU in this project's CI."""

    def __init__(self, config_path: str):
        import torch_npu  # noqa: F401  (import guard: only constructed when it imports)
        self.npu = torch_npu.npu
        self.config_path = config_path
        self.started = False

    def __enter__(self):
        if hasattr(self.npu, "init_dump") and not self.started:
            self.npu.init_dump()
            self.npu.set_dump(self.config_path)
            self.started = True
        return self

    def __exit__(self, *exc):
        return False

    def finalize(self) -> None:
        if self.started and hasattr(self.npu, "finalize_dump"):
            self.npu.finalize_dump()
            self.started = False


class AclDumpPolicy(Policy):
    def __init__(self, acl_config: str | os.PathLike | AclConfig | None = None, dump_path: str | None = None,
                 *, verbose: bool = True):
        self.acl_config = acl_config
        self.dump_path = dump_path
        self.verbose = verbose
        self.config: AclConfig | None = None
        self.writer = None
        self.mapped_ops = 0
        self.failures: list[str] = []
        self._npu: _NpuAclDump | None = None
        self._npu_tried = False

    # ---- block entry/exit -------------------------------------------------------
    def begin(self, session: Any) -> None:
        try:
            check_acl_dump_env()
            if isinstance(self.acl_config, AclConfig):
                self.config = self.acl_config
            else:
                self.config = load_acl_config(self.acl_config)
        except AclConfigError as e:
            raise AclDumpError(str(e)) from None
        from .acl_dump import KernelDumpWriter
        self.writer = KernelDumpWriter(self.config, dump_path=self.dump_path)

    def end(self, session: Any) -> None:
        if self._npu is not None:
            self._npu.finalize()
        if self.verbose and self.writer is not None:
            n = len(self.writer.written)
            msg = (f"ir2tbe: {self.mapped_ops} replayed op(s) mapped to kernels; {n} kernel dump file(s) "
                   f"under {self.writer.root}")
            if n:
                msg += f"; mapping table {self.writer.map_path}"
            elif not self.config.enabled:
                msg += f' (dump_op_switch is "off" in {self.config.source or "acl.json"})'
            print(msg, flush=True)
            for f in self.failures:
                print(f"ir2tbe: {f}", flush=True)

    # ---- per op ---------------------------------------------------------------
    def run_op(self, ev: OpEvent) -> Any:
        if not ev.notes.get("replay_matched") or self.writer is None:
            return NotImplemented
        from .kernels import lower_to_kernels

        device = _first_device(ev)
        if device.type == "npu":
            self._maybe_npu_dump()
        mapping = lower_to_kernels(ev.func, ev.args, ev.kwargs)
        self.mapped_ops += 1
        self.writer.device_id = device.index or 0
        self.writer.write(mapping, ev.store_seqid, device=str(device))
        ev.notes["acl_kernels"] = len(mapping.kernels)
        return mapping.native_outputs

    def _maybe_npu_dump(self) -> None:
        if self._npu_tried:
            return
        self._npu_tried = True
        try:
            self._npu = _NpuAclDump(self.config.source or "acl.json")
            self._npu.__enter__()
        except Exception as e:  # torch_npu missing or its dump API changed: keep our own kernel dump
            self.failures.append(f"torch_npu ACL dump not started: {type(e).__name__}: {e}")
            self._npu = None


# torch.utils.dumper(load_with_acl_dump=True, acl_config=...) adds this policy
register_policy("load_with_acl_dump", lambda session: AclDumpPolicy(acl_config=session.acl_config))
