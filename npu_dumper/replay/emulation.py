"""Preview Ascend NPU numerics on CPU, and plant faults the way a buggy kernel would.

Two public context managers, each owning a private TorchDispatchMode:

`emulate_npu(cube_dtype=torch.float16, saturate=False)`
    Cube ops (matrix multiply, convolution, attention, fused RNN layers, forward and
    backward; the CUBE_OPS registry below) run the way the Ascend cube unit runs a
    float32 model by default: operands are rounded to float16, products accumulate
    in float32 (on CPU: the original op, fed float16-representable values; a product
    of two float16 values is exact in float32), and every floating result is rounded
    to float16 and handed back in the original dtype. Everything else (vector ops:
    gelu, softmax, layer norm, ...) runs unchanged. With `saturate=True` nothing
    becomes inf/nan in float16: values clamp to +-65504 and NaN becomes 0 (our
    choice; it is how a saturating conversion treats NaN). Without it a value beyond
    65504 becomes inf, which is exactly what the overflow check should then find.
    Each cube op tells the dumper above it that it computed in float16
    (npu_dumper.capture.hints.note_compute_dtype), so the comparison reports fp16-level
    differences on those ops as expected rather than as failures.

`inject_fault(op="aten.gelu.default", rel=0.05, call=None, seed=0)`
    Makes one op wrong: every floating output element is multiplied by (1 + rel)
    or (1 - rel) (a fixed pseudo-random sign pattern from `seed`), so the relative
    Euclidean distance to the correct output is exactly `rel` and the cosine drops
    to about 1/sqrt(1 + rel**2). `call=k` hits only the k-th call (1-based) of that
    op as it reaches the injector; None hits every call. An injector that never
    fired raises at exit: a fault test that tests nothing must not pass.

Nesting order (both): they sit BELOW the dumper, i.e. enter them FIRST::

    with emulate_npu():                 # or inject_fault(...), or both
        with npu_dumper.dumper(...):
            loss = model(x).sum(); loss.backward()

The dumper then records the op's real inputs and the emulated/faulty outputs, as
it would on a device whose kernels behave that way. Entered the other way round
(inside a dumper) both raise EmulationOrderError at entry: the dumper would record
float16-rounded inputs as if the user's code produced them, and the compute-dtype
note would land on the wrong op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_flatten, tree_map

from ..capture.dynamo_skip import no_dynamo_import
from ..errors import DumperError
from ..capture.hints import note_compute_dtype, pop_compute_dtype
from ..capture.opschema import named_args, op_info

aten = torch.ops.aten

__all__ = [
    "CUBE_OPS", "CubeOp", "EmulationOrderError", "FaultSpecError", "emulate_npu",
    "inject_fault", "is_cube_op", "parse_fault", "register_cube_op",
]


class EmulationOrderError(DumperError):
    """emulate_npu()/inject_fault() entered inside a dumper block (they must be outside)."""


class FaultSpecError(DumperError):
    """An inject_fault() op name or amount that cannot be used, or a fault that never fired."""


# ---- the cube-op registry -----------------------------------------------------

@dataclass(frozen=True)
class CubeOp:
    """An op the Ascend cube unit runs. `kind` is for reports and docs only."""
    kind: str


CUBE_OPS: dict[torch._ops.OpOverloadPacket, CubeOp] = {}


def register_cube_op(packet, kind: str) -> None:
    """Declare that every overload of `packet` (e.g. aten.mm) runs on the cube unit."""
    CUBE_OPS[packet] = CubeOp(kind)


def _register_known(names: Iterable[str], kind: str) -> None:
    # Some ops exist only in some torch builds/versions; a missing one is not an error.
    for name in names:
        packet = getattr(aten, name, None)
        if isinstance(packet, torch._ops.OpOverloadPacket):
            register_cube_op(packet, kind)


# Both directions: a backward matmul is an mm/bmm call, so the same entries cover it.
_register_known(("mm", "bmm", "addmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "vdot",
                 "matmul", "linear", "_addmm_activation",
                 "addmm_", "baddbmm_", "addbmm_", "addmv_"), "matmul")
_register_known(("convolution", "convolution_backward", "_convolution", "convolution_overrideable",
                 "convolution_backward_overrideable", "mkldnn_convolution", "cudnn_convolution",
                 "cudnn_convolution_transpose", "miopen_convolution"), "convolution")
_register_known(("_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_flash_attention_for_cpu_backward",
                 "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
                 "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_efficient_attention_backward",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
                 "_flash_attention_forward", "_flash_attention_backward"), "attention")
# Fused RNN layers: on the NPU their gate matmuls are cube work. We round the layer's
# operands and results; the recurrence inside stays float32 (a documented approximation).
_register_known(("mkldnn_rnn_layer", "mkldnn_rnn_layer_backward", "_cudnn_rnn",
                 "_cudnn_rnn_backward", "miopen_rnn", "miopen_rnn_backward"), "rnn")


def is_cube_op(func) -> bool:
    """True if `func` (an OpOverload or OpOverloadPacket) is in CUBE_OPS."""
    packet = getattr(func, "overloadpacket", func)
    return packet in CUBE_OPS


# ---- nesting checks -------------------------------------------------------------

def _is_recording_mode(mode) -> bool:
    """The dumper's DumpMode, or another mode that declares `records_ops = True`.
    (By class, not by module name: a move of the mode fails here loudly.)"""
    from ..capture.mode import DumpMode
    return getattr(mode, "records_ops", False) or isinstance(mode, DumpMode)


def _refuse_inside_dumper(what: str) -> None:
    if any(_is_recording_mode(m) for m in _get_current_dispatch_mode_stack()):
        raise EmulationOrderError(
            f"{what} was entered inside a dumper block; enter it outside: "
            f"`with {what}: with dumper(...):` so the dumper records what the device computes"
        )


# ---- emulate_npu ---------------------------------------------------------------

_WIDE_FLOATS = (torch.float32, torch.float64)


class _CubeRounding:
    """How values cross the cube unit: rounding to `dtype`, optionally saturating."""

    def __init__(self, dtype: torch.dtype, saturate: bool):
        if not dtype.is_floating_point:
            raise ValueError(f"cube_dtype must be a floating dtype, got {dtype}")
        self.dtype = dtype
        self.saturate = saturate
        self.max = torch.finfo(dtype).max

    def applies_to(self, t) -> bool:
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            return False
        # Narrower or equal dtypes are already what the cube computes in; with
        # saturation they still lose their inf/nan.
        return t.dtype in _WIDE_FLOATS and t.dtype != self.dtype or self.saturate

    def rounded(self, t: torch.Tensor) -> torch.Tensor:
        if self.saturate:
            t = t.nan_to_num(0.0, self.max, -self.max).clamp(-self.max, self.max)
        return t.to(self.dtype).to(t.dtype)

    def round_in_place(self, t: torch.Tensor) -> None:
        t.copy_(self.rounded(t))


@no_dynamo_import
class _EmulateNPUMode(TorchDispatchMode):
    def __init__(self, rounding: _CubeRounding, cube_ops: dict):
        super().__init__()
        self.rounding = rounding
        self.cube_ops = cube_ops
        self.dtype_name = str(rounding.dtype).removeprefix("torch.")
        self.cube_calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket not in self.cube_ops:
            return func(*args, **kwargs)
        rounding = self.rounding
        written = _written_tensors(func, args, kwargs)
        touched = False

        def operand(t):
            nonlocal touched
            if not rounding.applies_to(t):
                return t
            touched = True
            # A written argument (addmm_'s self, an out=) is overwritten by the result
            # anyway: round it in place so the op still writes into the caller's tensor.
            if id(t) in written:
                rounding.round_in_place(t)
                return t
            return rounding.rounded(t)

        args, kwargs = tree_map(operand, (args, kwargs))
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if rounding.applies_to(t):
                rounding.round_in_place(t)
        if touched:
            self.cube_calls += 1
            note_compute_dtype(self.dtype_name)
        return out


def _written_tensors(func, args, kwargs) -> set[int]:
    """ids of the tensors the op's schema marks written (in-place self, out=)."""
    info = op_info(func)
    written: set[int] = set()
    if not info.schema_written:
        return written
    for name, _, value in named_args(info, args, kwargs):
        if name in info.schema_written:
            written.update(id(t) for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))
    return written


