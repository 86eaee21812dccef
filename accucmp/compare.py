"""compare_dumps: two dump files in, one row per tensor out (torch-free).

Pipeline: open both files (dumpfile.DumpFile validates them) -> pair ops
(matching.py) -> pair tensors by input/output name -> compute the metrics of each
pair (metrics.py; small tensors read whole, large ones streamed in chunks of
`chunk_elements`, both sides in lockstep, so peak memory is bounded by the chunk
size) -> a pandas table sorted in execution order. No verdict here: verdict.py
applies thresholds to the table, and can be re-run on a saved csv.
"""

from __future__ import annotations

import math
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import h5py
import numpy as np
import pandas as pd

from dumpfile import schema as S
from dumpfile.errors import DumpError, DumpFormatError
from dumpfile.reader import DumpFile, ValueRecord, decode_raw

from . import matching
from .metrics import (METRIC_NAMES, MetricResult, TensorComparison, aligned, compare_stats,
                      comparison_for, resolve_algorithms)

BASE_COLUMNS = ["Index", "NPUDump", "NPUDumpPath", "GroundTruthPath", "DataType", "Shape"]
TAIL_COLUMNS = [
    "CompareFailReason", "SeqId", "Phase", "Module", "GoldenDataType", "GoldenShape", "GoldenSeqId",
    "GoldenOp", "IO", "TensorName", "PrecisionDtype", "ComputeDtype", "Uninitialized", "CompareStatus",
    "MatchedBy", "GoldenAbsMax", "TargetMean", "TargetStd", "GoldenMean", "GoldenStd",
    "NonFiniteMismatch", "TargetNonFinite", "GoldenNonFinite",
]
FP64_COLUMNS = ["TargetErrorVsFp64", "GoldenErrorVsFp64"]

# CompareStatus values: why a row has (or lacks) metrics; the verdict keys on these.
STATUS_COMPARED = "compared"
STATUS_STATS = "stats"                  # statistics-only: lower bounds / exact std
STATUS_UNMATCHED = "unmatched"
STATUS_UNINITIALIZED = "uninitialized"  # output of an empty-like op
STATUS_EMPTY = "empty"
STATUS_SIZE_MISMATCH = "size_mismatch"
STATUS_CORRUPT = "corrupt"              # unreadable / attributes disagree with data


class CompareError(DumpError):
    """A comparison could not be set up (bad regex, unknown metric)."""


@dataclass
class CompareResult:
    table: pd.DataFrame
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Task:
    order: int
    row: dict[str, Any]
    target: ValueRecord | None
    golden: ValueRecord | None
    fp64: ValueRecord | None = None


def _dtype_of(rec: ValueRecord) -> str:
    if rec.dtype:
        return rec.dtype
    try:
        return str(rec.file.h5[rec.path].dtype) if rec.type == S.TYPE_TENSOR else ""
    except (KeyError, TypeError, ValueError):
        return ""


def _shape_str(shape) -> str:
    return "(" + ",".join(str(int(s)) for s in shape) + ")"


def _check_record(rec: ValueRecord) -> tuple[tuple[int, ...], int]:
    """(shape, numel) from the attributes, checked against the stored data."""
    where = f"{rec.file.path}: {rec.path}"
    try:
        shape = rec.shape
    except (ValueError, TypeError) as e:
        raise DumpFormatError(f"{where}: unreadable shape attribute ({e})") from e
    if any(s < 0 for s in shape):
        raise DumpFormatError(f"{where}: negative dimension in shape attribute {shape}")
    numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if rec.type == S.TYPE_TENSOR:
        ds = getattr(rec, "dataset", None) or rec.file.h5[rec.path]
        stored = int(ds.size or 0)
        if rec.dtype == "complex32":
            stored //= 2
        if S.ATTR_SHAPE in rec.attrs and stored != numel:
            raise DumpFormatError(f"{where}: shape attribute {_shape_str(shape)} ({numel} elements) "
                                  f"disagrees with the stored data ({stored} elements)")
    return shape, numel


def _least_precise(dtypes) -> str:
    """The floating dtype with the largest unit roundoff, '' when none is floating."""
    best, best_u = "", -1.0
    for d in dtypes:
        u = S.UNIT_ROUNDOFF.get(d)
        if u is not None and u > best_u:
            best, best_u = d, u
    return best


