"""Load-replay at the size of a real model: time and peak memory against the plain steps.

Workload: Hugging Face GPT-2 small built from its config (12 layers, 768 wide, 12 heads,
vocab 50257: 124M parameters; random weights from a fixed seed, no download), one LM
training step (forward, loss, backward) on 2 x 128 tokens, torch.set_num_threads(1).
Four kinds of step, each in its own Python process so that each one's peak RSS is its own:

  plain-fp32   the step                              (the dump's 1x)
  dump         the step under a full dump            -> the golden file replayed below
  plain-bf16   the step under bf16 autocast          (the replay's 1x)
  replay       the bf16-autocast step load-replaying the golden file

Each process builds the model, runs one warm-up step of its kind's precision (plain), then
the measured step; it reports the step's wall time, its CPU time (all of the process's threads:
on a machine shared with other work it moves less than the wall time), its own peak RSS (VmHWM, which includes
the warm-up's), and for dump/replay the dump writer process's peak too. The kinds run one
after the other, `--rounds` times interleaved, and the ratios are printed side by side.

    python benchmarks/bench_replay_scale.py [--rounds N] [--layers L | --double]
           [--embd E --heads H --vocab V --batch B --seq S] [--tmp DIR] [--compare]
           [--profile] [--old-code DIR] [--replay-option NAME=VALUE ...] [--kinds K1,K2]
           [--probe-each]

--probe-each: every replay probes the golden's metadata in a child process (docs/FORMAT.md,
  "Reading untrusted files"); by default the run keeps its own record of probed files, so
  the first replay probes and later rounds skip it, as a user's next replay of a golden does
  (each round's line says which).
--double: 24 layers (how the costs grow with the recording: goal memory flat, time linear).
--embd/--heads/--vocab/--layers: a smaller model for quick runs (e.g. --layers 2 --embd 256
  --heads 4 --vocab 8192).
--compare: `accucmp compare -m replay.h5 -g golden.h5` of the last round: rows, failing rows.
--profile: the replay step also under cProfile (its top functions by cumulative and own time).
Every replay kind also prints its time breakdown: matching/reading/substituting, the own-error
  reference (and its costliest ops), the replayed ops, the rest of the dispatch mode, outside it.
--old-code DIR: one more kind, `replay-old`: the same replay with PYTHONPATH=DIR (e.g. an
  export of an older commit: `git archive <rev> | tar -x -C DIR`), for before/after in one run;
  with the dump kind, `dump-old` too (the dump with that code, into a file of its own).
--kinds K1,K2: only these kinds (e.g. `--kinds plain-fp32,dump`: the dump against its 1x).
  Two more kinds measure the dump's floors: `mode-floor`, the step under a dispatch mode
  that only calls each op (the floor of any dispatch-mode dumper in the model's thread);
  `write-floor`, the dump file's size written with plain pwrites into a new file, through
  the page cache and with O_DIRECT, and nothing else (after the dump kind: its file's size).
The dump kinds print their time breakdown too: the model thread's CPU in the op walk (the
  captures), copy-on-write, the hand-off to the writer (submit), the plain dump's own-error
  policy, the rest of the dispatch mode (the op itself) and outside it; its wall time split
  into running, waiting for a CPU (other load: schedstat) and blocked (the writer, the GIL);
  the CPU of the writer's threads (metadata, data) and of the writer process. The "+writer"
  column is the dumping process's CPU plus the writer process's.
--replay-option NAME=VALUE: a torch.utils.dumper option for the replay step (Python literal),
  e.g. max_load_bytes=67108864 or own_error=False.
BENCH_TRACE_PEAK=1 (environment): the replay step also lists the ops that raised its
  high-water mark (VmHWM before and after each dispatched op) and by how much.
"peak at" is where a 20 ms RSS sampler saw the highest RSS (and its anonymous / file-backed
parts: recorded tensors mapped from the load file are file-backed); "peak RSS" is VmHWM.

The files (the golden dump is ~2.5 GB at GPT-2 small) go into a temporary directory under
--tmp (default: the system's), removed at the end. On a machine shared with other work the
seconds move; the ratios of kinds measured in the same round move less. The load average
(`os.getloadavg`) is printed before and after.
"""

from __future__ import annotations

import argparse
import ast
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
KINDS = ("plain-fp32", "dump", "plain-bf16", "replay")


