"""compare_dumps' execution paths (in process, worker processes, threads) give equal tables;
the reader's fast dense-stride check agrees with the exhaustive one."""

import itertools

import numpy as np
import pandas as pd
import pytest

from accucmp.compare import parallel as P
from accucmp.compare import pipeline as C
from accucmp.compare.pipeline import auto_jobs, compare_dumps
from dumpfile.read.reader import _strides_are_dense
from tests._compare_helpers import write_dump


def _ops(n, fault_at=None, seed=5):
    rng = np.random.default_rng(seed)
    ops = []
    for i in range(1, n + 1):
        a = rng.standard_normal((3, 5)).astype(np.float32)
        out = a * np.float32(1.05 if i == fault_at else 1.0)
        big = rng.standard_normal(300).astype(np.float32)     # above chunk_elements below: streamed
        ops.append(dict(op="aten.mul.Tensor", seqid=i, module=f"m.{i % 3}", phase="forward",
                        inputs={"self": a, "big": big}, outputs={"result": out}))
    return ops


@pytest.fixture
def dumps(tmp_path):
    write_dump(tmp_path / "g.h5", _ops(12))
    write_dump(tmp_path / "t.h5", _ops(12, fault_at=7))
    return tmp_path / "t.h5", tmp_path / "g.h5"


def test_processes_threads_and_in_process_give_equal_tables(dumps, monkeypatch):
    t, g = dumps
    one = compare_dumps(t, g, chunk_elements=64).table
    procs = compare_dumps(t, g, jobs=2, chunk_elements=64).table
    monkeypatch.setattr(P, "_FORK", None)        # as where fork is unavailable
    threads = compare_dumps(t, g, jobs=3, chunk_elements=64).table
    pd.testing.assert_frame_equal(one, procs, check_exact=True)
    pd.testing.assert_frame_equal(one, threads, check_exact=True)
    faulty = one[one["RelativeEuclideanDistance"] > 0.01]
    assert list(faulty["SeqId"]) == [7] and list(faulty["TensorName"]) == ["result"]


def test_workers_reopen_the_fp64_golden_too(dumps, tmp_path):
    """A forked worker opens every file again, the fp64 golden included (it holds its own
    copy of the work with the reopened file): the fp64 columns equal the in-process ones."""
    t, g = dumps
    fp = [dict(o, inputs={k: v.astype(np.float64) for k, v in o["inputs"].items()},
               outputs={k: v.astype(np.float64) * (1 + 1e-9) for k, v in o["outputs"].items()})
          for o in _ops(12)]
    write_dump(tmp_path / "f.h5", fp)
    one = compare_dumps(t, g, golden_fp64=str(tmp_path / "f.h5"), chunk_elements=64).table
    two = compare_dumps(t, g, golden_fp64=str(tmp_path / "f.h5"), chunk_elements=64, jobs=2).table
    pd.testing.assert_frame_equal(one, two, check_exact=True)
    assert one["TargetErrorVsFp64"].notna().all() and one["GoldenErrorVsFp64"].notna().all()
    faulty = one[one["TargetErrorVsFp64"] > 0.01]
    assert list(faulty["SeqId"]) == [7] and list(faulty["TensorName"]) == ["result"]


# The forked workers' path is taken only when no other thread could hold a lock across the
# fork (parallel._safe_to_fork). A test file under pytest-xdist may share its process with
# one that left threads (tqdm's monitor, an executor's worker), so these tests run the
# compare in a fresh interpreter, whose only thread is its main one.
_IN_FRESH_PROCESS = """
import os, sys
from accucmp.compare import parallel as P, pipeline as C
def boom(self, lo, hi):
    raise RuntimeError("worker failed")
def die(self, lo, hi):
    os._exit(9)
C._Work.rows = {"boom": boom, "die": die}[sys.argv[1]]
assert not P.blocking_threads(), P.blocking_threads()
try:
    C.compare_dumps(sys.argv[2], sys.argv[3], jobs=2)
except Exception as e:
    print(f"{type(e).__name__}: {e}")
else:
    print("no error")
"""


def _compare_in_fresh_process(fault: str, t, g) -> str:
    import subprocess
    import sys
    res = subprocess.run([sys.executable, "-c", _IN_FRESH_PROCESS, fault, str(t), str(g)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip().splitlines()[-1]


def test_worker_errors_reach_the_caller(dumps):
    t, g = dumps
    assert _compare_in_fresh_process("boom", t, g) == "RuntimeError: worker failed"


def test_auto_jobs_stays_in_process_for_few_ops():
    assert auto_jobs(10) == 1
    assert 1 <= auto_jobs(10_000) <= P.AUTO_JOBS_MAX


def test_spans_cover_every_pair_once():
    for n, jobs in ((1, 2), (7, 2), (1000, 3), (100_000, 4)):
        spans = P._spans(n, jobs)
        assert spans[0][0] == 0 and spans[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


@pytest.mark.parametrize("shape", [(2, 3), (3, 2), (2, 2, 2), (1, 4), (4, 1, 2)])
def test_dense_stride_check_never_accepts_an_overlapping_layout(shape):
    n = int(np.prod(shape))
    accepted = 0
    for strides in itertools.product(range(0, 9), repeat=len(shape)):
        idx = sum(np.arange(s).reshape([-1 if d == k else 1 for d in range(len(shape))]) * st
                  for k, (s, st) in enumerate(zip(shape, strides))).reshape(-1)
        dense = idx.max() < n and np.unique(idx).size == n
        fast = _strides_are_dense(shape, strides)
        assert not fast or dense, strides
        assert fast == dense, strides      # and it finds every dense one (permuted contiguous)
        accepted += fast
    assert accepted > 0


def test_fast_json_text_equals_json_dumps_indent(dumps, tmp_path):
    import json
    import math

    from accucmp.report.outputs import _jsonable, to_json
    from accucmp.compare.verdict import apply_verdict

    def reference(table, meta):
        rows = [{k: _jsonable(v) for k, v in rec.items()} for rec in table.to_dict(orient="records")]
        return json.dumps({"meta": meta or {}, "rows": rows}, indent=1, default=str, allow_nan=False)

    t, g = dumps
    write_dump(tmp_path / "short.h5", _ops(5))                # golden-only ops: NA SeqIds
    real = apply_verdict(compare_dumps(tmp_path / "short.h5", g).table)
    assert real["SeqId"].isna().any()
    odd = pd.DataFrame({
        "f": [1.5, math.inf, math.nan], "s": ["x\x00\x01}\x00{", "\u00e9", None], "b": [True, False, True],
        "i": pd.array([1, None, 3], dtype="Int64"), "np": [np.float32(1.5), np.int64(3), np.bool_(True)],
        "o": pd.Series([pd.NA, 1, "x"], dtype=object), "F": pd.array([1.0, None, 2.0], dtype="Float64"),
        "lst": [[1], [], [2, 3]]})
    for table, meta in ((real, {"nested": [1, {"a": "\x00"}]}), (odd, None), (odd.drop(columns="lst"), {}),
                        (real.head(0), None)):
        assert to_json(table, meta) == reference(table, meta)


def test_a_worker_that_dies_is_one_error_not_a_hang(dumps):
    # multiprocessing.Pool waited for a killed worker's rows for ever; the executor notices
    t, g = dumps
    assert _compare_in_fresh_process("die", t, g).startswith("OSError: a compare worker process died")
