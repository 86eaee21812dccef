"""Ops that are bookkeeping, not numerics, by op namespace (torch-free, shared by the dumper,
golden replay and compare). issue 35 item 3.

`torch.profiler.record_function` (which `optimizer.zero_grad()`, `optimizer.step()` and
DataLoader use) dispatches `profiler::_record_function_enter_new` and
`profiler::_record_function_exit`: a label in, an opaque handle (a ScriptObject) out, no
tensor either way. Nothing in them can be replayed or compared, so the dumper does not
record them (they take no seqid, so a step dumps the same ops whether or not a profiler
label wraps part of it), golden replay skips them in older dumps without listing them as
failures, and compare leaves them out of the pairing. Kept as data keyed by namespace, as
opschema.COLLECTIVE_NAMESPACES is.
"""

from __future__ import annotations

# namespace -> why its ops carry no numerics
BOOKKEEPING_NAMESPACES: dict[str, str] = {
    "profiler": "profiler label (record_function): no tensor in or out",
}


def namespace_of(op: str) -> str:
    """'profiler._record_function_enter_new.default' -> 'profiler' (a dump's op name);
    'profiler::_record_function_enter_new' -> 'profiler' (a schema name)."""
    return op.split("::", 1)[0] if "::" in op else op.split(".", 1)[0]


def is_bookkeeping(op: str) -> bool:
    return namespace_of(op) in BOOKKEEPING_NAMESPACES
