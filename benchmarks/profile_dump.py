"""The dumper's cost in the model's own thread, per op, and where it goes (cProfile).

A dump's wall time is the model's thread (the dispatch mode: argument walk, captures,
module path, enqueue) plus whatever the writer cannot hide. This isolates the first: the
dispatch mode runs exactly as in a dump, but its writer is a sink that drops each job
(captures released as the real writer releases them), so the difference to the plain
step is the mode's own per-op cost (process CPU time: the sink adds no thread, and CPU time
is what other load on a shared machine disturbs least). For scale, the same steps under an
empty TorchDispatchMode (it only calls each op) give the floor any dispatch-mode tool pays.
Then the same steps run under cProfile.

    python benchmarks/profile_dump.py [--steps N] [--top K] [--no-profile] [--stats-writer] [MODEL ...]

Times are each kind's fastest step (process CPU time): other load on the machine only
ever adds time, so the minimum over interleaved steps moves least between runs.

`--stats-writer`: the statistics-only writer's own CPU time per step (its thread's
`time.thread_time` over each op it writes, and the part spent in `_batch`, the batched
reductions, and in the file's row appends), beside the model thread's CPU time during the
step, for steps under `torch.utils.dumper(stats_only=True)`. The writer shares the GIL
(and on a 2-core machine the CPU) with the model, so this is what a statistics dump adds
beyond the dispatch mode's own cost above.

On a machine shared with other work, times move by more than the differences being
measured; instruction counts do not. `--only KIND` (plain / empty / mode) runs two warm-up
steps of each kind and then N steps of one kind, untimed, to be counted by callgrind:

    valgrind --tool=callgrind --callgrind-out-file=/dev/null \
        python benchmarks/profile_dump.py --only mode --steps 6 shufflenet

(the difference of the `I refs` totals of `--only mode` and `--only plain`, divided by N,
is the mode's instructions per step; the start-up cancels out). `--only stats` runs steps
under a statistics-only dump, writer thread included: its difference to `--only plain` is
the whole statistics dump's instructions per step (callgrind runs the threads one at a
time, and counts no time spent waiting for the GIL).

`--torch-calls`: the statistics writer's calls into torch per step, counted (each holds the
GIL the model's thread needs, or releases it and waits to get it back: on a loaded machine
a count shows a change that CPU times, moving ±20%, hide).

Models: the sample models (bench_models.py) and `gpt2` (a tiny Hugging Face GPT-2 from its
config, when transformers is importable). One thread (torch.set_num_threads(1)).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_models import print_profile, warmed_steps  # noqa: E402
from npu_dumper.capture.snapshots import CaptureRegistry  # noqa: E402
from npu_dumper.capture.mode import DumpMode  # noqa: E402
from npu_dumper.capture.selection import OpFilter  # noqa: E402
from npu_dumper.capture.module_tracking import ModuleTracker  # noqa: E402
from npu_dumper.capture.policy import Policy  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402


class EmptyMode(TorchDispatchMode):
    """Calls every op, nothing else: the cost of being a Python dispatch mode at all."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


class SinkWriter:
    """Takes jobs like WriterThread.submit and drops them (captures discarded)."""

    failed = False

    def __init__(self, registry: CaptureRegistry):
        self.registry = registry
        self.jobs = 0

    def submit(self, job) -> None:
        self.jobs += 1
        for cap in job.captures:
            cap.done = True
            cap.tensor = None
            self.registry.discard(cap)


def mode_step(step, stats_only: bool = False) -> int:
    """One step under the dispatch mode with a sink writer; returns the ops recorded."""
    registry = CaptureRegistry()
    sink = SinkWriter(registry)
    with ModuleTracker() as tracker:
        mode = DumpMode(writer=sink, registry=registry, policies=[Policy()], op_filter=OpFilter(),
                        tracker=tracker)
        with mode:
            step()
    return sink.jobs


def stats_step(step) -> None:
    """One step under a statistics-only dump (both threads: the mode and the writer), its
    file removed after."""
    import tempfile
    import npu_dumper
    with tempfile.TemporaryDirectory() as tmp:
        with npu_dumper.dumper(use_dump=True, dump_path=os.path.join(tmp, "s.h5"), stats_only=True):
            step()


