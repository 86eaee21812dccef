"""Map one framework (IR) op to the kernels it runs, with each kernel's inputs and outputs.

On any device the op is lowered through PyTorch's decomposition tables
(torch._decomp.decomposition_table: aten -> core aten -> prims), recursively, and
run eagerly; every leaf op that computes (not a view) is one "kernel" with its own
inputs and outputs. This is what shows which step inside softmax, layer_norm or
gelu loses precision. An op without a decomposition is one kernel.

The op also runs natively on the caller's real arguments: the caller gets the
native result (the model behaves exactly as without the tool), the kernel
sequence runs on snapshots of the inputs, and the mapping records how far the
decomposed result is from the native one. On CUDA the names of the CUDA kernels
the native op launched are collected with torch.profiler.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch._decomp import decomposition_table
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from npu_dumper.capture.dynamo_skip import no_dynamo_import
from npu_dumper.capture.opschema import op_info

# Ops never decomposed: their decompositions draw random numbers differently from the
# native kernel, so the kernels' data would not be the op's data.
_NEVER_DECOMPOSE_TAGS = (torch.Tag.nondeterministic_seeded,)


@dataclass
class KernelRecord:
    order: int                      # 1-based position among the IR op's kernels
    name: str                       # "prims.mul.default"
    depth: int                      # 0 = the IR op itself (not decomposed)
    decomposed_from: tuple[str, ...]  # chain of ops whose decompositions led here, outermost first
    inputs: list[torch.Tensor] = field(default_factory=list)   # snapshots taken before it ran
    outputs: list[torch.Tensor] = field(default_factory=list)


@dataclass
class KernelMapping:
    ir_op: str
    kernels: list[KernelRecord]
    native_outputs: Any = None              # what the op returned natively (given to the caller)
    decomposed_outputs: Any = None          # what the kernel sequence computed
    max_abs_diff: float | None = None       # decomposed vs native, over all floating outputs
    device_kernels: list[str] = field(default_factory=list)  # CUDA kernel names (native run)
    notes: list[str] = field(default_factory=list)

    @property
    def decomposed(self) -> bool:
        return any(k.depth > 0 for k in self.kernels)


def _has_write_args(func) -> bool:
    return bool(op_info(func).schema_written)


def _snapshot(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    return x


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


@no_dynamo_import
class _KernelRecordingMode(TorchDispatchMode):
    """Applies decompositions where the table has one and records the leaf ops."""

    def __init__(self, decompositions: dict, *, record_inputs: bool, record_outputs: bool,
                 should_decompose: Callable[[Any], bool]):
        super().__init__()
        self.decompositions = decompositions
        self.record_inputs = record_inputs
        self.record_outputs = record_outputs
        self.should_decompose = should_decompose
        self.kernels: list[KernelRecord] = []
        self.chain: list[str] = []
        self.failures: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        decomp = self.decompositions.get(func)
        if decomp is not None and name not in self.chain and self.should_decompose(func):
            result = self._try_decomposition(func, decomp, args, kwargs)
            if result is not NotImplemented:
                return result
        if op_info(func).is_view:
            out = func(*args, **kwargs)
            # A true view moves no data: not a kernel. An op whose schema may alias but
            # did copy here (aten.to.dtype converting bf16 -> fp32) is a kernel.
            if not _copied(out, args, kwargs):
                return out
            self._record(name, args, kwargs, out)
            return out
        inputs = [t.detach().clone() for t in _tensors((args, kwargs))] if self.record_inputs else []
        out = func(*args, **kwargs)
        self._record(name, inputs, None, out)
        return out

    def _record(self, name, args_or_inputs, kwargs, out) -> None:
        record = KernelRecord(0, name, len(self.chain), tuple(self.chain))
        if self.record_inputs:
            record.inputs = (args_or_inputs if kwargs is None else
                             [t.detach().clone() for t in _tensors((args_or_inputs, kwargs))])
        if self.record_outputs:
            record.outputs = [t.detach().clone() for t in _tensors(out)]
        self.kernels.append(record)
        record.order = len(self.kernels)

    def _try_decomposition(self, func, decomp, args, kwargs):
        mark = len(self.kernels)
        # A decomposition that fails halfway may have written into a mutable argument:
        # keep copies to put back before running the op whole.
        saved = [(t, t.detach().clone()) for t in _tensors((args, kwargs))] if _has_write_args(func) else []
        self.chain.append(str(func))
        try:
            with self:
                return decomp(*args, **kwargs)
        except Exception as e:  # a decomposition that cannot run eagerly here: the op is one kernel
            del self.kernels[mark:]
            for t, copy in saved:
                with torch.no_grad():
                    t.copy_(copy)
            self.failures.append(f"{func}: decomposition failed ({type(e).__name__}: {e}); kept as one kernel")
            return NotImplemented
        finally:
            self.chain.pop()


def _copied(out, args, kwargs) -> bool:
    """True when an output of a view-schema op does not share storage with any input."""
    bases = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
    return any(t.untyped_storage().data_ptr() not in bases for t in _tensors(out))


def _max_abs_diff(decomposed, native) -> float | None:
    worst = None
    a_list, b_list = _tensors(decomposed), _tensors(native)
    if len(a_list) != len(b_list):
        return math.nan
    for a, b in zip(a_list, b_list):
        if not (a.is_floating_point() or a.is_complex()) or a.shape != b.shape:
            continue
        if a.numel() == 0:
            continue
        a64 = a.detach().to("cpu", torch.complex128 if a.is_complex() else torch.float64)
        b64 = b.detach().to("cpu", torch.complex128 if b.is_complex() else torch.float64)
        same_nonfinite = (~torch.isfinite(a64)) & (a64 == b64)
        both_nan = torch.isnan(a64) & torch.isnan(b64)
        d = (a64 - b64).abs()
        d = torch.where(same_nonfinite | both_nan, torch.zeros_like(d), d)
        d = torch.nan_to_num(d, nan=math.inf)
        v = float(d.max())
        worst = v if worst is None else max(worst, v)
    return worst


def _cuda_kernel_names(run: Callable[[], Any]) -> tuple[Any, list[str], str]:
    """Run `run` under the profiler; (result, CUDA kernel names, note)."""
    try:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            out = run()
            torch.cuda.synchronize()
    except Exception as e:   # profiler unavailable (e.g. CUPTI missing): the mapping still works
        return run(), [], f"CUDA kernel names unavailable: {type(e).__name__}: {e}"
    names = []
    for evt in prof.events():
        if getattr(evt, "device_type", None) == torch.autograd.DeviceType.CUDA and evt.name not in names:
            names.append(evt.name)
    return out, names, ""


def _rng_state(on_cuda: bool):
    cuda = torch.cuda.get_rng_state() if on_cuda and torch.cuda.is_available() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


def default_should_decompose(func) -> bool:
    return not any(tag in op_info(func).tags for tag in _NEVER_DECOMPOSE_TAGS)


def lower_to_kernels(func, args: tuple = (), kwargs: dict | None = None, *,
                     decompositions: dict | None = None, record_inputs: bool = True,
                     record_outputs: bool = True, run_native: bool = True,
                     should_decompose: Callable[[Any], bool] = default_should_decompose) -> KernelMapping:
    """Run `func(*args, **kwargs)` as its kernel sequence, recording each kernel.

    With run_native (default) the op also runs natively on the real arguments and
    that result is `native_outputs`; the kernels then run on snapshots taken before.
    Without it the kernels run on the real arguments (in-place ops mutate them) and
    `native_outputs` is the decomposed result.
    """
    kwargs = dict(kwargs or {})
    table = decomposition_table if decompositions is None else decompositions
    mapping = KernelMapping(str(func), [])
    on_cuda = any(t.is_cuda for t in _tensors((args, kwargs)))

    k_args, k_kwargs = (tree_map(_snapshot, args), tree_map(_snapshot, kwargs)) if run_native else (args, kwargs)
    # Random ops: the kernels must draw the same numbers the native op drew, and the
    # model's random stream must continue as if the op had run once.
    rng_before = _rng_state(on_cuda) if run_native else None
    if run_native:
        with torch.no_grad():
            if on_cuda and torch.cuda.is_available():
                native, names, note = _cuda_kernel_names(lambda: func(*args, **kwargs))
                mapping.device_kernels = names
                if note:
                    mapping.notes.append(note)
            else:
                native = func(*args, **kwargs)
        mapping.native_outputs = native

    mode = _KernelRecordingMode(table, record_inputs=record_inputs, record_outputs=record_outputs,
                                should_decompose=should_decompose)
    rng_after = None
    if rng_before is not None:
        rng_after = _rng_state(on_cuda)
        _set_rng_state(rng_before)
    try:
        with torch.no_grad(), mode:
            decomposed = func(*k_args, **k_kwargs)
    finally:
        if rng_after is not None:
            _set_rng_state(rng_after)
    mapping.kernels = mode.kernels
    mapping.notes.extend(mode.failures)
    mapping.decomposed_outputs = decomposed
    if run_native:
        mapping.max_abs_diff = _max_abs_diff(decomposed, mapping.native_outputs)
    else:
        mapping.native_outputs = decomposed
    return mapping
