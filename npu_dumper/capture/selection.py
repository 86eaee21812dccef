"""Which ops a dump block records (OpFilter: op patterns, module prefixes, phases) and
where the user's code called them from (user_stack_line, for record_stack=True)."""

from __future__ import annotations

import os
import traceback

import torch

from dumpfile import schema as S
from dumpfile.opfilter import OpSelection

_TORCH_DIR = os.path.dirname(torch.__file__)
# npu_dumper/ (this file's package's parent): frames of the dumper itself are not the user's
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class OpFilter(OpSelection):
    """include/exclude op patterns, module-path prefixes, phases. Decided once per op name."""

    def __init__(self, include=None, exclude=None, modules=None, phases=None):
        phase_list = _as_list(phases, "phases") if phases is not None else None
        super().__init__(_as_list(include, "include"), _as_list(exclude, "exclude"),
                         _as_list(modules, "modules"), phase_list)
        if self.phases is not None and not self.phases <= set(S.PHASES):
            from ..errors import DumperError
            raise DumperError(f"phases must be a subset of {S.PHASES}, got {sorted(self.phases)}")


def _as_list(v, name: str = "option") -> list[str]:
    if v is None:
        return []
    if isinstance(v, str):
        return [v]
    try:
        items = list(v)
    except TypeError:
        items = None
    if items is None or not all(isinstance(x, str) for x in items):
        from ..errors import DumperError
        raise DumperError(f"{name} must be a string or a list of strings, got {v!r}")
    return items


def user_stack_line() -> str:
    """The innermost frame outside torch and npu_dumper: 'file:line in func: code'."""
    for fr in reversed(traceback.extract_stack()):
        f = os.path.abspath(fr.filename)
        if f.startswith(_TORCH_DIR) or f.startswith(_OWN_DIR):
            continue
        return f"{fr.filename}:{fr.lineno} in {fr.name}: {(fr.line or '').strip()}"
    return ""
