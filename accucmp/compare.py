"""compare_dumps: two dump files in, one row per tensor out (torch-free).

Pipeline: open both files (dumpfile.DumpFile validates them) -> pair ops
(matching.py) -> pair tensors by input/output name -> compute the metrics of each
pair (metrics.py; small tensors read whole, large ones streamed in chunks of
`chunk_elements`, both sides in lockstep, so peak memory is bounded by the chunk
size) -> a pandas table sorted in execution order. No verdict here: verdict.py
applies thresholds to the table, and can be re-run on a saved csv.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import h5py
from h5py import h5a, h5d, h5g, h5o, h5s
import numpy as np
import pandas as pd

from dumpfile import legacy
from dumpfile import schema as S
from dumpfile.errors import DumpError, DumpFormatError
from dumpfile.lowlevel import UNSUPPORTED, read_open_attr
from dumpfile.reader import DumpFile, ValueRecord, chunk_slabs, decode_raw, h5_errors

from . import matching
from .metrics import MetricResult, TensorComparison, aligned, compare_stats, resolve_algorithms

BASE_COLUMNS = ["Index", "NPUDump", "NPUDumpPath", "GroundTruthPath", "DataType", "Shape"]
TAIL_COLUMNS = [
    "CompareFailReason", "SeqId", "Phase", "Module", "GoldenDataType", "GoldenShape", "GoldenSeqId",
    "GoldenOp", "IO", "TensorName", "PrecisionDtype", "ComputeDtype", "Uninitialized", "CompareStatus",
    "MatchedBy", "GoldenAbsMax", "TargetMean", "TargetStd", "GoldenMean", "GoldenStd",
    "NonFiniteMismatch", "TargetNonFinite", "GoldenNonFinite", "ExactMismatches", "BitIdentical",
    # load-replay with rounded inputs: the target against float64 on the inputs it got
    # (op attribute own_error, npu_dumper/replay/own_error.py): RED, max |x - ref|, max |ref|
    "OwnErrorVsFp64", "OwnMaxErrorVsFp64", "OwnRefAbsMax",
]
FP64_COLUMNS = ["TargetErrorVsFp64", "GoldenErrorVsFp64"]

# CompareStatus values: why a row has (or lacks) metrics; the verdict keys on these.
STATUS_COMPARED = "compared"
STATUS_STATS = "stats"                  # statistics-only: lower bounds / exact std
STATUS_UNMATCHED = "unmatched"
STATUS_UNINITIALIZED = "uninitialized"  # output of an empty-like op
STATUS_EMPTY = "empty"
STATUS_RANDOM_REPLAYED = "random_replayed"  # a random op's outputs were copied from the golden
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
        if isinstance(rec, _LightTensor):
            stored = rec.stored_size
        else:
            stored = int(rec.file.h5[rec.path].size or 0)
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


def _inherit_precision(table: pd.DataFrame, carry: "_PrecisionCarry | None" = None) -> None:
    """Independent runs: every op works on what earlier ops computed, so a tensor carries the
    rounding error of the least precise dtype computed in before it (a bf16 model's logits
    cast to fp32 for the loss hold bf16 error, not fp32 error). PrecisionDtype becomes the
    least precise of the row's own and of every earlier row's (execution order, both runs;
    `carry` holds what earlier batches of a streamed comparison saw).
    Not for replays: there every op starts from the golden's own inputs."""
    if table.empty or "PrecisionDtype" not in table:
        return
    coarsest, coarsest_u, out = ("", -1.0, []) if carry is None else (carry.coarsest, carry.coarsest_u, [])
    for d in table["PrecisionDtype"].tolist():
        u = S.UNIT_ROUNDOFF.get(d) if isinstance(d, str) else None
        if u is not None and u > coarsest_u:
            coarsest, coarsest_u = d, u
        out.append(coarsest if u is not None and coarsest_u > u else d)
    table["PrecisionDtype"] = out
    if carry is not None:
        carry.coarsest, carry.coarsest_u = coarsest, coarsest_u


