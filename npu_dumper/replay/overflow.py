"""Overflow check: record only the ops that create inf/nan (or leave a half dtype's range).

    with torch.utils.dumper(check_overflow=True, dump_path="overflow.h5",
                            overflow_dtype=torch.float16):
        loss = model(x).sum(); loss.backward()

An op overflows when a floating output holds inf or nan while none of its floating
inputs did (so an overflow is reported where it starts, not at every op it reaches).
With `overflow_dtype` (float16 / bfloat16), finite output values that would round to
inf in that dtype count too, and inputs beyond its range count as "already
overflowed": run in fp32 to predict which ops overflow once the model moves to half
precision. On an Ascend NPU with torch_npu, the device float-status flag is read as
well when the API is present (the original tool's only criterion).

Each overflow prints `IR: {op} SeqId: {n} is overflow!` plus the module path and is
dumped (inputs as before the op, outputs) under its seqid in the full op stream, so
seqids in the file are sparse. `limit` stops checking after N overflows;
`raise_on_overflow` raises OverflowDetected (a DumperError) at the first one, after
it has been recorded.
"""

from __future__ import annotations

import cmath
import sys
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten

from dumpfile import schema as S

from ..errors import DumperError
from ..capture.opschema import named_args, op_info
from ..capture.policy import OpEvent, Policy

_HALF_DTYPES = (torch.float16, torch.bfloat16)


class OverflowDetected(DumperError):
    """Raised at the first overflowing op when the dumper was asked to (overflow_raise=True)."""

    def __init__(self, message: str, op: str = "", seqid: int = 0, module: str = ""):
        super().__init__(message)
        self.op, self.seqid, self.module = op, seqid, module


def _floating_tensors(value: Any) -> list[torch.Tensor]:
    flat, _ = tree_flatten(value)
    return [t for t in flat if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]


def _npu_float_status() -> tuple[Callable[[], None], Callable[[], bool]] | None:
    """(clear, read) of the NPU's float-status flag when torch_npu offers it, else None."""
    try:
        import torch_npu  # noqa: F401
    except Exception:  # noqa: BLE001 - no NPU stack: the scan alone decides
        return None
    utils = getattr(getattr(torch, "npu", None), "utils", None)
    clear = getattr(utils, "clear_npu_overflow_flag", None)
    read = getattr(utils, "get_npu_overflow_flag", None) or getattr(utils, "npu_check_overflow", None)
    if clear is None or read is None:
        return None
    return clear, lambda: bool(read())