# ---- the child: one kind of step ------------------------------------------------------
def _vm_kb(field: str, pid: str = "self") -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _build(cfg: dict):
    import torch
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=cfg["vocab"], n_positions=max(1024, cfg["seq"]), n_embd=cfg["embd"],
                        n_layer=cfg["layers"], n_head=cfg["heads"], bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).train()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=gen)

    def step():
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)                 # the same dropout masks in every step
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        return float(out.loss)
    n_params = sum(p.numel() for p in model.parameters())
    return step, n_params


def _writer_peak_kb() -> int:
    """The pooled dump writer process's peak RSS (0 when there is none)."""
    try:
        from dumpfile.write import remote
        child = remote._pooled
        if child is not None and child.proc.poll() is None:
            return _vm_kb("VmHWM", str(child.proc.pid))
    except Exception:  # noqa: BLE001 - a measurement aid only
        pass
    return 0


def _time_breakdown() -> dict:
    """Where the replay step's time goes (CPU seconds of the model's thread, which load from
    other work moves less than wall time): in the replay policy's matching, reading and
    substituting (before_op), in the own-error reference (own_error.prepare + measure), in
    the replayed op itself (run_op less the reference), in the rest of the dispatch mode
    (the ops not replayed, recording, handing outputs to the writer) and outside it (the
    model's Python, autograd). Wrappers around the functions, installed in this child only."""
    from npu_dumper.capture.mode import DumpMode
    from npu_dumper.replay import load_replay, own_error
    from npu_dumper.capture.walk import ArgWalk
    acc = {"match+read+substitute": 0.0, "own-error reference": 0.0, "replayed op": 0.0, "dispatch": 0.0,
           "recording outputs": 0.0, "after_op": 0.0}
    depth = [0]

    def timed(owner, name, key, nested=False):
        fn = getattr(owner, name, None)
        if fn is None:
            return

        def wrapper(*args, **kwargs):
            if nested and depth[0]:
                return fn(*args, **kwargs)
            depth[0] += nested
            t = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                # (own-error measurements run on their worker thread: counted apart)
                k = key if threading.current_thread() is threading.main_thread() else key + " (worker thread)"
                acc[k] = acc.get(k, 0.0) + time.thread_time() - t
                depth[0] -= nested
        setattr(owner, name, wrapper)
    timed(load_replay.ReplayPolicy, "before_op", "match+read+substitute")
    timed(own_error, "prepare", "own-error reference")
    by_op = acc.setdefault("own-error by op", {})
    measure = own_error.measure

    def measure_by_op(func, prepared, out):       # (and which ops' references cost most)
        t = time.thread_time()
        try:
            return measure(func, prepared, out)
        finally:
            dt = time.thread_time() - t
            name = str(func).replace("aten.", "").replace(".default", "")
            by_op[name] = by_op.get(name, 0.0) + dt
    own_error.measure = measure_by_op
    timed(own_error, "measure", "own-error reference")
    timed(load_replay.ReplayPolicy, "run_op", "replayed op")
    timed(ArgWalk, "outputs", "recording outputs")
    timed(DumpMode, "_submit", "recording outputs")
    timed(load_replay.ReplayPolicy, "after_op", "after_op")
    timed(DumpMode, "__torch_dispatch__", "dispatch", nested=True)
    return acc


