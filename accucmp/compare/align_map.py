"""The --align-map file: the user's overrides for aligning different op streams (align.py),
read and checked (torch-free).

JSON {"modules": {T: G}, "ops": {"T1+T2": "G1+G2+G3"}}, or plain lines
`module T = G` / `op T1+T2 = G1+G2` ('#' starts a comment); a bad file is an
AlignMapError naming the file (and line) and the problem.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


class AlignMapError(ValueError):
    """The --align-map file cannot be used (the message names the file and the problem)."""


@dataclass
class AlignMap:
    """Override: target module path -> golden module path, and target op run -> golden op run
    (op names as tuples; a name matches an op whose name is it or starts with it plus '.')."""

    modules: dict[str, str] = field(default_factory=dict)
    ops: list[tuple[tuple[str, ...], tuple[str, ...]]] = field(default_factory=list)


def _op_list(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split("+") if p.strip())


def load_map(path: str | None) -> AlignMap | None:
    """Read an --align-map file: JSON {"modules": {T: G}, "ops": {"T1+T2": "G1+G2+G3"}}, or
    plain lines `module T = G` / `op T1+T2 = G1+G2` ('#' starts a comment)."""
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as e:
        raise AlignMapError(f"{path}: cannot read align map: {e}") from e
    amap = AlignMap()
    if text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise AlignMapError(f"{path}: not valid JSON: {e}") from e
        bad = set(data) - {"modules", "ops"}
        if bad or not all(isinstance(data.get(k, {}), dict) for k in ("modules", "ops")):
            raise AlignMapError(f"{path}: expected {{\"modules\": {{...}}, \"ops\": {{...}}}}, got keys {sorted(data)}")
        for t, g in data.get("modules", {}).items():
            amap.modules[str(t)] = str(g)
        for t, g in data.get("ops", {}).items():
            amap.ops.append((_op_list(str(t)), _op_list(str(g))))
    else:
        for n, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            kind, _, rest = line.partition(" ")
            t, eq, g = rest.partition("=")
            if kind not in ("module", "op") or not eq or not t.strip() or not g.strip():
                raise AlignMapError(f"{path}:{n}: expected 'module TARGET = GOLDEN' or 'op A+B = C+D', got {line!r}")
            if kind == "module":
                amap.modules[t.strip()] = g.strip()
            else:
                amap.ops.append((_op_list(t), _op_list(g)))
    if not amap.modules and not amap.ops:
        raise AlignMapError(f"{path}: align map holds no module or op mapping")
    return amap
