"""The full dump's writer side per op: the dump writer process's work (remote_child),
replayed in this process from the records a real dump sent it, beside the HDF5 floor.

A full dump's end-to-end time on models of many small ops is bounded by the writer
process making each op's HDF5 objects. This records the messages the model's process
sends the writer during one dumped step (`op` records and `release`s), then replays them
`--steps` times into a fresh file through the child's own code (remote_child._Server:
the same DumpWriter calls), timed (process CPU time, the fastest replay), then once under
cProfile. Compare its time with benchmarks/bench_hdf5_floor.py's floor (the same objects
made by direct library calls): the difference is the writer's Python per op.

    python benchmarks/profile_writer.py [--steps N] [--top K] [--no-profile] [MODEL ...]

On a machine shared with other work, CPU times move by more than the differences being
measured; instruction counts do not. `--save FILE` stores one model's messages;
`--replay FILE` replays them `--steps` times, untimed, without importing torch, to be
counted by callgrind:

    python benchmarks/profile_writer.py --save /tmp/shufflenet.msgs shufflenet
    valgrind --tool=callgrind --callgrind-out-file=/dev/null \
        python benchmarks/profile_writer.py --replay /tmp/shufflenet.msgs --steps 3

(the difference of the `I refs` totals of --steps 3 and --steps 1, halved, is the
writer's instructions per step; the start-up cancels out).
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dumpfile.write.remote_child import _Server  # noqa: E402


def record_messages(step, path: str) -> list[bytes]:
    """The pickled messages one dumped step sends the writer process (as the child gets them)."""
    import npu_dumper
    from dumpfile.write import remote
    sent: list[bytes] = []
    orig = remote.RemoteDumpWriter.send

    def send(self, msg):
        sent.append(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
        return orig(self, msg)
    remote.RemoteDumpWriter.send = send
    try:
        with npu_dumper.dumper(use_dump=True, dump_path=path, writer="process"):
            step()
    finally:
        remote.RemoteDumpWriter.send = orig
    return sent


def replay(messages: list[bytes], path: str, root_attrs: dict) -> tuple[float, int]:
    """The child's work for these messages into a new file (unpickling included, the
    byte writes excluded: the model's process makes those). Returns (CPU s, ops)."""
    srv = _Server(None)
    if os.path.exists(path):
        os.remove(path)     # (outside the timing, as bench_models.py removes its files)
    t0 = time.process_time()
    srv._open(path, "dump", root_attrs, 1.0)
    ops = 0
    for raw in messages:
        msg = pickle.loads(raw)
        if msg[0] == "op":
            reply = srv._op(msg[1])
            if reply[0] != "ok":
                raise SystemExit(f"replay failed: {reply}")
            ops += 1
        elif msg[0] == "release":
            srv.w.release_ops(msg[1])
            srv._maybe_flush()
    srv._close(True, {})
    return time.process_time() - t0, ops


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*", default=["shufflenet", "gpt2"])
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--save", metavar="FILE", help="store the first model's messages, then stop")
    ap.add_argument("--replay", metavar="FILE", help="replay stored messages, untimed (callgrind)")
    args = ap.parse_args()
    if args.replay:
        with open(args.replay, "rb") as fh:
            msgs = pickle.load(fh)
        with tempfile.TemporaryDirectory() as tmp:
            for _ in range(args.steps):
                replay(msgs, os.path.join(tmp, "dst.h5"), {})
        return
    import torch
    from bench_models import print_profile, warmed_steps
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        for name, step in warmed_steps(args.models):
            src = os.path.join(tmp, "src.h5")
            record_messages(step, src)                       # warm-up (op tables, the child)
            msgs = record_messages(step, src)
            if args.save:
                with open(args.save, "wb") as fh:
                    pickle.dump(msgs, fh)
                return
            nbytes = sum(map(len, msgs))
            dst = os.path.join(tmp, "dst.h5")
            plain, times = [], []
            ops = 0
            for _ in range(args.steps):
                t0 = time.process_time()
                step()
                plain.append(time.process_time() - t0)
                t, ops = replay(msgs, dst, {})
                times.append(t)
            p, w = min(plain), min(times)
            print(f"{name}: {ops} ops, {len(msgs)} messages ({nbytes / 1e3:.0f} kB pickled); CPU ms "
                  f"per step: plain {p * 1e3:.1f}, writer process {w * 1e3:.1f} ({w / p:.2f}x plain, "
                  f"{w / max(ops, 1) * 1e3:.3f} ms per op)", flush=True)
            if args.no_profile:
                continue
            print_profile(lambda: replay(msgs, dst, {}), args.steps, args.top)


if __name__ == "__main__":
    main()
