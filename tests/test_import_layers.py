"""The packages form a layered graph: dumpfile (torch-free) <- npu_dumper <- ir2tbe <- accucmp.
No package imports one above it, not even lazily inside a function."""

from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("dumpfile", "npu_dumper", "ir2tbe", "accucmp", "sample_models")


def _package_imports() -> dict[str, dict[str, list[str]]]:
    """package -> imported package -> files that import it (every import statement, at
    module level or inside a function)."""
    graph: dict[str, dict[str, list[str]]] = {p: {} for p in PACKAGES}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top in PACKAGES and top != pkg:
                        graph[pkg].setdefault(top, []).append(str(path.relative_to(ROOT)))
    return graph


def _cycle(graph: dict[str, dict]) -> list[str]:
    """One cycle in the graph as a path, or []."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str]:
        state[n] = 1
        stack.append(n)
        for m in graph.get(n, {}):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return []

    for n in graph:
        if n not in state:
            found = visit(n)
            if found:
                return found
    return []


def test_no_cycle_between_packages():
    graph = _package_imports()
    cycle = _cycle(graph)
    assert not cycle, " -> ".join(cycle) + f": {graph}"
    assert not graph["dumpfile"], f"dumpfile is the bottom layer, yet imports {graph['dumpfile']}"
    assert set(graph["npu_dumper"]) <= {"dumpfile"}, graph["npu_dumper"]


def test_cycle_finder_finds_one():
    assert _cycle({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b": 1}, "b": {}}) == []


def _loaded_after_import(package: str, code: str = "") -> set[str]:
    script = (f"import sys, json\nimport {package}\n{code}\n"
              "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600, check=True).stdout
    return set(json.loads(out.strip().splitlines()[-1]))


def test_fresh_interpreter_loads_only_lower_layers():
    assert not {"torch", "npu_dumper", "ir2tbe", "accucmp"} & _loaded_after_import("dumpfile")
    assert not {"ir2tbe", "accucmp"} & _loaded_after_import("npu_dumper")
    assert "accucmp" not in _loaded_after_import("ir2tbe")


def test_acl_dump_policy_found_through_the_registry():
    """dumper(load_with_acl_dump=True) without importing ir2tbe first: the registry imports
    the provider it names, which registers itself."""
    loaded = _loaded_after_import("npu_dumper", (
        "import types\n"
        "from npu_dumper.capture.policy import make_policy\n"
        "p = make_policy('load_with_acl_dump', types.SimpleNamespace(acl_config='x/acl.json'))\n"
        "assert type(p).__module__ == 'ir2tbe.acl_policy', type(p)\n"))
    assert "ir2tbe" in loaded


def test_golden_replay_is_a_plain_function_and_replay_a_plain_package():
    """npu_dumper.replay is the package of replay modes (no callable-module trick); golden
    replay is the function npu_dumper.golden_replay."""
    import types

    import npu_dumper
    from npu_dumper.replay import golden
    assert isinstance(npu_dumper.replay, types.ModuleType) and not callable(npu_dumper.replay)
    assert npu_dumper.golden_replay is golden.replay
    from npu_dumper.replay.emulation import emulate_npu
    assert emulate_npu is npu_dumper.emulate_npu

