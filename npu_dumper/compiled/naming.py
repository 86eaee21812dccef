"""What an FX node of a compiled graph is called in a dump: module path and source line.

Dynamo records, per node, the nn.Module stack it was traced in (`nn_module_stack`:
key -> (qualified name, class)) and the user's source lines (`stack_trace`). AOTAutograd
copies the forward node's stack onto the backward nodes it derived
(`fwd_nn_module_stack`). The qualified names are Dynamo's sources
(`L['self'].layers[0].fc1`, `L['self']._modules['fc1']`); the dump writes the path the
eager dumper writes for the same module (`layers.0.fc1`), so both dumps name it alike.
"""

from __future__ import annotations

import re

# L['self'] / L['model'] / G['net'] at the start: the root (the eager dumper's "")
_ROOT = re.compile(r"^(?:L|G)\[['\"][^'\"]+['\"]\]\.?")
_MODULES = re.compile(r"\._modules\[['\"]([^'\"]+)['\"]\]")
_INDEX = re.compile(r"\[['\"]?([^'\"\]]+)['\"]?\]")
# a model wrapped in torch.compile and traced through its OptimizedModule
_ORIG_MOD = "_orig_mod"


def module_path(fqn: str) -> str:
    """Dynamo's qualified name of a module as the eager dumper's module path."""
    s = _ROOT.sub("", fqn.strip())
    s = _MODULES.sub(r".\1", s)
    s = _INDEX.sub(r".\1", s).strip(".")
    if s == _ORIG_MOD:
        return ""
    if s.startswith(_ORIG_MOD + "."):
        s = s[len(_ORIG_MOD) + 1:]
    return s


def node_module(meta: dict) -> str:
    """The innermost module a graph node was traced in ("" at the model's own code)."""
    stack = meta.get("nn_module_stack") or meta.get("fwd_nn_module_stack")
    if not stack:
        return ""
    last = list(stack.values())[-1]
    fqn = last[0] if isinstance(last, tuple) else str(last)
    return module_path(fqn)


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def node_source(meta: dict) -> str:
    """The user's source line a node came from: `file:line in function: code` (the
    innermost frame of its stack trace, the form the dumper's record_stack writes)."""
    trace = meta.get("stack_trace") or ""
    lines = trace.rstrip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        m = _FRAME.search(lines[i])
        if m:
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            return f"{m.group(1)}:{m.group(2)} in {m.group(3)}: {code}"
    return ""
