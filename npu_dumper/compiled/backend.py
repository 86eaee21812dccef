"""The recording backend: AOTAutograd's forward and backward ATen graphs, each run as
Inductor-compiled pieces (pieces.py, runner.py).

    compiled = torch.compile(model, backend=npu_dumper.compiled.backend())
    with torch.utils.dumper(use_dump=True, dump_path="compiled.h5", compiled=True):
        loss = loss_fn(compiled(x), y); loss.backward()

AOTAutograd traces the Dynamo graph without decompositions, so the graphs hold the ATen
ops the eager dumper records (addmm, silu, _softmax...), and partitions it into a
forward and a backward graph (the default partition: activations saved, as eager
autograd does, no recompute). Inductor then compiles each piece as it compiles a whole
graph: its own AOTAutograd pass with its decomposition table, its pattern passes, its
lowerings and fusions, its C++ (CPU) or Triton (GPU) code.
"""

from __future__ import annotations

import contextvars
import itertools
import threading
from typing import Callable

import torch

from dumpfile import schema as S

from .runner import GraphRunner

_graph_ids = itertools.count()


def _inductor() -> Callable:
    import torch._inductor.compile_fx as cfx
    from . import session
    return session.original_compile_fx() or cfx.compile_fx


def backend(split: str = "node", inductor: Callable | None = None,
            config_patches: dict | None = None) -> Callable:
    """A torch.compile backend (a callable of (GraphModule, example inputs)).
    `split`: "node" (every ATen op its own compiled piece) or "module" (docs/COMPILED.md);
    `inductor`: what compiles a piece (default torch._inductor.compile_fx.compile_fx);
    `config_patches`: Inductor config for every piece (torch.compile's mode=/options=)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import default_partition
    from .pieces import SPLITS
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")

    def compile_piece(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        compile_fx = inductor or _inductor()
        # Compiled in a thread of its own: the graph's runtime (AOTAutograd's
        # CompiledFunction) runs with dispatch state that Inductor's own tracing of the
        # piece must not inherit ("Attempting to use FunctionalTensor on its own"); a new
        # thread starts from the defaults (grad mode on, autocast off: the graph holds
        # its casts explicitly; the inputs are detached, so the piece compiles for inference).
        # Inductor's config patches are per thread (ContextVars): the caller's context is
        # copied into the thread, so `inductor_config.patch(...)` around the step applies.
        ctx = contextvars.copy_context()
        inputs = [t.detach() if isinstance(t, torch.Tensor) else t for t in example_inputs]
        box: dict = {}

        def work():
            try:
                if config_patches:
                    import torch._inductor.config as icfg
                    with icfg.patch(config_patches):
                        box["fn"] = compile_fx(gm, inputs)
                else:
                    box["fn"] = compile_fx(gm, inputs)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                box["error"] = e
        t = threading.Thread(target=ctx.run, args=(work,), name="npu_dumper-compile-piece")
        t.start()
        t.join()
        if "error" in box:
            raise box["error"]
        fn = box["fn"]
        return _boxed(fn)

    def make(phase: str) -> Callable:
        def compiler(gm: torch.fx.GraphModule, example_inputs) -> GraphRunner:
            label = f"{phase} {next(_graph_ids)}"
            from functorch.compile import make_boxed_func
            return make_boxed_func(GraphRunner(gm, phase, label, split, compile_piece))
        return compiler

    return aot_autograd(fw_compiler=make(S.PHASE_FORWARD), bw_compiler=make(S.PHASE_BACKWARD),
                        partition_fn=default_partition, keep_inference_input_mutations=True)


def _boxed(fn: Callable) -> Callable:
    """Inductor's compiled callable (compile_fx's result takes the inputs as arguments) as
    one taking a list, as the runner calls it."""
    return lambda args: fn(*args)