class _Comparer:
    def __init__(self, algorithms, chunk_elements: int):
        self.algorithms = algorithms
        self.chunk = max(1, int(chunk_elements))

    def _read_whole(self, rec: ValueRecord, numel: int) -> bool:
        return rec.type != S.TYPE_TENSOR or numel <= self.chunk

    def _chunks(self, rec: ValueRecord, numel: int):
        if self._read_whole(rec, numel):
            return iter([np.asarray(rec.read()).reshape(-1)])
        if isinstance(rec, _LightTensor) and rec.fast and rec.stored_shape:
            return rec.iter_chunks_into(self.chunk)
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
            row["CompareFailReason"] = ("uninitialized memory (empty-like output, out= or collective "
                                        "output buffer before the op): not compared")
            return
        if t.is_stats or g.is_stats:
            xs = t.stats() if t.is_stats else _stats_of(self._chunks(t, t_n))
            ys = g.stats() if g.is_stats else _stats_of(self._chunks(g, g_n))
            res, extras = compare_stats(xs, ys, self.algorithms)
            self._put(row, res, extras)
            if S.STATS_HASH_FIELD in xs and S.STATS_HASH_FIELD in ys:
                # content hashes of both sides (1.7 statistics dumps): bit identity, exact
                row["BitIdentical"] = xs[S.STATS_HASH_FIELD] == ys[S.STATS_HASH_FIELD]
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
        # TensorComparison directly: comparison_for would re-resolve the metric names per row
        tc = TensorComparison(algorithms=self.algorithms,
                              bool_mode=row["DataType"] == "bool" or row["GoldenDataType"] == "bool")
        f = task.fp64
        fp = None
        if f is not None:
            f_shape, f_n = _check_record(f)
            if f_n == t_n and not f.is_stats and not f.uninitialized:
                fp = (TensorComparison(algorithms=("RelativeEuclideanDistance",)),
                      TensorComparison(algorithms=("RelativeEuclideanDistance",)))
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
        if tc.elements != t_n:
            raise DumpFormatError(f"{t.file.path}: {t.path}: read {tc.elements} elements, shape says {t_n}")
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


def _stats_of(chunks) -> dict[str, float]:
    """The statistics fields of a tensor given as chunks (for stats-vs-data rows), computed
    as the dumper computes a statistics-only dump's (npu_dumper tensor_stats, docs/FORMAT.md):
    complex tensors by magnitude, std the sample std (n-1, 0 for one element)."""
    n = nan = inf = 0
    lo, hi, s, ss = math.inf, -math.inf, 0.0, 0.0
    for c in chunks:
        c = np.asarray(c)
        if np.iscomplexobj(c):
            # the other side holds statistics of |z|; a float64 cast would keep the real part
            c = np.abs(c)
        c = c.astype(np.float64, copy=False).reshape(-1)
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
    var = max((ss - n * mean * mean) / (n - 1), 0.0) if n > 1 else (0.0 if n else math.nan)
    return {"min": lo if n else math.nan, "max": hi if n else math.nan, "mean": mean,
            "std": math.sqrt(var), "norm": math.sqrt(ss) if n else math.nan,
            "nan_count": nan, "inf_count": inf, "numel": n + nan + inf}


# Reading every attribute of every dataset (DumpFile.values) costs ~10 HDF5
# attribute reads per tensor, and h5py's high-level objects cost ~50-90 us each to
# create; on thousands of small tensors that dominated the compare. These read only
# what a comparison needs, through h5py's low-level API: one group opened per
# input/output side, members opened relative to it, attributes read only when
# present. Storage dtypes that say the torch dtype by themselves skip the "dtype"
# attribute; ambiguous ones (uint8/uint16 raw bits, float16 pairs) read it.
_UNAMBIGUOUS_STORAGE = {np.dtype(k): k for k in ("float32", "float64", "int8", "int16", "int32", "int64",
                                                 "bool", "complex64", "complex128", "uint32", "uint64")}