def _dump_breakdown() -> dict:
    """Where a full dump's time goes in the model's thread (CPU seconds of that thread, and
    the wall seconds it waited for the writer): the op walk making the captures (inputs,
    outputs: the copies of the arguments an op writes are made here), copy-on-write (the
    pending captures of a storage an op is about to write, copied first), the hand-off to
    the writer (`submit`: its back-pressure waits), the plain dump's own-error policy
    (PlainOwnError.run_op: in a float32 run only its check of the arguments' dtypes),
    the rest of the dispatch mode (the op itself, numbering, attribution) and outside it.
    Counts too: captures copied by copy-on-write and their bytes. Wrappers installed in
    this child only; the writer's threads and process are measured from /proc."""
    from npu_dumper.capture.mode import DumpMode
    from npu_dumper.capture.snapshots import CaptureRegistry, TensorCapture
    from npu_dumper.capture.walk import ArgWalk
    from npu_dumper.replay.own_error import PlainOwnError
    from npu_dumper.sinks.thread import WriterThread
    acc = {"walk inputs": 0.0, "walk outputs": 0.0, "copy-on-write": 0.0, "submit": 0.0,
           "submit wall": 0.0, "own-error policy": 0.0, "dispatch": 0.0,
           "cow captures": 0, "cow bytes": 0}
    depth = [0]

    def timed(owner, name, key, nested=False, wall=None):
        fn = getattr(owner, name)

        def wrapper(*args, **kwargs):
            if nested and depth[0]:
                return fn(*args, **kwargs)
            depth[0] += nested
            t, w = time.thread_time(), time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[key] += time.thread_time() - t
                if wall:
                    acc[wall] += time.perf_counter() - w
                depth[0] -= nested
        setattr(owner, name, wrapper)
    timed(ArgWalk, "inputs", "walk inputs")
    timed(ArgWalk, "outputs", "walk outputs")
    timed(CaptureRegistry, "before_write", "copy-on-write")
    timed(WriterThread, "submit", "submit", wall="submit wall")
    timed(PlainOwnError, "run_op", "own-error policy")
    timed(DumpMode, "__torch_dispatch__", "dispatch", nested=True)
    materialize = TensorCapture.materialize

    def counted(cap):
        copied = not cap.done and cap.tensor is not None
        materialize(cap)
        if copied:
            acc["cow captures"] += 1
            acc["cow bytes"] += cap.nbytes
    TensorCapture.materialize = counted
    return acc


