"""Is every recorded value the one the op saw? An independent check by recomputation.

For each Hugging Face model of tests/_real_models.py named (random weights, tiny sizes, built
from their configs: no download): one training step is dumped (fp32, or under bf16 autocast
with --amp), then every recorded op is run again, on CPU and one thread, from its recorded
inputs laid out with their recorded strides (npu_dumper.replay.recorded.load_call), and its
results are compared with its recorded outputs bit for bit. The dump's reader only supplies
the inputs; the outputs come from the op itself, so an input recorded after the op wrote it,
a view whose base was read at another version or a value stored from the wrong storage shows
as an output that differs.

    python benchmarks/check_recorded_recompute.py [--amp] [--keep DIR] [MODEL ...]

Default models: gpt2 llama t5 deepseek_v2 swin whisper. Prints, per model, how many outputs
were equal, which differed (op, seqid, module, dtype, shape, largest difference), and how many
could not be checked (uninitialized outputs; ops that draw random numbers, whose seed is not
recorded; ops that cannot be rebuilt, with the reason). Exit 1 when any output differs.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

DEFAULT = ("gpt2", "llama", "t5", "deepseek_v2", "swin", "whisper")


def _bits(t):
    import torch
    t = t.detach().contiguous().clone().reshape(-1)
    return t.view(torch.uint8) if t.dtype.is_floating_point and t.numel() else t


def check(name: str, path: str, amp: bool) -> tuple[collections.Counter, list]:
    import torch
    from accucmp.compare.matching import tensor_leaves
    from dumpfile.read.reader import DumpFile
    from npu_dumper.replay.recorded import load_call, tensor_from_record
    from tests import _real_models as R

    spec, model, x, y = R.make(name)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if amp else contextlib.nullcontext()
    with ctx, torch.utils.dumper(use_dump=True, dump_path=path):
        R.step(model, x, y, spec.image, spec.forward)
    counts: collections.Counter = collections.Counter()
    differ: list = []
    f = DumpFile(path)
    try:
        for op in f.ops():
            call = load_call(op, keep_strides=True)
            if not call.ok:
                counts[f"not rebuilt: {call.why_not}"[:90]] += 1
                continue
            with torch.no_grad():
                out = call.call()
            got = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)]
            recorded = list(tensor_leaves(op.outputs()).values())
            if len(got) != len(recorded):
                counts["outputs not one to one"] += 1
                continue
            for o, rec in zip(got, recorded):
                if rec.attrs.get("uninitialized"):
                    counts["uninitialized"] += 1
                    continue
                want = tensor_from_record(rec)
                o = o.reshape(want.shape) if o.numel() == want.numel() else o
                if o.shape == want.shape and o.dtype == want.dtype and torch.equal(_bits(o), _bits(want)):
                    counts["equal"] += 1
                else:
                    counts["DIFFER"] += 1
                    d = (float((o.double() - want.double()).abs().max())
                         if o.shape == want.shape and o.is_floating_point() and o.numel() else None)
                    differ.append((op.op, op.seqid, op.module, str(o.dtype), tuple(o.shape), d))
    finally:
        f.close()
    return counts, differ


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=list(DEFAULT))
    ap.add_argument("--amp", action="store_true", help="the dumped step under bf16 autocast")
    ap.add_argument("--keep", help="folder for the dumps (default: a temporary one, removed)")
    a = ap.parse_args()
    import torch
    torch.set_num_threads(1)
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        where = a.keep or tmp
        os.makedirs(where, exist_ok=True)
        for name in a.models:
            counts, differ = check(name, os.path.join(where, f"{name}{'_amp' if a.amp else ''}.h5"), a.amp)
            print(f"{name:12s} {'bf16 autocast' if a.amp else 'fp32'}: "
                  + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
            for row in differ[:10]:
                print("    differs:", row)
            bad += len(differ)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