class OverflowPolicy(Policy):
    """Records only overflowing ops (see module doc)."""

    def __init__(self, overflow_dtype: torch.dtype | str | None = None, limit: int | None = None,
                 raise_on_first: bool = False, *, dtype: torch.dtype | str | None = None,
                 raise_on_overflow: bool | None = None, verbose: bool = True):
        dtype = overflow_dtype if overflow_dtype is not None else dtype
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype.replace("torch.", ""), None)
        if dtype is not None and dtype not in _HALF_DTYPES and not (
                isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise DumperError(f"overflow_dtype must be a floating dtype such as torch.float16, got {dtype!r}")
        if limit is not None and int(limit) < 1:
            raise DumperError(f"overflow_limit must be >= 1, got {limit!r}")
        self.overflow_dtype: torch.dtype | None = dtype
        self.limit = int(limit) if limit is not None else None
        self.raise_on_first = bool(raise_on_overflow if raise_on_overflow is not None else raise_on_first)
        self.verbose = verbose
        self.overflows: list[tuple[str, int, str, str]] = []   # (op, seqid, module, why)
        self.ops_checked = 0
        self._max = torch.finfo(dtype).max if dtype is not None else None
        self._npu = None
        self._stopped = False

    @property
    def summary(self) -> str:
        line = f"overflow check: {len(self.overflows)} overflowing op(s) in {self.ops_checked} checked"
        if self._stopped:
            line += f" (stopped after {self.limit})"
        if self.overflows:
            line += ": " + ", ".join(f"{op} SeqId {n}" for op, n, _, _ in self.overflows[:5])
            if len(self.overflows) > 5:
                line += f", +{len(self.overflows) - 5} more"
        return line

    def begin(self, session: Any = None) -> None:
        self._npu = _npu_float_status()

    # ---- per op ----------------------------------------------------------------------
    def before_op(self, ev: OpEvent) -> None:
        if self._stopped:
            return
        # inputs the op may overwrite must be judged now; the others after the op (cheaper:
        # only when an output overflowed)
        written = _written_values(ev)
        if written:
            ev.notes["overflow_written_bad"] = any(self._bad(t) for t in _floating_tensors(written))
        if self._npu is not None:
            self._npu[0]()

    def should_record(self, ev: OpEvent) -> bool:
        if self._stopped:
            return False
        self.ops_checked += 1
        why = self._output_overflow(_checked_outputs(ev))
        if why is None and self._npu is not None and self._npu[1]():
            why = "device float-status flag"
        if why is None:
            return False
        unwritten = _unwritten_values(ev)
        if ev.notes.get("overflow_written_bad") or _nonfinite_scalar(unwritten) or any(
                self._bad(t) for t in _floating_tensors(unwritten)):
            # inherited: an input was already non-finite, or the caller asked for an
            # infinity (masked_fill(mask, -inf), torch.full(..., -inf): attention masks)
            return False
        ev.group_attrs[S.OP_OVERFLOW] = why
        ev.notes["overflow"] = why
        return True

    def after_op(self, ev: OpEvent, recorded: bool) -> None:
        why = ev.notes.get("overflow")
        if why is None:
            return
        self.overflows.append((ev.name, ev.seqid, ev.module, why))
        if self.verbose:
            where = f" (module: {ev.module})" if ev.module else ""
            print(f"IR: {ev.name} SeqId: {ev.seqid} is overflow!{where} [{why}]", flush=True)
        if self.raise_on_first:
            raise OverflowDetected(f"IR: {ev.name} SeqId: {ev.seqid} is overflow! ({why})",
                                   ev.name, ev.seqid, ev.module)
        if self.limit is not None and len(self.overflows) >= self.limit:
            self._stopped = True
            if self.verbose:
                print(f"overflow check: stopped after {self.limit} overflow(s)", file=sys.stderr, flush=True)

    def end(self, session: Any = None) -> None:
        if self.verbose and not self.overflows:
            print(self.summary, flush=True)

    # ---- tests on values ---------------------------------------------------------------
    def _bad(self, t: torch.Tensor) -> bool:
        """Non-finite, or (with overflow_dtype) beyond that dtype's range."""
        if not bool(torch.isfinite(t).all()):
            return True
        return self._beyond(t)

    def _beyond(self, t: torch.Tensor) -> bool:
        if self._max is None or t.dtype.itemsize <= self.overflow_dtype.itemsize and \
                torch.finfo(t.dtype).max <= self._max:
            return False
        # the largest magnitude rounds to inf in the target dtype exactly when some value does
        peak = t.detach().abs().amax()
        return bool(torch.isinf(peak.to(self.overflow_dtype)))

    def _output_overflow(self, outputs: Any) -> str | None:
        for t in _floating_tensors(outputs):
            finite = torch.isfinite(t)
            if not bool(finite.all()):
                n_nan = int(torch.isnan(t).sum())
                n_inf = int(t.numel() - int(finite.sum()) - n_nan)
                return f"output holds {n_inf} inf, {n_nan} nan"
            if self._beyond(t):
                name = str(self.overflow_dtype).replace("torch.", "")
                return f"output exceeds the {name} range (|x| up to {float(t.detach().abs().amax()):.4g})"
        return None


# op (overload packet) -> its outputs that hold log(0) = -inf by design: CTC's log-space
# alpha table (unreachable states)
_LOG_SPACE_OUTPUTS = {torch.ops.aten._ctc_loss: (1,)}


def _checked_outputs(ev: OpEvent) -> Any:
    """The op's outputs, less those whose -inf is by design (their nan/+inf still count) and
    those that hold uninitialised memory: an empty-like op's result (dropout's buffer before
    `bernoulli_` fills it) or an opaque workspace is whatever the allocator left there, and a
    NaN in it is no overflow (the dump marks them `uninitialized`, compare skips them)."""
    info = op_info(ev.func)
    if info.uninitialized:
        return []
    if info.opaque_returns and isinstance(ev.outputs, (tuple, list)):
        return [t for i, t in enumerate(ev.outputs) if i not in info.opaque_returns]
    skip = _LOG_SPACE_OUTPUTS.get(getattr(ev.func, "overloadpacket", None))
    if not skip or not isinstance(ev.outputs, (tuple, list)):
        return ev.outputs
    return [torch.where(torch.isneginf(t), 0.0, t) if i in skip and isinstance(t, torch.Tensor) else t
            for i, t in enumerate(ev.outputs)]


def _nonfinite_scalar(values: list) -> bool:
    """A Python number argument that is inf or nan (the caller's own infinity)."""
    leaves, _ = tree_flatten(values)
    return any(isinstance(v, (float, complex)) and not cmath.isfinite(v) for v in leaves)


def _split_args(ev: OpEvent) -> tuple[list, list]:
    """(values of the arguments the op writes, incl. hidden writes; the other values).
    Destinations the op overwrites without reading (out=, fill_/bernoulli_'s self: uninitialised
    memory, recorded `uninitialized`) are neither: a NaN left in them is no inherited overflow."""
    info = op_info(ev.func)
    w, u = [], []
    for name, _, v in named_args(info, ev.args, ev.kwargs):
        if name in info.not_data:
            continue
        (w if name in info.written else u).append(v)
    return w, u


def _written_values(ev: OpEvent) -> list:
    return _split_args(ev)[0] if op_info(ev.func).written else []


def _unwritten_values(ev: OpEvent) -> list:
    return _split_args(ev)[1]
