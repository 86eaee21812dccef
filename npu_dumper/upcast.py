"""Run chosen ops or module subtrees at a higher precision inside a low-precision step.

`upcast(ops=[...], modules=[...], dtype=torch.float32)` owns a private TorchDispatchMode
(structured like npu_dumper/emulation.py). For an op that matches, every floating tensor
argument narrower than `dtype` is cast up to `dtype`, the op runs, and each floating output
is cast back to the dtype the op would have produced (found by running it on meta tensors:
exact type promotion, no compute; the widest floating input's dtype for ops without a meta
kernel); in-place and out= ops write the result
back into the caller's tensor. Other ops run unchanged.

An op matches when
  - its name is in `ops`: overload ("aten.gelu.default") or packet ("aten.gelu") names;
  - or it runs inside a module whose path is in `modules` or below one ("layers.3" covers
    "layers.3" and "layers.3.fc"), forward or backward: the backward ops are attributed to
    their forward module through the autograd node's metadata, as the dumper does
    (npu_dumper.capture.module_tracking).

Nesting: a mode that should see the upcast inputs (emulate_npu, inject_fault, a dumper
recording what the kernels got) is entered BEFORE (outside) upcast.

Environment protocol (used by `accucmp bisect`, docs/WHATIF.md): `upcast_from_env()` reads
NPU_DUMPER_UPCAST, a JSON object {"ops": [...], "modules": [...], "dtype": "float32"}, and
returns an `upcast` for it (a no-op context when the variable is unset or empty), so a user's
step script needs one line: `with npu_dumper.upcast_from_env(): loss = step()`.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .capture.dynamo_skip import no_dynamo_import
from .replay.emulation import _written_tensors
from .errors import DumperError
from .capture.module_tracking import ModuleTracker, backward_module

ENV_VAR = "NPU_DUMPER_UPCAST"

__all__ = ["ENV_VAR", "UpcastSpecError", "upcast", "upcast_from_env"]


class UpcastSpecError(DumperError):
    """NPU_DUMPER_UPCAST (or upcast()'s arguments) cannot be used."""


def _in_subtree(module: str, roots: tuple[str, ...]) -> bool:
    return any(module == r or module.startswith(r + ".") or r == "" for r in roots)


@no_dynamo_import
class _UpcastMode(TorchDispatchMode):
    def __init__(self, ops: frozenset[str], modules: tuple[str, ...], dtype: torch.dtype,
                 tracker: ModuleTracker):
        super().__init__()
        self.ops = ops
        self.modules = modules
        self.dtype = dtype
        self.tracker = tracker
        self.upcast_calls = 0
        self.upcast_ops: set[str] = set()

    def _module(self) -> str:
        node = torch._C._current_autograd_node()
        if node is not None and not self.tracker.in_forward:
            return backward_module(node)
        self.tracker.tag_pending()
        return self.tracker.current

    def _matches(self, func) -> tuple[bool, str]:
        module = self._module()
        if str(func) in self.ops or str(func.overloadpacket) in self.ops:
            return True, module
        return bool(self.modules) and _in_subtree(module, self.modules), module

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        hit, module = self._matches(func)
        if not hit:
            out = func(*args, **kwargs)
            self._note(out, module)
            return out
        floats = [t for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if not floats or all(t.dtype.itemsize >= self.dtype.itemsize for t in floats):
            out = func(*args, **kwargs)
            self._note(out, module)
            return out
        produced = _output_dtypes(func, args, kwargs, floats)
        written = _written_tensors(func, args, kwargs)
        targets: list[torch.Tensor] = []

        def up(t):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype.itemsize < self.dtype.itemsize:
                if id(t) in written:
                    targets.append(t)
                return t.to(self.dtype)
            return t

        up_args, up_kwargs = tree_map(up, (args, kwargs))
        out = func(*up_args, **up_kwargs)
        self.upcast_calls += 1
        self.upcast_ops.add(str(func))
        if targets:   # in-place / out=: the caller's tensor gets the (cast back) result
            for t in targets:
                src = out if isinstance(out, torch.Tensor) and not isinstance(out, (tuple, list)) else None
                if src is None:
                    src = next(o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor))
                with torch.no_grad():
                    t.copy_(src.to(t.dtype))
            result = targets[0] if len(targets) == 1 and isinstance(out, torch.Tensor) else out
            self._note(result, module)
            return result

        flat, spec = tree_flatten(out)
        for i, t in enumerate(flat):
            want = produced[i] if i < len(produced) else None
            if isinstance(t, torch.Tensor) and t.is_floating_point() and want is not None and t.dtype != want:
                flat[i] = t.to(want)
        result = spec.unflatten(flat) if hasattr(spec, "unflatten") else tree_unflatten(flat, spec)
        self._note(result, module)
        return result

    def _note(self, out, module: str) -> None:
        if self.tracker.in_forward:
            self.tracker.note_outputs([t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)], module)


