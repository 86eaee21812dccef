"""Pair the target's ops with the golden's, and within a pair, tensors with tensors.

Two regimes (decided by `pair_ops`):
- replay: the target (or golden) was written by load-replay or golden replay, so its
  seqids *are* the other file's seqids: pair by identical seqid.
- independent runs: seqids are unrelated. Op names are first made canonical through
  the op-name map (dumpfile.opmap_data: cudnn vs native batch norm etc.), then the
  two canonical op streams are aligned (difflib.SequenceMatcher between a common
  prefix and suffix) so an op inserted or missing on one side does not shift every
  later pair: first the ops that compute, then the casts, copies and views between
  each two of their pairs. Inside a region the alignment could not pair, ops pair by
  canonical name and k-th call. Equal streams (the usual case) pair one to one without
  difflib.

Ops left over stay as unmatched pairs, on both sides, with a reason. A name pair whose
ops cannot be one op's calls (another phase, shapes that cannot match) is re-paired with
the same-named ops near it by shape (`repair_incompatible`, run by pairing.match_ops).
"""

from __future__ import annotations

import difflib
import functools
import itertools
from dataclasses import dataclass
from typing import Iterable

from dumpfile import schema as S
from dumpfile.departures import is_by_design_op, unwrapped_module
from dumpfile.read import legacy
from dumpfile.opmap_data import build_equivalence, build_renames, packet_of
from dumpfile.read.reader import OpRecord, ValueRecord

# SequenceMatcher is quadratic on repetitive streams: above this many ops in the
# differing middle, fall back to name + k-th call there.
MAX_ALIGN_OPS = 4000

_EQUIV = build_equivalence()
_RENAMES = build_renames()
REPLAY_MODES = (S.MODE_LOAD, S.MODE_GOLDEN)


@dataclass(slots=True)   # one per op pair of a compare: no per-instance dict (~100 B each)
class OpPair:
    target: OpRecord | None
    golden: OpRecord | None
    matched_by: str = ""     # "seqid", "name", "map", "region", "unmatched"
    reason: str = ""
    region: object = None    # align.Region when matched_by == "region" (ops of different streams)


@functools.lru_cache(maxsize=1 << 14)       # called per op of both dumps, names repeat
def canonical_op(name: str) -> str:
    """One name for every op the map says is equivalent; other names in the original
    layout's spelling (dumpfile.read.legacy: `aten.addmm.default` and an original file's
    `addmm` are one op), so a mixed pair (original file vs our dump) compares."""
    packet = packet_of(name)
    others = _EQUIV.get(packet)
    if not others:
        guess = legacy.aten_guess(name)
        if guess is not None:             # an original name: the map may know its ATen form
            packet = packet_of(guess)
            others = _EQUIV.get(packet)
    if not others:
        return legacy.legacy_op_name(name)
    return min((packet, *others))


def is_replay_pairing(target_mode: str, golden_mode: str) -> bool:
    return target_mode in REPLAY_MODES or golden_mode in REPLAY_MODES


def _how(t: OpRecord, g: OpRecord) -> str:
    return "name" if t.op == g.op else "map"


def _target_only(t: OpRecord, why: str = "") -> OpPair:
    if _recomputed(t):
        why = f"{t.op} re-run by activation checkpointing in backward; the golden run did not re-run it"
    return OpPair(t, None, "unmatched", why or f"No data match with {t.op} in golden dump data.")


def _recomputed(op: OpRecord) -> bool:
    """Whether an op is a forward op re-run during backward (read for unmatched ops only:
    an attribute read per op of a large dump would cost seconds)."""
    if getattr(op, "phase", "") != S.PHASE_BACKWARD:
        return False
    try:
        return bool(op.attrs.get(S.OP_RECOMPUTE, False))
    except Exception:  # noqa: BLE001 - a reason text only: the pairing stands without it
        return False


def _golden_only(g: OpRecord, why: str = "") -> OpPair:
    if _recomputed(g):
        why = f"{g.op} re-run by activation checkpointing in the golden's backward; my run did not re-run it"
    return OpPair(None, g, "unmatched", why or f"No data match with {g.op} in my dump data.")


