"""compare_dumps: two dump files in, one row per tensor out (torch-free).

Pipeline: open both files (dumpfile.DumpFile validates them) -> pair ops
(matching.py) -> pair tensors by input/output name -> compute the metrics of each
pair (metrics.py; small tensors read whole, large ones streamed in chunks of
`chunk_elements`, both sides in lockstep, so peak memory is bounded by the chunk
size) -> a pandas table sorted in execution order. No verdict here: verdict.py
applies thresholds to the table, and can be re-run on a saved csv.

The stages around it: rows.py makes an op pair's Tasks (row + the two value records,
read through dumpfile/read/light.py), parallel.py decides where rows are computed,
precision.py builds the table and carries PrecisionDtype forward. This module keeps
the entry points, the setup of a comparison and Comparer (the metrics of one Task);
it is ~470 lines because setup (option checks, op pairing, metadata) and the comparer
are each one piece and splitting them further would scatter one flow.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from dumpfile import schema as S
from dumpfile.errors import DumpError, DumpFormatError
from dumpfile.read.reader import DumpFile, h5_errors

from accucmp.compare import align, matching
from accucmp.compare.measure import Comparer
from accucmp.compare.parallel import auto_jobs, row_batches
from accucmp.compare.precision import PrecisionCarry, to_frame
from accucmp.compare.rows import (  # noqa: F401  (the columns and statuses are public here too)
    BASE_COLUMNS, EAGER_ELEMENTS, FP64_COLUMNS, STATUS_COMPARED, STATUS_CORRUPT, STATUS_EMPTY, STATUS_RANDOM_REPLAYED,
    STATUS_SIZE_MISMATCH, STATUS_STATS, STATUS_UNINITIALIZED, STATUS_UNMATCHED, TAIL_COLUMNS, Task,
    tasks_for_pair)
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
                  align_map: str | None = None) -> CompareResult:
    """Compare every tensor of `target` against its pair in `golden`.

    Returns a CompareResult whose table has one row per tensor (BASE_COLUMNS, one
    column per requested metric, TAIL_COLUMNS, FP64_COLUMNS when `golden_fp64`),
    sorted in execution order; `.meta` holds paths, modes and counts. `jobs` > 1
    compares in that many worker processes (threads where fork is unavailable);
    0 picks one per core when there are many ops (auto_jobs). Results do not
    depend on it. `align_map`: override file for aligning different op streams (align.py).
    """
    amap = _load_align_map(align_map)
    algs, pattern, files = _open_inputs(target, golden, golden_fp64, algorithms, select)
    try:
        return _compare_files(*files, algs, pattern, jobs, chunk_elements, amap)
    finally:
        for f in files:
            if f is not None:
                f.close()


def _load_align_map(path: str | None):
    try:
        return align.load_map(path)
    except align.AlignMapError as e:
        raise CompareError(str(e)) from e


def _open_inputs(target: str, golden: str, golden_fp64: str | None, algorithms, select: str | None):
    """(metric names, --select pattern, [target, golden, fp64 golden or None] open) for
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
    return algs, pattern, files