_B_TYPE, _B_DTYPE, _B_SHAPE = S.ATTR_TYPE.encode(), S.ATTR_DTYPE.encode(), S.ATTR_SHAPE.encode()
_B_UNINIT, _B_ORDER = S.ATTR_UNINITIALIZED.encode(), b"order"
_B_COMPUTE = S.OP_COMPUTE_DTYPE.encode()
_B_INPUT_DTYPES = S.OP_INPUT_DTYPES.encode()
_B_OWN_ERROR = S.OP_OWN_ERROR.encode()
_B_RANDOM_REPLAYED = S.OP_RANDOM_OUTPUTS_REPLAYED.encode()
_FAST_READ_KINDS = frozenset("biufc")
# Tensors up to this many elements are read when their record is made (at most a
# few ops' worth are held at a time: see _compare_files).
_EAGER_ELEMENTS = 1 << 14


def _ll_attr(oid, name: bytes, default=None):
    """An attribute of a low-level object id, as h5py's attrs[name] returns it; `default` when absent."""
    if not h5a.exists(oid, name):
        return default
    value = read_open_attr(h5a.open(oid, name))
    if value is UNSUPPORTED:
        return h5py.AttributeManager(_IdHolder(oid))[name.decode()]
    return value


class _IdHolder:
    """What h5py.AttributeManager needs of its parent: an `id`."""

    def __init__(self, oid):
        self.id = oid


def _str_attr(oid, name: bytes, default: str = "") -> str:
    v = _ll_attr(oid, name)
    if v is None or isinstance(v, h5py.Empty):
        return default
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


def _link_names(gid) -> list[str]:
    names: list[bytes] = []
    gid.links.iterate(names.append)     # name order, as Group.keys()
    return [n.decode("utf-8", "surrogateescape") for n in names]


def _light_record(f: DumpFile, path: str, name: str, eager: int = 0) -> ValueRecord:
    """The record at `path` (opened from the file root)."""
    return _light_member(f, f.h5.id, path.encode("utf-8", "surrogateescape"), path, name, eager)


def _light_member(f: DumpFile, parent_id, link: bytes, path: str, name: str, eager: int) -> ValueRecord:
    """The record of `link` in the open group `parent_id`; tensors of at most `eager`
    elements are read now, while their dataset is open (reopening one by path costs
    as much as reading it)."""
    oid = h5o.open(parent_id, link)
    is_group = isinstance(oid, h5g.GroupID)
    code = _ll_attr(oid, _B_TYPE)
    if code is None:
        code = S.TYPE_LIST if is_group else S.TYPE_TENSOR
    code = int(code)
    if code in S.LIST_TYPES:
        rec = ValueRecord(f, path, name, code, {S.ATTR_TYPE: code})
        kids = sorted(_link_names(oid) if is_group else [],
                      key=lambda k: (int(k.rsplit("_", 1)[-1]) if k.rsplit("_", 1)[-1].isdigit() else 1 << 62, k))
        rec.children = [_light_member(f, oid, k.encode("utf-8", "surrogateescape"), f"{path}/{k}", k, eager)
                        for k in kids]
        return rec
    if code not in S.TENSOR_TYPES:
        # a plain value (int, None, dtype...): compare skips it, so its other attributes are not read
        return ValueRecord(f, path, name, code, {S.ATTR_TYPE: code})
    if code != S.TYPE_TENSOR or is_group:
        return f._record(path, name)          # views, statistics, odd layouts: the reader's full record
    stored_shape, stored_dtype = oid.shape, oid.dtype
    fast = stored_shape is not None and stored_dtype.kind in _FAST_READ_KINDS and stored_dtype.subdtype is None
    attrs: dict[str, Any] = {S.ATTR_TYPE: code}
    if f.attrs.get(S.ROOT_FORMAT) is None:
        # an original-layout file (or a legacy export): the dtype is the original's DataType
        # (Half stored as F32) or source_dtype (bfloat16 as float32), not the storage's
        attrs[S.ATTR_DTYPE] = legacy.dtype_of(
            {k: v for k in (S.ATTR_DATA_TYPE, S.ATTR_SOURCE_DTYPE)
             if (v := _ll_attr(oid, k.encode())) is not None}, stored_dtype)
    else:
        dtype = _UNAMBIGUOUS_STORAGE.get(stored_dtype)
        attrs[S.ATTR_DTYPE] = dtype or _str_attr(oid, _B_DTYPE, str(stored_dtype))
    shape = _ll_attr(oid, _B_SHAPE)
    if shape is not None:
        attrs[S.ATTR_SHAPE] = shape
    uninit = _ll_attr(oid, _B_UNINIT)
    if uninit is not None:
        attrs[S.ATTR_UNINITIALIZED] = uninit
    rec = _LightTensor(f, path, name, code, attrs)
    rec.stored_shape = stored_shape
    rec.stored_dtype = stored_dtype
    rec.fast = fast
    if fast and rec.stored_size <= eager:
        arr = np.empty(stored_shape, dtype=stored_dtype)
        try:
            if arr.size:
                oid.read(h5s.ALL, h5s.ALL, arr)
            rec.data = arr
        except (OSError, ValueError, TypeError, KeyError):
            pass                              # read() tries again and reports the error on the row
    return rec


