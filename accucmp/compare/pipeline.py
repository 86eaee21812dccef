"""compare_dumps / stream_compare: two dump files in, one row per tensor out (torch-free).

The comparison runs as stages, each a module handing a small frozen dataclass to the next:

  match    pairing.match_ops: the op pairs of the two open dumps         -> Matched
  read     rows.tasks_for_pair: an op pair's tensor pairs and records    -> Task (per row)
  metrics  measure.Comparer: a Task's metrics into its row; batched here -> Measured
  verdict  verdict.judge: thresholds applied to a batch                  -> Judged
  outputs  streaming.compare_to_csv (csv/jsonl as the batches come), report/

This module opens the files (dumpfile.DumpFile validates them), lists their ops, runs the
stages and gathers the rows: into one table (compare_dumps, for library use) or into
Measured batches of whole ops (stream_compare). parallel.py decides where the rows are
computed, precision.py builds a table and carries PrecisionDtype forward. No verdict
here: verdict.py applies thresholds to the table, and can be re-run on a saved csv.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from dumpfile import dtensor as DT
from dumpfile import schema as S
from dumpfile.errors import DumpError, DumpFormatError
from dumpfile.read.reader import DumpFile, ending_text

from accucmp.compare import align_map, matching
from accucmp.compare.departures import (departure_rows, interleave, leaf_inputs, loss_scaler_notes,
                                        pair_departure, step_result_departures, structural_pairs)
from accucmp.compare.measure import Comparer, Measured
from accucmp.compare.pairing import OpChoice, match_ops
from accucmp.compare.parallel import auto_jobs, row_batches
from accucmp.compare.precision import PrecisionCarry, to_frame
from accucmp.compare.rows import (BASE_COLUMNS, EAGER_ELEMENTS, FP64_COLUMNS, NOT_MEASURED, TAIL_COLUMNS,
                                  Task, tasks_for_pair)
from accucmp.compare.metrics import resolve_algorithms


class CompareError(DumpError):
    """A comparison could not be set up (bad regex, unknown metric)."""


@dataclass
class CompareResult:
    table: pd.DataFrame
    meta: dict[str, Any] = field(default_factory=dict)


# A fixed 2 MiB HDF5 metadata cache (HDF5's initial size, without growth): walking
# thousands of small objects ran as fast or faster, and closing the file no longer
# spends 0.15 s tearing down a cache grown to tens of MiB.
_MDC_BYTES = 2 << 20


def _open(path, role: str) -> DumpFile:
    try:
        f = DumpFile(path)
        try:
            cfg = f.h5.id.get_mdc_config()
            cfg.set_initial_size = True
            cfg.initial_size = cfg.min_size = cfg.max_size = _MDC_BYTES
            cfg.incr_mode = cfg.decr_mode = cfg.flash_incr_mode = 0
            f.h5.id.set_mdc_config(cfg)
        except (AttributeError, RuntimeError, ValueError, OSError):
            pass                          # only a speed setting
        return f
    except DumpError:
        raise
    except (OSError, ValueError) as e:
        raise DumpFormatError(f"{path}: cannot open {role} dump: {e}") from e


def compare_dumps(target: str, golden: str, *, algorithms=None, select: str | None = None, jobs: int = 1,
                  chunk_elements: int = 1 << 22, golden_fp64: str | None = None,
                  align_map: str | None = None, exclude=()) -> CompareResult:
    """Compare every tensor of `target` against its pair in `golden`.

    Returns a CompareResult whose table has one row per tensor (BASE_COLUMNS, one
    column per requested metric, TAIL_COLUMNS, FP64_COLUMNS when `golden_fp64`),
    sorted in execution order; `.meta` holds paths, modes and counts. `jobs` > 1
    compares in that many worker processes (threads where fork is unavailable);
    0 picks one per core when there are many ops (auto_jobs). Results do not
    depend on it. `align_map`: override file for aligning different op streams (align.py).
    `select`/`exclude`: the ops taking part (pairing.OpChoice).
    """
    amap = _load_align_map(align_map)
    algs, pattern, files = _open_inputs(target, golden, golden_fp64, algorithms, select, exclude)
    try:
        return _compare_files(*files, algs, pattern, jobs, chunk_elements, amap)
    finally:
        for f in files:
            if f is not None:
                f.close()


def _load_align_map(path: str | None):
    try:
        return align_map.load_map(path)
    except align_map.AlignMapError as e:
        raise CompareError(str(e)) from e


def _open_inputs(target: str, golden: str, golden_fp64: str | None, algorithms, select: str | None,
                 exclude=()):
    """(metric names, the ops chosen (pairing.OpChoice of --select, --exclude; None: all),
    [target, golden, fp64 golden or None] open) for
    compare_dumps and stream_compare: bad options are said before a file is opened, and a
    file that fails to open closes the ones opened before it."""
    try:
        algs = resolve_algorithms(algorithms)
    except ValueError as e:
        raise CompareError(str(e)) from e
    try:
        pattern = re.compile(select) if select else None
    except re.error as e:
        raise CompareError(f"--select {select!r}: not a valid regular expression ({e})") from e
    exclude = tuple(str(p) for p in (exclude or ()) if str(p))
    choice = OpChoice(pattern, exclude) if pattern is not None or exclude else None
    files: list = []
    try:
        files.append(_open(target, "target"))
        files.append(_open(golden, "golden"))
        files.append(_open(golden_fp64, "fp64 golden") if golden_fp64 else None)
    except BaseException:
        for f in files:
            if f is not None:
                f.close()
        raise
    return algs, choice, files


@dataclass
class CompareStream:
    """A comparison delivered in pieces: `batches` yields Measured batches (measure.py) of
    whole ops, in execution order, each a table with the columns of compare_dumps' table
    (Index counts on across batches; `first` is a batch's first Index). Only one batch is held at a time, so memory does not grow with the row
    count. `meta` is compare_dumps' meta; its "rows" is filled in once the batches are
    exhausted. Close it (or use it as a context manager) to release the files."""

    meta: dict[str, Any]
    columns: list[str]
    batches: Any
    _files: list = field(default_factory=list, repr=False)

    def close(self) -> None:
        close = getattr(self.batches, "close", None)
        if close is not None:
            close()                       # stops worker pools before the files go
        for f in self._files:
            f.close()
        self._files = []

    def __enter__(self) -> "CompareStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def stream_compare(target: str, golden: str, *, algorithms=None, select: str | None = None, jobs: int = 1,
                   chunk_elements: int = 1 << 22, golden_fp64: str | None = None,
                   batch_rows: int = 4096, align_map: str | None = None, view=None,
                   exclude=()) -> CompareStream:
    """compare_dumps as a stream of row batches (see CompareStream): the same rows, the
    same order, for results larger than memory (`accucmp compare` writes them to the csv
    as they come). A batch holds whole ops and about `batch_rows` rows. `view`: how a
    rank's tensors pair with a single-process reference's (reference_runs.RankView)."""
    amap = _load_align_map(align_map)
    algs, pattern, files = _open_inputs(target, golden, golden_fp64, algorithms, select, exclude)
    opened = [f for f in files if f is not None]
    try:
        setup = _setup(*files, algs, pattern, jobs, chunk_elements, amap, view)
    except BaseException:
        for f in opened:
            f.close()
        raise
    return CompareStream(setup.meta, setup.columns, _frames(setup, batch_rows), opened)


def _setup(tf: DumpFile, gf: DumpFile, ff: DumpFile | None, algs, pattern, jobs, chunk_elements,
           amap=None, view=None) -> "_Setup":
    """Pair the ops of two open dumps; everything a comparison needs before reading tensors."""
    t_ops, g_ops = tf.ops(), gf.ops()
    parallel_ops = []
    if view is not None:        # ops only the parallel run has: listed, never aligned
        t_ops, parallel_ops = view.parallel_ops(tf, t_ops)
    # against a single-process reference a rank's tensors differ from the reference's in the
    # batch dimension by design: the view says how they pair, not a re-pairing by shape
    m = match_ops(tf, gf, t_ops, g_ops, pattern, amap, repair_shapes=view is None)
    pairs = matched = m.pairs
    if view is not None:
        view.bind(gf, m.pairs)
        if pattern is not None:
            parallel_ops = [o for o in parallel_ops if pattern.keeps(o)]
        matched = tuple(p for p in m.pairs if not view.is_parallel(p))
        parallel_ops = sorted(parallel_ops + [p.target for p in m.pairs if view.is_parallel(p)],
                              key=lambda o: o.seqid)
        pairs = _with_ops(matched, parallel_ops)
    metric_cols = list(algs)
    # a compiled step against an eager one: ops outside the compiled graphs, functionalization's
    # copies and values a fused kernel never materialises have no partner by design; a fault
    # in the compiled code is no op of its own but a node's own error, which the dumper
    # measures on every compiled node (docs/COMPILED.md), so an unpaired op neither departs
    # nor stops a row within its own error from passing as inherited
    compiled = _compiled(tf, gf)
    structural = frozenset() if m.replay or compiled else structural_pairs(matched)
    work = _Work(pairs, ff, metric_cols, m.replay, Comparer(algs, chunk_elements), m.ios, view=view,
                 golden_own=not m.replay and _compiled(gf) and not _compiled(tf),
                 structure=() if m.replay or compiled else structure_before(pairs, matched, structural),
                 structural=structural, ends_step=step_result_departures(matched, structural)
                 if structural and _single_process(tf) and _single_process(gf) else frozenset())
    if jobs <= 0:
        jobs = auto_jobs(len(m.pairs))
    columns = BASE_COLUMNS + metric_cols + TAIL_COLUMNS + (FP64_COLUMNS if ff is not None else [])
    n_unmatched_t = sum(1 for p in m.pairs if p.golden is None)
    n_unmatched_g = sum(1 for p in m.pairs if p.target is None)
    warnings = [(f"{f.path}: not closed cleanly (complete=False): the run may have crashed; "
                 "comparing what was flushed") if f.step_raised is None else
                f"{f.path}: {ending_text(f)}: comparing the ops it reached"
                for f in (tf, gf) if not f.complete] + list(m.warnings)
    meta = {
        "target": tf.path, "golden": gf.path, "golden_fp64": ff.path if ff is not None else None,
        "target_mode": tf.mode, "golden_mode": gf.mode,
        "pairing": "seqid" if m.replay else "stream",
        "target_ops": m.target_ops, "golden_ops": m.golden_ops,
        "paired_ops": sum(1 for p in m.pairs if p.target is not None and p.golden is not None),
        "unmatched_target_ops": n_unmatched_t, "unmatched_golden_ops": n_unmatched_g,
        "op_filter": {"target": m.target_filter, "golden": m.golden_filter, "ops_left_out": m.ops_left_out},
        "notes": list(m.notes) + loss_scaler_notes(m.pairs),
        "aligned_regions": list(m.aligned_regions),
        "rows": None, "compared_io": list(m.ios), "algorithms": list(algs),
        "select": pattern.select.pattern if pattern is not None and pattern.select is not None else None,
        "exclude": list(pattern.exclude) if pattern is not None else [],
        "warnings": warnings,
        "target_world_size": _world_size(tf), "golden_world_size": _world_size(gf),
    }
    departures = departure_rows(tf, gf, meta["warnings"])
    if departures:
        meta["departures"] = len(departures)
    return _Setup(work, (tf, gf, ff), jobs, columns, meta, m.inherit, departures)


def _with_ops(pairs, ops) -> tuple:
    """`pairs` with a target-only pair for each of `ops` (sorted by seqid) put in execution order."""
    if not ops:
        return pairs
    out, k = [], 0
    for p in pairs:
        while k < len(ops) and p.target is not None and ops[k].seqid < p.target.seqid:
            out.append(matching.OpPair(ops[k], None, "parallelism"))
            k += 1
        out.append(p)
    out += [matching.OpPair(op, None, "parallelism") for op in ops[k:]]
    return tuple(out)


def _world_size(f: DumpFile) -> int:
    try:
        return int(f.attrs.get(S.ROOT_WORLD_SIZE, 1) or 1)
    except (TypeError, ValueError):
        return 1


def _single_process(f: DumpFile) -> bool:
    """A run of one process with no parallel wrapper: a gradient's last op is then the model's
    own (DDP's reducer divides each gradient into a bucket that no recorded op reads again:
    an op the single-process reference lacks by design, not a changed result)."""
    if _world_size(f) > 1:
        return False
    layout = f.attrs.get(S.ROOT_PARALLEL_LAYOUT)
    if layout is None:
        return True
    try:
        doc = DT.layout(layout)
    except (ValueError, TypeError, AttributeError):
        return False
    return not (isinstance(doc, dict) and doc.get("wrappers"))


def _compiled(*files: DumpFile) -> bool:
    return any(f.attrs.get(S.ROOT_COMPILED) for f in files)


def structure_before(pairs, matched, structural: frozenset | None = None) -> tuple[tuple[int, str], ...]:
    """Independent runs: for each op either run has and the other lacks, dtype casts left out
    (autocast and a model cast add them by design: op_policies.BY_DESIGN_UNPAIRED), its place
    in `pairs` and what StructureDiffers says of the rows after it ('2 op(s) with no partner:
    aten.mul.Tensor (target) in block.scale, ...'). An op both runs leave a call of unpaired
    is not one (departures.structural_pairs: the same computation elsewhere in the other
    stream, e.g. the gradient sum of a tied embedding that autograd orders differently under
    autocast; counting it took inheritance from every row of the compare). And an op can
    only change what runs after it: GradScaler's `full` and `mul` after the loss no longer
    keep the forward's rounding differences from passing as inherited."""
    from accucmp.compare.op_policies import BY_DESIGN_UNPAIRED, packet
    if structural is None:
        structural = structural_pairs(matched)
    odd = [(i, p.target or p.golden, "target" if p.golden is None else "golden") for i, p in enumerate(pairs)
           if id(p) in structural]
    odd = [(i, op, side) for i, op, side in odd if packet(op.op) not in BY_DESIGN_UNPAIRED]
    out = []
    for k, (i, _, _) in enumerate(odd):
        shown = ", ".join(f"{op.op} ({side})" + (f" in {op.module}" if op.module else "")
                          for _, op, side in odd[:min(k + 1, 3)])
        out.append((i, f"{k + 1} op(s) with no partner: {shown}" + (", ..." if k + 1 > 3 else "")))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class _Setup:
    work: "_Work"
    files: tuple
    jobs: int
    columns: list[str]
    meta: dict[str, Any]            # "rows" filled in once the rows are all made
    inherit: bool                   # carry precision forward (independent runs, not replays)
    departures: list = field(default_factory=list)   # rows of the target's departures (departures.py)

    def parts(self):
        """The compared rows' batches in execution order, the departures put among them."""
        return interleave(row_batches(self, _open), self.departures)


def _compare_files(tf: DumpFile, gf: DumpFile, ff: DumpFile | None, algs, pattern, jobs, chunk_elements,
                   amap=None):
    setup = _setup(tf, gf, ff, algs, pattern, jobs, chunk_elements, amap)
    rows: list[dict[str, Any]] = []
    for part in setup.parts():
        rows += part
    table = to_frame(rows, setup.columns, 0, PrecisionCarry() if setup.inherit else None)
    meta = setup.meta
    meta["rows"] = len(table)
    return CompareResult(table, meta)


def _frames(setup: _Setup, batch_rows: int):
    """The comparison as Measured batches of about `batch_rows` rows, whole ops each (the
    verdict's per-op hints need an op's rows together)."""
    carry = PrecisionCarry() if setup.inherit else None
    start, rows = 0, []
    for part in setup.parts():
        rows += part
        if len(rows) >= batch_rows:
            yield Measured(to_frame(rows, setup.columns, start, carry), start)
            start += len(rows)
            rows = []
    if rows or start == 0:
        yield Measured(to_frame(rows, setup.columns, start, carry), start)
        start += len(rows)
    setup.meta["rows"] = start


@dataclass(frozen=True, slots=True)
class _Work:
    """The comparison of a list of op pairs, in pieces [lo, hi) that can run anywhere."""

    pairs: tuple[matching.OpPair, ...]
    ff: DumpFile | None
    metric_cols: list[str]
    replay: bool
    comparer: Comparer
    ios: tuple[str, ...] = (S.INPUT_GROUP, S.OUTPUT_GROUP)
    # independent runs: (place in `pairs`, StructureDiffers text of the rows after it) of each
    # op with no partner beyond dtype casts (structure_before)
    structure: tuple = ()
    provenance: dict = field(default_factory=dict)   # (file, op, seqid) -> its inputs' producers
    structural: frozenset = frozenset()                # id() of the unpaired ops that are departures
    ends_step: frozenset = frozenset()   # id() of those that change what the step ends with: fail
    view: Any = None            # a rank against a single-process reference (reference_runs.RankView)
    golden_own: bool = False    # the golden is a compiled dump, the target is not: its nodes' own errors count

    @property
    def eager(self) -> int:
        return min(EAGER_ELEMENTS, self.comparer.chunk)

    def tasks(self, lo: int, hi: int):
        """Tasks of pairs[lo:hi], made pair by pair: only one op's small tensors (read
        eagerly) are held at a time."""
        for i in range(lo, hi):
            yield from self.pair_tasks(self.pairs[i], i)

    def structure_at(self, index: int) -> str:
        """StructureDiffers of the rows of pairs[index]: the ops with no partner before it."""
        k = bisect.bisect_left(self.structure, (index, ""))
        return self.structure[k - 1][1] if k else ""

    def pair_tasks(self, pair: matching.OpPair, index: int) -> list["Task"]:
        tasks = tasks_for_pair(pair, self.ff, self.metric_cols, self.replay, self.eager, self.ios,
                               golden_own=self.golden_own)
        if self.view is not None:
            tasks = self.view.adjust(pair, tasks)
        structure = self.structure_at(index) if self.structure else ""
        if structure:
            for task in tasks:
                task.row["StructureDiffers"] = structure
        if not self.replay and pair.target is not None and pair.golden is not None and pair.region is None:
            leaves = leaf_inputs(pair, self.provenance)
            for task in tasks:
                if task.row.get("IO") == S.INPUT_GROUP and task.row.get("TensorName") in leaves:
                    task.row["Leaf"] = True
        if id(pair) in self.structural:
            # an op only one of two independent runs has (a load-replay's come from its file)
            row = pair_departure(pair, id(pair) in self.ends_step)
            if row is not None:
                tasks.insert(0, Task(row, None, None))
        return tasks

    @staticmethod
    def computes(task: "Task") -> bool:
        """Whether the task's metrics are computed (both sides present, not a replayed random op)."""
        return task.target is not None and task.golden is not None \
            and task.row["CompareStatus"] not in NOT_MEASURED

    def rows(self, lo: int, hi: int) -> list[dict[str, Any]]:
        rows = []
        for task in self.tasks(lo, hi):
            rows.append(task.row)
            if self.computes(task):
                self.comparer.run(task)
        return rows