@dataclass
class CompareStream:
    """A comparison delivered in pieces: `batches` yields DataFrames of whole ops, in
    execution order, with the columns of compare_dumps' table (Index counts on across
    batches). Only one batch is held at a time, so memory does not grow with the row
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
                   batch_rows: int = 4096, align_map: str | None = None) -> CompareStream:
    """compare_dumps as a stream of row batches (see CompareStream): the same rows, the
    same order, for results larger than memory (`accucmp compare` writes them to the csv
    as they come). A batch holds whole ops and about `batch_rows` rows."""
    amap = _load_align_map(align_map)
    algs, pattern, files = _open_inputs(target, golden, golden_fp64, algorithms, select)
    opened = [f for f in files if f is not None]
    try:
        setup = _setup(*files, algs, pattern, jobs, chunk_elements, amap)
    except BaseException:
        for f in opened:
            f.close()
        raise
    return CompareStream(setup.meta, setup.columns, _frames(setup, batch_rows), opened)


def _attr_text(v) -> str:
    if v is None:
        return ""
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


def _setup(tf: DumpFile, gf: DumpFile, ff: DumpFile | None, algs, pattern, jobs, chunk_elements,
           amap=None) -> "_Setup":
    """Pair the ops of two open dumps; everything a comparison needs before reading tensors."""
    from dumpfile.golden_info import read_not_replayed

    t_ops, g_ops = tf.ops(), gf.ops()
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
            t_ops = [o for o in t_ops if g_sel.selected(o.op, o.phase, o.module)]
        if t_sel is not None:
            g_ops = [o for o in g_ops if t_sel.selected(o.op, o.phase, o.module)]
        filtered_out = n - len(t_ops) - len(g_ops)
    if pattern is not None:
        keep = lambda o: bool(pattern.search(o.op) or pattern.search(o.module or ""))  # noqa: E731
        t_ops, g_ops = [o for o in t_ops if keep(o)], [o for o in g_ops if keep(o)]
    with h5_errors(gf.path):
        not_replayed = read_not_replayed(gf.h5)
    pairs = matching.pair_ops(t_ops, g_ops, target_mode=tf.mode, golden_mode=gf.mode,
                              golden_missing_reasons=not_replayed)
    metric_cols = list(algs)
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
    if not replay:
        pairs, regions = align.align_pairs(pairs, amap)
    # Only the io groups both dumps recorded: a load-replay dump holds outputs only (its
    # inputs are the golden's by construction), and dump_mode=input/output dumps hold one
    # side; the other side's tensors are not "unmatched", they were never asked for.
    ios = tuple(io for io in (S.INPUT_GROUP, S.OUTPUT_GROUP)
                if io in tf.recorded_io and io in gf.recorded_io)
    work = _Work(pairs, ff, metric_cols, replay, Comparer(algs, chunk_elements), ios)
    if jobs <= 0:
        jobs = auto_jobs(len(pairs))
    columns = BASE_COLUMNS + metric_cols + TAIL_COLUMNS + (FP64_COLUMNS if ff is not None else [])
    n_unmatched_t = sum(1 for p in pairs if p.golden is None)
    n_unmatched_g = sum(1 for p in pairs if p.target is None)
    warnings = [f"{f.path}: not closed cleanly (complete=False): the run may have crashed; "
                "comparing what was flushed" for f in (tf, gf) if not f.complete] + warnings
    meta = {
        "target": tf.path, "golden": gf.path, "golden_fp64": ff.path if ff is not None else None,
        "target_mode": tf.mode, "golden_mode": gf.mode,
        "pairing": "seqid" if replay else "stream",
        "target_ops": len(t_ops), "golden_ops": len(g_ops),
        "paired_ops": sum(1 for p in pairs if p.target is not None and p.golden is not None),
        "unmatched_target_ops": n_unmatched_t, "unmatched_golden_ops": n_unmatched_g,
        "op_filter": {"target": t_sel.describe() if t_sel else "", "golden": g_sel.describe() if g_sel else "",
                      "ops_left_out": filtered_out},
        "notes": ([subset_note] if subset_note else []) + align.notes(regions),
        "aligned_regions": [r.description for r in regions],
        "rows": None, "compared_io": list(ios), "algorithms": list(algs), "select": pattern.pattern if pattern else None,
        "warnings": warnings,
    }
    return _Setup(work, (tf, gf, ff), jobs, columns, meta,
                  inherit=not matching.is_replay_pairing(tf.mode, gf.mode))


@dataclass
class _Setup:
    work: "_Work"
    files: tuple
    jobs: int
    columns: list[str]
    meta: dict[str, Any]
    inherit: bool                   # carry precision forward (independent runs, not replays)


def _compare_files(tf: DumpFile, gf: DumpFile, ff: DumpFile | None, algs, pattern, jobs, chunk_elements,
                   amap=None):
    setup = _setup(tf, gf, ff, algs, pattern, jobs, chunk_elements, amap)
    rows: list[dict[str, Any]] = []
    for part in row_batches(setup, _open):
        rows += part
    table = to_frame(rows, setup.columns, 0, PrecisionCarry() if setup.inherit else None)
    meta = setup.meta
    meta["rows"] = len(table)
    return CompareResult(table, meta)


def _frames(setup: _Setup, batch_rows: int):
    """The comparison as DataFrames of about `batch_rows` rows, whole ops each (the
    verdict's per-op hints need an op's rows together)."""
    carry = PrecisionCarry() if setup.inherit else None
    start, rows = 0, []
    for part in row_batches(setup, _open):
        rows += part
        if len(rows) >= batch_rows:
            yield to_frame(rows, setup.columns, start, carry)
            start += len(rows)
            rows = []
    if rows or start == 0:
        yield to_frame(rows, setup.columns, start, carry)
        start += len(rows)
    setup.meta["rows"] = start


@dataclass
class _Work:
    """The comparison of a list of op pairs, in pieces [lo, hi) that can run anywhere."""

    pairs: list[matching.OpPair]
    ff: DumpFile | None
    metric_cols: list[str]
    replay: bool
    comparer: Comparer
    ios: tuple[str, ...] = (S.INPUT_GROUP, S.OUTPUT_GROUP)

    @property
    def eager(self) -> int:
        return min(EAGER_ELEMENTS, self.comparer.chunk)

    def tasks(self, lo: int, hi: int):
        """Tasks of pairs[lo:hi], made pair by pair: only one op's small tensors (read
        eagerly) are held at a time."""
        for pair in self.pairs[lo:hi]:
            yield from tasks_for_pair(pair, self.ff, self.metric_cols, 0, self.replay, self.eager,
                                       self.ios)

    def pair_tasks(self, pair: matching.OpPair) -> list["Task"]:
        return tasks_for_pair(pair, self.ff, self.metric_cols, 0, self.replay, self.eager, self.ios)

    @staticmethod
    def computes(task: "Task") -> bool:
        """Whether the task's metrics are computed (both sides present, not a replayed random op)."""
        return task.target is not None and task.golden is not None \
            and task.row["CompareStatus"] != STATUS_RANDOM_REPLAYED

    def rows(self, lo: int, hi: int) -> list[dict[str, Any]]:
        rows = []
        for task in self.tasks(lo, hi):
            rows.append(task.row)
            if self.computes(task):
                self.comparer.run(task)
        return rows


