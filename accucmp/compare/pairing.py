"""The match stage: which op of one dump pairs with which op of the other (torch-free).

match_ops takes the two open dumps and their op lists and returns a Matched: the op
pairs in execution order (a side None when unmatched), how they were paired (by seqid
for a replay or an extract, else by aligning the name streams, with the leftovers
aligned into regions), the io groups both dumps recorded, and what the comparison's
meta says about it. The pairing algorithms themselves are matching.py (ops, and
tensors within a pair) and align.py (regions of fused vs decomposed ops).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dumpfile import schema as S
from dumpfile.read.reader import DumpFile, h5_errors

from accucmp.compare import align, matching


@dataclass(frozen=True, slots=True)
class Matched:
    """The match stage's result, handed to the read stage (rows.py) pair by pair."""

    pairs: tuple[matching.OpPair, ...]  # execution order
    replay: bool                        # paired by seqid (the files share the numbering)
    inherit: bool                       # carry precision forward (independent runs, not replays)
    ios: tuple[str, ...]                # the io groups both dumps recorded
    target_ops: int                     # ops taking part, after the filters and --select
    golden_ops: int
    target_filter: str                  # each dump's own op filter, described
    golden_filter: str
    ops_left_out: int                   # by the other dump's op filter
    notes: tuple[str, ...]
    aligned_regions: tuple[str, ...]
    warnings: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class OpChoice:
    """Which ops a compare takes part in: `--select` (a regex searched in the op name or the
    module path) and `--exclude` (op-name patterns with the dumper's `exclude=` syntax,
    dumpfile.opfilter.matches: a glob or a regex against the full overload name, the packet
    name and the bare name). Applied to both dumps, and so to every check made of them
    (the folder compare's replica check runs the same selection)."""

    select: re.Pattern | None = None
    exclude: tuple[str, ...] = ()

    def keeps(self, op) -> bool:
        from dumpfile.opfilter import matches

        if self.select is not None and not (self.select.search(op.op) or self.select.search(op.module or "")):
            return False
        return not any(matches(p, op.op) for p in self.exclude)

    @property
    def trivial(self) -> bool:
        return self.select is None and not self.exclude


def _attr_text(v) -> str:
    if v is None:
        return ""
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


def _compiled_vs_eager(tf: DumpFile, gf: DumpFile) -> bool:
    with h5_errors(tf.path):
        t = _attr_text(tf.attrs.get(S.ROOT_COMPILED))
    with h5_errors(gf.path):
        g = _attr_text(gf.attrs.get(S.ROOT_COMPILED))
    return bool(t) != bool(g)


def _note_outside_compiled(pairs: list, tf: DumpFile, gf: DumpFile) -> None:
    """A compiled dump (docs/COMPILED.md) records the ops of the compiled graphs only: an
    eager op it lacks ran outside them, or (split "module") inside a fused piece. Said so
    in the unmatched op's reason instead of "no data match", whichever role the compiled
    dump has."""
    with h5_errors(tf.path):
        t_split = _attr_text(tf.attrs.get(S.ROOT_COMPILED))
    with h5_errors(gf.path):
        g_split = _attr_text(gf.attrs.get(S.ROOT_COMPILED))
    if bool(t_split) == bool(g_split):
        return
    split, path = (t_split, tf.path) if t_split else (g_split, gf.path)
    why = ("not in the compiled graphs of {path}: run outside torch.compile (the loss after the "
           "model, the backward seed, code at a graph break)")
    if split != "node":
        why += f", or computed inside a fused piece (split {split!r}: never materialised)"
    for p in pairs:
        # an op of the eager dump with no partner in the compiled one
        eager_only = p.golden if p.target is None else None if t_split else p.target if p.golden is None else None
        if eager_only is not None:
            p.reason = f"{eager_only.op} " + why.format(path=path)


