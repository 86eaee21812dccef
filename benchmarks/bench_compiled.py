"""A torch.compile'd step dumped with compiled=True, against the compiled step itself,
measured side by side in one process (docs/COMPILED.md, "Overhead").

    python benchmarks/bench_compiled.py [--width 256] [--depth 4] [--batch 32] [--steps 5]

Three ways of running the same training step of the sample MLP (Linear + GELU blocks,
LayerNorm, MSE loss); each is warmed (compiled) before timing. The dumped steps run in
one block (entering a block resets Dynamo, so one block per step would time compiles),
interleaved with `stock` steps; `pieces` interleaved with `stock` outside it:
  stock     torch.compile(model) (Inductor, whole graphs, fused)
  pieces    the recording backend outside a block: the graphs run as one compiled piece
            per ATen op, nothing recorded (what splitting alone costs)
  dumped    the same inside torch.utils.dumper(compiled=True): every node's values
            written to HDF5 (writer process), and each node's own error measured (the
            node's op re-run in float64 on its inputs, the default)
  no-own    the same with own_error=False (nothing re-run in float64), in a block of its
            own, interleaved with stock too
OMP_NUM_THREADS defaults to 1 here (see main). Prints the median milliseconds per step and the ratios to `stock`, and the first step's
time of each (compile; Inductor's caches in a fresh temporary directory, warm after `stock`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    # One thread per kernel: Inductor's C++ kernels use OpenMP, whose threads spin-wait;
    # on a shared, oversubscribed machine (load 14 on 2 cores) that made every compiled
    # step ~250x slower at random (1.8 ms vs 456 ms for the same step), drowning the ratio.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    tmp = tempfile.mkdtemp(prefix="bench_compiled_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp, "inductor")

    import torch
    import torch.nn.functional as F
    import npu_dumper
    from npu_dumper.compiled import backend
    from sample_models.mlp import ReferenceMLP

    torch.manual_seed(0)
    model = ReferenceMLP(width=a.width, depth=a.depth)
    x, target = torch.randn(a.batch, a.width), torch.randn(a.batch, a.width)

    def step(m):
        m.zero_grad(set_to_none=True)
        F.mse_loss(m(x), target).backward()

    from torch._inductor.compile_fx import compile_fx as inductor

    # `stock` calls Inductor through a backend of its own, so that a compiled=True block
    # (which reroutes torch.compile's default backend) leaves it stock
    stock = torch.compile(model, backend=lambda gm, ex: inductor(gm, ex))
    pieces = torch.compile(model, backend=backend())
    dumped = torch.compile(model)
    first = {}
    for name, m in (("stock", stock), ("pieces", pieces)):
        t = time.perf_counter()
        step(m)
        first[name] = time.perf_counter() - t
    times = {"stock": [], "pieces": [], "dumped": [], "stock ": [], "no-own": [], "stock  ": []}
    for _ in range(a.steps):          # outside a block: stock and pieces, interleaved
        for name, m in (("stock", stock), ("pieces", pieces)):
            t = time.perf_counter()
            step(m)
            times[name].append(time.perf_counter() - t)
    # One block for all dumped steps (its entry resets Dynamo: every model recompiles on
    # its first call in it, untimed), interleaved with stock steps.
    for label, own, ref in (("dumped", True, "stock "), ("no-own", False, "stock  ")):
        with npu_dumper.dumper(dump_path=os.path.join(tmp, f"{label}.h5"), compiled=True, own_error=own) as d:
            t = time.perf_counter()
            step(dumped)
            first[label] = time.perf_counter() - t
            n = d.num_ops
            step(stock)
            for _ in range(a.steps):
                for name, m in ((ref, stock), (label, dumped)):
                    t = time.perf_counter()
                    step(m)
                    times[name].append(time.perf_counter() - t)
        if own:
            written = d.summary["bytes_written"]
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"MLP width {a.width} depth {a.depth} batch {a.batch}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, {a.steps} steps each; {n} ops recorded per dumped step, "
          f"{written / (a.steps + 1) / 1e6:.2f} MB per step")
    print(f"  first step (compile; Inductor's caches cold for stock, warm after): "
          + ", ".join(f"{k} {v:.1f} s" for k, v in first.items()))
    print(f"  pieces  {med['pieces'] * 1e3:8.2f} ms/step  x{med['pieces'] / med['stock']:.2f} of stock "
          f"({med['stock'] * 1e3:.2f} ms/step, interleaved outside the block)")
    print(f"  dumped  {med['dumped'] * 1e3:8.2f} ms/step  x{med['dumped'] / med['stock ']:.2f} of stock "
          f"({med['stock '] * 1e3:.2f} ms/step, interleaved inside the block)")
    print(f"  no-own  {med['no-own'] * 1e3:8.2f} ms/step  x{med['no-own'] / med['stock  ']:.2f} of stock "
          f"({med['stock  '] * 1e3:.2f} ms/step, interleaved inside its block): own_error=False")


if __name__ == "__main__":
    main()
