"""Dump step vs plain step under DDP and FSDP2, 2 gloo ranks on CPU, side by side in one run.

Workload: 4 x (Linear(512,512) + GELU), batch 32 per rank, fp32, sum loss, forward +
backward; DDP(model) and fully_shard per block + root. Each round times one plain step and
one dumped step (full dump, default writer) on both ranks, alternating, with a barrier
before each; the dump file is removed outside the timing. Two dumped variants: one block
per step (`step=`, the block's start and final flush included) and 5 steps in one block
(per step). Prints median ms/step (rank 0's clock, the step ends when both ranks have
finished it) and the ratios dump / plain.

    python benchmarks/bench_dump_distributed.py [--rounds R] [--stats]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(512, 512), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


def wrap(kind: str, net: torch.nn.Module) -> torch.nn.Module:
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel(net)
    from torch.distributed.fsdp import fully_shard
    for m in net:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m)
    return fully_shard(net)


def timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return (time.perf_counter() - t0) * 1e3


def worker(rank: int, world: int, port: int, rounds: int, stats: bool, out: str) -> None:
    import npu_dumper  # noqa: F401 - installs torch.utils.dumper
    torch.set_num_threads(1)       # two ranks on a 2-core machine
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    lines = []
    try:
        for kind in ("ddp", "fsdp2"):
            model = wrap(kind, make_model())
            x = torch.randn(32, 512)

            def step():
                model(x).sum().backward()

            def dumped(n=1):
                with torch.utils.dumper(dump_path=os.path.join(out, f"{kind}.h5"), stats_only=stats):
                    for _ in range(n):
                        step()

            for _ in range(2):       # warm-up: gloo connections, allocator, writer start
                step()
                dumped()
            plain, dump, dump5 = [], [], []
            for _ in range(rounds):
                plain.append(timed(step))
                dump.append(timed(dumped))
                os.remove(os.path.join(out, f"{kind}_rank{rank}.h5"))
                dump5.append(timed(lambda: dumped(5)) / 5)
                os.remove(os.path.join(out, f"{kind}_rank{rank}.h5"))
            p, d, d5 = statistics.median(plain), statistics.median(dump), statistics.median(dump5)
            lines.append(f"{kind:6s} plain {p:7.1f} ms | dump{' (stats)' if stats else ''}: "
                         f"1 step/block {d:7.1f} ms ({d / p:5.2f}x), 5 steps/block {d5:7.1f} ms/step "
                         f"({d5 / p:5.2f}x)   median of {rounds}")
    finally:
        dist.destroy_process_group()
    if rank == 0:
        print("\n".join(lines), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--stats", action="store_true", help="statistics-only dumps")
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(worker, args=(2, port, a.rounds, a.stats, out), nprocs=2)


if __name__ == "__main__":
    main()