def _selected_across(sel):
    """A test of whether the other dump's op filter `sel` selects an op: its module prefixes
    and the op's path compared without wrapper components (dumpfile.departures.
    unwrapped_module), so a DDP run filtered to `module.fc1` selects an unwrapped run's
    `fc1`, and the other way."""
    if not sel.modules:
        return lambda op: sel.selected(op.op, op.phase, op.module)
    from dumpfile.departures import unwrapped_module
    from dumpfile.opfilter import OpSelection

    bare = OpSelection(sel.include, sel.exclude, [unwrapped_module(m) for m in sel.modules], sel.phases)
    return lambda op: (sel.selected(op.op, op.phase, op.module)
                       or bare.selected(op.op, op.phase, unwrapped_module(op.module)))


def match_ops(tf: DumpFile, gf: DumpFile, t_ops: list, g_ops: list, pattern=None, amap=None,
              repair_shapes: bool = True) -> Matched:
    """Pair the ops `t_ops` of `tf` with the ops `g_ops` of `gf` (each file's ops() in
    execution order); `pattern`: --select (a compiled regex) or an OpChoice (--select and
    --exclude), `amap`: the --align-map overrides."""
    from dumpfile.bookkeeping import is_bookkeeping
    from dumpfile.golden_info import read_not_replayed

    # A filtered dump (include/exclude/modules/phases) against one filtered differently or
    # not at all: pass each side's ops through the other's selection, so both streams hold
    # the ops both runs would have written; otherwise the name-stream alignment pairs a
    # selected op with a same-named op the filter dropped (another layer's mm).
    with h5_errors(tf.path):
        t_sel = tf.op_filter
    with h5_errors(gf.path):
        g_sel = gf.op_filter
    filtered_out = 0
    if t_sel != g_sel:
        n = len(t_ops) + len(g_ops)
        if g_sel is not None:
            keep = _selected_across(g_sel)
            t_ops = [o for o in t_ops if keep(o)]
        if t_sel is not None:
            keep = _selected_across(t_sel)
            g_ops = [o for o in g_ops if keep(o)]
        filtered_out = n - len(t_ops) - len(g_ops)
    # profiler labels an older dump recorded: no numerics to pair (dumpfile/bookkeeping.py)
    if any(is_bookkeeping(o.op) for o in t_ops) or any(is_bookkeeping(o.op) for o in g_ops):
        t_ops = [o for o in t_ops if not is_bookkeeping(o.op)]
        g_ops = [o for o in g_ops if not is_bookkeeping(o.op)]
    choice = pattern if isinstance(pattern, OpChoice) or pattern is None else OpChoice(pattern)
    if choice is not None and not choice.trivial:
        t_ops, g_ops = [o for o in t_ops if choice.keeps(o)], [o for o in g_ops if choice.keeps(o)]
    with h5_errors(gf.path):
        not_replayed = read_not_replayed(gf.h5)
    if _compiled_vs_eager(tf, gf) and not matching.is_replay_pairing(tf.mode, gf.mode):
        io = S.INPUT_GROUP if all(S.INPUT_GROUP in f.recorded_io for f in (tf, gf)) else S.OUTPUT_GROUP
        pairs = matching.pair_by_stream(t_ops, g_ops, key=matching.compiled_signature(io))
    else:
        pairs = matching.pair_ops(t_ops, g_ops, target_mode=tf.mode, golden_mode=gf.mode,
                                  golden_missing_reasons=not_replayed)
    _note_outside_compiled(pairs, tf, gf)
    replay = matching.is_replay_pairing(tf.mode, gf.mode)
    warnings = []
    # An extracted file (accucmp extract: a few ops of a run, under their seqids) against
    # a whole dump: the name-stream alignment pairs its mm/13 with the run's first mm. When
    # its seqids line up with the other file's (same names at the same seqids), pair by
    # seqid and leave out the other file's ops the extract does not hold.
    subset_note = ""
    from accucmp.extract import ROOT_EXTRACTED_FROM

    extracted = [f for f in (tf, gf) if f.attrs.get(ROOT_EXTRACTED_FROM) is not None]
    if not replay and extracted:
        seqs_t, seqs_g = {o.seqid for o in t_ops}, {o.seqid for o in g_ops}
        # the whole dump's ops the extract holds (both extracted: the seqids both hold)
        t_sub = t_ops if gf not in extracted else [o for o in t_ops if o.seqid in seqs_g]
        g_sub = g_ops if tf not in extracted else [o for o in g_ops if o.seqid in seqs_t]
        trial = matching.pair_by_seqid(t_sub, g_sub)
        bad, both = matching.seqid_name_mismatches(trial)
        if both and bad <= matching.MAX_SEQID_NAME_MISMATCH * both:
            left_out = len(t_ops) + len(g_ops) - len(t_sub) - len(g_sub)
            pairs, replay = trial, True
            t_ops, g_ops = t_sub, g_sub
            subset_note = (f"{' and '.join(f.path for f in extracted)} extracted: paired by seqid"
                           + (f", {left_out} op(s) of the other file outside the extract left out" if left_out else ""))
    if replay:
        bad, both = matching.seqid_name_mismatches(pairs)
        if both and bad > matching.MAX_SEQID_NAME_MISMATCH * both:
            replay = False
            pairs = matching.pair_by_stream(t_ops, g_ops)
            src = _attr_text(tf.attrs.get(S.ROOT_LOAD_FILE) or gf.attrs.get(S.ROOT_LOAD_FILE))
            warnings.append(f"seqids do not line up: {bad} of {both} ops paired by seqid have different names, "
                            f"so {gf.path} is not the file {tf.path} was replayed from"
                            + (f" ({src})" if src else "") + "; paired by aligning the op streams instead")
    # Independent runs that computed one thing with different ops (fused attention vs
    # bmm+softmax+bmm): the ops both sides left unmatched, aligned many-to-one (align.py)
    regions = []
    repaired = 0
    if not replay:
        # a name pair whose tensors cannot be one op's (a run that makes one op's calls in
        # another order) is re-paired by shape or left unmatched (matching.repair_incompatible)
        if repair_shapes:
            pairs, repaired = matching.repair_incompatible(pairs, op_signature)
            pairs, _ = matching.split_unfit_by_design(pairs, op_signature)
            pairs, _ = matching.split_unfit_islands(pairs, op_signature)
        pairs, regions = align.align_pairs(pairs, amap)
    # Only the io groups both dumps recorded: a load-replay dump holds outputs only (its
    # inputs are the golden's by construction), and dump_mode=input/output dumps hold one
    # side; the other side's tensors are not "unmatched", they were never asked for.
    ios = tuple(io for io in (S.INPUT_GROUP, S.OUTPUT_GROUP)
                if io in tf.recorded_io and io in gf.recorded_io)
    return Matched(tuple(pairs), replay, not matching.is_replay_pairing(tf.mode, gf.mode), ios,
                   len(t_ops), len(g_ops), t_sel.describe() if t_sel else "", g_sel.describe() if g_sel else "",
                   filtered_out, tuple(([subset_note] if subset_note else []) + align.notes(regions)
                                       + ([f"{repaired} pair(s) of same-named ops whose shapes or phases cannot "
                                           "match re-paired by shape (one run makes that op's calls in another "
                                           "order)"] if repaired else [])),
                   tuple(r.description for r in regions), tuple(warnings))


def op_signature(op) -> matching.OpSignature:
    """An op's role (phase) and its tensors' shapes by name, from its catalog row where the
    file has one (dumpfile.read.catalog.op_shapes), else from its groups (rows.op_tensors
    without tensor data); no shapes when the op cannot be read (it then fits every partner
    and the rows say what is wrong with it)."""
    from accucmp.compare.rows import op_tensors
    from dumpfile.errors import DumpError
    from dumpfile.read.catalog import op_shapes

    try:
        found = op_shapes(op.file, op) if not getattr(op.file, "is_table", False) else None
        if found is not None:
            shapes = tuple((f"{io}/{n}", shape) for io, n, shape in found)
        else:
            ot = op_tensors(op, 0)
            shapes = tuple((f"{io}/{n}", tuple(int(d) for d in rec.shape)) for io, values in
                           ((S.INPUT_GROUP, ot.inputs), (S.OUTPUT_GROUP, ot.outputs)) for n, rec in values.items())
    except (DumpError, OSError, ValueError, KeyError, TypeError):
        shapes = ()
    return matching.OpSignature(op.phase or "", shapes)