def pair_by_seqid(target: list[OpRecord], golden: list[OpRecord],
                  golden_missing_reasons: dict[tuple[str, int], str] | None = None) -> list[OpPair]:
    """Replay regime: identical seqids pair. Output in seqid order."""
    by_seq = {g.seqid: g for g in golden}
    used: set[int] = set()
    pairs: list[OpPair] = []
    for t in target:
        g = by_seq.get(t.seqid)
        if g is None or g.seqid in used:
            pairs.append(_target_only(t, f"No data match with {t.op} (seqid {t.seqid}) in golden dump data."))
            continue
        used.add(g.seqid)
        p = OpPair(t, g, "seqid")
        if canonical_op(t.op) != canonical_op(g.op):
            p.reason = f"op names differ at seqid {t.seqid}: target {t.op}, golden {g.op}"
        pairs.append(p)
    reasons = golden_missing_reasons or {}
    for g in golden:
        if g.seqid not in used:
            why = reasons.get((g.op, g.seqid))
            pairs.append(_golden_only(g, (f"{g.op} seqid {g.seqid} not in my dump: {why}" if why else
                                          f"No data match with {g.op} (seqid {g.seqid}) in my dump data.")))
    pairs.sort(key=lambda p: (p.target or p.golden).seqid)
    return pairs


def _pair_kth(ts: list[OpRecord], gs: list[OpRecord], key=None) -> list[OpPair]:
    """k-th call of each canonical name pairs with the k-th; the rest unmatched.

    Output follows the target's order, golden-only ops placed after the pair that
    precedes them in the golden stream.
    """
    key = key or (lambda o: canonical_op(o.op))
    queues: dict = {}
    for j, g in enumerate(gs):
        queues.setdefault(key(g), []).append(j)
    heads: dict = {}
    g_to_t: dict[int, int] = {}
    for i, t in enumerate(ts):
        c = key(t)
        k = heads.get(c, 0)
        q = queues.get(c, ())
        if k < len(q):
            g_to_t[q[k]] = i
            heads[c] = k + 1
    t_to_g = {i: j for j, i in g_to_t.items()}
    out: list[OpPair] = []
    # golden-only ops before the first paired one go first
    pending = []
    emitted_g = set()
    last_t = -1
    for j, g in enumerate(gs):
        if j not in g_to_t:
            pending.append((last_t, j))
        else:
            last_t = max(last_t, g_to_t[j])
    after: dict[int, list[int]] = {}
    for lt, j in pending:
        after.setdefault(lt, []).append(j)
    for j in after.get(-1, []):
        out.append(_golden_only(gs[j]))
        emitted_g.add(j)
    for i, t in enumerate(ts):
        if i in t_to_g:
            g = gs[t_to_g[i]]
            out.append(OpPair(t, g, _how(t, g)))
        else:
            out.append(_target_only(t))
        for j in after.get(i, []):
            out.append(_golden_only(gs[j]))
    return out


def pair_by_stream(target: list[OpRecord], golden: list[OpRecord], key=None) -> list[OpPair]:
    """Independent runs: align the canonical op-name streams (`key`: what is aligned
    per op instead of its canonical name, e.g. compiled_signature).

    With the canonical names, the ops that compute (everything but what a device or
    precision change adds or drops by design: casts, copies, views, allocations,
    dumpfile.departures.is_by_design_op) are aligned first, and the ops between two of
    their aligned pairs are aligned with each other. Aligned all at once, the casts an
    autocast run adds before nearly every matmul cut the stream into short runs of
    repeated layers, and difflib's longest-block search matched one layer's ops with
    another's (T5 under bf16 autocast: 15 to 112 pairs in the wrong block, the verdict
    blaming an input that no op of the step made)."""
    if key is None:
        key = lambda o: canonical_op(o.op)     # noqa: E731
        anchored = True
    else:
        anchored = False
    tn = [key(t) for t in target]
    gn = [key(g) for g in golden]
    if tn == gn:
        return [OpPair(t, g, _how(t, g)) for t, g in zip(target, golden)]
    if anchored:
        ta = [i for i, t in enumerate(target) if not _by_design(t.op)]
        ga = [j for j, g in enumerate(golden) if not _by_design(g.op)]
        if ta and ga and (len(ta) < len(target) or len(ga) < len(golden)):
            syncs = _equal_matches([tn[i] for i in ta], [gn[j] for j in ga])
            if syncs is not None:
                out: list[OpPair] = []
                pt = pg = 0
                for a, b in syncs:
                    i, j = ta[a], ga[b]
                    out += _pair_names(target[pt:i], golden[pg:j], tn[pt:i], gn[pg:j], key)
                    out.append(OpPair(target[i], golden[j], _how(target[i], golden[j])))
                    pt, pg = i + 1, j + 1
                return out + _pair_names(target[pt:], golden[pg:], tn[pt:], gn[pg:], key)
    return _pair_names(target, golden, tn, gn, key)


