"""What the load-replay's own-error measurement costs: bf16 load-replays of third-party models
(tests/_real_models.py) with own_error=True (default) and own_error=False, interleaved, median
of N runs each; prints the ratio.

    PYTHONPATH=. python benchmarks/bench_own_error.py [--models resnet,gpt2] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")

import torch  # noqa: E402

import npu_dumper  # noqa: E402,F401
from tests import _real_models as R  # noqa: E402


def replay_seconds(name: str, golden: str, out: str, own_error: bool) -> float:
    spec, model, x, y = R.make(name, torch.bfloat16)
    t0 = time.perf_counter()
    with torch.utils.dumper(use_load=True, load_file_path=golden, dump_path=out, own_error=own_error):
        R.step(model, x, y, spec.image)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="resnet,gpt2,llama")
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        for name in a.models.split(","):
            g = R.dump(name, f"{d}/{name}_g.h5")
            on, off = [], []
            for i in range(a.runs):
                on.append(replay_seconds(name, g, f"{d}/on{i}.h5", True))
                off.append(replay_seconds(name, g, f"{d}/off{i}.h5", False))
            m_on, m_off = statistics.median(on), statistics.median(off)
            print(f"{name}: bf16 load-replay {m_off * 1e3:.0f} ms without, {m_on * 1e3:.0f} ms with own error: "
                  f"{m_on / m_off:.2f}x", flush=True)


if __name__ == "__main__":
    main()