def stats_writer(models: list[str], steps: int) -> None:
    """Per step: the statistics writer thread's CPU time (all of it, its batches, its row
    appends) and the model thread's, medians over `steps` dumped steps."""
    import tempfile
    import npu_dumper
    from npu_dumper.sinks import stats as sink_stats
    from dumpfile.write import stats as write_stats
    acc: dict[str, float] = {}
    clock = time.thread_time

    def timed(cls, name):
        f = getattr(cls, name)

        def wrapper(*a, **k):
            t0 = clock()
            try:
                return f(*a, **k)
            finally:
                acc[name] = acc.get(name, 0.0) + clock() - t0
        setattr(cls, name, wrapper)
        return f
    originals = [(sink_stats.StatsWriterThread, n, timed(sink_stats.StatsWriterThread, n))
                 for n in ("_write_job", "_batch")]
    originals.append((write_stats.StatsDumpWriter, "add_op", timed(write_stats.StatsDumpWriter, "add_op")))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "s.h5")
            for name, step in warmed_steps(models):
                rows: list[tuple] = []
                for i in range(steps + 1):
                    acc.clear()
                    with npu_dumper.dumper(use_dump=True, dump_path=path, stats_only=True) as d:
                        t0 = clock()
                        step()
                        model = clock() - t0
                    os.remove(path)
                    if i:                                    # (the first: warm-up)
                        rows.append((model, acc.get("_write_job", 0.0), acc.get("_batch", 0.0),
                                     acc.get("add_op", 0.0), d._writer.num_batched))
                med = [sorted(c)[len(c) // 2] for c in zip(*rows)]
                print(f"{name}: CPU ms per step (medians of {steps}): model thread {med[0] * 1e3:.1f}, "
                      f"statistics writer {med[1] * 1e3:.1f} (batches {med[2] * 1e3:.1f}, row appends "
                      f"{med[3] * 1e3:.1f}); tensors batched {int(med[4])}", flush=True)
    finally:
        for cls, n, f in originals:
            setattr(cls, n, f)


def _is_torch_call(fn) -> bool:
    """A C function that is torch's: a tensor or storage method, a torch function."""
    owner = getattr(fn, "__self__", None)
    return (isinstance(owner, (torch.Tensor, torch.UntypedStorage))
            or type(owner).__name__ == "_VariableFunctionsClass"
            or (getattr(fn, "__module__", None) or "").startswith("torch"))


def writer_torch_calls(models: list[str], steps: int) -> None:
    """Per step: the statistics writer thread's calls into torch, counted (sys.setprofile
    in that thread only), the most frequent named. A count, not a time: it does not move
    with other load on the machine."""
    import collections
    from npu_dumper.sinks import stats as sink_stats
    counts: collections.Counter = collections.Counter()

    def count(frame, event, fn):
        if event == "c_call" and _is_torch_call(fn):
            counts[getattr(fn, "__qualname__", None) or str(fn)] += 1
    run = sink_stats.StatsWriterThread._run

    def counted_run(self):
        sys.setprofile(count)
        try:
            run(self)
        finally:
            sys.setprofile(None)
    sink_stats.StatsWriterThread._run = counted_run
    try:
        for name, step in warmed_steps(models):
            stats_step(step)                                   # (warm-up)
            counts.clear()
            for _ in range(steps):
                stats_step(step)
            top = ", ".join(f"{k} {v / steps:.0f}" for k, v in counts.most_common(8))
            print(f"{name}: statistics writer's calls into torch per step "
                  f"{sum(counts.values()) / steps:.0f} ({top})", flush=True)
    finally:
        sink_stats.StatsWriterThread._run = run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*", default=["transformer", "shufflenet"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--only", choices=("plain", "empty", "mode", "stats"),
                    help="untimed: run --steps steps of this kind only (for callgrind)")
    ap.add_argument("--stats-writer", action="store_true",
                    help="the statistics-only writer's CPU time per step instead")
    ap.add_argument("--torch-calls", action="store_true",
                    help="count the statistics-only writer's calls into torch per step instead")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.torch_calls:
        writer_torch_calls(args.models, args.steps)
        return
    if args.stats_writer:
        stats_writer(args.models, args.steps)
        return
    for name, step in warmed_steps(args.models):
        mode_step(step)                                   # warm-up: op tables
        if args.only:
            step()
            with EmptyMode():
                step()
            mode_step(step)
            stats_step(step)
            for _ in range(args.steps):
                if args.only == "plain":
                    step()
                elif args.only == "empty":
                    with EmptyMode():
                        step()
                elif args.only == "stats":
                    stats_step(step)
                else:
                    mode_step(step)
            continue
        plain, moded, empty = [], [], []
        ops = 0
        clock = time.process_time
        for _ in range(args.steps):                       # interleaved: drift hits all alike
            t0 = clock()
            step()
            plain.append(clock() - t0)
            t0 = clock()
            ops = mode_step(step)
            moded.append(clock() - t0)
            em = EmptyMode()
            t0 = clock()
            with em:
                step()
            empty.append(clock() - t0)
        p, m, e = (min(v) for v in (plain, moded, empty))
        print(f"{name}: {ops} ops recorded ({em.ops} dispatched), CPU ms per step: plain {p * 1e3:.2f}, "
              f"empty mode {e * 1e3:.2f}, dump mode + sink {m * 1e3:.2f}; per recorded op in the "
              f"model's thread {(m - p) / max(ops, 1) * 1e3:.4f} ms (empty mode: "
              f"{(e - p) / max(ops, 1) * 1e3:.4f} ms)", flush=True)
        if args.no_profile:
            continue
        print_profile(lambda: mode_step(step), args.steps, args.top)


if __name__ == "__main__":
    main()