@functools.lru_cache(maxsize=1 << 12)
def _by_design(name: str) -> bool:
    """An op a device or precision change adds or drops by design, by its name in either
    layout (the original tool's `_to_copy` as ours `aten._to_copy.default`)."""
    if is_by_design_op(name):
        return True
    guess = legacy.aten_guess(name)
    return guess is not None and is_by_design_op(guess)


def _common_ends(tn: list, gn: list) -> tuple[int, int]:
    """How many keys the two streams share at their start, and then at their end."""
    pre = 0
    while pre < min(len(tn), len(gn)) and tn[pre] == gn[pre]:
        pre += 1
    suf = 0
    while suf < min(len(tn), len(gn)) - pre and tn[-1 - suf] == gn[-1 - suf]:
        suf += 1
    return pre, suf


def _equal_matches(tn: list, gn: list) -> list[tuple[int, int]] | None:
    """The (i, j) of every element of an equal block when aligning `tn` with `gn` (a common
    prefix and suffix, difflib's equal blocks between them): increasing in both. None when
    the differing middle is too long to align (pair_by_stream then pairs by k-th call)."""
    pre, suf = _common_ends(tn, gn)
    tm, gm = tn[pre:len(tn) - suf], gn[pre:len(gn) - suf]
    if len(tm) > MAX_ALIGN_OPS or len(gm) > MAX_ALIGN_OPS:
        return None
    out = [(k, k) for k in range(pre)]
    for i1, j1, n in difflib.SequenceMatcher(None, tm, gm, autojunk=False).get_matching_blocks():
        out += [(pre + i1 + k, pre + j1 + k) for k in range(n)]
    return out + [(len(tn) - suf + k, len(gn) - suf + k) for k in range(suf)]


def _pair_names(target: list[OpRecord], golden: list[OpRecord], tn: list, gn: list, key) -> list[OpPair]:
    """Align the streams `tn` / `gn` (the keys of `target` / `golden`): a common prefix and
    suffix, difflib between them, name and k-th call inside what it could not align."""
    if tn == gn:
        return [OpPair(t, g, _how(t, g)) for t, g in zip(target, golden)]
    pre, suf = _common_ends(tn, gn)
    out = [OpPair(t, g, _how(t, g)) for t, g in zip(target[:pre], golden[:pre])]
    tm, gm = target[pre:len(target) - suf], golden[pre:len(golden) - suf]
    tmn, gmn = tn[pre:len(tn) - suf], gn[pre:len(gn) - suf]
    if len(tm) > MAX_ALIGN_OPS or len(gm) > MAX_ALIGN_OPS:
        out += _pair_kth(tm, gm, key)
    else:
        sm = difflib.SequenceMatcher(None, tmn, gmn, autojunk=False)
        for tag, i1, i2, j1, j2 in sm.get_opcodes():
            if tag == "equal":
                out += [OpPair(t, g, _how(t, g)) for t, g in zip(tm[i1:i2], gm[j1:j2])]
            else:
                out += _pair_kth(tm[i1:i2], gm[j1:j2], key)
    out += [OpPair(t, g, _how(t, g)) for t, g in zip(target[len(target) - suf:], golden[len(golden) - suf:])]
    return out


def compiled_signature(io: str):
    """A key for aligning a compiled dump (docs/COMPILED.md) with an eager one: canonical
    name, phase and the shapes of the op's `io` tensors. The compiled dump lacks the ops
    run outside its graphs (the loss and its backward), whose names recur inside them (a
    loss's backward `mul` against the model's): the shapes keep them apart."""
    def key(o: OpRecord):
        try:
            values = o.inputs() if io == S.INPUT_GROUP else o.outputs()
            shapes = tuple(sorted((n, tuple(v.shape)) for n, v in values.items() if v.is_tensor))
        except Exception:  # noqa: BLE001 - unreadable metadata: the name alone
            shapes = ()
        return (canonical_op(o.op), o.phase, shapes)
    return key


# A replayed file pairs by seqid only if its seqids are the other file's. When more than
# this share of seqid pairs name different ops, the golden is not the file that was
# replayed (another run's dump, a different step): pair by aligning the op streams.
MAX_SEQID_NAME_MISMATCH = 0.2


def seqid_name_mismatches(pairs: list[OpPair]) -> tuple[int, int]:
    """(pairs whose op names differ, pairs with both sides) of a seqid pairing."""
    both = [p for p in pairs if p.target is not None and p.golden is not None]
    bad = sum(1 for p in both if canonical_op(p.target.op) != canonical_op(p.golden.op))
    return bad, len(both)


