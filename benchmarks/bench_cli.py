"""`accucmp` command-line speed, measured side by side in one run (real processes).

    python benchmarks/bench_cli.py [--small-ops 3000] [--repeat 5]

Prints start-up time of `accucmp --help` and `accucmp compare --help` against a bare
`python -c pass` and msprobe's 3.5 s; end-to-end `accucmp compare` (process start,
open, pair, metrics, verdict, csv, summary) rows/s against msprobe's 24-39 rows/s;
`accucmp ls` and `accucmp extract` on the same dump. The engine alone (rows/s,
GB/s with --jobs 2, memory against chunk size) is in bench_compare.py.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from dumpfile import DumpWriter, TensorMeta  # noqa: E402

MSPROBE_STARTUP_S = 3.5
MSPROBE_ROWS_PER_S = (24, 39)
ACCUCMP = [sys.executable, "-m", "accucmp.cli.main"]


def write_small(path, n_ops, seed, noise=0.0, mode="dump"):
    rng = np.random.default_rng(seed)
    with DumpWriter(path, mode=mode) as w:
        for i in range(1, n_ops + 1):
            g = w.begin_op("aten.add.Tensor" if i % 3 else "aten.mm.default", i,
                           phase="forward" if i < n_ops // 2 else "backward", module=f"layers.{i % 7}")
            a = np.random.default_rng(i).standard_normal(64).astype(np.float32)
            b = np.random.default_rng(i + 1).standard_normal(64).astype(np.float32)
            out = (a + b) * (1 + rng.standard_normal(64).astype(np.float32) * np.float32(noise))
            for name, v in (("self", a), ("other", b)):
                w.write_tensor(g["input"], name, v, TensorMeta("float32", (64,), (1,)))
            w.write_tensor(g["output"], "result", out.astype(np.float32), TensorMeta("float32", (64,), (1,)))
            w.end_op()


def run(args, repeat):
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        r = subprocess.run(args, capture_output=True, text=True)
        times.append(time.perf_counter() - t0)
        if r.returncode not in (0, 1):
            raise SystemExit(f"{' '.join(args)} failed ({r.returncode}): {r.stderr.strip()[-500:]}")
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--small-ops", type=int, default=3000)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    d = tempfile.mkdtemp(prefix="bench_cli_")
    try:
        bare = run([sys.executable, "-c", "pass"], a.repeat)
        print(f"python -c pass:            {bare:.3f} s")
        for label, args in (("accucmp --help", ["--help"]), ("accucmp compare --help", ["compare", "--help"])):
            t = run(ACCUCMP + args, a.repeat)
            print(f"{label:26s} {t:.3f} s (target < 0.5 s; msprobe {MSPROBE_STARTUP_S} s: "
                  f"{MSPROBE_STARTUP_S / t:.1f}x faster)")

        g, m = os.path.join(d, "golden.h5"), os.path.join(d, "target.h5")
        write_small(g, a.small_ops, 0)
        write_small(m, a.small_ops, 1, noise=2 ** -24, mode="load")
        rows = a.small_ops * 3
        out = os.path.join(d, "out")
        t = run(ACCUCMP + ["compare", "-m", m, "-g", g, "-out", out, "-q"], max(1, a.repeat // 2))
        lo, hi = MSPROBE_ROWS_PER_S
        print(f"accucmp compare (end to end, {rows} rows of 64 float32, default --jobs 0 = one process per "
              f"core): {t:.2f} s = {rows / t:,.0f} rows/s "
              f"(target >= 2,000; msprobe {lo}-{hi}: {rows / t / hi:.0f}-{rows / t / lo:.0f}x)")
        t1 = run(ACCUCMP + ["compare", "-m", m, "-g", g, "-out", out, "-q", "--jobs", "1"], max(1, a.repeat // 2))
        print(f"  with --jobs 1 (one process): {t1:.2f} s = {rows / t1:,.0f} rows/s")
        t = run(ACCUCMP + ["compare", "-m", m, "-g", g, "-out", out, "-q", "--format", "csv,json,html"], 1)
        print(f"  with json + html report:  {t:.2f} s = {rows / t:,.0f} rows/s")
        t = run(ACCUCMP + ["ls", g], max(1, a.repeat // 2))
        print(f"accucmp ls ({a.small_ops} ops):     {t:.2f} s = {a.small_ops / t:,.0f} ops/s")
        t = run(ACCUCMP + ["ls", g, "--stats"], 1)
        print(f"accucmp ls --stats:         {t:.2f} s = {a.small_ops / t:,.0f} ops/s")
        ext = os.path.join(d, "ext.h5")
        t0 = time.perf_counter()
        subprocess.run(ACCUCMP + ["extract", "-i", g, "-o", ext, "-s", "/aten.mm.default/3/"],
                       check=True, capture_output=True)
        print(f"accucmp extract (1 op of {a.small_ops}): {time.perf_counter() - t0:.2f} s")
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
