"""Departures of the target run from its recording, as rows of the comparison (issue 31).

A load-replay dump holds, in its root attribute `replay_departures` (dumpfile/departures.py),
every way the live run left the recording it replayed: ops inserted or missing, changed
value arguments, parameters/buffers/batch tensors whose live value is not the recorded one.
Each becomes one row (CompareStatus `departure`, column Departure = the kind), placed in
execution order among the compared rows by its position on the recording's seqid axis, so
that the first one leads the verdict when it comes before the first op that caused an
error (findings.first_failure). The verdict (verdict.judge_row) fails inserted, missing and
argument rows outright, and judges input rows by their measured difference against what a
cast to the live dtype allows (InputUlps). Torch-free.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Iterator

from dumpfile import departures as D
from dumpfile import schema as S
from dumpfile.read.catalog import linked_tensor, row_entries
from dumpfile.read.reader import DumpFile
from dumpfile.read.records import shown_place

STATUS_DEPARTURE = "departure"
# independent runs: an op only one run has. Unmatched on its own (two runs may compute the same
# thing with other ops: sdpa against eager attention's mask building); it leads the headline
# when it comes before the first op that caused an error (report/summary.py)
STATUS_UNPAIRED_OP = "unpaired_op"
IO_DEPARTURE = "departure"
_ORDER = "_departure_at"


def _where(row: dict[str, Any]) -> str:
    return row.get("module") or "the model's top level"


def sentence(row: dict[str, Any]) -> str:
    """What the headline says of one departure (module first: that is where a user looks)."""
    kind, op, where = row["kind"], row.get("op", "?"), _where(row)
    phase = " (backward)" if row.get("phase") == "backward" else ""
    if kind == D.INSERTED:
        why = f": {row['detail']}" if row.get("detail") else ""
        return f"{where} runs {op}{phase}, which the golden run does not have{why}"
    if kind == D.MISSING:
        if row.get("reason"):
            return f"{where} does not run {op}{phase}: {row['reason']}"
        seq = row.get("golden_seqid")
        at = f" (golden #{int(seq)})" if seq is not None and not math.isnan(seq) else ""
        return f"{where} does not run {op}{phase}, which the golden run has{at}"
    if kind == D.ARGUMENT:
        return f"{where} {op}{phase}: argument {row.get('argument', '?')} {row.get('live', '?')}, " \
               f"golden {row.get('golden', '?')}"
    if row.get("detail"):
        return f"input {row.get('argument', '?')} of {op} in {where}{phase}{MEASURE}: {row['detail']}"
    made = row.get("made_by")
    via = f", read through {made}" if made else ""
    return (f"input {row.get('argument', '?')} of {op} in {where}{phase}{MEASURE}: "
            f"no op of the step made it (a parameter, buffer or the batch{via})")


# where the verdict puts the measured difference and its bound in an input departure's sentence
MEASURE = " differs from the golden's"


def with_measure(reason: str, clause: str) -> str:
    return reason.replace(MEASURE, f"{MEASURE} ({clause})", 1) if clause else reason


def read_departures(f: DumpFile) -> dict[str, Any] | None:
    """The target's departures, or None when it is not a load-replay dump that recorded them."""
    text = f.attrs.get(D.ROOT_ATTR)
    if text is None:
        return None
    return D.decode(text, f.path)


def departure_rows(f: DumpFile, golden: DumpFile | None = None, warnings: list | None = None) -> list[dict[str, Any]]:
    """One table row per recorded departure, in the order the replay recorded them; none when
    `golden` is not the recording they were taken against (a warning says so)."""
    doc = read_departures(f)
    if not doc:
        return []
    src = doc.get("source") or {}
    if golden is not None and src and D.source_of(golden.attrs) != src:
        if warnings is not None and doc["rows"]:
            warnings.append(f"{f.path}: its {len(doc['rows'])} departure(s) from the recording it replayed "
                            f"are not judged: {golden.path} is not that recording")
        return []
    rows = []
    for d in doc["rows"]:
        at = d.get("at", math.nan)
        # an op an optimizer's step ran: shown as AdamW.step's (OpRecord.shown_place)
        phase, module = shown_place(d.get("phase", ""), d.get("module", ""), d.get("optimizer"))
        d = {**d, "phase": phase, "module": module}
        row = {
            # SeqId: the recorded op it sits at (an inserted op: the one it ran after); the
            # exact place among the compared rows is the private key _ORDER (not a column)
            _ORDER: at, "NPUDump": d.get("op", ""), "NPUDumpPath": "", "GroundTruthPath": "",
            "SeqId": int(at) if not math.isnan(at) else math.nan,
            "Phase": d.get("phase", ""), "Module": d.get("module", ""),
            "IO": IO_DEPARTURE, "TensorName": d.get("argument", ""),
            "CompareStatus": STATUS_DEPARTURE, "Departure": d["kind"],
            "CompareFailReason": sentence(d),
            "GoldenSeqId": d.get("golden_seqid", math.nan),
        }
        if d["kind"] == D.INPUT:
            row.update({"DataType": d.get("dtype", ""), "GoldenDataType": d.get("golden", ""),
                        "PrecisionDtype": d.get("dtype", ""),
                        "RelativeEuclideanDistance": d.get("rel_err", math.nan),
                        "MaxAbsoluteError": d.get("max_abs_err", math.nan),
                        "GoldenAbsMax": d.get("golden_abs_max", math.nan)})
        rows.append(row)
    if doc.get("omitted"):
        rows[-1]["CompareFailReason"] += f" [{doc['omitted']} later departure(s) not kept in the file]"
    return rows


