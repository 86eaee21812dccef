"""Peak resident memory of `accucmp compare` against tensor size (issue 16: memory
bounded by the chunk, goal: flat).

    python benchmarks/bench_compare_memory.py [--min-log2 20] [--max-log2 26]

For n = 2^k elements, k in [min, max]: two one-op dumps holding a (1, n) float32 output,
compared in a child process (`python -m accucmp.cli.main compare -j 1 -q`); prints the child's
peak RSS (ru_maxrss of the waited child), the tensor's size and their ratio, with the
smallest size's peak as the baseline the others are compared to side by side.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from dumpfile import DumpWriter, TensorMeta  # noqa: E402


def write(path: str, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, n), dtype=np.float32)
    with DumpWriter(path) as w:
        g = w.begin_op("aten.relu.default", 1)
        w.write_tensor(g["output"], "result", x, TensorMeta("float32", (1, n), (n, 1)))
        w.end_op()


def peak_rss_mb(args: list[str]) -> float:
    """Peak RSS of one child (wait4's rusage: that child only)."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.Popen([sys.executable, "-m", "accucmp.cli.main", *args], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(p.pid, 0)
    err = p.stderr.read().decode(errors="replace")
    p.stderr.close()
    code = os.waitstatus_to_exitcode(status)
    if code not in (0, 1):
        raise SystemExit(f"compare failed ({code}): {err}")
    return usage.ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--min-log2", type=int, default=20)
    ap.add_argument("--max-log2", type=int, default=26)
    a = ap.parse_args()
    base = None
    print(f"{'elements':>10} {'tensor MB':>10} {'peak RSS MB':>12} {'RSS/tensor':>11} {'vs 2^min':>9}")
    with tempfile.TemporaryDirectory() as d:
        for k in range(a.min_log2, a.max_log2 + 1):
            n = 1 << k
            t, g = os.path.join(d, f"t{k}.h5"), os.path.join(d, f"g{k}.h5")
            # written by a child: this process must stay small, as a child's ru_maxrss
            # counts the image it was forked from (a 2^26 tensor written here read as
            # 321 MB for a compare that peaks at 165 MB)
            subprocess.run([sys.executable, "-c", f"import sys; sys.path[:0] = [{ROOT!r}, "
                            f"{os.path.dirname(os.path.abspath(__file__))!r}]; "
                            f"from bench_compare_memory import write; write({t!r}, {n}, 1); "
                            f"write({g!r}, {n}, 2)"], check=True)
            rss = peak_rss_mb(["compare", "-m", t, "-g", g, "-o", os.path.join(d, "out"), "-q", "-j", "1"])
            base = base or rss
            mb = n * 4 / 2**20
            print(f"{'2^%d' % k:>10} {mb:>10.0f} {rss:>12.0f} {rss / mb:>11.2f} {rss / base:>9.2f}")
            os.remove(t)
            os.remove(g)


if __name__ == "__main__":
    main()
