"""The tasks of a folder compare, run on Dask workers: plain arguments in, small dicts out
(torch-free; ranks.py submits them and merges what they return).

pair_task compares one rank pair to its csv (streaming.compare_to_csv) and returns its
summary, never the rows; replica_task checks that the tensors the golden run holds
bit-for-bit equal on two ranks are equal on those ranks of the target run too.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Mapping

from dumpfile.cli_boundary import is_bad_input
from dumpfile.errors import DumpError


_FIRST_FAILURE_KEYS = ("NPUDump", "SeqId", "Phase", "Module", "IO", "TensorName", "NPUDumpPath",
                       "GroundTruthPath", "Result", "FailReason", "CompareFailReason", "Severity",
                       "CosineSimilarity", "RelativeEuclideanDistance", "MaxAbsoluteError", "MaxRelativeError",
                       "PrecisionDtype", "DecidedBy", "DecidingMetric", "DecidingValue", "DecidingBound")


def _small_row(row: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """What the merged summary needs of a row, as plain Python values."""
    if row is None:
        return None
    out = {}
    for k in _FIRST_FAILURE_KEYS:
        if k in row:
            v = row[k]
            try:
                if v is None or v != v:           # NaN, pd.NA raises on bool()
                    v = None
            except (TypeError, ValueError):
                v = None
            if hasattr(v, "item"):
                v = v.item()
            out[k] = v
    return out


def _progress_sender(queue_name: str | None):
    """on_rows for a task: row counts to the client's progress bar, at most twice a second."""
    if not queue_name:
        return None
    from accucmp.compare.streaming import Throttle

    try:
        from distributed import Queue

        q = Queue(queue_name)
    except (ImportError, ValueError, RuntimeError):
        return None

    def send(n: int) -> None:
        try:
            q.put(n)
        except Exception:  # noqa: BLE001 - progress only: the comparison goes on without it
            pass

    return Throttle(send)


def _failed(e: Exception, t0: float, files: tuple[str, ...] = ()) -> dict[str, Any]:
    """A task's result for bad input: a DumpError, or what the CLI boundary's own rule
    (is_bad_input, applied in the worker) counts as bad input, named by `files` when its
    message names none (h5py's do not). Anything else is our bug and goes up: the CLI
    boundary reports it (exit 3, log file)."""
    if isinstance(e, DumpError):
        return {"error": " ".join(str(e).split()), "seconds": time.perf_counter() - t0}
    if not is_bad_input(e):
        raise e
    msg = f"{type(e).__name__}: {' '.join(str(e).split())}"
    if files and not any(f in msg for f in files):
        msg = f"{' vs '.join(files)}: {msg}"
    return {"error": msg, "seconds": time.perf_counter() - t0}


def pair_task(target: str, golden: str, csv_path: str, options: dict[str, Any],
              queue_name: str | None = None) -> dict[str, Any]:
    """Compare one rank pair to `csv_path`; returns its summary (never the rows)."""
    from accucmp.compare.streaming import compare_to_csv

    t0 = time.perf_counter()
    send = _progress_sender(queue_name)
    options = dict(options)
    if options.get("view") is not None:      # a rank against a single-process reference
        from accucmp.compare.reference_runs import RankView

        options["view"] = RankView.from_options(options["view"])
    try:
        r = compare_to_csv(target, golden, Path(csv_path), jobs=1, on_rows=send, **options)
    except Exception as e:  # noqa: BLE001 - sorted: a damaged file is that pair's error, a bug goes up
        return _failed(e, t0, (target, golden))
    finally:
        if send is not None:
            send.flush()
    s = r.summary
    return {
        "error": None, "csv": str(r.csv), "rows": r.rows, "counts": s.counts, "inherited": int(s.inherited),
        "first_failure": _small_row(s.first_failure),
        "worst": [_small_row(w) for w in s.worst], "worst_by": s.worst_by,
        "warnings": list(r.meta.get("warnings") or []), "seconds": time.perf_counter() - t0,
    }


_REPLICA_METRICS = ["MaxAbsoluteError", "RelativeEuclideanDistance"]