class _LightTensor(ValueRecord):
    """A plain tensor record that reads through the low-level API.

    It holds no open HDF5 object: HDF5 scans every object open in a file when an
    attribute is opened, so keeping thousands of datasets open (as h5py objects
    cached per record did) made each attribute read cost 50-200 us.
    """

    stored_shape: tuple[int, ...] | None = None
    stored_dtype: Any = None
    fast: bool = False
    data: np.ndarray | None = None            # the stored array, when read eagerly

    @property
    def stored_size(self) -> int:
        if self.stored_shape is None:
            return 0
        return math.prod(int(d) for d in self.stored_shape)

    def read(self):
        if self.data is not None:
            return decode_raw(self.data, self.dtype)
        if not self.fast:
            return super().read()             # empty dataspace, strings, compounds: the reader's way
        arr = np.empty(self.stored_shape, dtype=self.stored_dtype)
        if arr.size:
            with h5_errors(self.file.path, self.path):
                h5d.open(self.file.h5.id, self.path.encode("utf-8", "surrogateescape")).read(h5s.ALL, h5s.ALL, arr)
        return decode_raw(arr, self.dtype)

    def iter_chunks_into(self, chunk_elements: int):
        """As DumpFile.iter_chunks (same pieces: the metrics' summation order depends on
        them), read into one reused buffer: a fresh 16 MiB array per piece costs page
        faults comparable to the read. A piece is valid until the next is asked for."""
        shape = tuple(int(d) for d in self.stored_shape)
        slabs = list(chunk_slabs(shape, chunk_elements))
        with h5_errors(self.file.path, self.path):
            dsid = h5d.open(self.file.h5.id, self.path.encode("utf-8", "surrogateescape"))
            fspace = dsid.get_space()
            buf = np.empty(max((math.prod(c) for _, c in slabs), default=1), dtype=self.stored_dtype)
        for start, count in slabs:
            out = buf[:math.prod(count)].reshape(count)
            # a generator: the guard goes around each read, not around the consumer's code
            with h5_errors(self.file.path, self.path):
                fspace.select_hyperslab(start, count)
                dsid.read(h5s.create_simple(out.shape), fspace, out)
            yield decode_raw(out, self.dtype).reshape(-1)


def _light_values(f: DumpFile, group_path: str, op_id=None, side: str = "", eager: int = 0
                  ) -> dict[str, ValueRecord]:
    try:
        gid = h5o.open(op_id, side.encode()) if op_id is not None else h5o.open(f.h5.id, group_path.encode())
    except KeyError:
        # a side the op has no group for has no values; any other failure to open it is
        # damage and must raise (read as "absent", it hid a damaged op's tensors)
        exists = op_id.links.exists(side.encode()) if op_id is not None else group_path in f.h5
        if exists:
            raise
        return {}
    if not isinstance(gid, h5g.GroupID):
        return {}
    names = _link_names(gid)
    order = _ll_attr(gid, _B_ORDER)
    if order is not None:
        present = set(names)
        listed = [n.decode() if isinstance(n, bytes) else str(n) for n in np.asarray(order).reshape(-1)]
        names = [n for n in listed if n in present] + [n for n in names if n not in set(listed)]
    return {n: _light_member(f, gid, n.encode("utf-8", "surrogateescape"), f"{group_path}/{n}", n, eager)
            for n in names}