def _output_dtypes(func, args, kwargs, floats) -> list:
    """The dtypes the op would have produced from the original arguments, output by output
    (flattened): found by running it on meta tensors, which costs no compute and follows
    type promotion exactly (a bf16 tensor times a 0-dim float32 tensor stays bf16; sum with
    dtype=float32 gives float32). Ops without a meta kernel: the widest floating input."""
    def meta(t):
        return t.to("meta") if isinstance(t, torch.Tensor) else t

    try:
        # below every mode: a dumper or fault injector outside must not see this call
        with _disable_current_modes():
            margs, mkwargs = tree_map(meta, (args, kwargs))
            out = func(*margs, **mkwargs)
        return [t.dtype if isinstance(t, torch.Tensor) else None for t in tree_flatten(out)[0]]
    except Exception:   # noqa: BLE001 - no meta kernel / data-dependent op: fall back
        widest = max((t.dtype for t in floats), key=lambda d: d.itemsize)
        return [widest] * 64


class upcast:
    """Run `ops` and the subtrees of `modules` in `dtype` (see module doc).

    `upcast_calls` counts the op calls that ran upcast; `upcast_ops` names them.
    """

    def __init__(self, ops: Iterable[str] = (), modules: Iterable[str] = (),
                 dtype: torch.dtype = torch.float32):
        if isinstance(ops, str) or isinstance(modules, str):
            raise UpcastSpecError("upcast(ops=..., modules=...) take lists of names, not one string")
        if not dtype.is_floating_point:
            raise UpcastSpecError(f"upcast dtype must be floating, got {dtype}")
        self._tracker = ModuleTracker()
        self._mode = _UpcastMode(frozenset(map(str, ops)), tuple(map(str, modules)), dtype, self._tracker)

    @property
    def upcast_calls(self) -> int:
        return self._mode.upcast_calls

    @property
    def upcast_ops(self) -> set[str]:
        return set(self._mode.upcast_ops)

    def __enter__(self):
        self._tracker.__enter__()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        try:
            return self._mode.__exit__(*exc)
        finally:
            self._tracker.__exit__(*exc)


def parse_spec(text: str) -> dict:
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise UpcastSpecError(f"{ENV_VAR}: not JSON ({e})") from None
    if not isinstance(spec, dict) or set(spec) - {"ops", "modules", "dtype"}:
        raise UpcastSpecError(f'{ENV_VAR}: expected {{"ops": [...], "modules": [...], "dtype": "float32"}}, got {text!r}')
    dtype = getattr(torch, str(spec.get("dtype", "float32")), None)
    if not isinstance(dtype, torch.dtype):
        raise UpcastSpecError(f"{ENV_VAR}: unknown dtype {spec.get('dtype')!r}")
    return {"ops": list(spec.get("ops", [])), "modules": list(spec.get("modules", [])), "dtype": dtype}


def spec_json(suspects) -> str:
    """NPU_DUMPER_UPCAST for accucmp.bisect Suspect-like objects (.kind "op"/"module", .name)."""
    return json.dumps({"ops": sorted(s.name for s in suspects if s.kind == "op"),
                       "modules": sorted(s.name for s in suspects if s.kind == "module")})


def upcast_from_env(environ=None):
    """The `upcast` NPU_DUMPER_UPCAST asks for, or a do-nothing context when it is unset."""
    text = (os.environ if environ is None else environ).get(ENV_VAR, "").strip()
    if not text:
        return contextlib.nullcontext()
    return upcast(**parse_spec(text))
