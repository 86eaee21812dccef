"""JSON text read from a dump (root and op attributes, catalog rows, statistics table
values, the original layout's bookkeeping) parsed with a bound on its nesting: json.loads
recurses once per bracket, so `[[[...]]]` 3,000 deep raised RecursionError (an internal
error) in every command that read it. Text nested deeper than MAX_DEPTH is a ValueError,
as any other malformed JSON, before json.loads sees it. Torch-free, numpy-free."""

from __future__ import annotations

import json
import re
from typing import Any

# deeper than anything a writer stores (catalog rows: 6 levels; nested lists of values: a
# few more); far below the interpreter's recursion limit
MAX_DEPTH = 64

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKET = re.compile(r"[\[\]{}]")


def depth(text: str) -> int:
    """The deepest nesting of brackets outside strings."""
    deepest = level = 0
    for m in _BRACKET.finditer(_STRING.sub("", text)):
        if m.group() in "[{":
            level += 1
            deepest = max(deepest, level)
        else:
            level -= 1
    return deepest


def loads(text: str | bytes, max_depth: int = MAX_DEPTH) -> Any:
    """json.loads, refusing (ValueError) text nested deeper than `max_depth`. Costs two
    str.count calls on text with fewer brackets than that (every row a writer stores)."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    if text.count("[") + text.count("{") > max_depth and depth(text) > max_depth:
        raise ValueError(f"JSON nested deeper than {max_depth} levels")
    return json.loads(text)