class _Comparer:
    def __init__(self, algorithms, chunk_elements: int):
        self.algorithms = algorithms
        self.chunk = max(1, int(chunk_elements))

    def _read_whole(self, rec: ValueRecord, numel: int) -> bool:
        return rec.type != S.TYPE_TENSOR or numel <= self.chunk

    def _chunks(self, rec: ValueRecord, numel: int):
        if self._read_whole(rec, numel):
            return iter([np.asarray(rec.read()).reshape(-1)])
        return rec.iter_chunks(self.chunk)

    def run(self, task: _Task) -> dict[str, Any]:
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
        t_shape, t_n = _check_record(t)
        g_shape, g_n = _check_record(g)
        if t.uninitialized or g.uninitialized:
            row["CompareStatus"] = STATUS_UNINITIALIZED
            row["CompareFailReason"] = "output of an empty-like op (uninitialized memory): not compared"
            return
        if t.is_stats or g.is_stats:
            xs = t.stats() if t.is_stats else _stats_of(self._chunks(t, t_n))
            ys = g.stats() if g.is_stats else _stats_of(self._chunks(g, g_n))
            res, extras = compare_stats(xs, ys, self.algorithms)
            self._put(row, res, extras)
            row["CompareStatus"] = STATUS_STATS
            return
        if t_n != g_n:
            row["CompareStatus"] = STATUS_SIZE_MISMATCH
            row["CompareFailReason"] = (f"size mismatch: target {_shape_str(t_shape)} ({t_n} elements), "
                                        f"golden {_shape_str(g_shape)} ({g_n} elements)")
            return
        if t_n == 0:
            row["CompareStatus"] = STATUS_EMPTY
            row["CompareFailReason"] = "empty tensor (0 elements)"
            return
        tc = comparison_for(_numpy_kind(row["DataType"]), _numpy_kind(row["GoldenDataType"]), self.algorithms)
        f = task.fp64
        fp = None
        if f is not None:
            f_shape, f_n = _check_record(f)
            if f_n == t_n and not f.is_stats and not f.uninitialized:
                fp = (comparison_for(np.float64, np.float64, ["RelativeEuclideanDistance"]),
                      comparison_for(np.float64, np.float64, ["RelativeEuclideanDistance"]))
        whole = self._read_whole(t, t_n) and self._read_whole(g, g_n)
        if whole:
            x = np.asarray(t.read()).reshape(-1)
            y = np.asarray(g.read()).reshape(-1)
            tc.add(x, y)
            if tc.needs_kl_pass:
                tc.kl_pass(x, y)
            if fp:
                z = np.asarray(f.read()).reshape(-1)
                fp[0].add(x, z)
                fp[1].add(y, z)
        else:
            for x, y in aligned(self._chunks(t, t_n), self._chunks(g, g_n)):
                tc.add(x, y)
            if tc.needs_kl_pass:
                for x, y in aligned(self._chunks(t, t_n), self._chunks(g, g_n)):
                    tc.kl_pass(x, y)
            if fp:
                for x, z in aligned(self._chunks(t, t_n), self._chunks(f, f_n)):
                    fp[0].add(x, z)
                for y, z in aligned(self._chunks(g, g_n), self._chunks(f, f_n)):
                    fp[1].add(y, z)
        if tc.total != t_n:
            raise DumpFormatError(f"{t.file.path}: {t.path}: read {tc.total} elements, shape says {t_n}")
        self._put(row, tc.results(), tc.extras())
        row["CompareStatus"] = STATUS_COMPARED
        if fp:
            row["TargetErrorVsFp64"] = fp[0].results()["RelativeEuclideanDistance"].value
            row["GoldenErrorVsFp64"] = fp[1].results()["RelativeEuclideanDistance"].value

    def _put(self, row, results: dict[str, MetricResult], extras: dict[str, float]) -> None:
        reasons = [row["CompareFailReason"]] if row.get("CompareFailReason") else []
        for name, r in results.items():
            row[name] = r.value
            if r.reason and r.reason not in reasons:
                reasons.append(r.reason)
        row["CompareFailReason"] = "; ".join(_dedupe_bool(reasons))
        row.update(extras)