def _proc_cpu(pid: int) -> float:
    """CPU seconds so far of process `pid` (all its threads); 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _run_delay() -> float:
    """Seconds this thread has waited on a run queue for a CPU (schedstat; 0 if unknown):
    of a thread's wall time neither running nor blocked (a GIL, a lock, a disk) — the
    share other load on the machine took."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def _faults() -> tuple[int, int, int, int]:
    """Page faults so far: this thread's minor and major ones, the process's minor and major
    ones (/proc/thread-self/stat, getrusage). A fresh page of the heap, a page of a mapped
    recorded tensor touched first, a page the C heap gave back and wants again: each is a
    fault, which on a virtual machine costs the faulting thread microseconds of CPU."""
    import resource
    try:
        with open("/proc/thread-self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        mine = int(fields[7]), int(fields[9])
    except (OSError, IndexError, ValueError):
        mine = 0, 0
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return mine[0], mine[1], ru.ru_minflt, ru.ru_majflt


def _thread_cpu() -> dict:
    """CPU seconds so far of each of this process's threads, by native id: (name, seconds)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[int(tid)] = (names.get(int(tid), "(not a Python thread)"),
                             (int(fields[11]) + int(fields[12])) / tick)
        except (OSError, IndexError, ValueError):
            pass
    return out


def _print_breakdown(kind: str, b: dict) -> None:
    step = b["step"]
    op = b["replayed op"] - b["own-error reference"]
    parts = {"match+read+substitute": b["match+read+substitute"],
             "own-error reference": b["own-error reference"], "replayed op (run_op less the reference)": op,
             "recording outputs (walk, hand-off to the writer)": b.get("recording outputs", 0.0),
             "after_op (departures)": b.get("after_op", 0.0),
             "rest of dispatch (ops not measured: casts, fp32 ops; the mode's bookkeeping)":
                 b["dispatch"] - b["match+read+substitute"] - b["replayed op"]
                 - b.get("recording outputs", 0.0) - b.get("after_op", 0.0),
             "outside dispatch (model Python, autograd)": step - b["dispatch"]}
    print(f"  {kind} time breakdown (CPU of the model's thread in the step, {step:.2f} s): " +
          "; ".join(f"{k} {v:.2f} s ({100 * v / step:.0f}%)" for k, v in parts.items()))
    if b.get("other threads") is not None:
        print(f"  {kind} CPU of the process's other threads in the step: " +
              ", ".join(f"{k} {v:.2f} s" for k, v in b["other threads"].items()) +
              f"; the process's CPU in the block's entry {b['entry']:.2f} s (reading the recording's "
              f"index) and exit {b['exit']:.2f} s (the writer finishing, departures)")
    if b.get("step running") is not None:
        print(f"  {kind} model thread's wall in the step {b['step wall']:.2f} s: running "
              f"{b['step running']:.2f} s, waiting for a CPU {b['step run queue']:.2f} s, blocked "
              f"{b['step wall'] - b['step running'] - b['step run queue']:.2f} s (the writer's "
              "back-pressure, the own-error worker, the GIL, reads from the device)")
    if b.get("own-error reference (worker thread)"):
        print(f"  {kind} own-error measurements on their worker thread (overlapping the step): "
              f"{b['own-error reference (worker thread)']:.2f} s CPU")
    top = sorted(b.get("own-error by op", {}).items(), key=lambda kv: -kv[1])[:8]
    if top:
        print(f"  {kind} own-error measure by op: " + ", ".join(f"{k} {v:.2f} s" for k, v in top))


def _print_dump_breakdown(kind: str, b: dict) -> None:
    step = b["step"]
    walk = b["walk inputs"] + b["walk outputs"]
    parts = {"capture/walk": walk, "copy-on-write": b["copy-on-write"],
             "submit (waits for the writer)": b["submit"], "own-error policy": b["own-error policy"],
             "rest of dispatch (the op itself, numbering, attribution)":
                 b["dispatch"] - walk - b["copy-on-write"] - b["submit"] - b["own-error policy"],
             "outside dispatch (model Python, autograd)": step - b["dispatch"]}
    print(f"  {kind} time breakdown (CPU of the model's thread in the block, {step:.2f} s): " +
          "; ".join(f"{k} {v:.2f} s ({100 * v / step:.0f}%)" for k, v in parts.items()))
    blocked = b["step wall"] + b["entry wall"] + b["exit wall"] - step - b["run queue"]
    print(f"  {kind} model thread's wall in the block: running {step:.2f} s, waiting for a CPU (other load) "
          f"{b['run queue']:.2f} s, blocked {blocked:.2f} s (GIL, the writer at submit and exit, "
          "page faults)")
    print(f"  {kind} model thread waited {b['submit wall']:.2f} s (wall) in submit; copy-on-write "
          f"copied {b['cow captures']} captures, {b['cow bytes'] / 1e6:.0f} MB; wall: entry "
          f"{b['entry wall']:.2f} s, step {b['step wall']:.2f} s, exit (the writer finishing) "
          f"{b['exit wall']:.2f} s")
    others = ", ".join(f"{k} {v:.2f} s" for k, v in b.get("other threads", {}).items())
    wp = b.get("writer process")
    print(f"  {kind} CPU of the other threads: {others}; of the writer process "
          + (f"{wp:.2f} s (+ {b['writer process start']:.2f} s start-up and open)" if wp is not None else "-")
          + f"; the process's CPU in the block's entry {b['entry']:.2f} s, exit {b['exit']:.2f} s")


def _write_floor(nbytes: int, tmp: str) -> dict:
    """The floor of writing a dump's bytes on this machine: `nbytes` (the dump's file size)
    written into a new file with os.pwrite in 8 MiB pieces, through the page cache and
    with O_DIRECT (from an aligned buffer), each timed in wall and process CPU; nothing
    else (no HDF5, no model). The files are removed outside the timing."""
    import mmap
    chunk = 8 << 20
    buf = mmap.mmap(-1, chunk)              # (page-aligned, as O_DIRECT needs)
    buf.write(os.urandom(1 << 20) * (chunk >> 20))
    res = {}
    for label, flags in (("buffered", 0), ("direct", getattr(os, "O_DIRECT", 0))):
        path = os.path.join(tmp, f"write-floor-{label}.bin")
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags)
        except OSError:
            continue                         # (no O_DIRECT on this file system)
        off = 0
        while off < nbytes:
            off += os.pwrite(fd, buf, off)
        os.close(fd)
        res[label] = (time.perf_counter() - t0, time.process_time() - c0)
        os.remove(path)
    wall, cpu = res["buffered"]
    summary = f"{nbytes / 1e9:.2f} GB in 8 MiB pwrites: " + "; ".join(
        f"{k} {w:.2f} s wall, {c:.2f} s CPU" for k, (w, c) in res.items())
    return {"kind": "write-floor", "wall_s": wall, "cpu_s": cpu, "peak_kb": _vm_kb("VmHWM"),
            "rss_before_kb": 0, "peak_at_s": 0.0, "peak_anon_kb": 0, "peak_file_kb": 0,
            "writer_peak_kb": 0, "loss": 0.0, "params": 0, "summary": summary}


def child(kind: str, cfg: dict, golden: str, out: str, options: dict, profile: bool) -> dict:
    import contextlib
    import io
    if kind == "write-floor":
        return _write_floor(os.path.getsize(golden) if os.path.exists(golden) else int(2.96e9),
                            os.path.dirname(out))
    import torch
    import npu_dumper
    torch.set_num_threads(1)
    step, n_params = _build(cfg)
    bf16 = kind in ("plain-bf16", "replay", "replay-old")
    amp = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    with amp():
        step()                                       # warm-up, plain
    rss_before = _vm_kb("VmRSS")
    peak_sampled = [0, 0.0, 0, 0]          # RSS, when, its anonymous and file-backed parts
    stop = threading.Event()

    seen_threads: dict = {}                # native id -> (name, CPU s), last seen (threads that end)

    def sample():                                    # when in the step the peak falls
        t0 = time.perf_counter()
        n = 0
        while not stop.wait(0.02):
            n += 1
            if n % 10 == 0:
                seen_threads.update(_thread_cpu())
            r = _vm_kb("VmRSS")
            if r > peak_sampled[0]:
                peak_sampled[:] = [r, time.perf_counter() - t0, _vm_kb("RssAnon"), _vm_kb("RssFile")]
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    summary = ""
    writer_kb = 0
    prof = None
    breakdown = None
    step_wall = step_queue = step_running = None      # (the replay kinds measure them)
    t0 = time.perf_counter()
    c0 = time.process_time()
    m0 = time.thread_time()
    faults0 = _faults()
    if kind.startswith("plain"):
        with amp():
            loss = step()
    elif kind == "mode-floor":
        from torch.utils._python_dispatch import TorchDispatchMode

        class EmptyMode(TorchDispatchMode):      # the floor of any dispatch-mode dumper
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                return func(*args, **(kwargs or {}))
        with EmptyMode():
            loss = step()
    elif kind == "dump":
        breakdown = _dump_breakdown()
        w0 = time.perf_counter()
        p0 = time.process_time()
        threads0 = _thread_cpu()
        queued0 = _run_delay()
        with npu_dumper.dumper(use_dump=True, dump_path=golden) as d:
            p1, w1 = time.process_time(), time.perf_counter()
            child_proc = getattr(getattr(d._writer.writer, "_child", None), "proc", None)
            wpid = child_proc.pid if child_proc is not None else 0
            wcpu0 = _proc_cpu(wpid) if wpid else 0.0       # (its start-up and the file's open)
            loss = step()
            p2, w2 = time.process_time(), time.perf_counter()
            named = _thread_cpu()           # (the pooled threads are renamed idle at exit)
        p3, w3 = time.process_time(), time.perf_counter()
        threads1 = {tid: (named.get(tid, (name,))[0], sec) for tid, (name, sec) in _thread_cpu().items()}
        queued = _run_delay() - queued0
        writer_kb = _writer_peak_kb()          # (back in the pool after the block)
        summary = f"{d.num_ops} ops"
        direct = getattr(getattr(d._writer.writer, "_bytes", None), "direct_bytes", None)
        if direct is not None:
            summary += f", {direct / 1e9:.2f} GB of tensor bytes written with O_DIRECT"
        breakdown.update({"writer process": _proc_cpu(wpid) - wcpu0 if wpid else None,
                          "writer process start": wcpu0, "entry wall": w1 - w0, "run queue": queued,
                          "step wall": w2 - w1, "exit wall": w3 - w2})
    else:
        buf = io.StringIO()
        rises = []
        if os.environ.get("BENCH_TRACE_PEAK"):
            # which ops raise the high-water mark (VmHWM before and after each replayed op)
            from npu_dumper.capture.mode import DumpMode
            dispatch = DumpMode.__torch_dispatch__

            def traced(self, func, types, args=(), kwargs=None):
                before = _vm_kb("VmHWM")
                out = dispatch(self, func, types, args, kwargs)
                after = _vm_kb("VmHWM")
                if after > before:
                    rises.append((after - before, after, str(func), 0))
                return out
            DumpMode.__torch_dispatch__ = traced
        breakdown = _time_breakdown()
        if profile:
            import cProfile
            prof = cProfile.Profile()
            prof.enable()
        with contextlib.redirect_stdout(buf), amp():
            p0 = time.process_time()
            with npu_dumper.dumper(use_load=True, load_file_path=golden, dump_path=out, **options) as d:
                p1 = time.process_time()
                threads0 = _thread_cpu()
                w1, q1, c1 = time.perf_counter(), _run_delay(), time.thread_time()
                loss = step()
                step_wall, step_queue = time.perf_counter() - w1, _run_delay() - q1
                step_running = time.thread_time() - c1
                threads1 = _thread_cpu()
                p2 = time.process_time()
                if rises:
                    rises.append((0, _vm_kb("VmHWM"), "end of step", 0))
            p3 = time.process_time()
        if rises:
            rises.append((0, _vm_kb("VmHWM"), "after exit", 0))
        writer_kb = _writer_peak_kb()
        summary = buf.getvalue().strip()
        if rises:
            ends = rises[-2:]
            rises = sorted(rises[:-2], reverse=True)
            summary += " [HWM rises: " + ", ".join(f"{n}: +{r // 1024}M to {a // 1024}M"
                                                    for r, a, n, q in rises[:8] + ends) + "]"
        measurer = getattr(d.policies[0], "_measurer", None)
        if measurer is not None and hasattr(measurer, "waited_s"):
            summary += (f" [the model's thread waited {measurer.waited_s:.2f} s for own-error measurements"
                        f" ({measurer.waits_for_writes} writes waited)]")
        tensors = getattr(d.policies[0], "_tensors", None)
        if tensors is not None and hasattr(tensors, "peak_held_bytes"):
            summary += f" [recorded tensors held: peak {tensors.peak_held_bytes / 2**20:.0f} MiB]"
        if prof is not None:
            prof.disable()
    faults = [b - a for a, b in zip(faults0, _faults())]
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    main_cpu = time.thread_time() - m0
    stop.set()
    sampler.join()
    res = {"kind": kind, "wall_s": wall, "cpu_s": cpu, "peak_kb": _vm_kb("VmHWM"),
           "rss_before_kb": rss_before, "peak_at_s": peak_sampled[1],
           "peak_anon_kb": peak_sampled[2], "peak_file_kb": peak_sampled[3], "writer_peak_kb": writer_kb,
           "loss": loss, "params": n_params, "summary": summary, "faults": faults}
    for path in (golden if kind == "dump" else out,):
        if kind != "plain-fp32" and kind != "plain-bf16" and os.path.exists(path):
            res["file_bytes"] = os.path.getsize(path)
    wp = (breakdown or {}).get("writer process")
    res["cpu_all_s"] = cpu + (wp + breakdown["writer process start"] if wp is not None else 0.0)
    if breakdown is not None:
        others: dict[str, float] = {}
        me = threading.get_native_id()
        for tid, (name, sec) in {**seen_threads, **threads1}.items():
            if tid != me:
                others[name] = others.get(name, 0.0) + sec - threads0.get(tid, (name, 0.0))[1]
        res["breakdown"] = dict(breakdown, step=main_cpu, entry=p1 - p0, exit=p3 - p2,
                                **{"other threads": {k: v for k, v in others.items() if v >= 0.01}})
        if step_wall is not None:
            res["breakdown"].update({"step wall": step_wall, "step run queue": step_queue,
                                     "step running": step_running})
    if prof is not None:
        import pstats
        s = io.StringIO()
        st = pstats.Stats(prof, stream=s)
        st.sort_stats("cumulative").print_stats(30)
        st.sort_stats("tottime").print_stats(25)
        res["profile"] = s.getvalue()
    return res


# ---- the parent ---------------------------------------------------------------------
def _evict(path: str) -> None:
    """Drop `path`'s pages from the page cache, so that every replay kind starts as a replay
    of a golden dumped earlier or elsewhere does (the dump writes its large tensors with
    O_DIRECT and leaves them uncached; the replay that ran first would otherwise leave them
    cached for the next kind of the round)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except (OSError, AttributeError):
        pass
    finally:
        os.close(fd)