def pair_ops(target: list[OpRecord], golden: list[OpRecord], *, target_mode: str, golden_mode: str,
             golden_missing_reasons: dict[tuple[str, int], str] | None = None) -> list[OpPair]:
    if is_replay_pairing(target_mode, golden_mode):
        return pair_by_seqid(target, golden, golden_missing_reasons)
    return pair_by_stream(target, golden)


# ---- tensors within a pair ----------------------------------------------------
def tensor_leaves(values: dict[str, ValueRecord], prefix: str = "") -> dict[str, ValueRecord]:
    """name -> tensor record, lists flattened to 'name/name_i' (non-tensor values dropped)."""
    out: dict[str, ValueRecord] = {}
    for name, rec in values.items():
        key = f"{prefix}{name}"
        if rec.is_list:
            out.update(tensor_leaves({c.name: c for c in rec.children}, key + "/"))
        elif rec.is_tensor:
            out[key] = rec
    return out


def _renamed(key: str) -> Iterable[str]:
    head, _, tail = key.partition("/")
    for alt in _RENAMES.get(head, ()):
        if tail:
            # list children are named after the list: self/self_0 -> input/input_0
            yield f"{alt}/" + "/".join(
                alt + part[len(head):] if part.startswith(head + "_") else part for part in tail.split("/"))
        else:
            yield alt


def pair_tensors(target: dict[str, ValueRecord], golden: dict[str, ValueRecord]
                 ) -> list[tuple[str, ValueRecord | None, ValueRecord | None]]:
    """(name, target, golden) in target order, then golden-only ones; renames per the op map."""
    out = []
    used: set[str] = set()
    for key, t in target.items():
        g_key = key if key in golden else next((k for k in _renamed(key) if k in golden and k not in target), None)
        if g_key is not None and g_key not in used:
            used.add(g_key)
            out.append((key, t, golden[g_key]))
        else:
            out.append((key, t, None))
    out += [(k, None, g) for k, g in golden.items() if k not in used]
    return out


# ---- pairs that cannot be one op's calls -------------------------------------------------
# Independent runs pair by name and k-th call (above). When a run makes one op's calls in
# another order, the k-th calls are different tensors: DDP's reducer scales each gradient
# with a `mul.out` as autograd hands it over, and under autocast a layer's bias gradient
# comes before its weight's, so the name pairing joined (64, 32) with (64) (36 "size
# mismatch" rows on a DDP bf16 vs fp32 compare); addmm's backward makes its two mm calls
# in the other order than x @ W.t()'s. Where a pair's ops differ in shapes or phase, the
# same-named ops near it are re-paired by signature, and the new pairing is kept when it
# has more pairs of equal signature (or fewer that cannot match) than the old one.
SHAPE_REPAIR_WINDOW = 64       # a cluster: same-named pairs no further apart than this ...
SHAPE_REPAIR_CLUSTER = 64      # ... and at most this many (re-pairing is quadratic in it)
_ROLES = (S.PHASE_FORWARD, S.PHASE_BACKWARD)


def shapes_compatible(a: tuple, b: tuple) -> bool:
    """Whether tensors of shapes `a` and `b` could stand for one tensor of two runs: equal
    shapes, as many elements (a view or reshape: compared flat), or as many dimensions each
    a multiple of the other's (a micro-batch against the full batch, a shard against the
    whole tensor: the distributed compares pair those and measure them sliced or assembled).
    (64, 32) and (64) are none of these."""
    a, b = tuple(a), tuple(b)
    if a == b:
        return True
    na, nb = 1, 1
    for d in a:
        na *= int(d)
    for d in b:
        nb *= int(d)
    if na == nb:
        return True
    if len(a) != len(b):
        return False
    return all(x == y or (x and y and (x % y == 0 or y % x == 0)) for x, y in zip(a, b))


@dataclass(frozen=True, slots=True)
class OpSignature:
    """What pairing checks of an op besides its name: its role (phase) and its tensors' shapes
    by name ("input/self", "output/result", list members "input/tensors/tensors_0")."""

    phase: str
    shapes: tuple[tuple[str, tuple], ...]

    def fits(self, other: "OpSignature") -> bool:
        """Could these two ops be one op of two runs: the same role, every tensor both name
        of compatible shape."""
        if self.phase != other.phase and self.phase in _ROLES and other.phase in _ROLES:
            return False
        mine = dict(self.shapes)
        return all(shapes_compatible(mine[n], s) for n, s in other.shapes if n in mine)

    def same(self, other: "OpSignature") -> bool:
        return self.phase == other.phase and self.shapes == other.shapes


