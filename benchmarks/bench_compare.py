"""Compare-engine speed and memory, measured side by side in one run.

    python benchmarks/bench_compare.py [--large-mb 64] [--small-ops 2000]

Prints: rows/s on many small tensors (end to end: open, pair, read, metrics,
verdict), GB/s on large tensors with jobs 1 and 2 (all ten metrics and without
the two-pass KL), and peak RSS growth against chunk size (child processes).
Targets (issue 4): >= 2,000 rows/s small, >= 1 GB/s large with jobs=2, memory
bounded by the chunk size. msprobe's compare: 24-39 rows/s.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from accucmp.compare.pipeline import compare_dumps  # noqa: E402
from accucmp.compare.verdict import apply_verdict  # noqa: E402
from dumpfile import DumpWriter, TensorMeta  # noqa: E402


def write_small(path, n_ops, rng, fault=0.0):
    with DumpWriter(path) as w:
        for i in range(1, n_ops + 1):
            g = w.begin_op("aten.add.Tensor" if i % 3 else "aten.mm.default", i)
            a = rng.standard_normal(64).astype(np.float32)
            b = rng.standard_normal(64).astype(np.float32)
            w.write_tensor(g["input"], "self", a, TensorMeta("float32", (8, 8)))
            w.write_tensor(g["input"], "other", b, TensorMeta("float32", (8, 8)))
            w.write_tensor(g["output"], "result", (a + b) * (1 + fault), TensorMeta("float32", (8, 8)))
            w.end_op()


def write_large(path, n, mb, seed, noise):
    rng = np.random.default_rng(seed)
    elems = mb * (1 << 20) // 4
    with DumpWriter(path) as w:
        for i in range(1, n + 1):
            g = w.begin_op("aten.mm.default", i)
            base = np.random.default_rng(i).standard_normal(elems, dtype=np.float32)
            if noise:
                base = base + rng.standard_normal(elems, dtype=np.float32) * np.float32(noise)
            w.write_tensor(g["output"], "result", base, TensorMeta("float32", (elems,)))
            w.end_op()
    return n * elems * 4


def timed(fn, repeat=2):
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def peak_child(t, g, chunk):
    """Peak traced allocation (numpy buffers included) of one compare, in a fresh process."""
    code = ("import sys,tracemalloc; sys.path.insert(0,%r); from accucmp.compare.pipeline import compare_dumps; "
            "tracemalloc.start(); compare_dumps(%r,%r,chunk_elements=%d); "
            "print(tracemalloc.get_traced_memory()[1]/2**20)"
            % (os.path.join(os.path.dirname(__file__), ".."), t, g, chunk))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--small-ops", type=int, default=2000)
    ap.add_argument("--large-mb", type=int, default=64, help="MiB per large tensor (4 tensors per file)")
    args = ap.parse_args()
    d = tempfile.mkdtemp(prefix="bench_compare_")

    ts, gs = os.path.join(d, "ts.h5"), os.path.join(d, "gs.h5")
    write_small(gs, args.small_ops, np.random.default_rng(1))
    write_small(ts, args.small_ops, np.random.default_rng(1), fault=1e-7)
    sec, table = timed(lambda: apply_verdict(compare_dumps(ts, gs).table))
    print(f"small tensors: {len(table)} rows (64 float32 each) in {sec:.2f} s = {len(table) / sec:,.0f} rows/s "
          f"(target >= 2,000; msprobe 24-39)")
    sec2, _ = timed(lambda: apply_verdict(compare_dumps(ts, gs, jobs=2).table))
    print(f"small tensors, jobs=2 (worker processes): {sec2:.2f} s = {len(table) / sec2:,.0f} rows/s "
          f"({sec / sec2:.2f}x jobs=1)")
    sec1, _ = timed(lambda: compare_dumps(ts, gs, algorithms=["CosineSimilarity", "RelativeEuclideanDistance",
                                                                "MaxAbsoluteError"]).table)
    print(f"small tensors, 3 metrics: {len(table) / sec1:,.0f} rows/s")

    tl, gl = os.path.join(d, "tl.h5"), os.path.join(d, "gl.h5")
    nbytes = write_large(gl, 4, args.large_mb, 0, 0.0)
    write_large(tl, 4, args.large_mb, 1, 1e-3)
    total = 2 * nbytes
    print(f"large tensors: 4 x {args.large_mb} MiB float32 per file ({total / 1e9:.2f} GB both sides)")
    no_kl = [m for m in ("CosineSimilarity", "MaxAbsoluteError", "AccumulatedRelativeError",
                         "RelativeEuclideanDistance", "StandardDeviation", "MeanAbsoluteError",
                         "RootMeanSquareError", "MaxRelativeError", "MeanRelativeError")]
    for label, algs in (("all ten metrics", None), ("without KL (one pass)", no_kl)):
        res = {}
        for jobs in (1, 2):
            sec, _ = timed(lambda: compare_dumps(tl, gl, jobs=jobs, algorithms=algs), repeat=2)  # best of 2: a shared machine
            res[jobs] = sec
            print(f"  {label:24s} jobs={jobs}: {sec:.2f} s = {total / sec / 1e9:.2f} GB/s")
        print(f"  {label:24s} jobs=2 / jobs=1 speed-up: {res[1] / res[2]:.2f}x")

    for chunk in (1 << 16, 1 << 20, 1 << 22):
        mb = peak_child(tl, gl, chunk)
        print(f"peak traced memory, chunk_elements={chunk:>8}: {mb:7.1f} MiB "
              f"(one tensor is {args.large_mb} MiB per side)")


if __name__ == "__main__":
    main()