def _run_child(kind: str, cfg: dict, tmp: str, options: dict, profile: bool, pythonpath: str,
               golden: str, probe_record: str = "") -> dict:
    out = os.path.join(tmp, f"{kind}.h5")
    # (the file a dump kind writes goes before it starts: unlinking the last round's
    # gigabytes is the file system's work, not the dump's; PERFORMANCE.md, "How to measure")
    for path in (out, golden) if kind.startswith("dump") else (out,):
        if os.path.exists(path):
            os.remove(path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([pythonpath, HERE]), HF_HUB_OFFLINE="1",
               OMP_NUM_THREADS="1", ACCUCMP_PROBE_RECORD=probe_record)
    spec = json.dumps({"kind": kind.removesuffix("-old"), "cfg": cfg, "golden": golden,
                       "out": out, "options": options, "profile": profile})
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", spec],
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{kind}: child failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    res["kind"] = kind
    return res


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return -1


def _compare(tmp: str, kind: str, golden: str) -> str:
    out = os.path.join(tmp, f"{kind}_compare")
    os.makedirs(out, exist_ok=True)
    code = "import sys; from accucmp.cli.main import main; sys.argv[0] = 'accucmp'; sys.exit(main())"
    proc = subprocess.run([sys.executable, "-c", code, "compare", "-m", os.path.join(tmp, f"{kind}.h5"),
                           "-g", golden, "-o", out],
                          env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True)
    tail = (proc.stdout + proc.stderr).strip().splitlines()
    return f"exit {proc.returncode}: " + (tail[-1] if tail else "")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--golden-cached", action="store_true",
                    help="leave the golden file in the page cache between kinds (default: dropped "
                         "before each replay kind, which then reads it from the device)")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--double", action="store_true", help="twice the layers")
    ap.add_argument("--embd", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--tmp", default=None)
    ap.add_argument("--compare", action="store_true")
    ap.add_argument("--probe-each", action="store_true",
                    help="every replay probes the golden's metadata in a child (no record of "
                         "probed files: each replay as a user's first of that golden)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--old-code", default=None)
    ap.add_argument("--replay-option", action="append", default=[])
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--golden", default=None, help="keep the golden dump here; an existing one is "
                    "replayed as it is (the dump kind is then not run unless --kinds names it)")
    a = ap.parse_args()
    if a.child:
        spec = json.loads(a.child)
        res = child(spec["kind"], spec["cfg"], spec["golden"], spec["out"], spec["options"], spec["profile"])
        print(json.dumps(res))
        return
    cfg = {"layers": a.layers * (2 if a.double else 1), "embd": a.embd, "heads": a.heads,
           "vocab": a.vocab, "batch": a.batch, "seq": a.seq}
    options = {}
    for o in a.replay_option:
        k, _, v = o.partition("=")
        options[k] = ast.literal_eval(v)
    kinds = [k for k in a.kinds.split(",") if k]
    if a.old_code:
        if "dump" in kinds:
            kinds.insert(kinds.index("dump") + 1, "dump-old")
        if "replay" in kinds or "dump" not in kinds:
            kinds.insert(kinds.index("replay") + 1 if "replay" in kinds else len(kinds), "replay-old")
    if a.golden and os.path.exists(a.golden) and a.kinds == ",".join(KINDS):
        kinds.remove("dump")
    if "dump" not in kinds and any(k.startswith("replay") for k in kinds) and not (
            a.golden and os.path.exists(a.golden)):
        raise SystemExit("the replay kinds need the dump kind (it writes the golden file) or --golden")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    tmp = tempfile.mkdtemp(prefix="bench_replay_scale_", dir=a.tmp)
    golden = os.path.abspath(a.golden) if a.golden else os.path.join(tmp, "golden.h5")
    # the record of probed files (dumpfile/read/probed_files.py): one of this run's own, so
    # the first replay of the golden probes it and later rounds skip the probe as a user's
    # next replay of it would; --probe-each: none, every replay probes
    probe_record = "" if a.probe_each else os.path.join(tmp, "probed-files")
    try:
        for r in range(a.rounds):
            for kind in kinds:
                path = a.old_code if kind.endswith("-old") else ROOT
                if kind.startswith("replay") and not a.golden_cached:
                    _evict(golden)          # each replay reads the golden from the device
                before = _size(probe_record)
                res = _run_child(kind, cfg, tmp, options if kind.startswith("replay") else {}, a.profile, path,
                                 os.path.join(tmp, "dump-old.h5") if kind == "dump-old" else golden,
                                 probe_record)
                runs[kind].append(res)
                probed = "" if not kind.startswith("replay") else (
                    "  (golden probed)" if a.probe_each or _size(probe_record) != before else
                    "  (golden's probe recorded by an earlier round: skipped)")
                print(f"  round {r + 1} {kind:11s} {res['wall_s']:7.2f} s  {res['peak_kb'] / 1024:7.0f} MB{probed}",
                      flush=True)
            if a.compare:
                for kind in kinds:
                    if kind.startswith("replay"):
                        print(f"  compare {kind}: {_compare(tmp, kind, golden)}")
                if "replay" in kinds and "replay-old" in kinds:
                    from check_replay_verdicts import diff_rows
                    rows = {}
                    for kind in ("replay", "replay-old"):
                        d = os.path.join(tmp, f"{kind}_compare")
                        with open(os.path.join(d, next(f for f in os.listdir(d) if f.endswith(".csv"))),
                                  newline="") as f:
                            rows[kind] = list(csv.DictReader(f))
                    problems, cols = diff_rows(rows["replay-old"], rows["replay"])
                    print(f"  replay vs replay-old CSV: {len(rows['replay'])} rows, "
                          f"{'SAME rows and results' if not problems else 'DIFFER: ' + '; '.join(problems[:5])}; "
                          "other columns that differ: "
                          + (", ".join(f"{c} (max rel {v:.1e})" for c, v in sorted(cols.items())) or "none"))
            for kind in kinds:                     # each round's replay files go; the golden stays
                if kind.startswith("replay") or kind == "dump-old":
                    p = os.path.join(tmp, f"{kind}.h5")
                    if os.path.exists(p):
                        os.remove(p)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    first = runs[kinds[0]][0]
    print(f"\nGPT-2 from its config: {cfg['layers']} layers, {cfg['embd']} wide, {cfg['heads']} heads, "
          f"vocab {cfg['vocab']} ({first['params'] / 1e6:.0f}M parameters), batch {cfg['batch']} x "
          f"{cfg['seq']} tokens, one training step, 1 thread; median of {a.rounds} round(s)")
    base = {"plain-fp32": "plain-fp32", "dump": "plain-fp32", "dump-old": "plain-fp32",
            "mode-floor": "plain-fp32", "write-floor": "plain-fp32", "plain-bf16": "plain-bf16",
            "replay": "plain-bf16", "replay-old": "plain-bf16"}
    kinds = [k for k in kinds if runs[k]]
    print(f"  {'kind':11s} {'time':>8s} {'vs plain':>9s} {'CPU':>8s} {'vs plain':>9s} "
          f"{'+writer':>8s} {'vs plain':>9s} "
          f"{'peak RSS':>9s} {'vs plain':>9s} "
          f"{'writer RSS':>10s} {'file':>9s}  peak at")
    for kind in kinds:
        rs = runs[kind]
        ref = runs.get(base[kind])
        wall = statistics.median(x["wall_s"] for x in rs)
        peak = statistics.median(x["peak_kb"] for x in rs) / 1024
        cpu = statistics.median(x["cpu_s"] for x in rs)
        cpu_all = statistics.median(x.get("cpu_all_s", x["cpu_s"]) for x in rs)
        if ref:
            tr = statistics.median(x["wall_s"] / y["wall_s"] for x, y in zip(rs, ref))
            cr = statistics.median(x["cpu_s"] / y["cpu_s"] for x, y in zip(rs, ref))
            ar = statistics.median(x.get("cpu_all_s", x["cpu_s"]) / y["cpu_s"] for x, y in zip(rs, ref))
            mr = statistics.median(x["peak_kb"] / y["peak_kb"] for x, y in zip(rs, ref))
        else:
            tr = cr = mr = ar = float("nan")
        wk = rs[-1].get("writer_peak_kb", 0) / 1024
        fb = rs[-1].get("file_bytes", 0) / 1e9
        print(f"  {kind:11s} {wall:7.2f}s {tr:8.2f}x {cpu:7.2f}s {cr:8.2f}x {cpu_all:7.2f}s {ar:8.2f}x "
              f"{peak:8.0f}M {mr:8.2f}x "
              f"{(f'{wk:.0f}M' if wk else '-'):>10s} {(f'{fb:.2f}GB' if fb else '-'):>9s}  "
              f"{rs[-1]['peak_at_s']:.1f}s of the step (anon {rs[-1]['peak_anon_kb'] / 1024:.0f}M, "
              f"file {rs[-1]['peak_file_kb'] / 1024:.0f}M)")
    for kind in kinds:
        f = runs[kind][-1].get("faults")
        if f:
            print(f"  {kind} page faults in the measured step (its block included): the model's thread {f[0]:,} minor, "
                  f"{f[1]:,} major; the process {f[2]:,} minor, {f[3]:,} major")
        if runs[kind][-1].get("summary"):
            print(f"  {kind}: {runs[kind][-1]['summary']}")
        if runs[kind][-1].get("breakdown"):
            (_print_dump_breakdown if kind.startswith("dump") else _print_breakdown)(
                kind, runs[kind][-1]["breakdown"])
        if runs[kind][-1].get("profile"):
            print(f"--- cProfile of {kind} ---\n{runs[kind][-1]['profile']}")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
