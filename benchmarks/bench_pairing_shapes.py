"""Cost of checking op signatures while pairing independent runs (issue 33: pairs whose
shapes or phases cannot match are re-paired, accucmp/compare/matching.repair_incompatible).

Two independent dumps of a sample transformer (fp32 golden, bf16-autocast target, so the
streams differ a little and many pairs differ in signature by dtype only: shapes equal);
pairing (pairing.match_ops) and the whole compare timed with the signature pass and without
it (matching.repair_incompatible replaced by the identity), alternating, side by side in one
process: the ratios are what to read on a shared machine, not the seconds.

    python benchmarks/bench_pairing_shapes.py [--depth 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _dumps(folder: Path, depth: int) -> tuple[str, str]:
    import torch

    import npu_dumper  # noqa: F401
    from sample_models.transformer import TinyTransformer

    paths = []
    for name, autocast in (("golden", False), ("target", True)):
        torch.manual_seed(0)
        m = TinyTransformer(depth=depth)
        tok = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1))
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        p = folder / f"{name}.h5"
        with torch.utils.dumper(dump_path=str(p)):
            with ctx:
                y = m(tok)
            y.float().sum().backward()
        paths.append(str(p))
    return paths[1], paths[0]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    from accucmp.compare import matching, pairing
    from accucmp.compare.pipeline import _open, compare_dumps

    real = matching.repair_incompatible
    off = lambda pairs, signature, **kw: (pairs, 0)  # noqa: E731
    with tempfile.TemporaryDirectory() as d:
        target, golden = _dumps(Path(d), a.depth)
        tf, gf = _open(target, "target"), _open(golden, "golden")
        t_ops, g_ops = tf.ops(), gf.ops()
        calls = {"n": 0}
        counting = lambda op: (calls.__setitem__("n", calls["n"] + 1), pairing.op_signature(op))[1]  # noqa: E731
        matching.repair_incompatible(list(matching.pair_by_stream(t_ops, g_ops)), counting)
        print(f"ops: target {len(t_ops)}, golden {len(g_ops)}; signatures read: {calls['n']}")
        times = {"with": [], "without": []}
        whole = {"with": [], "without": []}
        for _ in range(a.repeats):
            for label, fn in (("with", real), ("without", off)):
                matching.repair_incompatible = fn
                t0 = time.perf_counter()
                pairing.match_ops(tf, gf, t_ops, g_ops)
                times[label].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                compare_dumps(target, golden, jobs=1)
                whole[label].append(time.perf_counter() - t0)
        matching.repair_incompatible = real
        tf.close(), gf.close()
    for name, t in (("pairing", times), ("whole compare", whole)):
        w, wo = statistics.median(t["with"]), statistics.median(t["without"])
        print(f"{name}: with signatures {w:.3f} s, without {wo:.3f} s, ratio {w / wo:.2f}x (median of {a.repeats})")


if __name__ == "__main__":
    sys.exit(main())
