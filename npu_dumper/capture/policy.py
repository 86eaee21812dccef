"""How the dispatch mode's per-op pipeline is extended (dump, load-replay, overflow, ACL dump).

The mode (npu_dumper/capture/mode.py) owns interception, seqids, phase/module attribution,
snapshots and the writer thread. Everything a mode of operation changes is a
Policy with these hooks, called for every *eligible* op (outermost, not a skipped
view op, passing the user's filters), in this order:

    ev = OpEvent(...)                      # seqid assigned, live args
    for p in policies: p.before_op(ev)     # may replace ev.args/ev.kwargs (replay)
    inputs captured (pre-op snapshot)
    out = first policy whose run_op() does not return NotImplemented, else func(*args)
    ev.outputs = out; outputs captured
    record = all(p.should_record(ev) for p in policies)
    if record: written under ev.store_op / ev.store_seqid (policies may change them)
    for p in policies: p.after_op(ev, recorded=record)

`begin(session)` runs at block entry (before the model runs: validate inputs there,
raising npu_dumper.errors.DumperError subclasses), `end(session)` at exit (summaries).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable


class OpEvent:
    """One eligible op as the policies see it. A slotted class with a plain __init__, not a
    dataclass: one is made per recorded op in the model's thread, and the dataclass (two
    default_factory dicts and __post_init__) cost three times as much."""

    __slots__ = ("func", "name", "args", "kwargs", "seqid", "phase", "module", "grad_fn",
                 "stack", "outputs", "store_op", "store_seqid", "group_attrs", "notes")

    def __init__(self, func: Any, name: str, args: tuple, kwargs: dict, seqid: int, phase: str,
                 module: str = "", grad_fn: str = "", stack: str = "", outputs: Any = None,
                 store_op: str = "", store_seqid: int = 0, group_attrs: dict | None = None,
                 notes: dict | None = None):
        self.func = func                  # torch._ops.OpOverload
        self.name = name                  # str(func): "aten.addmm.default"
        self.args = args
        self.kwargs = kwargs
        self.seqid = seqid                # live stream position, 1-based, every eligible op
        self.phase = phase                # "forward" / "backward"
        self.module = module
        self.grad_fn = grad_fn
        self.stack = stack
        self.outputs = outputs            # the op's return value, after it ran
        self.store_op = store_op or name          # name written to the file
        self.store_seqid = store_seqid or seqid   # seqid written to the file
        # extra per-op attributes to write; scratch space shared between policies
        self.group_attrs = {} if group_attrs is None else group_attrs
        self.notes = {} if notes is None else notes

    def __repr__(self) -> str:
        return f"OpEvent({self.name} #{self.seqid} {self.phase} {self.module!r})"


class Policy:
    """Base: records every op unchanged (plain dump)."""

    # begin() starts a child process of its own before the dump's writer starts (load-replay
    # probes its golden, dumpfile.read.probe): the dumper starts the writer's child first, so
    # that the two start side by side
    starts_a_child = False
    # its before_op runs before the other policies' (their before_op reads what it notes)
    before_others = False
    # its before_op puts other values in the op's arguments (load-replay's recorded inputs)
    substitutes_inputs = False

    def begin(self, session: Any) -> None:
        pass

    def before_op(self, ev: OpEvent) -> None:
        pass

    def run_op(self, ev: OpEvent) -> Any:
        return NotImplemented

    def should_record(self, ev: OpEvent) -> bool:
        return True

    def op_computed(self, ev: OpEvent) -> None:
        """The op was computed by code the dumper does not run (a node of a torch.compile'd
        graph, npu_dumper/compiled/): `ev.outputs` holds its result, `ev.args` its inputs,
        which the computation did not write. Called before the record is written, so
        `ev.group_attrs` still reaches the file."""

    def after_op(self, ev: OpEvent, recorded: bool) -> None:
        pass

    def end(self, session: Any) -> None:
        pass

    def root_attrs(self) -> dict[str, Any]:
        """Root attributes this mode adds to the dump when it closes (after end())."""
        return {}


# ---- policies that packages above npu_dumper provide ----------------------------------
# dumper option -> factory(dumper) -> Policy. ir2tbe's ACL kernel dump registers itself
# here when it is imported, so npu_dumper imports nothing of ir2tbe (the packages stay a
# layered graph: ir2tbe -> npu_dumper -> dumpfile). A user who only enters
# torch.utils.dumper(load_with_acl_dump=True) has not imported the provider: its module is
# named here as data (as a packaging entry point would name it) and imported on first use.
_FACTORIES: dict[str, Callable[[Any], Policy]] = {}
PROVIDERS: dict[str, str] = {"load_with_acl_dump": "ir2tbe.acl_policy"}


def register_policy(option: str, factory: Callable[[Any], Policy]) -> None:
    """Make dumper option `option` add `factory(dumper)` to the session's policies."""
    _FACTORIES[option] = factory


def make_policy(option: str, session: Any) -> Policy:
    """The policy registered for `option`, importing its provider module if needed."""
    factory = _FACTORIES.get(option)
    if factory is None and option in PROVIDERS:
        importlib.import_module(PROVIDERS[option])      # registers itself
        factory = _FACTORIES.get(option)
    if factory is None:
        raise LookupError(f"no policy registered for dumper option {option!r}")
    return factory(session)
