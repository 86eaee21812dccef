"""Reading speed: `accucmp ls` (and `ls --stats`) of a large dump, and `compare` rows/s.

    python benchmarks/bench_ls.py [--ops 50000] [--repeat 3] [--keep DIR] [--clock wall|cpu]
                                  [--in-process-only]

Writes, once, a full dump (tree layout with its catalog, DumpWriter) and a statistics-only
dump (table layout) of N small ops (add/mm of 64-element float32 tensors, 3 tensors and a
scalar per op), then times, warm (files in the page cache, the first run not counted):
listing in one process (accucmp.listing.list_ops + render, as `accucmp ls` does, without
the process start) and end to end as a process (`python -m accucmp.cli.main ls`), with and
without --stats (--stats of a full dump reads every tensor: on the N/10-op dump); and `accucmp compare --jobs 1` (one process) of two full dumps of
N/10 ops, in rows/s, end to end and warm in one process. Targets (issue 23): ls < 1 s for 50k
ops warm; compare >= 5,000 rows/s; each printed as a ratio to its goal.

`--clock cpu` times in process CPU time (time.process_time; for the runs as a process, the
children's user + system time from getrusage): steadier than wall time on a shared machine,
where other processes take the cores. `--in-process-only` leaves out the runs as a process.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from dumpfile import DumpWriter, TensorMeta  # noqa: E402
from dumpfile.stats_table import IO_INPUT, IO_OUTPUT, tensor_row  # noqa: E402
from dumpfile.write.stats import StatsDumpWriter, value_rows  # noqa: E402
from dumpfile import schema as S  # noqa: E402

ACCUCMP = [sys.executable, "-m", "accucmp.cli.main"]

# the clock of the in-process timings (--clock): wall or this process's CPU time
CLOCK = time.perf_counter


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _op(i: int, n_ops: int):
    return ("aten.add.Tensor" if i % 3 else "aten.mm.default",
            "forward" if i < n_ops // 2 else "backward", f"layers.{i % 7}")


def write_full(path: str, n_ops: int, seed: int, noise: float = 0.0) -> None:
    rng = np.random.default_rng(seed)
    meta = TensorMeta("float32", (64,), (1,))
    with DumpWriter(path, mode="dump") as w:
        for i in range(1, n_ops + 1):
            op, phase, module = _op(i, n_ops)
            g = w.begin_op(op, i, phase=phase, module=module)
            a = np.random.default_rng(i).standard_normal(64).astype(np.float32)
            b = np.random.default_rng(i + 1).standard_normal(64).astype(np.float32)
            out = (a + b) * (1 + rng.standard_normal(64).astype(np.float32) * np.float32(noise))
            w.write_tensor(g["input"], "self", a, meta)
            w.write_tensor(g["input"], "other", b, meta)
            w.write_value(g["input"], "alpha", 1, "Scalar")
            w.write_tensor(g["output"], "result", out.astype(np.float32), meta)
            w.end_op()


def write_stats(path: str, n_ops: int) -> None:
    stats = [-1.5, 2.5, 0.01, 0.9, 8.0, 0.0, 0.0, 64.0]
    with StatsDumpWriter(path, mode="dump") as w:
        for i in range(1, n_ops + 1):
            op, phase, module = _op(i, n_ops)
            rows = [tensor_row(i, IO_INPUT, "self", "float32", (64,), 0, stats, False),
                    tensor_row(i, IO_INPUT, "other", "float32", (64,), 0, stats, False),
                    *value_rows(i, IO_INPUT, "alpha", 1, "Scalar"),
                    tensor_row(i, IO_OUTPUT, "result", "float32", (64,), 0, stats, False)]
            w.add_op(op, i, rows, phase=phase, module=module)


def in_process_ls(path: str, stats: bool, repeat: int) -> float:
    from accucmp.listing import list_ops, render
    times = []
    for _ in range(repeat + 1):
        t0 = CLOCK()
        lines, info = list_ops(path, stats=stats)
        with contextlib.redirect_stdout(io.StringIO()):
            render(lines, info, console=None, plain=True, stats=stats)
        times.append(CLOCK() - t0)
    return statistics.median(times[1:])


def in_process_compare(m: str, g: str, d: str, repeat: int) -> tuple[float, int]:
    """accucmp.compare.streaming.compare_to_csv, as `accucmp compare` runs it, timed warm
    (the first run, which also walks both files' safety checks, not counted)."""
    from accucmp.compare.streaming import compare_to_csv
    times, rows = [], 0
    for i in range(repeat + 1):
        out = os.path.join(d, f"inproc_{i}.csv")
        if os.path.exists(out):
            os.remove(out)
        t0 = CLOCK()
        rows = compare_to_csv(m, g, out, jobs=1).rows
        times.append(CLOCK() - t0)
        os.remove(out)
    return statistics.median(times[1:]), rows


def process(args: list[str], repeat: int) -> float:
    times = []
    for _ in range(repeat + 1):
        cpu = CLOCK is not time.perf_counter
        t0 = _children_cpu() if cpu else time.perf_counter()
        r = subprocess.run(args, capture_output=True, text=True)
        times.append((_children_cpu() if cpu else time.perf_counter()) - t0)
        if r.returncode not in (0, 1):
            raise SystemExit(f"{' '.join(args)} failed ({r.returncode}): {r.stderr.strip()[-500:]}")
    return statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", type=int, default=50000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--keep", help="directory to keep (and reuse) the dumps in")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--in-process-only", action="store_true", help="leave out the runs as a process")
    a = ap.parse_args()
    global CLOCK
    CLOCK = time.process_time if a.clock == "cpu" else time.perf_counter
    d = a.keep or tempfile.mkdtemp(prefix="bench_ls_")
    os.makedirs(d, exist_ok=True)
    try:
        full, st = os.path.join(d, f"full_{a.ops}.h5"), os.path.join(d, f"stats_{a.ops}.h5")
        g, m = os.path.join(d, f"g_{a.ops // 10}.h5"), os.path.join(d, f"m_{a.ops // 10}.h5")
        for path, make in ((full, lambda p: write_full(p, a.ops, 0)), (st, lambda p: write_stats(p, a.ops)),
                           (g, lambda p: write_full(p, a.ops // 10, 0)),
                           (m, lambda p: write_full(p, a.ops // 10, 1, noise=2 ** -24))):
            if not os.path.exists(path):
                t0 = time.perf_counter()
                make(path)
                print(f"wrote {os.path.basename(path)} in {time.perf_counter() - t0:.1f} s", flush=True)
        print(f"{a.ops} ops, warm, medians of {a.repeat}, {a.clock} clock, load {os.getloadavg()[0]:.2f}:")
        # (ls --stats of a full dump reads every tensor's data: timed on the N/10-op dump)
        for label, path, n, stats in (("full dump", full, a.ops, False),
                                      ("full dump", g, a.ops // 10, True),
                                      ("statistics dump", st, a.ops, False),
                                      ("statistics dump", st, a.ops, True)):
            t = in_process_ls(path, stats, a.repeat)
            flag = " --stats" if stats else ""
            text = f"  ls{flag:8s} {label:16s} {n:6d} ops: in process {t:6.2f} s ({n / t:9,.0f} ops/s)"
            if not a.in_process_only:
                tp = process(ACCUCMP + ["ls", "--plain", path] + (["--stats"] if stats else []), 1)
                goal = "" if stats else f"; as a process / 1 s goal: {tp:4.2f}x"
                text += f"; as a process {tp:6.2f} s{goal}"
            print(text, flush=True)
        rows = (a.ops // 10) * 3     # tensor rows: 3 tensors an op (the scalar is no row)
        out = os.path.join(d, "out")
        if not a.in_process_only:
            t = process(ACCUCMP + ["compare", "-m", m, "-g", g, "-out", out, "-q", "--jobs", "1"], 1)
            print(f"  compare --jobs 1, {rows} rows of 64 float32: {t:.2f} s = {rows / t:,.0f} rows/s "
                  f"end to end (target >= 5,000: {rows / t / 5000:.2f}x)")
        ti, n_rows = in_process_compare(m, g, d, a.repeat)
        print(f"  compare in one process (warm, jobs=1): {ti:.2f} s = {n_rows / ti:,.0f} rows/s "
              f"({n_rows / ti / 5000:.2f}x the 5,000 goal)", flush=True)
    finally:
        if not a.keep:
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