def _key(row: dict[str, Any]) -> float:
    v = row.get(_ORDER, row.get("SeqId"))
    try:
        v = float(v)
    except (TypeError, ValueError):
        return math.inf
    return math.inf if math.isnan(v) else v


def interleave(parts: Iterable[list[dict[str, Any]]], departures: list[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    """The compared rows' batches with each departure row put before the first row at or
    after its position (compared rows come in execution order; a departure at seqid s sits
    before the op recorded at s: a changed argument is seen before the op's outputs)."""
    pending = sorted(departures, key=_key)
    i = 0
    for part in parts:
        if i >= len(pending):
            yield part
            continue
        out = []
        for row in part:
            k = _key(row)
            while i < len(pending) and _key(pending[i]) <= k:
                out.append(pending[i])
                i += 1
            out.append(row)
        yield out
    if i < len(pending):
        yield pending[i:]


def pair_departure(pair, ends_step: bool = False) -> dict[str, Any] | None:
    """Independent runs (two plain dumps): an op one run has and the other does not, when the
    pairing and alignment left it alone and it is not a by-design cast (dumpfile.departures),
    is where the runs depart structurally: one row, before that op's unmatched tensor rows.
    `ends_step`: the step ends with its result (step_result_departures): column EndsStep, and
    the sentence says so."""
    op = pair.target if pair.target is not None else pair.golden
    if op is None or (pair.target is not None and pair.golden is not None) or D.is_by_design_op(op.op):
        return None
    kind = D.INSERTED if pair.target is not None else D.MISSING
    phase, module = op.shown_place
    d = {"kind": kind, "op": op.op, "module": module, "phase": phase}
    if kind == D.MISSING:
        d["golden_seqid"] = float(op.seqid)
    row = {
        "NPUDump": op.op, "NPUDumpPath": "", "GroundTruthPath": "",
        "SeqId": op.seqid if kind == D.INSERTED else math.nan, "Phase": phase, "Module": module,
        "IO": IO_DEPARTURE, "TensorName": "", "CompareStatus": STATUS_UNPAIRED_OP, "Departure": kind,
        "CompareFailReason": sentence(d),
        "GoldenSeqId": op.seqid if kind == D.MISSING else math.nan, "GoldenOp": op.op if kind == D.MISSING else "",
    }
    if ends_step:
        row["EndsStep"] = True
        row["CompareFailReason"] += (
            "; no later op of that run reads its result (a gradient the step ends with), and the other "
            "run ends the step with no other op there: the step's results differ")
    return row


# ---- independent runs: which inputs no op of the step made ------------------------------------
def _producer(entry: dict) -> str | None:
    """The op whose output a catalog entry's tensor is ('' when it was first stored as an
    input: no recorded op made it), from the entry's link (`obj`) or its view's base."""
    linked = linked_tensor(entry)
    return linked[0] if linked is not None and linked[2] == "output" else ""


def input_producers(f: DumpFile, op) -> dict[str, str] | None:
    """{input name: the op that made it, '' for none} of one op, from its catalog row; None
    when the file cannot say (no catalog row, or written without links: root `dedup`)."""
    if not f.attrs.get("dedup", False):
        return None
    entries = row_entries(f, op)
    return None if entries is None else {e["n"]: _producer(e) for e in entries[0]}


def leaf_inputs(pair, cache: dict) -> set[str]:
    """Names of the pair's input tensors that no op of the step made in either run: the
    golden's is first stored as an input there, and the target's too or it comes from a
    by-design cast (autocast's weight cast). A difference there is the run's own data."""
    t_op, g_op = pair.target, pair.golden
    if t_op is None or g_op is None:
        return set()
    sides = []
    for op in (t_op, g_op):
        key = (id(op.file), op.op, op.seqid)
        if key not in cache:
            if len(cache) > 4096:
                cache.clear()
            cache[key] = input_producers(op.file, op)
        sides.append(cache[key])
    t, g = sides
    if t is None or g is None:
        return set()
    if D.is_by_design_op(t_op.op) and any(D.is_collective_op(side.get("self", "")) for side in sides):
        # a copy into a collective's output buffer (gloo's reduce-scatter copies its result
        # in from a tensor it made itself): what is copied is the collective's result, made
        # in the step from the ranks' tensors, not a parameter, buffer or the batch
        return set()
    return {name for name, made in g.items() if made == "" and name in t
            and (t[name] == "" or D.is_by_design_op(t[name]))}


def leaf_sentence(row: dict[str, Any]) -> str:
    return sentence({"kind": D.INPUT, "op": row.get("NPUDump", "?"), "module": row.get("Module", ""),
                     "phase": row.get("Phase", ""), "argument": row.get("TensorName", "?")})


def structural_pairs(pairs) -> frozenset:
    """id() of the unpaired ops of two independent runs that are departures: those whose op
    (by overload packet) the other run has no unpaired call of. When both runs leave a call
    of the same op unpaired, the pairing missed (the same computation attributed to another
    module: `x @ W.t() + b` in the parent against nn.Linear), and the rows stay unmatched."""
    t_only: dict[str, list] = {}
    g_only: dict[str, list] = {}
    for p in pairs:
        if (p.target is None) == (p.golden is None):
            continue
        op = p.target if p.target is not None else p.golden
        if D.is_by_design_op(op.op) or _recomputed(op) or loss_scaler_op(op) or D.is_constant_op(getattr(op, "attrs", None)) \
                or _restride_only(op):
            continue
        (t_only if p.target is not None else g_only).setdefault(D.op_packet(op.op), []).append(p)
    inert = _inert(pairs, [p for ps in (*t_only.values(), *g_only.values()) for p in ps])
    out = set()
    for mine, other in ((t_only, g_only), (g_only, t_only)):
        for packet, ps in mine.items():
            if packet not in other:
                out.update(id(p) for p in ps if id(p) not in inert)
    return frozenset(out)


def _inert(pairs, unpaired: list) -> set[int]:
    """id() of the pairs in `unpaired` (one run's op with no partner) whose op changed no value
    a paired op of its run reads: following the catalog's input links back from every paired
    op and every op no op reads (what the step ends with: a clipping's `mul_` of the
    gradients), through unpaired ops, a cast or a view, that carry a value on, none reaches
    it, though some op reads it; or its result is one of its inputs bit for bit (a clamp that
    clamped nothing), and it carries on only that input. A float16 run's overflow guard: T5's
    `isinf(h).any()`, `where` and a `clamp` that clamped nothing, Whisper's `clamp` and its
    backward's mask (`ge`, `le`, `logical_and_`); each kept every later row from passing as
    inherited, and T5's fp16 run failed at `isinf` with its planted faults not named. Never an
    op no op reads (a gradient the step ends with: step_result_departures judges those), nor
    in a file without input links (it cannot say who reads what)."""
    cands = {}
    for p in unpaired:
        op = p.target or p.golden
        if getattr(op, "file", None) is not None:
            cands.setdefault(id(op.file), {})[(op.op, op.seqid)] = (p, op)
    if not cands:
        return set()
    paired: dict[int, set] = {}            # file -> (op, seqid) of its paired ops
    for p in pairs:
        ops = ((p.target, p.golden) if p.target is not None and p.golden is not None else ()) \
            + (tuple(p.region.target_ops) + tuple(p.region.golden_ops) if p.region is not None else ())
        for op in ops:
            paired.setdefault(id(getattr(op, "file", None)), set()).add((op.op, op.seqid))
    out = set()
    for key, mine in cands.items():
        f = next(iter(mine.values()))[1].file
        returned: dict = {}          # candidate -> the inputs it returns (None: it computes)
        walked = _reached(f, paired.get(key, set()), mine, returned)
        if walked is not None:
            reached, read = walked
            # (an op that returns its input changed nothing, whoever reads it)
            out.update(id(p) for k, (p, _) in mine.items()
                       if (k not in reached and k in read) or returned.get(k) is not None)
    return out


def _reached(f: DumpFile, seeds: set, cands: dict, returned: dict) -> tuple[set, set] | None:
    """((op, seqid) of the ops of `f` whose results an op of `seeds` or an op no op reads
    reads, directly or through unpaired ops that carry them on, walked back from the last op;
    those any op reads), or None when the file has no input links or an op's cannot be read.
    `returned` gets, for each reached candidate, the inputs it returns bit for bit (None:
    none), which alone it carries on."""
    if not f.attrs.get("dedup", False):
        return None
    try:
        ops = f.ops()
    except Exception:  # noqa: BLE001 - an unreadable index: says nothing
        return None
    first = min(seqid for _, seqid in cands)
    reached: set = set()
    read: set = set()
    for op in reversed([o for o in ops if o.seqid >= first]):
        k = (op.op, op.seqid)
        entries = row_entries(f, op)
        if entries is None:
            return None
        links = [(e.get("n"), linked_tensor(e)) for e in entries[0]]
        read.update(linked[:2] for _, linked in links if linked is not None)
        if k not in seeds and k not in reached and k in read:
            continue                    # (walking back, every reader of k has been seen)
        kept = None
        if k in cands:
            kept = returned[k] = _returned_inputs(cands[k][1])
        reached.update(linked[:2] for name, linked in links
                       if linked is not None and (kept is None or name in kept))
    return reached, read


def _returned_inputs(op) -> set | None:
    """Names of the tensor inputs the op returns bit for bit (each of its results equal to one
    of them, same shape and dtype: a clamp that clamped nothing); None when some result is
    none of its inputs, or they cannot be read, or hold more than WRITE_CHECK_ELEMENTS."""
    import numpy as np

    from accucmp.compare.matching import tensor_leaves
    try:
        ins, outs = tensor_leaves(op.inputs()), tensor_leaves(op.outputs())
        ins = {n: r for n, r in ins.items() if r.is_tensor}
        outs = [r for r in outs.values() if r.is_tensor]
        if not outs or sum(int(r.numel) for r in (*ins.values(), *outs)) > WRITE_CHECK_ELEMENTS:
            return None
        kept = set()
        for rec in outs:
            new_v = np.asarray(rec.read())
            same = [n for n, r in ins.items() if r.dtype == rec.dtype and tuple(r.shape) == tuple(rec.shape)
                    and np.array_equal(np.asarray(r.read()), new_v)]
            if not same:
                return None
            kept.update(same)
        return kept
    except Exception:  # noqa: BLE001 - unreadable values: it may have changed them
        return None


def _read_from(f: DumpFile, ops: list, start: int) -> set | None:
    """(op, seqid) of every op whose tensors an op of `ops` from `start` on reads (its
    catalog's input links); None when the file cannot say (written without links or
    without a catalog, a row unreadable)."""
    if not f.attrs.get("dedup", False):
        return None
    out: set = set()
    for op in ops[start:]:
        entries = row_entries(f, op)
        if entries is None:
            return None
        for e in entries[0]:
            # (a list's members are entries of their own: "tensors/tensors_0")
            linked = linked_tensor(e)
            if linked is not None:
                out.add(linked[:2])
    return out


# the most elements _write_changed reads of one op (its inputs; outputs as many again)
WRITE_CHECK_ELEMENTS = 1 << 26


def _write_changed(op) -> bool:
    """Whether an in-place op's recorded outputs differ from what it updated: each output
    against its same-named input, and not equal to another input of the op (autograd's
    `add_` of a gradient into a .grad zeroed with set_to_none=False; a clipping whose
    factor came out 1). True when the values cannot be read, or hold more than
    WRITE_CHECK_ELEMENTS (an optimizer's foreach list of a large model's parameters): the op
    says it updates, and the verdict does not pass what it did not look at."""
    import numpy as np

    from accucmp.compare.matching import tensor_leaves
    try:
        ins, outs = tensor_leaves(op.inputs()), tensor_leaves(op.outputs())
        if sum(int(r.numel) for r in ins.values() if r.is_tensor) > WRITE_CHECK_ELEMENTS:
            return True
        others = None
        for name, rec in outs.items():
            old = ins.get(name)
            if old is None or not rec.is_tensor:
                return True
            new_v = np.asarray(rec.read())
            if np.array_equal(new_v, np.asarray(old.read())):
                continue
            if others is None:
                others = [np.asarray(r.read()) for n, r in ins.items() if n not in outs and r.is_tensor]
            if not any(o.shape == new_v.shape and np.array_equal(o, new_v) for o in others):
                return True
        return False
    except Exception:  # noqa: BLE001 - unreadable values: the op's name says it updates
        return True


def step_result_departures(pairs, structural: frozenset) -> frozenset:
    """id() of the departures (structural_pairs) that change what the step ends with: an op
    of the backward, or one that updates a tensor in place and changed it, only one run has,
    whose results no later op of its run reads (the sum autograd makes of a weight's two
    gradients when two modules share it, left in .grad; an accumulation into a .grad the step
    did not zero; a gradient clipping the golden lacks), where the other run has no such op in
    that module (another way to compute the same gradient there). Nothing after such an op
    can differ, so the rule that lets an unpaired op lead the verdict only when an error
    follows it never fires: an untied lm_head passed (GPT-2, independent bf16 compare).
    Files without input links (dedup off, no catalog) say nothing here."""
    cands = []          # (pair, op, side, whether it updates in place)
    for p in pairs:
        if (p.target is None) == (p.golden is None):
            continue
        op = p.target if p.target is not None else p.golden
        in_place = D.is_in_place_update(op.op)
        if not (op.phase == "backward" or in_place) or D.is_by_design_op(op.op) or _recomputed(op):
            continue
        cands.append((p, op, "target" if p.golden is None else "golden", in_place))
    if not any(id(p) in structural for p, *_ in cands):
        return frozenset()
    by_file: dict[int, list] = {}
    for _, op, _, _ in cands:
        by_file.setdefault(id(op.file), []).append(op)
    read: dict[int, set | None] = {}
    for key, mine in by_file.items():
        f = mine[0].file
        try:
            ops = f.ops()
        except Exception:  # noqa: BLE001 - an unreadable index: this rule says nothing
            read[key] = None
            continue
        first = min(op.seqid for op in mine)
        start = next((i for i, o in enumerate(ops) if o.seqid >= first), len(ops))
        read[key] = _read_from(f, ops, start)

    def ends_step(op) -> bool:
        got = read.get(id(op.file))
        return got is not None and (op.op, op.seqid) not in got

    ending = [(p, op, side) for p, op, side, in_place in cands
              if ends_step(op) and (not in_place or _write_changed(op))]
    # a module where both runs end the step with an op the other lacks: two ways to one result
    both = {(side, D.unwrapped_module(op.module or "")) for _, op, side in ending}
    return frozenset(id(p) for p, op, side in ending if id(p) in structural
                     and ("golden" if side == "target" else "target", D.unwrapped_module(op.module or "")) not in both)


def loss_scaler_notes(pairs) -> list[str]:
    """What the summary says of each run's loss scaler (its ops with no partner): that they
    are by design and that the compare divides the scale out."""
    counts = {"target": 0, "golden": 0}
    for p in pairs:
        if (p.target is None) != (p.golden is None):
            op = p.target if p.target is not None else p.golden
            if loss_scaler_op(op):
                counts["target" if p.target is not None else "golden"] += 1
    return [f"the {side} trains with a loss scaler (GradScaler): its {n} op(s) are by design, and tensors "
            f"that carry the scale are compared with it divided out (column LossScale)"
            for side, n in counts.items() if n]


def loss_scaler_op(op) -> bool:
    """A loss scaler's own op (op attribute loss_scaler): its scale and the scaling are a
    precision port's by design, as a cast is."""
    try:
        return bool(D.loss_scaler_role(op.attrs.get(S.OP_LOSS_SCALER)))
    except Exception:  # noqa: BLE001 - unreadable attributes: judged as any other op
        return False


def _restride_only(op) -> bool:
    """An `as_strided(_)` that moves no element (dumpfile.departures.restride_moves_no_element),
    judged from its input's and output's recorded shape, strides and offset."""
    if D.op_packet(op.op) not in D.RESTRIDES:
        return False
    try:
        ins = [v for v in op.inputs().values() if v.is_tensor]
        outs = [v for v in op.outputs().values() if v.is_tensor]
        if len(ins) != 1 or len(outs) != 1:
            return False
        a, b = ins[0], outs[0]
        return D.restride_moves_no_element(op.op, a.shape, S.live_stride(a.attrs), b.shape, S.live_stride(b.attrs),
                                           S.storage_offset(a.attrs, a.path), S.storage_offset(b.attrs, b.path))
    except Exception:  # noqa: BLE001 - unreadable records: judged as any other op
        return False


def _recomputed(op) -> bool:
    """An op activation checkpointing re-ran in backward: a memory trade, not numerics."""
    try:
        return bool(op.attrs.get("recompute", False))
    except Exception:  # noqa: BLE001 - unreadable attributes: judged as any other op
        return False