@dataclass
class _OpTensors:
    inputs: dict[str, ValueRecord]
    outputs: dict[str, ValueRecord]
    compute_dtype: str
    random_outputs_replayed: bool = False
    input_dtypes: tuple[str, ...] = ()     # when the dump stored no inputs (op attribute)
    own_error: dict = field(default_factory=dict)   # output name -> [RED, max abs, max |ref|]


def _op_tensors(op, eager: int = 0) -> _OpTensors:
    if op is None:
        return _OpTensors({}, {}, "")
    f = op.file
    if getattr(f, "is_table", False):      # statistics table file (format 1.1): no op groups
        a = op.attrs
        return _OpTensors(matching.tensor_leaves(op.inputs()), matching.tensor_leaves(op.outputs()),
                          str(a.get(S.OP_COMPUTE_DTYPE, "") or ""),
                          bool(a.get(S.OP_RANDOM_OUTPUTS_REPLAYED, False)),
                          _split_dtypes(a.get(S.OP_INPUT_DTYPES, "")), _own_errors(a.get(S.OP_OWN_ERROR, "")))
    path = op.path
    # the low-level reads below bypass DumpFile's guards: name this file on HDF5 failures
    with h5_errors(f.path):
        op_id = h5o.open(f.h5.id, path.encode("utf-8", "surrogateescape"))
        ins = matching.tensor_leaves(_light_values(f, f"{path}/{S.INPUT_GROUP}", op_id, S.INPUT_GROUP, eager))
        outs = matching.tensor_leaves(_light_values(f, f"{path}/{S.OUTPUT_GROUP}", op_id, S.OUTPUT_GROUP, eager))
        cd = _str_attr(op_id, _B_COMPUTE, "")
        return _OpTensors(ins, outs, cd, bool(_ll_attr(op_id, _B_RANDOM_REPLAYED, False)),
                          _split_dtypes(_str_attr(op_id, _B_INPUT_DTYPES, "")),
                          _own_errors(_str_attr(op_id, _B_OWN_ERROR, "")))


def _own_errors(text: Any) -> dict:
    """The op attribute own_error ({output: [RED, max abs, max |ref|]}); {} when absent or bad
    (a damaged attribute only loses the refinement: the row is judged against the golden)."""
    text = text.decode("utf-8", "replace") if isinstance(text, bytes) else str(text or "")
    if not text:
        return {}
    try:
        d = json.loads(text)
    except ValueError:
        return {}
    return {str(k): v for k, v in d.items() if isinstance(v, list) and len(v) == 3} if isinstance(d, dict) else {}


def _split_dtypes(text: Any) -> tuple[str, ...]:
    text = text.decode("utf-8", "replace") if isinstance(text, bytes) else str(text or "")
    return tuple(d for d in text.split(",") if d)


