"""Which torch op a recorded op name is, and whether a call of it draws random numbers
(so that its result cannot be reproduced from its inputs alone). Used by every replay
mode, `accucmp demo` and ir2tbe through recorded.py's callers.
"""

from __future__ import annotations

from typing import Any

import torch

from ..capture.opschema import op_info


def resolve_op(name: str) -> Any:
    """'aten.addmm.default' -> torch.ops.aten.addmm.default (any namespace), or None.

    Also accepts 'aten::addmm.default', 'aten.addmm' (the default overload) and the
    original dumper's wrapper names such as 'add_Tensor' / 'addmm'.
    """
    name = name.replace("::", ".")
    parts = name.split(".")
    candidates: list[tuple[str, str, str]] = []
    if len(parts) >= 3:
        candidates.append((parts[0], parts[1], ".".join(parts[2:])))
    elif len(parts) == 2:
        candidates.append((parts[0], parts[1], "default"))
    elif parts[0]:
        base, _, overload = parts[0].rpartition("_")
        if base and overload[:1].isupper():          # 'add_Tensor' -> aten.add.Tensor
            candidates.append(("aten", base, overload))
        candidates.append(("aten", parts[0], "default"))
    for ns, op, overload in candidates:
        try:
            packet = getattr(getattr(torch.ops, ns), op)
            return getattr(packet, overload)
        except (AttributeError, RuntimeError):
            continue
    return None


def is_random(func: Any) -> bool:
    return op_info(func).is_random


# Seeded ops that draw nothing for some arguments: attention and dropout with a zero
# probability, dropout outside training. Keyed by argument name, as the schemas spell it.
_NO_DRAW_WHEN = {"dropout_p": 0.0, "p": 0.0, "train": False}


def draws_random(func: Any, named_args: dict[str, Any]) -> bool:
    """Whether this call of `func` consumes random numbers (so its result cannot be
    reproduced from its inputs alone)."""
    if not is_random(func):
        return False
    info = op_info(func)
    for i, name in enumerate(info.arg_names):
        if name not in _NO_DRAW_WHEN:
            continue
        value = named_args.get(name, info.defaults[i])
        if isinstance(value, (bool, int, float)) and value == _NO_DRAW_WHEN[name]:
            return False
    return True
