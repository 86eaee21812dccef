"""Which dumper block the compiled graphs record into, and how a `compiled=True` block
makes an already-compiled model run through the recording backend.

`torch.compile(model)` (backend "inductor") calls `torch._inductor.compile_fx.compile_fx`
when Dynamo compiles a frame. While a `compiled=True` block is active that function is
replaced by the recording backend (backend.py, which compiles its pieces with the
original), and Dynamo's caches are reset at entry and at exit: the model's frames
compile again on their first call inside the block (through the backend) and again
after it (as the user compiled them). Code compiled with another backend (a custom
one, "aot_eager") is not re-routed: pass `backend=npu_dumper.compiled.backend()` there.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_recorder = None        # NodeRecorder of the active compiled=True block


_original = None      # torch._inductor.compile_fx.compile_fx while it is replaced


def original_compile_fx():
    """Inductor's compile_fx while a block has replaced it (else None)."""
    return _original


def recorder():
    """The active block's NodeRecorder, or None (graphs then just run)."""
    return _recorder


class CompiledSession:
    """Entered by the dumper block (compiled=True) instead of its dispatch mode."""

    def __init__(self, mode, split: str = "node", reroute: bool = True):
        from .recorder import NodeRecorder
        self.recorder = NodeRecorder(mode)
        self.split = split
        self.reroute = reroute
        self._saved = None

    def __enter__(self):
        global _recorder, _original
        with _lock:
            _recorder = self.recorder
        if self.reroute:
            import torch._dynamo
            import torch._inductor.compile_fx as cfx
            self._saved = _original = cfx.compile_fx
            cfx.compile_fx = _reroute(self.split, self._saved)
            torch._dynamo.reset()
        return self

    def __exit__(self, *exc):
        global _recorder, _original
        with _lock:
            _recorder = None
        if exc[0] is None and self.recorder.mode.num_recorded == 0:
            import warnings
            warnings.warn("torch.utils.dumper(compiled=True) recorded no op: nothing ran through "
                          "torch.compile's default (inductor) backend in the block; a model compiled "
                          "with another backend records with backend=npu_dumper.compiled.backend()",
                          stacklevel=3)
        if self._saved is not None:
            import torch._dynamo
            import torch._inductor.compile_fx as cfx
            cfx.compile_fx = self._saved
            self._saved = _original = None
            torch._dynamo.reset()
        return False


def _reroute(split: str, inductor):
    """compile_fx's signature (Dynamo passes config_patches=, compile_region_name=): the
    recording backend takes the graph and its example inputs; the user's config patches
    (torch.compile's mode= and options=) apply to every piece."""
    from .backend import backend

    def compile_fx(model_, example_inputs_, *, config_patches=None, compile_region_name=None, **other):
        if other:
            # a caller of compile_fx's other options (inner_compile=, decompositions=: its
            # own recursion, AOT export): not torch.compile's backend call, left to Inductor
            return inductor(model_, example_inputs_, config_patches=config_patches,
                            compile_region_name=compile_region_name, **other)
        return backend(split=split, inductor=inductor, config_patches=config_patches)(model_, example_inputs_)
    return compile_fx
