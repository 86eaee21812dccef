"""The table in docs/COMPARE.md: third-party models x dtype x scenario.

    PYTHONPATH=. python benchmarks/real_models_table.py [--models gpt2,bert] [--dtypes fp32,bf16,fp16]
        [--scenarios replay,plain]

For each model (tests/_real_models.py: transformers models built from their configs, random
weights) a golden fp32 training step is dumped, then per dtype:
  replay: a clean load-replay (failing rows) and one per planted 7% fault (named first?);
  plain:  a clean plain dump vs the golden (failing rows, caused-here ops) and one per fault
          (is the first caused-here op the planted call?).
Prints one markdown row per model, dtype and scenario.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")

import torch  # noqa: E402

from accucmp.compare.pipeline import compare_dumps  # noqa: E402
from accucmp.compare.verdict import apply_verdict  # noqa: E402
from accucmp.report.findings import first_failure  # noqa: E402
from tests import _real_models as R  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(R.MODELS))
    ap.add_argument("--dtypes", default="fp32,bf16,fp16")
    ap.add_argument("--scenarios", default="replay,plain")
    a = ap.parse_args()
    print("| model | dtype | scenario | clean: failing rows | planted fault named first |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as d:
        for name in a.models.split(","):
            g = R.dump(name, f"{d}/{name}_g.h5")
            for dn in a.dtypes.split(","):
                for sc in a.scenarios.split(","):
                    load = g if sc == "replay" else None
                    t = apply_verdict(compare_dumps(R.dump(name, f"{d}/c.h5", DTYPES[dn], load=load), g).table)
                    clean = int((t["Result"] == "fail").sum())
                    named = []
                    for fl in R.spec_of(name).faults:
                        t = apply_verdict(compare_dumps(R.dump(name, f"{d}/f.h5", DTYPES[dn], load=load,
                                                               fault=fl), g).table)
                        ff = first_failure(t)
                        key = "SeqId" if sc == "replay" else "GoldenSeqId"
                        ok = ff is not None and ff["NPUDump"] == fl.op and int(ff[key]) == R.planted_seqid(g, fl)
                        named.append(f"{fl.op.split('.')[1]}#{fl.call} {'yes' if ok else 'NO'}")
                    print(f"| {name} | {dn} | {'load-replay' if load else 'plain dump vs dump'} | {clean} | "
                          f"{', '.join(named)} |", flush=True)


if __name__ == "__main__":
    main()
