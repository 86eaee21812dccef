"""Does a dump's cost grow linearly with its op count? ms/op at 5k, 20k and 50k ops.

For each size and writer: the block's whole time per op (body + exit), and the wait at
block exit alone per op (draining the writer, closing the file), side by side with the
same loop undumped. Goal (issue 15): each column within 1.3x across the sizes. The
reference MLP ratios (full <= 2x plain, statistics <= 1.2x) come from bench_dump.py and
bench_dump_stats.py, printed after these when --mlp is given.

    python benchmarks/bench_dump_exit.py [--sizes 5000,20000,50000] [--mlp]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import npu_dumper  # noqa: E402


def step(x: torch.Tensor, n: int) -> torch.Tensor:
    # two ops per iteration, small tensors: the per-op cost is the dumper's, not the math's
    for _ in range(n // 2):
        x = torch.tanh(x * 1.0001)
    return x


def measure(n: int, opts: dict | None, d: str) -> tuple[float, float]:
    """(whole block, exit alone) in ms per op."""
    x = torch.randn(64, 64)
    if opts is None:
        t0 = time.perf_counter()
        step(x, n)
        return (time.perf_counter() - t0) * 1e3 / n, 0.0
    path = os.path.join(d, "exit.h5")
    t0 = time.perf_counter()
    blk = npu_dumper.dumper(use_dump=True, dump_path=path, **opts)
    with blk:
        step(x, n)
        t1 = time.perf_counter()
    t2 = time.perf_counter()
    assert blk.summary["ops_kept"] == n, blk.summary
    os.remove(path)
    return (t2 - t0) * 1e3 / n, (t2 - t1) * 1e3 / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="5000,20000,50000")
    ap.add_argument("--mlp", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    sizes = [int(s) for s in args.sizes.split(",")]
    writers = {"plain": None, "process": dict(writer="process"), "thread": dict(writer="thread"),
               "stats": dict(stats_only=True)}
    with tempfile.TemporaryDirectory() as d:
        measure(1000, writers["process"], d)       # warm-up (writer process start)
        print(f"{'writer':8} " + " ".join(f"{n:>17}" for n in sizes) + "   max/min")
        print(f"{'':8} " + " ".join(f"{'block  exit ms/op':>17}" for _ in sizes))
        for name, opts in writers.items():
            res = [measure(n, opts, d) for n in sizes]
            whole = [r[0] for r in res]
            cells = " ".join(f"{w:8.3f} {e:8.3f}" for w, e in res)
            print(f"{name:8} {cells}   {max(whole) / min(whole):5.2f}x", flush=True)
    if args.mlp:
        for script in ("bench_dump.py", "bench_dump_stats.py"):
            subprocess.run([sys.executable, str(ROOT / "benchmarks" / script)], check=False)


if __name__ == "__main__":
    main()
