"""Dump overhead on every sample model, measured side by side in one run.

The reference workload (bench_dump.py) is one model with few, large ops; real models
also have many small ones, where the cost per op (HDF5 objects and attributes of the
original layout) is what a user waits for. For each sample model at its full size:
one training step plain, under a full dump (default writer, then writer="thread") and
under a statistics-only dump; prints the ratios, ops per step and MB per step.
Besides the sample models, `gpt2`: a third-party model (Hugging Face transformers' GPT-2,
2 layers, width 128, built from its config with random weights, no download; skipped when
transformers is not importable), one LM training step on 4 x 32 tokens.

    python benchmarks/bench_models.py [--rounds N] [--threads T] [--clock wall|cpu|cpu+child]
                                      [--kinds plain,stats] [MODEL ...]

`--kinds`: only these kinds of step (plain is always run: the ratios are to it), e.g.
`--kinds stats` for the statistics column alone, without the minutes of full dumps.

`--clock cpu` times each step in this process's CPU time (all its threads) instead of
wall time: on a machine shared with other work, wall-time ratios move with the load
(2-3x between runs on the loaded 2-core VM) and CPU-time ratios much less. It counts the
statistics writer (a thread) but not the full dump's writer process (a child), so its
`full` column is the model's side of a full dump only. `--clock cpu+child` adds the CPU time
of the dump writer process (read through its CPU-time clock, clock_getcpuclockid): the whole
work of a full dump, what a step costs when the two processes share one core, and what
other load on the machine disturbs least.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

import npu_dumper
import sample_models

KINDS = ("plain", "full", "full-thread", "stats")


def _cpu_with_child() -> float:
    """This process's CPU time plus the pooled dump writer process's (0 before it started)."""
    import ctypes
    from dumpfile.write import remote
    child = remote._pooled
    extra = 0.0
    if child is not None and child.proc.poll() is None:
        clk = ctypes.c_int()
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.clock_getcpuclockid(child.proc.pid, ctypes.byref(clk)) == 0:
            extra = time.clock_gettime(clk.value)
    return time.process_time() + extra
THIRD_PARTY = ("gpt2",)


def _gpt2_step():
    """A tiny GPT-2 (transformers, random weights from its config): one LM training step."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
        from transformers.utils import logging as hf_logging
    except Exception:  # noqa: BLE001 - not installed, or a broken install: skipped
        return None
    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=512, n_positions=64, n_embd=128, n_layer=2, n_head=4,
                     bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    model = GPT2LMHeadModel(cfg)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (4, 32), generator=gen)

    def step():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.loss
    return step


def get_model(name: str):
    """One training step of model `name` as a callable (None: not available here)."""
    if name == "gpt2":
        return _gpt2_step()
    spec = sample_models.get(name)
    model, batch = spec.build(seed=0), spec.make_inputs(seed=0)
    return lambda: spec.train_step(model, batch)


def warmed_steps(names):
    """(name, step) of each model of `names` that is available here, its step run once
    (warm-up); the others are said to be skipped."""
    for name in names:
        step = get_model(name)
        if step is None:
            print(f"{name}: not available, skipped")
            continue
        step()
        yield name, step


def print_profile(run, times: int, top: int) -> None:
    """cProfile of `run()` called `times` times, its `top` functions by own time."""
    import cProfile
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(times):
        run()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def measure(name: str, rounds: int, tmp: str, clock=time.perf_counter, kinds=KINDS) -> dict | None:
    step = get_model(name)
    if step is None:
        return None
    step()                                              # warm-up (op tables, the writer process)
    times: dict[str, list[float]] = {k: [] for k in kinds}
    ops = size = 0
    for _ in range(rounds):
        for kind in kinds:                               # interleaved: drift hits all alike
            path = os.path.join(tmp, f"{name}_{kind}.h5")
            t0 = clock()
            if kind == "plain":
                step()
            else:
                with npu_dumper.dumper(use_dump=True, dump_path=path, stats_only=kind == "stats",
                                       writer="thread" if kind == "full-thread" else "auto") as d:
                    step()
            times[kind].append(clock() - t0)
            if kind != "plain":
                if kind == "full" or not ops:
                    ops, size = d.num_ops, os.path.getsize(path)
                os.remove(path)                          # outside the timing (see bench_dump)
    med = {k: statistics.median(v[1:] if len(v) > 2 else v) for k, v in times.items()}
    return {"plain_ms": med["plain"] * 1e3, "ops": ops, "mb": size / 1e6,
            **{k: med[k] / med["plain"] for k in kinds[1:]}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*", default=list(sample_models.names()) + list(THIRD_PARTY))
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=("wall", "cpu", "cpu+child"), default="wall")
    ap.add_argument("--kinds", default=",".join(KINDS[1:]),
                    help="comma-separated kinds besides plain: full, full-thread, stats")
    args = ap.parse_args()
    kinds = ("plain",) + tuple(k for k in KINDS[1:] if k in args.kinds.split(","))
    clock = {"wall": time.perf_counter, "cpu": time.process_time, "cpu+child": _cpu_with_child}[args.clock]
    torch.set_num_threads(args.threads)
    print(f"{'model':12s} {'plain':>8s} {'ops':>5s} {'MB':>6s} {'full':>7s} {'thread':>7s} {'stats':>7s}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            r = measure(name, args.rounds, tmp, clock, kinds)
            if r is None:
                print(f"{name:12s} skipped (not importable here)", flush=True)
                continue
            cols = {k: f"{r[k]:6.1f}x" if k in r else f"{'-':>7s}" for k in ("full", "full-thread")}
            stats = f"{r['stats']:6.2f}x" if "stats" in r else f"{'-':>7s}"
            print(f"{name:12s} {r['plain_ms']:6.1f}ms {r['ops']:5d} {r['mb']:6.1f} "
                  f"{cols['full']} {cols['full-thread']} {stats}", flush=True)
    print("full: default writer (a child process); thread: writer='thread'; "
          f"ratios to the plain step, medians of {args.clock} time")


if __name__ == "__main__":
    main()