class emulate_npu:
    """Run cube ops with Ascend-like float16 numerics on any device (see module doc).

    `cube_calls` counts the cube ops that were emulated. Enter it OUTSIDE the dumper.
    """

    def __init__(self, cube_dtype: torch.dtype = torch.float16, saturate: bool = False):
        self._mode = _EmulateNPUMode(_CubeRounding(cube_dtype, saturate), CUBE_OPS)

    @property
    def cube_calls(self) -> int:
        return self._mode.cube_calls

    def __enter__(self):
        _refuse_inside_dumper("emulate_npu()")
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        # A cube op that ran with no dumper above it left its note; it must not be
        # attributed to the first op of some later dumper block.
        pop_compute_dtype()
        return self._mode.__exit__(*exc)


# ---- inject_fault --------------------------------------------------------------

def _resolve_op(op):
    """An OpOverload/OpOverloadPacket from itself or a name like "aten.gelu.default"."""
    if isinstance(op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return op
    parts = str(op).split(".")
    if len(parts) not in (2, 3):
        raise FaultSpecError(f"fault op {op!r}: expected 'namespace.op[.overload]', e.g. aten.gelu.default")
    try:
        target = getattr(getattr(torch.ops, parts[0]), parts[1])
        if len(parts) == 3:
            target = getattr(target, parts[2])
    except (AttributeError, RuntimeError):
        raise FaultSpecError(f"fault op {op!r}: no such op in torch.ops") from None
    return target


def parse_fault(text: str) -> dict:
    """'aten.gelu.default:0.05[:k]' -> inject_fault keyword arguments (CLI helper)."""
    parts = text.split(":")
    if not 1 <= len(parts) <= 3 or not parts[0]:
        raise FaultSpecError(f"fault {text!r}: expected OP[:REL[:CALL]], e.g. aten.gelu.default:0.05")
    spec: dict = {"op": parts[0]}
    try:
        if len(parts) > 1:
            spec["rel"] = float(parts[1])
        if len(parts) > 2:
            spec["call"] = int(parts[2])
    except ValueError:
        raise FaultSpecError(f"fault {text!r}: REL must be a number and CALL an integer") from None
    return spec


@no_dynamo_import
class _FaultMode(TorchDispatchMode):
    def __init__(self, target, rel: float, call: int | None, seed: int):
        super().__init__()
        self.target, self.rel, self.call, self.seed = target, rel, call, seed
        self.calls = 0   # calls of the target op seen
        self.hits = 0    # calls that were corrupted

    def _matches(self, func) -> bool:
        return func == self.target or func.overloadpacket == self.target

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self._matches(func):
            return out
        self.calls += 1
        if self.call is not None and self.calls != self.call:
            return out
        corrupted = False
        gen = torch.Generator().manual_seed(self.seed + self.hits)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) and t.numel():
                real = t.real.dtype if t.is_complex() else t.dtype    # complex: scale re and im
                sign = torch.randint(0, 2, t.shape, generator=gen).to(real).mul_(2).sub_(1)
                # In place: an in-place op's result is its `self`, which a buggy kernel
                # would have written wrong too; a fresh output is ours to change.
                t.mul_(sign.mul_(self.rel).add_(1))
                corrupted = True
        self.hits += corrupted
        return out


