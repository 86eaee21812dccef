"""Does a dump's cost grow linearly with its op count? ms/op at 5k, 20k and 50k ops.

For each size and writer: the block's whole time per op (body + exit), and the wait at
block exit alone per op (draining the writer, closing the file), side by side with the
same loop undumped. Goal (issue 15): each column within 1.3x across the sizes. The
reference MLP ratios (full <= 2x plain, statistics <= 1.2x) come from bench_dump.py and
bench_dump_stats.py, printed after these when --mlp is given.

    python benchmarks/bench_dump_exit.py [--sizes 5000,20000,50000] [--writers thread]
        [--repeat N] [--mlp]
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


def measure(n: int, opts: dict | None, d: str) -> tuple[float, float, float]:
    """(whole block, exit alone, this process's CPU time for the block) in ms per op. The
    CPU time (all threads; the process writer's child not counted) moves less than wall
    time when other jobs load the machine."""
    x = torch.randn(64, 64)
    c0 = time.process_time()
    if opts is None:
        t0 = time.perf_counter()
        step(x, n)
        return (time.perf_counter() - t0) * 1e3 / n, 0.0, (time.process_time() - c0) * 1e3 / n
    path = os.path.join(d, "exit.h5")
    t0 = time.perf_counter()
    blk = npu_dumper.dumper(use_dump=True, dump_path=path, **opts)
    with blk:
        step(x, n)
        t1 = time.perf_counter()
    t2 = time.perf_counter()
    c2 = time.process_time()
    assert blk.summary["ops_kept"] == n, blk.summary
    os.remove(path)
    return (t2 - t0) * 1e3 / n, (t2 - t1) * 1e3 / n, (c2 - c0) * 1e3 / n


def writer_only(n: int, d: str) -> float:
    """The in-process DumpWriter alone (no model, no thread), fed what the thread writer
    gives it for the loop above: per op a group, a link to the previous result and a new
    64x64 float32 result, a flush every half flush_interval. ms per op. What a writer that
    lags behind its model leaves for the block's exit."""
    from dumpfile.write.writer import DumpWriter, TensorMeta
    path = os.path.join(d, "writer.h5")
    data = torch.randn(64, 64).numpy()
    meta = TensorMeta("float32", (64, 64), (64, 1))
    t0 = time.perf_counter()
    with DumpWriter(path) as w:
        prev = None
        for i in range(1, n + 1):
            w.begin_op("aten.tanh.default" if i % 2 else "aten.mul.Tensor", i)
            inp, out = w.io_groups()
            if prev is None:
                w.write_tensor(inp, "self", data, meta)
            else:
                w.link(inp, "self", prev)
            prev = w.write_tensor(out, "result", data, meta)
            w.end_op()
    took = time.perf_counter() - t0
    os.remove(path)
    return took * 1e3 / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="5000,20000,50000")
    ap.add_argument("--writers", default="plain,process,thread,stats",
                    help="which of plain,process,thread,stats to run")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds over all sizes and writers (side by side), each printed")
    ap.add_argument("--writer-only", action="store_true",
                    help="also time the in-process DumpWriter alone at each size")
    ap.add_argument("--mlp", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    sizes = [int(s) for s in args.sizes.split(",")]
    writers = {"plain": None, "process": dict(writer="process"), "thread": dict(writer="thread"),
               "stats": dict(stats_only=True)}
    chosen = args.writers.split(",")
    writers = {k: v for k, v in writers.items() if k in chosen}
    with tempfile.TemporaryDirectory() as d:
        for opts in writers.values():
            if opts is not None:
                measure(1000, opts, d)          # warm-up (writer process start, pooled threads)
        print(f"{'writer':8} " + " ".join(f"{n:>26}" for n in sizes)
              + "   max/min: block, exit, cpu")
        print(f"{'':8} " + " ".join(f"{'block    exit     cpu ms/op':>26}" for _ in sizes))
        for _ in range(args.repeat):
            for name, opts in writers.items():
                res = [measure(n, opts, d) for n in sizes]
                whole = [r[0] for r in res]
                exits = [r[1] for r in res]
                cpu = [r[2] for r in res]
                cells = " ".join(f"{w:8.3f} {e:8.3f} {c:8.3f}" for w, e, c in res)
                ratio = f"{max(exits) / min(exits):5.2f}x" if min(exits) > 0 else "    -"
                print(f"{name:8} {cells}   {max(whole) / min(whole):5.2f}x {ratio} "
                      f"{max(cpu) / min(cpu):5.2f}x", flush=True)
            if args.writer_only:
                res = [writer_only(n, d) for n in sizes]
                cells = " ".join(f"{r:26.3f}" for r in res)
                print(f"{'writer':8} {cells}   {max(res) / min(res):5.2f}x  (DumpWriter alone, ms/op)",
                      flush=True)
    if args.mlp:
        for script in ("bench_dump.py", "bench_dump_stats.py"):
            subprocess.run([sys.executable, str(ROOT / "benchmarks" / script)], check=False)


if __name__ == "__main__":
    main()
