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

from dumpfile import jsontext

# A pattern read from a file (the root attribute op_filter) is run against every op name of
# both dumps: a regex with nested quantifiers (`(.|.)*Z`) backtracks exponentially and hung
# `compare`. Python's re has no time limit, so a file's pattern is checked before it is
# compiled (file_pattern_problem): no quantifier over a group holding another quantifier
# or an alternation, no backreference, at most MAX_UNBOUNDED_REPEATS quantifiers that may
# repeat more than MAX_SMALL_REPEAT times, at most MAX_PATTERN_CHARS characters. What is
# left matches in at most O(n^2) steps for a name of n characters, and names longer than
# MAX_NAME_CHARS (no op's: ATen names are < 100) are matched by glob only.
MAX_PATTERN_CHARS = 256
MAX_UNBOUNDED_REPEATS = 2
MAX_SMALL_REPEAT = 16
MAX_NAME_CHARS = 1024
MAX_PATTERNS = 1000


def file_pattern_problem(pattern: str) -> str | None:
    """Why a pattern read from a file may not be run as a regex (None: it may). Globs pass:
    a string that is no valid regex is only ever matched with fnmatch."""
    if len(pattern) > MAX_PATTERN_CHARS:
        return f"longer than {MAX_PATTERN_CHARS} characters"
    try:
        from re import _parser as parser       # (sre_parse before Python 3.11)
    except ImportError:                          # pragma: no cover
        import sre_parse as parser              # type: ignore[no-redef]
    try:
        tree = parser.parse(pattern)
    except (re.error, RecursionError, OverflowError):
        return None                              # not a regex: a glob
    const = parser
    repeats = (const.MAX_REPEAT, const.MIN_REPEAT, getattr(const, "POSSESSIVE_REPEAT", None))
    unbounded = 0

    def walk(items, inside_repeat: bool) -> str | None:
        nonlocal unbounded
        for op, av in items:
            if op in (const.GROUPREF, getattr(const, "GROUPREF_EXISTS", None)):
                return "a backreference"
            if op in repeats and op is not None:
                lo, hi, sub = av
                if hi > MAX_SMALL_REPEAT:
                    unbounded += 1
                if inside_repeat and hi > 1:
                    return "a quantifier inside a quantified group (nested quantifiers)"
                why = walk(sub, inside_repeat or hi > 1)
                if why:
                    return why
            elif op is const.BRANCH:
                if inside_repeat:
                    return "an alternation inside a quantified group"
                for alt in av[1]:
                    why = walk(alt, inside_repeat)
                    if why:
                        return why
            elif op is const.SUBPATTERN:
                why = walk(av[-1], inside_repeat)
                if why:
                    return why
            elif op in (const.ASSERT, const.ASSERT_NOT):
                why = walk(av[1], inside_repeat)
                if why:
                    return why
            elif op in (getattr(const, "ATOMIC_GROUP", None),) and op is not None:
                why = walk(av, inside_repeat)
                if why:
                    return why
        return None

    why = walk(tree, False)
    if why is None and unbounded > MAX_UNBOUNDED_REPEATS:
        why = f"more than {MAX_UNBOUNDED_REPEATS} unbounded quantifiers"
    return why


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
    return any(rx.fullmatch(c) for c in candidates if len(c) <= MAX_NAME_CHARS)


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
        d = jsontext.loads(text)
        if not isinstance(d, dict):
            raise ValueError("op_filter is not a JSON object")
        def strings(k):
            v = d.get(k) or []
            if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
                raise ValueError(f"op_filter {k!r} is not a list of strings")
            if len(v) > MAX_PATTERNS:
                raise ValueError(f"op_filter {k!r} holds {len(v)} entries (at most {MAX_PATTERNS})")
            if k in ("include", "exclude"):
                for p in v:
                    why = file_pattern_problem(p)
                    if why:
                        raise ValueError(f"op_filter {k!r} pattern {p[:60]!r} has {why}: a file's regular "
                                         "expression is not run unless it matches in bounded time; refused")
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
