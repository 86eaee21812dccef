"""Folder compares on Dask, and the memory of a streamed compare, measured side by side.

    python benchmarks/bench_compare_ranks.py [--pairs 8] [--rows 20000] [--rss-rows 100000,1000000]
                                             [--skip-rss] [--skip-scale] [--against DIR [--repeat 3]]

Prints:
1. `compare_runs` of PAIRS rank pairs x ROWS rows (small fp32 tensors, 3 per op) with
   1 and with 2 LocalCluster workers: wall time of each and their ratio (goal >= 1.7x
   on 2 cores), cluster start-up included and also shown apart.
2. peak RSS of one streamed single-pair compare (streaming.compare_to_csv, what
   `accucmp compare` runs) at each row count, in a fresh child process each, with the
   in-memory pipeline (compare_dumps + apply_verdict + to_csv, before streaming) at the
   smallest count for contrast. Goal: flat, <= 300 MB at 1M rows. With --against DIR,
   also another checkout's streamed compare of the same dumps, alternating with this one's:
   CPU, wall time and peak RSS side by side, and whether the result csv is identical
   (a restructuring must not slow the compare or change its output).
3. the per-op numbers docs/COMPARE.md "Scale on paper" starts from: file bytes per
   tensor row of a full and of a statistics dump, compare rows/s of both on one worker,
   and large-tensor GB/s on one worker.
Synthetic dumps are written with dumpfile.DumpWriter / StatsDumpWriter (torch-free).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from dumpfile import DumpWriter, TensorMeta  # noqa: E402
from dumpfile import schema as S  # noqa: E402


def write_small(path, n_rows, *, seed=0, fault_seqid=None, rank=0, world=1):
    """n_rows rows: ops with two 16-element fp32 inputs and one output (an add)."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(16).astype(np.float32)
    b = rng.standard_normal(16).astype(np.float32)
    meta = TensorMeta("float32", (16,))
    n_ops = max(1, n_rows // 3)
    with DumpWriter(path, root_attrs={S.ROOT_RANK: rank, S.ROOT_WORLD_SIZE: world}) as w:
        for i in range(1, n_ops + 1):
            g = w.begin_op("aten.add.Tensor", i)
            w.write_tensor(g["input"], "self", a, meta)
            w.write_tensor(g["input"], "other", b, meta)
            out = a + b
            if i == fault_seqid:
                out = out * np.float32(1.05)
            w.write_tensor(g["output"], "result", out, meta)
            w.end_op()
    return n_ops * 3


def write_stats(path, n_rows, *, seed=0):
    from dumpfile.stats_table import IO_INPUT, IO_OUTPUT, tensor_row
    from dumpfile.write.stats import StatsDumpWriter

    rng = np.random.default_rng(seed)
    n_ops = max(1, n_rows // 3)
    with StatsDumpWriter(path, mode=S.MODE_DUMP) as w:
        for i in range(1, n_ops + 1):
            rows = []
            for io, name in ((IO_INPUT, "self"), (IO_INPUT, "other"), (IO_OUTPUT, "result")):
                x = rng.standard_normal(16)
                st = {"min": x.min(), "max": x.max(), "mean": x.mean(), "std": x.std(ddof=1),
                      "norm": float(np.sqrt((x * x).sum())), "nan_count": 0, "inf_count": 0, "numel": 16}
                rows.append(tensor_row(i, io, name, "float32", (4096, 4096), S.DEVICE_TYPE_UNKNOWN,
                                       tuple(float(st[k]) for k in S.STATS_FIELDS)))
            w.add_op("aten.add.Tensor", i, rows)
    return n_ops * 3


def write_large(path, mb, seed):
    elems = mb * (1 << 20) // 4
    x = np.random.default_rng(seed).standard_normal(elems, dtype=np.float32)
    with DumpWriter(path) as w:
        g = w.begin_op("aten.mm.default", 1)
        w.write_tensor(g["output"], "result", x, TensorMeta("float32", (elems,)))
        w.end_op()
    return elems * 4


def rank_runs(d, pairs, rows):
    """Two run folders of `pairs` ranks; the target's rank 1 has one faulty op."""
    a, b = os.path.join(d, "A"), os.path.join(d, "B")
    os.makedirs(a)
    os.makedirs(b)
    base_a, base_b = os.path.join(d, "a.h5"), os.path.join(d, "b.h5")
    write_small(base_a, rows)
    write_small(base_b, rows, fault_seqid=rows // 6)
    for r in range(pairs):
        shutil.copy(base_a, os.path.join(a, f"dump_rank{r}.h5"))
        shutil.copy(base_a if r != 1 else base_b, os.path.join(b, f"dump_rank{r}.h5"))
    return a, b


def time_runs(a, b, out, workers):
    from accucmp.compare.ranks import compare_runs

    t0 = time.perf_counter()
    r = compare_runs(b, a, out, workers=workers, replica_check=False)
    wall = time.perf_counter() - t0
    busy = sum(p["seconds"] for p in r.pairs)
    assert not r.errors, r.errors
    return wall, busy, r


def cluster_start(workers):
    from dask.distributed import Client, LocalCluster
    import logging

    t0 = time.perf_counter()
    with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=":0",
                      silence_logs=logging.CRITICAL) as c, Client(c):
        return time.perf_counter() - t0


_CHILD = r"""
import json, resource, sys, time
sys.path.insert(0, %(root)r)
mode, t, g, out = sys.argv[1:5]
t0 = time.perf_counter()
if mode == "stream":
    from accucmp.compare.streaming import compare_to_csv
    r = compare_to_csv(t, g, out, jobs=1)
    rows = r.rows
else:
    from accucmp.compare.pipeline import compare_dumps
    from accucmp.compare.verdict import apply_verdict
    table = apply_verdict(compare_dumps(t, g, jobs=1).table)
    table.to_csv(out, index=False)
    rows = len(table)
# VmHWM: this process's own peak. ru_maxrss would also count the image of the parent it
# was forked from (exec keeps the larger of the two), and the parent holds the Dask run
hwm = [ln for ln in open("/proc/self/status") if ln.startswith("VmHWM:")]
peak = int(hwm[0].split()[1]) / 1024 if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
ru = resource.getrusage(resource.RUSAGE_SELF)     # CPU time: less sensitive than wall time to a loaded machine
print(json.dumps({"rows": rows, "seconds": time.perf_counter() - t0, "cpu_s": ru.ru_utime + ru.ru_stime,
                  "peak_mb": peak}))
"""


def child(mode, t, g, out, root=None):
    code = _CHILD % {"root": root or ROOT}
    p = subprocess.run([sys.executable, "-c", code, mode, t, g, out], capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"child failed: {p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def side_by_side(other, t, g, d, n, repeat):
    """This checkout's streamed compare against another's on the same dumps, alternating
    (a loaded machine slows both alike), each run in a fresh child; the result csv must
    be byte-identical."""
    import filecmp

    runs = {"this": [], "other": []}
    for i in range(repeat):
        for who, root in (("other", other), ("this", ROOT)):
            runs[who].append(child("stream", t, g, os.path.join(d, f"{who}{n}_{i}.csv"), root))
    same = filecmp.cmp(os.path.join(d, f"this{n}_0.csv"), os.path.join(d, f"other{n}_0.csv"), shallow=False)
    best = {w: (min(r["cpu_s"] for r in rs), min(r["seconds"] for r in rs), min(r["peak_mb"] for r in rs))
            for w, rs in runs.items()}
    (tc, tw, tp), (oc, ow, op) = best["this"], best["other"]
    print(f"[against] {n:,} rows, best of {repeat}: CPU {tc:.1f} s vs {oc:.1f} s ({tc / oc:.2f}x), wall {tw:.1f} s vs "
          f"{ow:.1f} s ({tw / ow:.2f}x), peak RSS {tp:.0f} MB vs {op:.0f} MB ({tp / op:.2f}x); "
          f"csv {'identical' if same else 'DIFFERENT'}; CPU of every run: this "
          f"{[round(r['cpu_s'], 1) for r in runs['this']]}, other {[round(r['cpu_s'], 1) for r in runs['other']]}")


def dask_ratio(d, args):
    a, b = rank_runs(d, args.pairs, args.rows)
    start1, start2 = cluster_start(1), cluster_start(2)
    w1, busy1, r1 = time_runs(a, b, os.path.join(d, "o1"), 1)
    w2, busy2, r2 = time_runs(a, b, os.path.join(d, "o2"), 2)
    rows = sum(p["rows"] for p in r1.pairs)
    assert r1.counts == r2.counts and r1.diverge_first == [1] == r2.diverge_first
    print(f"[ranks] {args.pairs} pairs x {args.rows} rows ({rows} rows): 1 worker {w1:.1f} s "
          f"({rows / w1:,.0f} rows/s), 2 workers {w2:.1f} s ({rows / w2:,.0f} rows/s): "
          f"speed-up {w1 / w2:.2f}x (goal >= 1.7x on 2 cores)")
    print(f"[ranks] cluster start-up (in those times): {start1:.1f} s with 1 worker, {start2:.1f} s with 2; "
          f"task time summed over pairs {busy1:.1f} s vs {busy2:.1f} s; "
          f"load average now {os.getloadavg()[0]:.2f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--rows", type=int, default=20000)
    ap.add_argument("--rss-rows", default="100000,1000000")
    ap.add_argument("--skip-rss", action="store_true")
    ap.add_argument("--skip-ranks", action="store_true")
    ap.add_argument("--skip-scale", action="store_true")
    ap.add_argument("--against", metavar="DIR", help="another checkout (e.g. `git worktree add /tmp/base HEAD~5`): "
                    "its streamed compare of the same dumps, alternating with this one's")
    ap.add_argument("--repeat", type=int, default=3, help="with --against: runs of each")
    ap.add_argument("--keep", help="directory to keep (and reuse) the --rss-rows dumps in: a 1M-row pair "
                    "takes minutes to write")
    args = ap.parse_args()
    d = tempfile.mkdtemp(prefix="bench_ranks_")
    kept = args.keep or d
    os.makedirs(kept, exist_ok=True)
    try:
        print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start")
        # 1. Dask: 1 vs 2 workers
        if not args.skip_ranks:
            dask_ratio(d, args)
        # 2. memory at growing row counts
        if not args.skip_rss:
            counts = [int(x) for x in args.rss_rows.split(",") if x]
            peaks = {}
            for n in counts:
                t, g = os.path.join(kept, f"t{n}.h5"), os.path.join(kept, f"g{n}.h5")
                t0 = time.perf_counter()
                if not (os.path.exists(t) and os.path.exists(g)):
                    write_small(t, n)
                    write_small(g, n, fault_seqid=n // 6)
                wt = time.perf_counter() - t0
                res = child("stream", t, g, os.path.join(d, f"s{n}.csv"))
                peaks[n] = res["peak_mb"]
                print(f"[rss] streamed compare, {res['rows']:,} rows: peak RSS {res['peak_mb']:.0f} MB, "
                      f"{res['seconds']:.1f} s, {res['cpu_s']:.1f} s CPU "
                      f"({res['rows'] / res['seconds']:,.0f} rows/s; dumps written in {wt:.0f} s)")
                if args.against:
                    side_by_side(args.against, t, g, d, n, args.repeat)
                if n == counts[0]:
                    old = child("table", t, g, os.path.join(d, f"m{n}.csv"))
                    print(f"[rss] in-memory pipeline (compare_dumps + apply_verdict + to_csv), {old['rows']:,} rows: "
                          f"peak RSS {old['peak_mb']:.0f} MB")
                for p in (t, g) if not args.keep else ():
                    os.remove(p)
            if len(peaks) > 1:
                lo, hi = counts[0], counts[-1]
                print(f"[rss] peak RSS at {hi:,} rows / at {lo:,} rows: {peaks[hi] / peaks[lo]:.2f}x "
                      f"(goal: flat; <= 300 MB at 1M rows)")
        # 3. per-op numbers for "Scale on paper"
        if not args.skip_scale:
            from accucmp.compare.streaming import compare_to_csv

            n = 30000
            t, g = os.path.join(d, "full_t.h5"), os.path.join(d, "full_g.h5")
            write_small(t, n)
            write_small(g, n, seed=1)
            full_b = os.path.getsize(t) / n
            t0 = time.perf_counter()
            compare_to_csv(t, g, os.path.join(d, "full.csv"), jobs=1)
            full_rate = n / (time.perf_counter() - t0)
            st, sg = os.path.join(d, "st.h5"), os.path.join(d, "sg.h5")
            write_stats(st, n)
            write_stats(sg, n, seed=1)
            stats_b = os.path.getsize(st) / n
            t0 = time.perf_counter()
            compare_to_csv(st, sg, os.path.join(d, "stats.csv"), jobs=1)
            stats_rate = n / (time.perf_counter() - t0)
            lt, lg = os.path.join(d, "lt.h5"), os.path.join(d, "lg.h5")
            nbytes = write_large(lt, 256, 0)
            write_large(lg, 256, 1)
            t0 = time.perf_counter()
            compare_to_csv(lt, lg, os.path.join(d, "large.csv"), jobs=1)
            gbs = 2 * nbytes / (time.perf_counter() - t0) / 1e9
            print(f"[scale] full dump: {full_b:,.0f} file bytes per row of a 16-element fp32 tensor "
                  f"(64 bytes of data); compare {full_rate:,.0f} rows/s on one worker")
            print(f"[scale] statistics dump: {stats_b:,.0f} file bytes per row; compare {stats_rate:,.0f} rows/s "
                  "on one worker")
            print(f"[scale] large tensors (256 MiB fp32 pair, all metrics): {gbs:.2f} GB/s read on one worker "
                  "(both sides counted)")
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