def _dedupe_bool(reasons: list[str]) -> list[str]:
    bools = [r for r in reasons if r.startswith("bool tensor: ")]
    rest = [r for r in reasons if not r.startswith("bool tensor: ")]
    if bools:
        rest.insert(0, "bool tensor: only CosineSimilarity and RelativeEuclideanDistance apply")
    return rest


def _numpy_kind(dtype_name: str):
    if dtype_name == "bool":
        return np.bool_
    return np.float64


def _stats_of(chunks) -> dict[str, float]:
    """The statistics fields of a tensor given as chunks (for stats-vs-data rows)."""
    n = nan = inf = 0
    lo, hi, s, ss = math.inf, -math.inf, 0.0, 0.0
    for c in chunks:
        c = np.asarray(c, dtype=np.float64).reshape(-1)
        fin = np.isfinite(c)
        nan += int(np.isnan(c).sum())
        inf += int(np.isinf(c).sum())
        c = c[fin]
        n += c.size
        if c.size:
            lo, hi = min(lo, float(c.min())), max(hi, float(c.max()))
            s += float(c.sum())
            ss += float(np.einsum("i,i->", c, c))
    mean = s / n if n else math.nan
    var = max(ss / n - mean * mean, 0.0) if n else math.nan
    return {"min": lo, "max": hi, "mean": mean, "std": math.sqrt(var), "norm": math.sqrt(ss),
            "nan_count": nan, "inf_count": inf, "numel": n + nan + inf}


# Reading every attribute of every dataset (DumpFile.values) costs ~10 HDF5
# attribute reads per tensor and dominated small-tensor compares; these read only
# what a comparison needs. Storage dtypes that say the torch dtype by themselves
# skip the "dtype" attribute; ambiguous ones (uint8/uint16 raw bits, float16 pairs)
# read it.
_UNAMBIGUOUS_STORAGE = {np.dtype(k): k for k in ("float32", "float64", "int8", "int16", "int32", "int64",
                                                 "bool", "complex64", "complex128", "uint32", "uint64")}


def _attr(obj, name, default=None):
    if name not in obj.attrs:
        return default
    v = obj.attrs[name]
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else v


def _light_record(f: DumpFile, path: str, name: str) -> ValueRecord:
    obj = f.h5[path]
    code = _attr(obj, S.ATTR_TYPE)
    if code is None:
        code = S.TYPE_LIST if isinstance(obj, h5py.Group) else S.TYPE_TENSOR
    code = int(code)
    if code in (S.TYPE_TENSOR_VIEW, S.TYPE_TENSOR_STATS) or (code not in S.TENSOR_TYPES and code not in S.LIST_TYPES):
        return f._record(path, name)          # rare, or not a tensor: the reader's full record
    if code in S.LIST_TYPES:
        rec = ValueRecord(f, path, name, code, {S.ATTR_TYPE: code})
        kids = sorted(obj.keys(), key=lambda k: (int(k.rsplit("_", 1)[-1]) if k.rsplit("_", 1)[-1].isdigit()
                                                 else 1 << 62, k))
        rec.children = [_light_record(f, f"{path}/{k}", k) for k in kids]
        return rec
    attrs: dict[str, Any] = {S.ATTR_TYPE: code}
    dtype = _UNAMBIGUOUS_STORAGE.get(obj.dtype)
    attrs[S.ATTR_DTYPE] = dtype or _attr(obj, S.ATTR_DTYPE, str(obj.dtype))
    shape = _attr(obj, S.ATTR_SHAPE)
    if shape is not None:
        attrs[S.ATTR_SHAPE] = shape
    if S.ATTR_UNINITIALIZED in obj.attrs:
        attrs[S.ATTR_UNINITIALIZED] = obj.attrs[S.ATTR_UNINITIALIZED]
    rec = _LightTensor(f, path, name, code, attrs)
    rec.dataset = obj
    return rec


class _LightTensor(ValueRecord):
    """A plain tensor record holding its open dataset (each h5py lookup by path costs)."""

    dataset: Any = None

    def read(self):
        return decode_raw(self.dataset[()], self.dtype)


