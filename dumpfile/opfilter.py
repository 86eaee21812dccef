"""Which ops a filtered dump selected (include/exclude op patterns, module prefixes, phases).

Torch-free, shared by the dumper (which ops to write) and accucmp (to compare a filtered
dump with an unfiltered one like with like: the other side's ops are passed through the
same selection before pairing, so an op the filter dropped does not shift the pairing).
The dumper records its selection as the root attribute `op_filter` (JSON).
"""

from __future__ import annotations

import fnmatch
import json
import re
from typing import Any

def matches(pattern: str, name: str) -> bool:
    """Glob or regex against the full overload name, the packet name and the bare name."""
    parts = name.split(".")
    candidates = (name, ".".join(parts[:2]), parts[1] if len(parts) > 1 else name)
    if any(fnmatch.fnmatchcase(c, pattern) for c in candidates):
        return True
    try:
        rx = re.compile(pattern)
    except re.error:
        return False
    return any(rx.fullmatch(c) for c in candidates)


def module_selected(module: str, prefixes: list[str]) -> bool:
    return any(module == m or module.startswith(m + ".") or m == "" for m in prefixes)


class OpSelection:
    """include/exclude patterns, module-path prefixes, phases (None: every phase)."""

    def __init__(self, include=(), exclude=(), modules=(), phases=None):
        self.include = list(include or ())
        self.exclude = list(exclude or ())
        self.modules = list(modules or ())
        self.phases = set(phases) if phases is not None else None
        self._by_name: dict[str, bool] = {}

    @property
    def trivial(self) -> bool:
        return not (self.include or self.exclude or self.modules or self.phases is not None)

    def op_selected(self, name: str) -> bool:
        ok = self._by_name.get(name)
        if ok is None:
            ok = ((not self.include or any(matches(p, name) for p in self.include))
                  and not any(matches(p, name) for p in self.exclude))
            self._by_name[name] = ok
        return ok

    def selected(self, name: str, phase: str, module: str) -> bool:
        if not self.op_selected(name):
            return False
        if self.phases is not None and phase not in self.phases:
            return False
        if self.modules and not module_selected(module, self.modules):
            return False
        return True

    def to_json(self) -> str:
        d: dict[str, Any] = {"include": self.include, "exclude": self.exclude, "modules": self.modules}
        if self.phases is not None:
            d["phases"] = sorted(self.phases)
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "OpSelection":
        d = json.loads(text)
        if not isinstance(d, dict):
            raise ValueError("op_filter is not a JSON object")
        def strings(k):
            v = d.get(k) or []
            if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
                raise ValueError(f"op_filter {k!r} is not a list of strings")
            return v
        return cls(strings("include"), strings("exclude"), strings("modules"),
                   strings("phases") if "phases" in d else None)

    def __eq__(self, other) -> bool:
        return isinstance(other, OpSelection) and self.to_json() == other.to_json()

    def describe(self) -> str:
        parts = [f"{k}={v}" for k, v in (("include", self.include), ("exclude", self.exclude),
                                        ("modules", self.modules)) if v]
        if self.phases is not None:
            parts.append(f"phases={sorted(self.phases)}")
        return ", ".join(parts)
