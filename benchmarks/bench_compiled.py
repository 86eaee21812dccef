"""A torch.compile'd step dumped with compiled=True, against the compiled step itself,
measured side by side in one process (docs/COMPILED.md, "Overhead").

    python benchmarks/bench_compiled.py [--width 256] [--depth 4] [--batch 32] [--steps 5]

Three ways of running the same training step of the sample MLP (Linear + GELU blocks,
LayerNorm, MSE loss); each is warmed (compiled) before timing. The dumped steps run in
one block (entering a block resets Dynamo, so one block per step would time compiles),
then `stock` and `pieces` interleaved step by step:
  stock     torch.compile(model) (Inductor, whole graphs, fused)
  pieces    the recording backend outside a block: the graphs run as one compiled piece
            per ATen op, nothing recorded (what splitting alone costs)
  dumped    the same inside torch.utils.dumper(compiled=True): every node's values
            written to HDF5 (writer process)
Prints the median seconds per step and the ratios to `stock`, plus the compile time of
the first step of each (Inductor's caches in a fresh temporary directory).
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

    stock = torch.compile(model)
    pieces = torch.compile(model, backend=backend())
    first = {}
    for name, m in (("stock", stock), ("pieces", pieces)):
        t = time.perf_counter()
        step(m)
        first[name] = time.perf_counter() - t
    times = {"stock": [], "pieces": [], "dumped": []}
    n = 0
    # one block for all dumped steps: its entry resets Dynamo (the model recompiles
    # through the recording backend: the first step's time is that compile)
    with npu_dumper.dumper(dump_path=os.path.join(tmp, "compiled.h5"), compiled=True) as d:
        t = time.perf_counter()
        step(stock)
        first["dumped"] = time.perf_counter() - t
        n = d.num_ops
        for _ in range(a.steps):
            t = time.perf_counter()
            step(stock)
            times["dumped"].append(time.perf_counter() - t)
    # (after the block Dynamo is reset again: stock recompiles once, untimed)
    step(stock)
    step(pieces)
    for _ in range(a.steps):
        for name, m in (("stock", stock), ("pieces", pieces)):
            t = time.perf_counter()
            step(m)
            times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"MLP width {a.width} depth {a.depth} batch {a.batch}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs; {n} ops recorded per dumped step; file {d.summary['bytes_written'] / (a.steps + 1) / 1e6:.2f} MB per step")
    for k in ("stock", "pieces", "dumped"):
        print(f"  {k:7s} first step (compile) {first[k]:7.2f} s   step median {med[k] * 1e3:8.2f} ms"
              f"   x{med[k] / med['stock']:.1f} of stock")


if __name__ == "__main__":
    main()