def _op_dtypes(ot: _OpTensors) -> list[str]:
    """Every dtype the op touched: stored tensors, the inputs' dtypes when only those were
    recorded (a load-replay dump), and the compute dtype."""
    out = [_dtype_of(r) for r in (*ot.inputs.values(), *ot.outputs.values())]
    return out + list(ot.input_dtypes) + ([ot.compute_dtype] if ot.compute_dtype else [])


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
                  chunk_elements: int = 1 << 22, golden_fp64: str | None = None) -> CompareResult:
    """Compare every tensor of `target` against its pair in `golden`.

    Returns a CompareResult whose table has one row per tensor (BASE_COLUMNS, one
    column per requested metric, TAIL_COLUMNS, FP64_COLUMNS when `golden_fp64`),
    sorted in execution order; `.meta` holds paths, modes and counts. `jobs` > 1
    compares in that many worker processes (threads where fork is unavailable);
    0 picks one per core when there are many ops (auto_jobs). Results do not
    depend on it.
    """
    algs, pattern, files = _open_inputs(target, golden, golden_fp64, algorithms, select)
    try:
        return _compare_files(*files, algs, pattern, jobs, chunk_elements)
    finally:
        for f in files:
            if f is not None:
                f.close()


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
                   batch_rows: int = 4096) -> CompareStream:
    """compare_dumps as a stream of row batches (see CompareStream): the same rows, the
    same order, for results larger than memory (`accucmp compare` writes them to the csv
    as they come). A batch holds whole ops and about `batch_rows` rows."""
    algs, pattern, files = _open_inputs(target, golden, golden_fp64, algorithms, select)
    opened = [f for f in files if f is not None]
    try:
        setup = _setup(*files, algs, pattern, jobs, chunk_elements)
    except BaseException:
        for f in opened:
            f.close()
        raise
    return CompareStream(setup.meta, setup.columns, _frames(setup, batch_rows), opened)


def _attr_text(v) -> str:
    if v is None:
        return ""
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


def _setup(tf: DumpFile, gf: DumpFile, ff: DumpFile | None, algs, pattern, jobs, chunk_elements) -> "_Setup":
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
    from .extract import ROOT_EXTRACTED_FROM

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
    # Only the io groups both dumps recorded: a load-replay dump holds outputs only (its
    # inputs are the golden's by construction), and dump_mode=input/output dumps hold one
    # side; the other side's tensors are not "unmatched", they were never asked for.
    ios = tuple(io for io in (S.INPUT_GROUP, S.OUTPUT_GROUP)
                if io in tf.recorded_io and io in gf.recorded_io)
    work = _Work(pairs, ff, metric_cols, replay, _Comparer(algs, chunk_elements), ios)
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
        "notes": [subset_note] if subset_note else [],
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


def _compare_files(tf: DumpFile, gf: DumpFile, ff: DumpFile | None, algs, pattern, jobs, chunk_elements):
    setup = _setup(tf, gf, ff, algs, pattern, jobs, chunk_elements)
    rows: list[dict[str, Any]] = []
    for part in _row_batches(setup):
        rows += part
    table = _to_frame(rows, setup.columns, 0, _PrecisionCarry() if setup.inherit else None)
    meta = setup.meta
    meta["rows"] = len(table)
    return CompareResult(table, meta)


class _PrecisionCarry:
    """_inherit_precision's running state, carried from one batch to the next."""

    def __init__(self):
        self.coarsest, self.coarsest_u = "", -1.0


def _to_frame(rows: list[dict[str, Any]], columns: list[str], start: int,
              carry: "_PrecisionCarry | None") -> pd.DataFrame:
    """Rows (in execution order, the first being row number `start`) as the result table."""
    table = pd.DataFrame(rows, columns=columns)
    table["Index"] = np.arange(start, start + len(table), dtype=np.int64)
    if carry is not None:
        _inherit_precision(table, carry)
    for c in ("SeqId", "GoldenSeqId"):
        table[c] = table[c].astype("Int64")
    return table


def _frames(setup: _Setup, batch_rows: int):
    """The comparison as DataFrames of about `batch_rows` rows, whole ops each (the
    verdict's per-op hints need an op's rows together)."""
    carry = _PrecisionCarry() if setup.inherit else None
    start, rows = 0, []
    for part in _row_batches(setup):
        rows += part
        if len(rows) >= batch_rows:
            yield _to_frame(rows, setup.columns, start, carry)
            start += len(rows)
            rows = []
    if rows or start == 0:
        yield _to_frame(rows, setup.columns, start, carry)
        start += len(rows)
    setup.meta["rows"] = start


def _row_batches(setup: _Setup):
    """Row dicts in execution order, a list per piece of whole ops."""
    work, jobs = setup.work, setup.jobs
    tf, gf, ff = setup.files
    pairs = work.pairs
    if jobs > 1 and len(pairs) > 1 and _FORK is not None and _safe_to_fork():
        yield from _rows_in_processes(work, tf, gf, ff, jobs)
    elif jobs > 1 and len(pairs) > 1:
        yield from _rows_in_threads(work, jobs)
    else:
        for lo, hi in _spans(len(pairs), 1):
            yield work.rows(lo, hi)