def _light_values(f: DumpFile, group_path: str) -> dict[str, ValueRecord]:
    grp = f.h5.get(group_path)
    if grp is None:
        return {}
    names = list(grp.keys())
    order = grp.attrs.get("order")
    if order is not None:
        listed = [n.decode() if isinstance(n, bytes) else str(n) for n in np.asarray(order).reshape(-1)]
        names = [n for n in listed if n in set(names)] + [n for n in names if n not in set(listed)]
    return {n: _light_record(f, f"{group_path}/{n}", n) for n in names}


@dataclass
class _OpTensors:
    inputs: dict[str, ValueRecord]
    outputs: dict[str, ValueRecord]
    compute_dtype: str


def _op_tensors(op) -> _OpTensors:
    if op is None:
        return _OpTensors({}, {}, "")
    f = op.file
    ins = matching.tensor_leaves(_light_values(f, f"{op.path}/{S.INPUT_GROUP}"))
    outs = matching.tensor_leaves(_light_values(f, f"{op.path}/{S.OUTPUT_GROUP}"))
    cd = _attr(f.h5[op.path], S.OP_COMPUTE_DTYPE, "")
    return _OpTensors(ins, outs, str(cd or ""))


def _op_dtypes(ot: _OpTensors) -> list[str]:
    out = [_dtype_of(r) for r in (*ot.inputs.values(), *ot.outputs.values())]
    return out + ([ot.compute_dtype] if ot.compute_dtype else [])


def _open(path, role: str) -> DumpFile:
    try:
        return DumpFile(path)
    except DumpError:
        raise
    except (OSError, ValueError) as e:
        raise DumpFormatError(f"{path}: cannot open {role} dump: {e}") from e


def compare_dumps(target: str, golden: str, *, algorithms=None, select: str | None = None, jobs: int = 1,
                  chunk_elements: int = 1 << 22, golden_fp64: str | None = None) -> CompareResult:
    """Compare every tensor of `target` against its pair in `golden`.

    Returns a CompareResult whose table has one row per tensor (BASE_COLUMNS, one
    column per requested metric, TAIL_COLUMNS, FP64_COLUMNS when `golden_fp64`),
    sorted in execution order; `.meta` holds paths, modes and counts.
    """
    try:
        algs = resolve_algorithms(algorithms)
    except ValueError as e:
        raise CompareError(str(e)) from e
    try:
        pattern = re.compile(select) if select else None
    except re.error as e:
        raise CompareError(f"--select {select!r}: not a valid regular expression ({e})") from e
    files = []
    try:
        tf = _open(target, "target")
        files.append(tf)
        gf = _open(golden, "golden")
        files.append(gf)
        ff = _open(golden_fp64, "fp64 golden") if golden_fp64 else None
        if ff is not None:
            files.append(ff)
        return _compare_files(tf, gf, ff, algs, pattern, jobs, chunk_elements)
    finally:
        for f in files:
            f.close()


def _compare_files(tf: DumpFile, gf: DumpFile, ff: DumpFile | None, algs, pattern, jobs, chunk_elements):
    from dumpfile.golden_info import read_not_replayed

    t_ops, g_ops = tf.ops(), gf.ops()
    if pattern is not None:
        keep = lambda o: bool(pattern.search(o.op) or pattern.search(o.module or ""))  # noqa: E731
        t_ops, g_ops = [o for o in t_ops if keep(o)], [o for o in g_ops if keep(o)]
    pairs = matching.pair_ops(t_ops, g_ops, target_mode=tf.mode, golden_mode=gf.mode,
                              golden_missing_reasons=read_not_replayed(gf.h5))
    tasks: list[_Task] = []
    metric_cols = list(algs)
    replay = matching.is_replay_pairing(tf.mode, gf.mode)
    for pair in pairs:
        tasks += _tasks_for_pair(pair, ff, metric_cols, len(tasks), replay)
    comparer = _Comparer(algs, chunk_elements)
    runnable = [t for t in tasks if t.target is not None and t.golden is not None]
    if jobs > 1 and len(runnable) > 1:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            list(pool.map(comparer.run, runnable))
    else:
        for t in runnable:
            comparer.run(t)
    columns = BASE_COLUMNS + metric_cols + TAIL_COLUMNS + (FP64_COLUMNS if ff is not None else [])
    table = pd.DataFrame([t.row for t in tasks], columns=columns)
    table["Index"] = np.arange(len(table), dtype=np.int64)
    for c in ("SeqId", "GoldenSeqId"):
        table[c] = table[c].astype("Int64")
    n_unmatched_t = sum(1 for p in pairs if p.golden is None)
    n_unmatched_g = sum(1 for p in pairs if p.target is None)
    warnings = [f"{f.path}: not closed cleanly (complete=False): the run may have crashed; "
                "comparing what was flushed" for f in (tf, gf) if not f.complete]
    meta = {
        "target": tf.path, "golden": gf.path, "golden_fp64": ff.path if ff is not None else None,
        "target_mode": tf.mode, "golden_mode": gf.mode,
        "pairing": "seqid" if matching.is_replay_pairing(tf.mode, gf.mode) else "stream",
        "target_ops": len(t_ops), "golden_ops": len(g_ops),
        "paired_ops": sum(1 for p in pairs if p.target is not None and p.golden is not None),
        "unmatched_target_ops": n_unmatched_t, "unmatched_golden_ops": n_unmatched_g,
        "rows": len(table), "algorithms": list(algs), "select": pattern.pattern if pattern else None,
        "warnings": warnings,
    }
    return CompareResult(table, meta)


