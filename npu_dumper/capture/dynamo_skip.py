"""Keep TorchDynamo out of our dispatch modes without importing torch._dynamo.

TorchDispatchMode wraps every subclass's `__torch_dispatch__` in `torch._disable_dynamo`
so that a `torch.compile`d model run under the mode never traces into the mode's own
Python. That wrapper imports torch._dynamo (with sympy and the inductor config) on
its first call: ~1 s at the first op of the first dumper block of a process, which is
most of what a one-step dump costs on a small model.

`no_dynamo_import(cls)` gets the same protection from the C side: the code object of
`__torch_dispatch__` is marked SKIP for itself and for every frame it calls (what
`torch._dynamo.disable(recursive=True)` does), through torch._C._dynamo.eval_frame, which
is loaded with torch anyway; the wrapper is then removed. Where this torch lacks that
API, the class keeps torch's wrapper (protected, at the import cost).
"""

from __future__ import annotations

from typing import Any


def _skip_strategy() -> Any:
    try:
        from torch._C._dynamo.eval_frame import (_FrameAction, _FrameExecStrategy,
                                                 set_code_exec_strategy)
        strategy = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)
    except (ImportError, AttributeError, TypeError):
        return None
    return lambda code: set_code_exec_strategy(code, strategy)


_mark_skipped = _skip_strategy()


def no_dynamo_import(cls: type) -> type:
    """Class decorator for a TorchDispatchMode subclass defining `__torch_dispatch__`."""
    wrapped = cls.__dict__.get("__torch_dispatch__")
    raw = getattr(wrapped, "__wrapped__", None)
    # only our own function is marked: never torch's shared wrapper code
    if _mark_skipped is None or raw is None or getattr(raw, "__module__", None) != cls.__module__:
        return cls
    try:
        _mark_skipped(raw.__code__)
    except (RuntimeError, TypeError):
        return cls
    cls.__torch_dispatch__ = raw
    return cls
