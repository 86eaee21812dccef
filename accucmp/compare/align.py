"""Align op streams that run different ops for one computation.

The target and the golden often compute one thing with different ops: a fused
scaled_dot_product_attention against bmm+softmax+bmm, addmm against mm+add,
native_layer_norm against its decomposition, a foreach optimizer against per-parameter
ops. The name-stream pairing (matching.pair_by_stream) leaves those ops unmatched on both
sides. This module runs after it, on the unmatched ops only:

1. A *gap* is a stretch of unmatched ops (both sides) between two paired ops; ops of one
   computation sit in the same gap because the ops around them pair.
2. In a gap, each side's ops form *runs*: consecutive ops of one (phase, module path);
   a target run meets golden runs of the same phase whose module is the same, an ancestor
   or a descendant (a decomposition written in a parent's forward).
3. A target run and a golden run of the same (phase, module) -- or the module/op names the
   override file maps onto each other -- form one *region* when their external inputs
   (tensors a run reads that no op of the run produced) agree: every external input of the
   side with fewer has a partner of the same shape on the other side, bit-identical (same
   bytes) or close by value (an upstream error may already be in them), and at least one
   final output (written and not read again inside the run) has a same-shaped partner.
   The outputs are not required to agree: a fault inside the fused op must still align, so
   its outputs are then judged and fail.
4. A region becomes one OpPair (matched_by "region") whose rows are its external inputs and
   its final outputs, paired by shape and closeness, labelled "A ≈ B+C+D". Ops no region
   takes stay unmatched pairs: listed, never judged.

torch-free (reads tensors as numpy through dumpfile), like the rest of `accucmp compare`.
The user's overrides (--align-map) are read in align_map.py. The rest stays one module
(~410 lines): the tensor fingerprints of a run, the region test and the walk over the
gaps serve only each other, in the order of the steps above.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dumpfile.departures import unwrapped_module
from dumpfile.read.reader import OpRecord, ValueRecord

from accucmp.compare.align_map import AlignMap

# Tensors above this many elements are matched by shape and dtype alone (reading them whole
# to hash or compare would cost more than the alignment is worth).
MAX_READ_ELEMENTS = 1 << 22
# "Close by value" for external inputs that are not bit-identical: an inherited upstream
# error of a few percent still aligns; a different tensor of the same shape does not.
CLOSE_REL = 0.1
# Inference reads every unmatched op's tensors and compares runs pairwise: a gap of more
# unmatched ops than this on a side (two unrelated runs) is left as it is, and a run pair
# with more tensor pairs to weigh than MAX_TENSOR_PAIRS is not a region.
MAX_GAP_OPS = 2000
MAX_TENSOR_PAIRS = 250_000


def _name_is(op: str, name: str) -> bool:
    return op == name or op.startswith(name + ".")


def _short(op: str) -> str:
    return op[:-len(".default")] if op.endswith(".default") else op


# ---- tensors of a run ----------------------------------------------------------
@dataclass
class _Tensor:
    rec: ValueRecord
    name: str            # op-qualified: "aten.addmm.default:input"
    shape: tuple
    key: tuple | None    # (shape, dtype, digest) when read; None when too large / unreadable
    value: np.ndarray | None
    sorted: np.ndarray | None = None


def _leaves(values) -> dict[str, ValueRecord]:
    from accucmp.compare.matching import tensor_leaves
    return tensor_leaves(values)


def _tensor(rec: ValueRecord, name: str) -> _Tensor:
    try:
        shape = tuple(rec.shape)
    except (ValueError, TypeError):
        shape = ()
    value = key = None
    try:
        if rec.numel <= MAX_READ_ELEMENTS:
            arr = np.asarray(rec.read())
            if arr.dtype.kind in "fiucb":
                value = arr
                key = (shape, str(arr.dtype), hashlib.blake2b(np.ascontiguousarray(arr).tobytes(),
                                                              digest_size=16).digest())
    except Exception:  # noqa: BLE001 - a statistics-only or damaged tensor: matched by shape alone
        pass
    return _Tensor(rec, name, shape, key, value)


@dataclass
class _Run:
    ops: list[OpRecord]
    inputs: list[_Tensor] = field(default_factory=list)     # external
    outputs: list[_Tensor] = field(default_factory=list)    # final

    @property
    def label(self) -> str:
        names = [_short(o.op) for o in self.ops]
        if len(names) > 12:           # a per-parameter optimizer: hundreds of ops
            return "+".join(names[:8]) + f"+... ({len(names)} ops)"
        return "+".join(names)


def _analyse(ops: list[OpRecord]) -> _Run:
    """External inputs (not produced by an earlier op of the run, by content) and final outputs
    (not read by a later op of the run, by content) of a run of ops."""
    run = _Run(list(ops))
    produced: set = set()
    all_outs: list[tuple[int, _Tensor]] = []
    read_at: dict[Any, int] = {}
    for i, op in enumerate(ops):
        for n, rec in _leaves(op.inputs()).items():
            t = _tensor(rec, f"{i}.{_short(op.op)}:{n}")
            if t.key is not None:
                read_at[t.key] = i
            if t.key is None or t.key not in produced:
                if t.value is None or t.value.size > 1:     # scalars carry no identity
                    if t.key is None or all(t.key != x.key for x in run.inputs):
                        run.inputs.append(t)
        for n, rec in _leaves(op.outputs()).items():
            t = _tensor(rec, f"{i}.{_short(op.op)}:{n}")
            if t.key is not None:
                produced.add(t.key)
            all_outs.append((i, t))
    for i, t in all_outs:
        if t.key is not None and read_at.get(t.key, -1) > i:
            continue                       # read again inside the run: an intermediate
        run.outputs.append(t)
    # which outputs are one storage updated in place is not recorded: all are kept, and
    # pairing by closeness (below) picks the right partner among same-shaped ones
    return run


def _rel_err(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = a.astype(np.float64, copy=False), b.astype(np.float64, copy=False)
    scale = float(np.max(np.abs(b64))) if b64.size else 0.0
    err = float(np.max(np.abs(a64 - b64))) if a64.size else 0.0
    if not np.isfinite(err):
        return float("inf")
    return err / scale if scale > 0 else (0.0 if err == 0 else float("inf"))


def _sorted(t: _Tensor) -> np.ndarray:
    if t.sorted is None:          # kept: a tensor meets every same-sized one of the other run
        t.sorted = np.sort(t.value.reshape(-1).astype(np.float64))
    return t.sorted


def _distance(a: _Tensor, b: _Tensor, layouts: bool | str = False) -> float:
    """0 identical, else relative max error; inf for a shape mismatch. Unread tensors of one
    shape count as a weak match (CLOSE_REL) so statistics-only or huge tensors still align by shape.
    `layouts`: a tensor of another shape but as many elements is compared by its sorted
    values, so k against the k.transpose(-2, -1) a decomposition copies still matches;
    "reshape": only when the flat element order agrees (bmm's [B*H, S, D] against [B, H, S, D])."""
    if a.shape != b.shape:
        if not layouts or int(np.prod(a.shape)) != int(np.prod(b.shape)):
            return float("inf")
        if a.value is None or b.value is None:
            return CLOSE_REL          # unread (statistics-only): as weak as a same-shape match
        try:
            by_values = _rel_err(_sorted(a), _sorted(b)) + 1e-9     # behind a same-shape partner
            if layouts == "reshape":
                # a row compares element by element: only a reshape of the same element order
                flat = _rel_err(a.value.reshape(-1), b.value.reshape(-1)) + 1e-9
                return flat if flat <= 2 * by_values + 1e-6 else float("inf")
            return by_values
        except (TypeError, ValueError):
            return float("inf")
    if a.key is not None and b.key is not None and a.key[2] == b.key[2]:
        return 0.0
    if a.value is None or b.value is None:
        return CLOSE_REL              # at the limit: behind every partner seen to be close
    try:
        return _rel_err(a.value, b.value)
    except (TypeError, ValueError):
        return float("inf")


def _pair_close(xs: list[_Tensor], ys: list[_Tensor], limit: float,
                layouts: bool | str = False) -> list[tuple[_Tensor, _Tensor]]:
    """Greedy: closest pairs first (ties by order), each tensor used once, distance <= limit."""
    cand = sorted(((_distance(x, y, layouts), i, j) for i, x in enumerate(xs) for j, y in enumerate(ys)),
                  key=lambda c: (c[0], c[1], c[2]))
    used_x, used_y, out = set(), set(), []
    for d, i, j in cand:
        if d > limit or d == float("inf") or i in used_x or j in used_y:
            continue
        used_x.add(i), used_y.add(j)
        out.append((i, j))
    out.sort()
    return [(xs[i], ys[j]) for i, j in out]


@dataclass
class Region:
    """One aligned many-to-one region: its ops on both sides and the tensor pairs to judge."""

    target_ops: list[OpRecord]
    golden_ops: list[OpRecord]
    target_label: str
    golden_label: str
    inputs: list[tuple[_Tensor, _Tensor]]
    outputs: list[tuple[_Tensor, _Tensor]]
    how: str                      # "inferred", "module map", "op map"
    # external inputs that found no partner and that the other run reads in a paired op next
    # to the region (align_pairs, _keep_regrouped): (side, tensor), side 0 the target. The
    # region's outputs then differ because the runs split one computation differently (a sum
    # regrouped: (a+b)+c against a+(b+c)), so they become unmatched input rows and the region
    # is not "caused here" (op_policies)
    unpaired_inputs: list[tuple[int, _Tensor]] = field(default_factory=list)

    def tensors(self, side: int, io: str) -> dict[str, ValueRecord]:
        """The region's tensors of one side as an op's inputs/outputs would be: the golden's
        keyed by the target's names so matching.pair_tensors pairs them; an unpaired input
        under a name of its own side (the golden's marked so), so it has no partner."""
        pairs = self.inputs if io == "input" else self.outputs
        out = {t.name: (t if side == 0 else g).rec for t, g in pairs}
        if io == "input":
            out.update({(x.name if s == 0 else f"{x.name} (golden)"): x.rec
                        for s, x in self.unpaired_inputs if s == side})
        return out

    def rebind(self, opened: dict[int, Any]) -> None:
        """In a forked worker: point the region's records at the files it opened again
        (keyed by id of the parent's file objects; records already moved are left)."""
        for op in self.target_ops + self.golden_ops:
            op.file = opened.get(id(op.file), op.file)
        for t, g in self.inputs + self.outputs:
            for x in (t, g):
                x.rec.file = opened.get(id(x.rec.file), x.rec.file)

    @property
    def description(self) -> str:
        return f"aligned region ({self.how}): {self.target_label} ≈ {self.golden_label}"


def _analysed(ops: list[OpRecord], cache: dict | None) -> _Run:
    """_analyse, once per run (a run meets several candidate runs; reading is the cost)."""
    if cache is None:
        return _analyse(ops)
    key = tuple(id(o) for o in ops)
    if key not in cache:
        cache[key] = _analyse(ops)
    return cache[key]


def _try_region(t_ops, g_ops, how: str, cache: dict | None = None) -> Region | None:
    tr, gr = _analysed(t_ops, cache), _analysed(g_ops, cache)
    few, many = (tr.inputs, gr.inputs) if len(tr.inputs) <= len(gr.inputs) else (gr.inputs, tr.inputs)
    if max(len(few) * len(many), len(tr.outputs) * len(gr.outputs)) > MAX_TENSOR_PAIRS:
        return None
    ins = _pair_close(few, many, CLOSE_REL, layouts=True)
    # inferred: most external inputs of the side with fewer have a partner (a fused op's
    # backward reads its saved logsumexp where a decomposition reads its saved softmax)
    if how == "inferred" and (not ins or 2 * len(ins) < len(few)):
        return None
    if few is not tr.inputs:
        ins = [(t, g) for g, t in ins]
    partnered = {id(x) for pair in ins for x in pair}
    unpaired = [(side, x) for side, run in ((0, tr), (1, gr)) for x in run.inputs if id(x) not in partnered]
    # rows compare element by element: inputs met in another layout only served the alignment
    in_pairs = [(t, g) for t, g in ins if t.shape == g.shape]
    # ties (statistics-only dumps: every same-shaped output is as close) go to the later
    # outputs: a decomposition's mm result is not what its add hands on
    outs = _pair_close(tr.outputs[::-1], gr.outputs[::-1], float("inf"), layouts="reshape")
    order = {id(t): k for k, t in enumerate(tr.outputs)}
    outs.sort(key=lambda p: order[id(p[0])])
    if not outs:
        return None
    # the last op's outputs are what the computation hands on; keep pairs that involve one
    # of them on either side (others are intermediates of a run that are not read again,
    # e.g. the fused op's logsumexp), unless that leaves nothing
    last_t = {id(t) for t in tr.outputs if t.name.startswith(f"{len(t_ops) - 1}.")}
    last_g = {id(g) for g in gr.outputs if g.name.startswith(f"{len(g_ops) - 1}.")}
    main = [(t, g) for t, g in outs if id(t) in last_t or id(g) in last_g]
    return Region(list(t_ops), list(g_ops), tr.label, gr.label, in_pairs, main or outs, how, unpaired)


# ---- gaps and runs ---------------------------------------------------------------
def _runs(ops: list[OpRecord]) -> list[list[OpRecord]]:
    out: list[list[OpRecord]] = []
    for op in ops:
        if out and (out[-1][-1].phase, out[-1][-1].module) == (op.phase, op.module):
            out[-1].append(op)
        else:
            out.append([op])
    return out


def _nested(a: str, b: str) -> bool:
    """One module path is the other or inside it: x @ W.t() + b written in a block's forward
    runs in `block`, the nn.Linear it replaces in `block.lin`. Paths are compared without
    wrapper components (dumpfile.departures.unwrapped_module): DDP's `module.`, compile's
    `_orig_mod.` name one model's `block` against an unwrapped run's."""
    a, b = unwrapped_module(a), unwrapped_module(b)
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def _find_seq(ops: list[OpRecord], names: tuple[str, ...], used: set[int]) -> list[int] | None:
    n = len(names)
    for s in range(len(ops) - n + 1):
        idx = list(range(s, s + n))
        if not used.intersection(idx) and all(_name_is(ops[k].op, names[m]) for m, k in enumerate(idx)):
            return idx
    return None


def _align_gap(ts: list[OpRecord], gs: list[OpRecord], amap: AlignMap | None) -> list[Region]:
    regions: list[Region] = []
    cache: dict = {}
    used_t: set[int] = set()
    used_g: set[int] = set()
    # 1. op mappings of the override file: the named op sequences, wherever they are in the gap
    for t_names, g_names in (amap.ops if amap else ()):
        while True:
            ti = _find_seq(ts, t_names, used_t)
            gi = _find_seq(gs, g_names, used_g) if ti is not None else None
            if ti is None or gi is None:
                break
            r = _try_region([ts[k] for k in ti], [gs[k] for k in gi], "op map")
            if r is None:
                break
            used_t.update(ti), used_g.update(gi)
            regions.append(r)
    # 2. runs of one (phase, module), target module renamed by the override file
    pos_t = {id(o): k for k, o in enumerate(ts)}
    pos_g = {id(o): k for k, o in enumerate(gs)}
    t_runs = _runs([o for k, o in enumerate(ts) if k not in used_t])
    g_runs = _runs([o for k, o in enumerate(gs) if k not in used_g])
    taken_g: set[int] = set()
    for t_run in t_runs:
        mod = t_run[0].module
        mapped = None
        if amap:              # the override file may name the wrapped path or the model's own
            mapped = amap.modules.get(mod, amap.modules.get(unwrapped_module(mod)))
        want = (t_run[0].phase, mapped if mapped is not None else mod)
        for j, g_run in enumerate(g_runs):
            if j in taken_g or g_run[0].phase != want[0] or not _nested(g_run[0].module, want[1]):
                continue
            r = _try_region(t_run, g_run, "module map" if mapped is not None else "inferred", cache)
            if r is not None:
                taken_g.add(j)
                used_t.update(pos_t[id(o)] for o in t_run)
                used_g.update(pos_g[id(o)] for o in g_run)
                regions.append(r)
                break
    return regions


# Paired ops between two stretches of unmatched ops of one (phase, module) do not split
# them: a per-parameter optimizer pairs its .item() calls with the foreach one's by name
# between the parameters' unmatched ops. Up to this many paired ops in a row are bridged.
MAX_BRIDGE = 8


def _unmatched(p) -> bool:
    return p.target is None or p.golden is None


def _key(p) -> tuple[str, str]:
    op = p.target if p.target is not None else p.golden
    return (op.phase, op.module)


def _gap_end(pairs: list, i: int) -> int:
    """End (exclusive) of the gap starting at unmatched pairs[i], bridging short runs of
    paired ops of the same (phase, module) as the unmatched ops on both sides of them."""
    j = i
    while True:
        while j < len(pairs) and _unmatched(pairs[j]):
            j += 1
        k = j
        while k < len(pairs) and not _unmatched(pairs[k]) and k - j < MAX_BRIDGE:
            k += 1
        if (k == j or k >= len(pairs) or not _unmatched(pairs[k])
                or not all(_key(pairs[m]) == _key(pairs[j - 1]) == _key(pairs[k]) for m in range(j, k))):
            return j
        j = k


def _keep_regrouped(region: Region, around: list) -> None:
    """Keep as unpaired only the inputs the other run reads in a paired op next to the gap
    (just before it, bridged inside it, just after it): there the runs split one computation differently (a sum
    regrouped, (residual+a)+b against residual+(a+b): the golden region reads `residual`, the
    target reads it in the add after its region), so the region's outputs are different partial
    results. An input found in neither is the same information in another form (a bool mask
    against an additive one, logsumexp against the saved softmax): the region stands for itself."""
    kept = []
    reads: dict[int, list[_Tensor]] = {}     # side -> the other run's reads (read once)
    for side, x in region.unpaired_inputs:
        if side not in reads:
            reads[side] = [_tensor(rec, n) for p in around
                           for n, rec in _leaves((p.golden if side == 0 else p.target).inputs()).items()]
        # strictly closer than CLOSE_REL: unread tensors (statistics-only) sit at the limit,
        # and a same shape alone is no evidence of the same tensor
        if any(_distance(x, y) < CLOSE_REL for y in reads[side]):
            kept.append((side, x))
    region.unpaired_inputs = kept


def align_pairs(pairs: list, amap: AlignMap | None = None) -> tuple[list, list[Region]]:
    """Replace unmatched ops that form regions by one region pair each (placed where the
    region's last target op stood); the other pairs are kept, in order."""
    from accucmp.compare.matching import OpPair

    out: list = []
    regions: list[Region] = []
    i = 0
    while i < len(pairs):
        if not _unmatched(pairs[i]):
            out.append(pairs[i])
            i += 1
            continue
        j = _gap_end(pairs, i)
        gap = pairs[i:j]
        ts = [p.target for p in gap if _unmatched(p) and p.target is not None]
        gs = [p.golden for p in gap if _unmatched(p) and p.golden is not None]
        found = _align_gap(ts, gs, amap) if ts and gs and max(len(ts), len(gs)) <= MAX_GAP_OPS else []
        around = [p for p in pairs[max(i - 1, 0):j + 1] if not _unmatched(p)]
        for r in found:
            _keep_regrouped(r, around)
        if not found:
            out += gap
        else:
            last = {id(r.target_ops[-1]): r for r in found}
            inside = {id(o) for r in found for o in r.target_ops + r.golden_ops}
            for p in gap:
                if not _unmatched(p):
                    out.append(p)
                    continue
                side = p.target if p.target is not None else p.golden
                r = last.get(id(p.target)) if p.target is not None else None
                if r is not None:
                    out.append(OpPair(r.target_ops[-1], r.golden_ops[-1], "region", r.description, r))
                elif id(side) not in inside:
                    out.append(p)
            regions += found
        i = j
    return out, regions

def notes(regions: list[Region], show: int = 3) -> list[str]:
    """The summary's lines on aligned regions (the csv has their rows, MatchedBy "region")."""
    if not regions:
        return []
    head = f"{len(regions)} region(s) where the runs used different ops aligned many-to-one"
    return [head + ": " + "; ".join(r.description for r in regions[:show])
            + (f"; ... ({len(regions) - show} more)" if len(regions) > show else "")]
