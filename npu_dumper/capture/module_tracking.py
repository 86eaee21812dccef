"""Which nn.Module an op ran in, forward and backward, and which optimizer's step, without
adding ops.

Forward: global module forward pre/post hooks keep a stack of module paths. Names
come from the outermost module's named_modules(), built lazily once per root.
Backward: after a forward op returns, autograd has attached its grad_fn; at the
next op (or block exit) we tag that node's `metadata` with the forward module path
(`tag_pending`). During backward the mode reads the tag of the node being run
(torch._C._current_autograd_node()). Only Python-level attribute access: no ops.
Optimizer: global step pre/post hooks (every torch.optim.Optimizer's step, a subclass's
too) keep a stack of the running optimizers' class names: their ops, outside any module,
are the update, not a forward (a step that raises leaves its name until the block exits).
"""

from __future__ import annotations

import weakref
from typing import Any

from torch.nn.modules.module import (register_module_forward_hook,
                                     register_module_forward_pre_hook)
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

METADATA_KEY = "npu_dumper.module"


class ModuleTracker:
    def __init__(self):
        # the paths of the modules whose forward is running, innermost last (the dispatch
        # mode reads it directly, once per op)
        self.stack: list[str] = []
        self._names: dict[int, str] = {}       # id(module) -> path, for the current root
        self._root: Any = None
        self._handles: list = []
        # (weakref to a forward output, module) not yet tagged on its grad_fn (tag_pending)
        self.untagged: list[tuple[Any, str]] = []
        # class names of the optimizers whose step() is running, innermost last (a wrapper
        # such as ZeroRedundancyOptimizer runs its inner optimizer's step)
        self.optimizers: list[str] = []

    @property
    def current(self) -> str:
        return self.stack[-1] if self.stack else ""

    @property
    def root(self) -> Any:
        """The outermost module seen running (None before any)."""
        return self._root

    @property
    def in_forward(self) -> bool:
        """A module's forward is running (its path may be "", the root's own code)."""
        return bool(self.stack)

    def __enter__(self):
        self._handles = [register_module_forward_pre_hook(self._pre),
                         register_module_forward_hook(self._post, always_call=True),
                         register_optimizer_step_pre_hook(self._step_pre),
                         register_optimizer_step_post_hook(self._step_post)]
        return self

    def __exit__(self, *exc):
        self.tag_pending()
        for h in self._handles:
            h.remove()
        self._handles = []
        self.stack.clear()
        self.optimizers.clear()

    def _step_pre(self, optimizer, args, kwargs) -> None:
        self.optimizers.append(type(optimizer).__name__)

    def _step_post(self, optimizer, args, kwargs) -> None:
        if self.optimizers:
            del self.optimizers[-1]

    def _root_names(self) -> dict[int, str]:
        """id(module) -> path under the current root (built at the first lookup)."""
        if not self._names:
            self._names = {id(m): n for n, m in self._root.named_modules(remove_duplicate=False)}
        return self._names

    def _name_of(self, module) -> str:
        if not self.stack:
            if self._root is module:
                return ""
            if self._root is not None:
                # a submodule of the model called on its own: activation checkpointing
                # re-running a block during backward keeps its path under the model
                name = self._root_names().get(id(module))
                if name:
                    return name
            self._root = module
            self._names = {}
            return ""
        name = self._root_names().get(id(module))
        if name is None:   # not a registered submodule of the root: name by class under parent
            parent = self.current
            name = f"{parent}.{type(module).__name__}" if parent else type(module).__name__
        return name

    def _pre(self, module, args):
        self.tag_pending()
        self.stack.append(self._name_of(module))

    def _post(self, module, args, output):
        self.tag_pending()
        if self.stack:
            self.stack.pop()

    # ---- backward attribution -----------------------------------------------------
    def note_outputs(self, outputs: list, module: str) -> None:
        """Forward op just produced `outputs` inside `module`: tag their grad_fn later.

        Not outside any module (the tag would be "", what an untagged node reads as):
        touching `t.grad_fn` gives the autograd node a Python object that it keeps, and a
        chain of such nodes is freed recursively through Python (torch 2.13: a chain of
        ~60k ops segfaulted when freed; plain PyTorch only when the user walks grad_fn)."""
        if not module:
            return
        for t in outputs:
            try:
                self.untagged.append((weakref.ref(t), module))
            except TypeError:
                pass

    def tag_pending(self) -> None:
        if not self.untagged:
            return
        items, self.untagged = self.untagged, []
        for ref, module in items:
            t = ref()
            if t is None:
                continue
            node = t.grad_fn
            if node is not None:
                md = node.metadata
                if METADATA_KEY not in md:
                    md[METADATA_KEY] = module


def backward_module(node) -> str:
    try:
        return node.metadata.get(METADATA_KEY, "")
    except (AttributeError, RuntimeError):
        return ""