def _rematch(ts, gs, original, sig):
    """Targets `ts` [(slot, op)] with goldens `gs` [(slot, op)] (golden order): equal
    signatures first, then compatible ones, each in order; a target left over keeps its
    `original` partner if nobody took it. Returns {slot: golden}."""
    partner: dict[int, OpRecord] = {}
    used: set[int] = set()
    for test in (OpSignature.same, OpSignature.fits):
        for j, t in ts:
            if j in partner:
                continue
            for k, (_, g) in enumerate(gs):
                if k not in used and test(sig(t), sig(g)):
                    partner[j] = g
                    used.add(k)
                    break
    for j, t in ts:
        g0 = original.get(j)
        k0 = next((k for k, (_, g) in enumerate(gs) if g is g0), None)
        if j not in partner and k0 is not None and k0 not in used:
            partner[j] = g0
            used.add(k0)
    return partner


def _score(pairs_tg, sig) -> tuple[int, int]:
    """(pairs of equal signature, pairs that cannot match) of [(target, golden)]."""
    same = sum(1 for t, g in pairs_tg if sig(t).same(sig(g)))
    bad = sum(1 for t, g in pairs_tg if not sig(t).fits(sig(g)))
    return same, bad


def repair_incompatible(pairs: list[OpPair], signature, window: int = SHAPE_REPAIR_WINDOW,
                        max_cluster: int = SHAPE_REPAIR_CLUSTER) -> tuple[list[OpPair], int]:
    """Re-pair same-named ops where a name pair's ops differ in signature (OpSignature:
    phase, shapes). Clusters of same-named pairs around such a pair (`window`, `max_cluster`)
    are re-matched by signature (_rematch); a cluster's new pairing replaces the old when it
    has more pairs of equal signature, or as many and fewer that cannot match. An op's one
    call with a wrong shape keeps its partner: the size mismatch is the finding. Returns the
    pairs (a target stays where it was; a golden left alone goes where it was) and how many
    pairs changed. Reads each paired op's signature once (no tensor data), again for the
    ops of a cluster; holds none of them between clusters."""
    from array import array

    name_of = lambda p: canonical_op((p.target or p.golden).op)  # noqa: E731
    # 8 bytes a pair, 1 a flag: a 1M-op compare holds ~9 MB here, not lists and sets of ints
    by_name: dict[str, array] = {}
    odd = bytearray(len(pairs))
    for i, p in enumerate(pairs):
        if p.matched_by not in ("name", "map", "unmatched"):
            continue
        by_name.setdefault(name_of(p), array("q")).append(i)
        if p.target is not None and p.golden is not None and not signature(p.target).same(signature(p.golden)):
            odd[i] = 1
    if not any(odd):
        return pairs, 0
    clusters: list[list[int]] = []
    for idx in by_name.values():
        run: list[int] = []
        for i in itertools.chain(idx, (None,)):
            if run and (i is None or i - run[-1] > window or len(run) >= max_cluster):
                if any(odd[j] for j in run):
                    clusters.append(run)
                run = []
            if i is not None:
                run.append(i)
    replaced: dict[int, list[OpPair]] = {}
    changed = 0
    why = ("No partner of matching shape for {op} in {side} dump data (its same-named ops there hold "
           "other shapes or run in another phase).")
    for slots in clusters:
        cache: dict[int, OpSignature] = {}

        def sig(op):
            s = cache.get(id(op))
            if s is None:
                s = cache[id(op)] = signature(op)
            return s

        ts = [(j, pairs[j].target) for j in slots if pairs[j].target is not None]
        gs = sorted(((j, pairs[j].golden) for j in slots if pairs[j].golden is not None), key=lambda x: x[1].seqid)
        original = {j: pairs[j].golden for j in slots if pairs[j].target is not None and pairs[j].golden is not None}
        partner = _rematch(ts, gs, original, sig)
        before = _score([(pairs[j].target, g) for j, g in original.items()], sig)
        after = _score([(pairs[j].target, g) for j, g in partner.items()], sig)
        if not (after[0] > before[0] or (after[0] == before[0] and after[1] < before[1])):
            continue
        taken = {id(g) for g in partner.values()}
        for j in slots:
            p = pairs[j]
            out: list[OpPair] = []
            if p.target is not None:
                g = partner.get(j)
                out.append(OpPair(p.target, g, _how(p.target, g)) if g is not None else
                           _target_only(p.target, why.format(op=p.target.op, side="golden")))
            if p.golden is not None and id(p.golden) not in taken:
                out.append(_golden_only(p.golden, why.format(op=p.golden.op, side="my")))
            changed += not (len(out) == 1 and out[0].target is p.target and out[0].golden is p.golden)
            replaced[j] = out
    result: list[OpPair] = []
    for i, p in enumerate(pairs):
        result += replaced.get(i, [p])
    return result, changed


