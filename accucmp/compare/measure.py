"""The metrics stage: one Task's metrics into its row (torch-free).

Comparer.run takes a Task from the read stage (rows.py: the row and the two value
records) and fills the row's metric columns and CompareStatus: small tensors read whole,
large ones streamed in chunks of `chunk_elements`, both sides in lockstep, so peak memory
is bounded by the chunk size; statistics-only sides compared by their statistics. The
pipeline (pipeline.py) gathers the rows into Measured batches for the verdict stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from dumpfile import schema as S
from dumpfile.overwritten import holds_no_data
from dumpfile.errors import DumpError, DumpFormatError
from dumpfile.read.light import LightTensor
from dumpfile.read.reader import ValueRecord

from accucmp.compare.absorption import absorbed_update
from accucmp.compare.cancellation import rounded_sum_cancellation
from accucmp.compare.metrics import MetricResult, TensorComparison, aligned
from accucmp.compare.stats_metrics import compare_stats, stats_of
from accucmp.compare.rows import (STATUS_COMPARED, STATUS_CORRUPT, STATUS_EMPTY, STATUS_SIZE_MISMATCH,
                                  STATUS_STATS, STATUS_UNINITIALIZED, Task, check_record, shape_str)
from accucmp.numformats import format_of, round_to


@dataclass(frozen=True, slots=True)
class Measured:
    """The metrics stage's result, handed to the verdict stage (verdict.judge): rows of
    whole ops in execution order, metric columns filled, no verdict yet."""

    table: pd.DataFrame
    first: int                  # the Index of its first row (batches count on)


class Comparer:
    def __init__(self, algorithms, chunk_elements: int):
        self.algorithms = algorithms
        self.chunk = max(1, int(chunk_elements))

    def _read_whole(self, rec: ValueRecord, numel: int) -> bool:
        return rec.type != S.TYPE_TENSOR or numel <= self.chunk

    def _chunks(self, rec: ValueRecord, numel: int, scale: float = 1.0):
        if scale != 1.0:
            # a loss scale (rows.Task.scale): divided out in float64, where dividing by a
            # power of two is exact and no float16 value under- or overflows
            return (_unscaled(c, scale) for c in self._chunks(rec, numel))
        if self._read_whole(rec, numel):
            return iter([np.asarray(rec.read()).reshape(-1)])
        if isinstance(rec, LightTensor) and rec.fast and rec.stored_shape:
            return rec.iter_chunks_into(self.chunk)
        return rec.iter_chunks(self.chunk)

    def run(self, task: Task) -> dict[str, Any]:
        row = task.row
        t, g = task.target, task.golden
        try:
            self._compare(task, row, t, g)
        except (DumpError, OSError, ValueError, KeyError, TypeError) as e:
            row["CompareStatus"] = STATUS_CORRUPT
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            row["CompareFailReason"] = msg
        return row

    def _compare(self, task, row, t, g):
        t_shape, t_n = check_record(t)
        g_shape, g_n = check_record(g)
        if t.uninitialized or g.uninitialized or holds_no_data(
                str(row.get("NPUDump") or ""), str(row.get("IO") or ""), str(row.get("TensorName") or "")):
            # (by the op's nature too: dumps written before the dumper marked bernoulli_'s
            # self `uninitialized` still hold dropout's empty_like buffer there)
            row["CompareStatus"] = STATUS_UNINITIALIZED
            row["CompareFailReason"] = ("uninitialized memory (empty-like output, out=, collective or "
                                        "fill_/copy_/bernoulli_ destination before the op): not compared")
            return
        if t.is_stats or g.is_stats:
            if task.scale != 1.0 and t.is_stats:
                # (statistics hold no tensor to divide: compared as recorded, the row says so)
                row["CompareFailReason"] = f"statistics of a tensor that carries a loss scale of {task.scale:g}"
            xs = t.stats() if t.is_stats else stats_of(self._chunks(t, t_n, task.scale))
            ys = g.stats() if g.is_stats else stats_of(self._chunks(g, g_n))
            res, extras = compare_stats(xs, ys, self.algorithms)
            self._put(row, res, extras)
            if S.STATS_HASH_FIELD in xs and S.STATS_HASH_FIELD in ys:
                # content hashes of both sides (1.7 statistics dumps): bit identity, exact
                row["BitIdentical"] = xs[S.STATS_HASH_FIELD] == ys[S.STATS_HASH_FIELD]
            row["CompareStatus"] = STATUS_STATS
            return
        if t_n != g_n:
            row["CompareStatus"] = STATUS_SIZE_MISMATCH
            row["CompareFailReason"] = (f"size mismatch: target {shape_str(t_shape)} ({t_n} elements), "
                                        f"golden {shape_str(g_shape)} ({g_n} elements)")
            return
        if t_n == 0:
            row["CompareStatus"] = STATUS_EMPTY
            row["CompareFailReason"] = "empty tensor (0 elements)"
            return
        # TensorComparison directly: comparison_for would re-resolve the metric names per row
        tc = TensorComparison(algorithms=self.algorithms,
                              bool_mode=row["DataType"] == "bool" or row["GoldenDataType"] == "bool")
        f = task.fp64
        fp = None
        if f is not None:
            _, f_n = check_record(f)
            if f_n == t_n and not f.is_stats and not f.uninitialized:
                fp = (TensorComparison(algorithms=("RelativeEuclideanDistance",)),
                      TensorComparison(algorithms=("RelativeEuclideanDistance",)))
        whole = self._read_whole(t, t_n) and self._read_whole(g, g_n)
        if whole:
            x = np.asarray(t.read()).reshape(-1)
            if task.scale != 1.0:
                x = _unscaled(x, task.scale)
            y = np.asarray(g.read()).reshape(-1)
            tc.add(x, y)
            if tc.needs_kl_pass:
                tc.kl_pass(x, y)
            if fp:
                z = np.asarray(f.read()).reshape(-1)
                fp[0].add(x, z)
                fp[1].add(y, z)
        else:
            for x, y in aligned(self._chunks(t, t_n, task.scale), self._chunks(g, g_n)):
                tc.add(x, y)
            if tc.needs_kl_pass:
                for x, y in aligned(self._chunks(t, t_n, task.scale), self._chunks(g, g_n)):
                    tc.kl_pass(x, y)
            if fp:
                for x, z in aligned(self._chunks(t, t_n, task.scale), self._chunks(f, f_n)):
                    fp[0].add(x, z)
                for y, z in aligned(self._chunks(g, g_n), self._chunks(f, f_n)):
                    fp[1].add(y, z)
        if tc.elements != t_n:
            raise DumpFormatError(f"{t.file.path}: {t.path}: read {tc.elements} elements, shape says {t_n}")
        self._put(row, tc.results(), tc.extras())
        row["CompareStatus"] = STATUS_COMPARED
        if task.sum_terms is not None:
            terms, rule, args = task.sum_terms
            row["RoundedInputCancellation"] = rounded_sum_cancellation(terms, rule, g_shape, args,
                                                                       limit=4 * self.chunk, golden=g)
        if task.update_base is not None:
            self._absorbed(task, row, t, g, t_n)
        self._range_loss(row, g, g_n, task.scale if task.range_scale is None else task.range_scale)
        if fp:
            row["TargetErrorVsFp64"] = fp[0].results()["RelativeEuclideanDistance"].value
            row["GoldenErrorVsFp64"] = fp[1].results()["RelativeEuclideanDistance"].value

    def _range_loss(self, row, g, n: int, scale: float = 1.0) -> None:
        """RangeLoss (rows.py) where the target's dtype has a narrower range than the golden's
        and every golden value lies below 16x its smallest normal: a second pass over the
        golden, only for such tensors (gradients at float16's underflow edge). `scale`: the
        loss scale the target's tensor carries over the golden's (rows.Task.scale): the
        target holds the golden's values times it (a GradScaler's point)."""
        dtype = str(row.get("DataType") or "")
        fmt = format_of(dtype)
        # (only where the golden's dtype holds smaller values than the target's: its subnormals
        # are finer)
        finer = S.SMALLEST_SUBNORMAL.get(str(row.get("GoldenDataType") or ""))
        big = row.get("GoldenAbsMax")
        if fmt is None or finer is None or finer >= S.SMALLEST_SUBNORMAL.get(dtype, 0.0):
            return
        if not isinstance(big, float) or not 0 < big * abs(scale) < 16 * fmt.min_normal:
            return
        err = ref = 0.0
        with np.errstate(all="ignore"):
            for y in self._chunks(g, n):
                y = np.asarray(y, dtype=np.float64)
                y = y[np.isfinite(y)]
                err = float(np.hypot(err, np.linalg.norm(round_to(y * scale, fmt) / scale - y)))
                ref = float(np.hypot(ref, np.linalg.norm(y)))
        if ref > 0:
            row["RangeLoss"] = err / ref

    def _absorbed(self, task: Task, row, t, g, n: int) -> None:
        """UpdateAbsorbed / UpdateChanged of an in-place update of state (absorption.py), from
        the two records of the tensor before the update; left NaN where those do not hold n
        elements or hold statistics only."""
        t_in, g_in, dtype = task.update_base
        fmt = format_of(dtype)
        bases = [r for r in (t_in, g_in) if r is not None]
        if fmt is None or any(r.is_stats or r.uninitialized or check_record(r)[1] != n for r in bases):
            return
        streams = [self._chunks(t, n), self._chunks(g, n), None if t_in is None else self._chunks(t_in, n),
                   self._chunks(g_in, n)]
        row["UpdateAbsorbed"], row["UpdateChanged"] = absorbed_update(*streams, fmt)

    def _put(self, row, results: dict[str, MetricResult], extras: dict[str, float]) -> None:
        reasons = [row["CompareFailReason"]] if row.get("CompareFailReason") else []
        for name, r in results.items():
            row[name] = r.value
            if r.reason and r.reason not in reasons:
                reasons.append(r.reason)
        row["CompareFailReason"] = "; ".join(_dedupe_bool(reasons))
        row.update(extras)


def _unscaled(x, scale: float) -> np.ndarray:
    """`x` divided by a loss scale in float64 (complex128 for a complex tensor: DeepSeek-V2's
    rotary gradients), where dividing by a power of two is exact."""
    x = np.asarray(x)
    return x.astype(np.complex128 if np.iscomplexobj(x) else np.float64) / scale


def _dedupe_bool(reasons: list[str]) -> list[str]:
    bools = [r for r in reasons if r.startswith("bool tensor: ")]
    rest = [r for r in reasons if not r.startswith("bool tensor: ")]
    if bools:
        rest.insert(0, "bool tensor: only CosineSimilarity and RelativeEuclideanDistance apply")
    return rest