@dataclass
class _Work:
    """The comparison of a list of op pairs, in pieces [lo, hi) that can run anywhere."""

    pairs: list[matching.OpPair]
    ff: DumpFile | None
    metric_cols: list[str]
    replay: bool
    comparer: _Comparer
    ios: tuple[str, ...] = (S.INPUT_GROUP, S.OUTPUT_GROUP)

    @property
    def eager(self) -> int:
        return min(_EAGER_ELEMENTS, self.comparer.chunk)

    def tasks(self, lo: int, hi: int):
        """Tasks of pairs[lo:hi], made pair by pair: only one op's small tensors (read
        eagerly) are held at a time."""
        for pair in self.pairs[lo:hi]:
            yield from _tasks_for_pair(pair, self.ff, self.metric_cols, 0, self.replay, self.eager,
                                       self.ios)

    def rows(self, lo: int, hi: int) -> list[dict[str, Any]]:
        rows = []
        for task in self.tasks(lo, hi):
            rows.append(task.row)
            if task.target is not None and task.golden is not None \
                    and task.row["CompareStatus"] != STATUS_RANDOM_REPLAYED:
                self.comparer.run(task)
        return rows


# The name npu_dumper.sinks.worker_threads gives its pooled threads while they wait for work
# (a dump earlier in this process leaves them for a while); kept equal by a test.
IDLE_DUMPER_THREAD_NAME = "npu_dumper-idle"


def _safe_to_fork() -> bool:
    """Fork only when no other thread can hold a lock (h5py's among them) that would stay
    held forever in the child: the main thread alone, or with idle dumper pool threads,
    which wait on a condition of their own and hold nothing. Dask's offload pool thread
    outlives a folder compare's client (distributed keeps it for the process); without a
    client (whose event-loop thread would be listed) nothing hands it work, and it never
    touches HDF5."""
    me = threading.current_thread()
    return me is threading.main_thread() and all(
        t is me or (t.daemon and (t.name == IDLE_DUMPER_THREAD_NAME or t.name.startswith(_DASK_OFFLOAD)))
        for t in threading.enumerate())


_DASK_OFFLOAD = "Dask-Offload"


AUTO_JOBS_MIN_PAIRS = 500      # below this, starting workers costs more than it saves
AUTO_JOBS_MAX = 4


def auto_jobs(n_pairs: int) -> int:
    """jobs=0: one worker per available core (at most AUTO_JOBS_MAX) for many ops, else 1."""
    if n_pairs < AUTO_JOBS_MIN_PAIRS:
        return 1
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, min(cores, AUTO_JOBS_MAX))