def split_unfit_islands(pairs: list[OpPair], signature) -> tuple[list[OpPair], int]:
    """A name pair of computing ops whose tensors cannot be one op's (OpSignature.fits) and
    that stands alone among unpaired ops (the nearest computing entries before and after it
    in the pairing are one-sided) becomes two unpaired ops. There the name streams differ,
    and one shared name is no evidence: a fused AdamW step (`_foreach_add_` on the step
    counts, `_fused_adamw_`) against a foreach one paired its step-count `_foreach_add_.Scalar`
    (0-dim tensors) with the foreach step's `_foreach_add_.Scalar` of eps to the square
    roots (the parameters' shapes), and the verdict blamed that add ("size mismatch ...
    caused here"). Unpaired, the two steps are aligned as one region (align.py). A pair
    with paired neighbours keeps its partner: one call with a wrong shape among ops that
    line up (a changed size) is the finding (repair_incompatible). Returns the pairs and
    how many were split."""
    def computing(p: OpPair) -> bool:
        return not _by_design((p.target or p.golden).op)

    def paired(p: OpPair) -> bool:
        return p.target is not None and p.golden is not None

    out: list[OpPair] = []
    split = 0
    for i, p in enumerate(pairs):
        t, g = p.target, p.golden
        if t is None or g is None or p.matched_by not in ("name", "map") or not computing(p):
            out.append(p)
            continue
        before = next((q for q in reversed(pairs[:i]) if computing(q)), None)
        after = next((q for q in pairs[i + 1:] if computing(q)), None)
        if (before is not None and paired(before)) or (after is not None and paired(after)) \
                or (before is None and after is None) or signature(t).fits(signature(g)):
            out.append(p)
            continue
        why = ("No partner for {op} in {side} dump data: its same-named op there, among ops the two runs "
               "do not share, holds tensors of other shapes (another computation under the same name).")
        out.append(_target_only(t, why.format(op=t.op, side="golden")))
        out.append(_golden_only(g, why.format(op=g.op, side="my")))
        split += 1
    return out, split


def split_unfit_by_design(pairs: list[OpPair], signature) -> tuple[list[OpPair], int]:
    """Name pairs of by-design ops (casts, copies, views, allocations: what a device or
    precision change adds or drops on its own, dumpfile.departures.is_by_design_op) that
    cannot be one op of two runs become two unpaired ops: their tensors' shapes do not fit
    (OpSignature.fits), or they run in different modules and their signatures differ.
    For an op that computes, a wrong shape is the finding (repair_incompatible keeps such a
    pair); a cast is no such op. BERT under bf16 autocast with its attention mask left out
    paired the golden's cast of the (2, 12) mask in `bert` with the target's autocast cast
    of a (32) bias in a query Linear: "size mismatch, no op of the step made it" named the
    Linear, not the mask the target never built. Unpaired, such ops are listed (by-design
    ops are never judged) and the verdict comes from the ops that compute. Returns the pairs
    and how many were split."""
    out: list[OpPair] = []
    split = 0
    for p in pairs:
        t, g = p.target, p.golden
        if t is None or g is None or p.matched_by != "name" or not _by_design(t.op):
            out.append(p)
            continue
        st, sg = signature(t), signature(g)
        if st.same(sg) or (st.fits(sg) and unwrapped_module(t.module or "") == unwrapped_module(g.module or "")):
            out.append(p)
            continue
        why = ("No partner for {op} in {side} dump data: its same-named op there is a cast or copy of another "
               "tensor ({what}); a device or precision change adds and drops these by design.")
        what = "other shapes" if not st.fits(sg) else f"in {g.module or 'the top level'}, not {t.module or 'the top level'}"
        out.append(_target_only(t, why.format(op=t.op, side="golden", what=what)))
        out.append(_golden_only(g, why.format(op=g.op, side="my", what=what)))
        split += 1
    return out, split