class inject_fault:
    """Make `op` wrong by a relative amount `rel`, below the dumper (see module doc).

    `op`: "aten.gelu.default" (one overload), "aten.gelu" (every overload), or the
    op object itself. `call`: only the k-th call (1-based) of it; None: every call.
    After the block, `hits` says how many calls were corrupted and `calls` how many
    calls of the op were seen.
    """

    def __init__(self, op="aten.gelu.default", rel: float = 0.05, call: int | None = None,
                 seed: int = 0, strict: bool = True):
        if not rel > 0:
            raise FaultSpecError(f"fault on {op}: rel must be > 0, got {rel}")
        if call is not None and call < 1:
            raise FaultSpecError(f"fault on {op}: call counts from 1, got {call}")
        self.op_name = str(op)
        self.strict = strict
        self._mode = _FaultMode(_resolve_op(op), float(rel), call, seed)

    @property
    def hits(self) -> int:
        return self._mode.hits

    @property
    def calls(self) -> int:
        return self._mode.calls

    def __enter__(self):
        _refuse_inside_dumper(f"inject_fault({self.op_name!r})")
        self._mode.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb):
        self._mode.__exit__(exc_type, exc, tb)
        if exc_type is None and self.strict and self.hits == 0:
            which = f"call {self._mode.call} of " if self._mode.call else ""
            why = (" (no floating-point or complex output to corrupt)"
                   if self.calls and (self._mode.call is None or self.calls >= self._mode.call) else "")
            raise FaultSpecError(
                f"fault on {which}{self.op_name} never fired: the op ran {self.calls} time(s) in the block{why}")
        return False