def _spans(n: int, jobs: int) -> list[tuple[int, int]]:
    # pieces small enough to balance uneven ops over the workers, large enough
    # that handing one over costs little next to comparing it
    step = max(1, min(256, n // (jobs * 8)))
    return [(i, min(n, i + step)) for i in range(0, n, step)]


def _rows_in_threads(work: _Work, jobs: int):
    """Where processes cannot fork: one reader thread, metrics on `jobs` threads (numpy
    releases the GIL on large blocks), a bounded window of tasks in flight. Yields row
    lists of whole ops, in order, as their metrics complete."""
    pending: deque = deque()          # (row, future or None), in execution order
    done: list[dict[str, Any]] = []
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for pair in work.pairs:
            for task in _tasks_for_pair(pair, work.ff, work.metric_cols, 0, work.replay, work.eager, work.ios):
                fut = None
                if task.target is not None and task.golden is not None \
                        and task.row["CompareStatus"] != STATUS_RANDOM_REPLAYED:
                    fut = pool.submit(work.comparer.run, task)
                pending.append((task.row, fut))
                while len(pending) > 2 * jobs:
                    row, fut = pending.popleft()
                    if fut is not None:
                        fut.result()
                    done.append(row)
            if len(done) >= 256:
                # a piece ends with a whole op: wait for this op's rows still in flight
                while pending:
                    row, fut = pending.popleft()
                    if fut is not None:
                        fut.result()
                    done.append(row)
                yield done
                done = []
        while pending:
            row, fut = pending.popleft()
            if fut is not None:
                fut.result()
            done.append(row)
    if done:
        yield done


# Worker processes: forked, so they inherit the pairs and settings (nothing but
# (lo, hi) is sent to them) and open the dumps again (an HDF5 handle must not be
# shared across a fork). HDF5 serialises every call within a process (h5py's lock),
# so threads cannot read two tensors at once; processes can.
try:
    import multiprocessing as _mp

    _FORK = _mp.get_context("fork")
except (ImportError, ValueError):
    _FORK = None
_WORKER: dict[str, Any] = {}


def _worker_start(work: _Work, paths: dict[int, str | None]) -> None:
    opened = {key: (_open(path, "worker") if path else None) for key, path in paths.items()}
    for pair in work.pairs:
        for op in (pair.target, pair.golden):
            if op is not None:
                op.file = opened[id(op.file)]
    if work.ff is not None:
        work.ff = opened[id(work.ff)]
    _WORKER["work"] = work


def _worker_rows(span: tuple[int, int]) -> list[dict[str, Any]]:
    return _WORKER["work"].rows(*span)


def _rows_in_processes(work: _Work, tf: DumpFile, gf: DumpFile, ff: DumpFile | None, jobs: int):
    """Row lists of spans of whole ops, in order, from forked workers."""
    paths = {id(f): f.path for f in (tf, gf, ff) if f is not None}
    spans = _spans(len(work.pairs), jobs)
    with _FORK.Pool(min(jobs, len(spans)), initializer=_worker_start, initargs=(work, paths)) as pool:
        yield from pool.imap(_worker_rows, spans)


def _tasks_for_pair(pair: matching.OpPair, ff: DumpFile | None, metric_cols, start: int,
                    replay: bool, eager: int = 0,
                    ios: tuple[str, ...] = (S.INPUT_GROUP, S.OUTPUT_GROUP)) -> list[_Task]:
    t_op, g_op = pair.target, pair.golden
    any_op = t_op or g_op
    phase = any_op.phase
    module = any_op.module
    t_ts, g_ts = _op_tensors(t_op, eager), _op_tensors(g_op, eager)
    precision = _least_precise(_op_dtypes(t_ts) + _op_dtypes(g_ts))
    compute = t_ts.compute_dtype or g_ts.compute_dtype
    tasks = []
    for io in ios:
        t_vals = t_ts.inputs if io == S.INPUT_GROUP else t_ts.outputs
        g_vals = g_ts.inputs if io == S.INPUT_GROUP else g_ts.outputs
        for name, t, g in matching.pair_tensors(t_vals, g_vals):
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
            elif io == S.OUTPUT_GROUP and (t_ts.random_outputs_replayed or g_ts.random_outputs_replayed):
                row["CompareStatus"] = STATUS_RANDOM_REPLAYED
                row["CompareFailReason"] = ("random op: load-replay handed on the golden's outputs "
                                            "(no device reproduces another's random numbers): not compared")
            elif pair.reason:
                row["CompareFailReason"] = pair.reason
            own = t_ts.own_error.get(name) if io == S.OUTPUT_GROUP and t is not None else None
            if own is not None:
                row["OwnErrorVsFp64"], row["OwnMaxErrorVsFp64"], row["OwnRefAbsMax"] = (float(v) for v in own)
            fp = None
            if ff is not None and g is not None:
                with h5_errors(ff.path):     # damage in the fp64 file stops the compare
                    fp = _light_record(ff, g.path, g.name, eager) if g.path in ff.h5 else None
                fp = fp if fp is not None and fp.is_tensor else None
            tasks.append(_Task(start + len(tasks), row, t, g, fp))
    return tasks


def _safe_shape(rec: ValueRecord) -> str:
    try:
        return _shape_str(rec.shape)
    except (ValueError, TypeError):
        return "?"