def _tasks_for_pair(pair: matching.OpPair, ff: DumpFile | None, metric_cols, start: int,
                    replay: bool) -> list[_Task]:
    t_op, g_op = pair.target, pair.golden
    any_op = t_op or g_op
    phase = any_op.phase
    module = any_op.module
    t_ts, g_ts = _op_tensors(t_op), _op_tensors(g_op)
    precision = _least_precise(_op_dtypes(t_ts) + _op_dtypes(g_ts))
    compute = t_ts.compute_dtype or g_ts.compute_dtype
    tasks = []
    for io in (S.INPUT_GROUP, S.OUTPUT_GROUP):
        t_vals = t_ts.inputs if io == S.INPUT_GROUP else t_ts.outputs
        g_vals = g_ts.inputs if io == S.INPUT_GROUP else g_ts.outputs
        for name, t, g in matching.pair_tensors(t_vals, g_vals):
            rec = t or g
            row: dict[str, Any] = {c: math.nan for c in metric_cols}
            row.update({
                "NPUDump": t_op.op if t_op else g_op.op,
                "NPUDumpPath": t.path if t else "",
                "GroundTruthPath": g.path if g else "",
                "DataType": _dtype_of(t) if t else "",
                "Shape": _safe_shape(t) if t else "",
                "CompareFailReason": "",
                # golden-only rows keep a SeqId only where both files share the numbering
                "SeqId": t_op.seqid if t_op else (g_op.seqid if replay else pd.NA),
                "Phase": phase, "Module": module,
                "GoldenDataType": _dtype_of(g) if g else "",
                "GoldenShape": _safe_shape(g) if g else "",
                "GoldenSeqId": g_op.seqid if g_op else pd.NA,
                "GoldenOp": g_op.op if g_op else "",
                "IO": io, "TensorName": name,
                "PrecisionDtype": precision, "ComputeDtype": compute,
                "Uninitialized": bool((t is not None and t.uninitialized) or (g is not None and g.uninitialized)),
                "CompareStatus": "", "MatchedBy": pair.matched_by,
                "NonFiniteMismatch": 0, "TargetNonFinite": 0, "GoldenNonFinite": 0,
            })
            if t is None or g is None:
                row["CompareStatus"] = STATUS_UNMATCHED
                row["CompareFailReason"] = pair.reason or (
                    f"No data match with {t.path} in golden dump data." if t is not None
                    else f"No data match with {g.path} in my dump data.")
                row["MatchedBy"] = "unmatched"
            elif pair.reason:
                row["CompareFailReason"] = pair.reason
            fp = None
            if ff is not None and g is not None and g.path in ff.h5:
                try:
                    fp = _light_record(ff, g.path, g.name)
                    fp = fp if fp.is_tensor else None
                except (KeyError, ValueError, OSError):
                    fp = None
            tasks.append(_Task(start + len(tasks), row, t, g, fp))
    return tasks


def _safe_shape(rec: ValueRecord) -> str:
    try:
        return _shape_str(rec.shape)
    except (ValueError, TypeError):
        return "?"