def _tensor_keys(part, seen: dict[tuple, tuple[Any, int]]) -> list[tuple]:
    """A key per row that names the same tensor in another run: op name, input/output,
    tensor name, shape, and the k-th call of that op with a tensor so named and shaped
    (seqids differ between runs that ran other ops in between). The shape keeps calls of
    one op on different tensors apart when a run makes them in another order: DDP's
    reducer scales each gradient with a `mul.out` as autograd hands it over, and under
    autocast the bias's comes before the weight's; keyed by call alone, the target's
    k-th `mul.out` was another tensor than the golden's and read as a desync."""
    keys = []
    shapes = part["Shape"].tolist() if "Shape" in part.columns else [None] * len(part)
    for op, sq, io, name, shape in zip(part["NPUDump"].tolist(), part["SeqId"].tolist(),
                                       part["IO"].tolist(), part["TensorName"].tolist(), shapes):
        sig = (op, io, name, str(shape))
        last, k = seen.get(sig, (None, -1))
        if sq != last:
            k += 1
            seen[sig] = (sq, k)
        keys.append(sig + (k,))
    return keys


def _keyed_batches(target: str, golden: str, opts: dict[str, Any]):
    """The non-empty row batches of one compare, each with its rows' _tensor_keys."""
    from accucmp.compare.pipeline import stream_compare

    seen: dict[tuple, tuple[Any, int]] = {}
    with stream_compare(target, golden, **opts) as st:
        for measured in st.batches:
            if not measured.table.empty:
                yield measured.table, _tensor_keys(measured.table, seen)


def _equal_mask(part):
    import numpy as np
    import pandas as pd

    mx = pd.to_numeric(part["MaxAbsoluteError"], errors="coerce").to_numpy()
    nf = pd.to_numeric(part["NonFiniteMismatch"], errors="coerce").fillna(0).to_numpy()
    ex = pd.to_numeric(part.get("ExactMismatches", pd.Series(np.nan, index=part.index)),
                       errors="coerce").fillna(0).to_numpy()
    ok = (part["CompareStatus"] == "compared").to_numpy()
    return ok & (mx == 0) & (nf == 0) & (ex == 0)


def replica_task(golden_ref: str, golden_r: str, target_ref: str, target_r: str, *,
                 chunk_elements: int = 1 << 22, keep: int = 5, select: str | None = None,
                 exclude=()) -> dict[str, Any]:
    """Which tensors the golden run holds equal on two ranks, and which of those the
    target run does not. Memory: 8 bytes per equal golden tensor (a sorted hash array).
    `select`/`exclude`: the ops the compare takes part in (as for the rank pairs: an op the
    user left out is out of every check)."""
    import numpy as np

    t0 = time.perf_counter()
    opts = dict(algorithms=_REPLICA_METRICS, chunk_elements=chunk_elements, jobs=1, select=select,
                exclude=tuple(exclude or ()))
    try:
        hashes = []
        for part, keys in _keyed_batches(golden_r, golden_ref, opts):
            eq = _equal_mask(part)
            hashes.append(np.fromiter((hash(k) for k, e in zip(keys, eq) if e), dtype=np.int64))
        equal = np.unique(np.concatenate(hashes)) if hashes else np.zeros(0, np.int64)
        checked = differ = 0
        first: list[dict[str, Any]] = []
        if equal.size:
            for part, keys in _keyed_batches(target_r, target_ref, opts):
                h = np.fromiter((hash(k) for k in keys), dtype=np.int64, count=len(keys))
                want = np.isin(h, equal)
                bad = want & ~_equal_mask(part)
                checked += int(want.sum())
                differ += int(bad.sum())
                for i in np.flatnonzero(bad)[:max(0, keep - len(first))]:
                    row = part.iloc[int(i)]
                    first.append({"NPUDump": row["NPUDump"], "SeqId": _int_or_none(row["SeqId"]),
                                  "IO": row["IO"], "TensorName": row["TensorName"],
                                  "Phase": row["Phase"], "Module": row["Module"],
                                  "MaxAbsoluteError": _float_or_none(row["MaxAbsoluteError"]),
                                  "CompareStatus": row["CompareStatus"]})
    except Exception as e:  # noqa: BLE001 - sorted: a damaged file is that check's error, a bug goes up
        return _failed(e, t0)
    return {"error": None, "golden_equal": int(equal.size), "checked": checked, "differ": differ,
            "first": first, "seconds": time.perf_counter() - t0}


def _int_or_none(v) -> int | None:
    try:
        return None if v is None or v != v else int(v)
    except (TypeError, ValueError):
        return None


def _float_or_none(v) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f
