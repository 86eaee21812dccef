"""Diagnosis on architectures the first table (benchmarks/real_models_table.py) does not
cover: tests/_real_models.py TRIAL (T5, Qwen2, DistilBERT, GPT-NeoX, Falcon with ALiBi,
Swin, Whisper, MobileViT, DeepSeek-V2 with complex rotary and MoE) or any model there.

    PYTHONPATH=. python benchmarks/real_models_trial.py [--models t5,qwen2] [--dtypes fp32,bf16,fp16]

Per model: a golden fp32 training step is dumped (warnings raised while dumping are counted),
then per dtype
  replay: a clean load-replay (failing rows) and one per planted 7% fault (named first?),
  plain:  a clean plain dump vs the golden (failing rows) and one per fault (is the first
          caused-here op the planted call?),
and once per model `accucmp compare` (the CLI, a subprocess) on the bf16 load-replay with the
first fault: exit status 1 (some rows fail) and its summary's first-failure line names the op.
A crash in any step is printed in its cell. Prints one markdown row per model and dtype.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import traceback
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from accucmp.compare.op_policies import ORIGIN_CAUSED  # noqa: E402
from accucmp.compare.pipeline import compare_dumps  # noqa: E402
from accucmp.compare.verdict import apply_verdict  # noqa: E402
from accucmp.report.findings import first_failure  # noqa: E402
from tests import _real_models as R  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _dump(warns: list, *a, **kw) -> str:
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        path = R.dump(*a, **kw)
    warns.extend(str(x.message).splitlines()[0][:100] for x in w)
    return path


def _judged(target: str, golden: str):
    return apply_verdict(compare_dumps(target, golden).table)


def _cell(fn) -> str:
    try:
        return fn()
    except Exception as e:  # a crash is a finding: print it in the table
        traceback.print_exc(file=sys.stderr)
        return f"CRASH {type(e).__name__}: {str(e)[:80]}"


def _named(t, fault, golden, plain: bool) -> str:
    ff = first_failure(t)
    if ff is None:
        return "not seen"
    key = "GoldenSeqId" if plain else "SeqId"
    if ff["NPUDump"] == fault.op and int(ff[key]) == R.planted_seqid(golden, fault) \
            and ff.get("Origin", ORIGIN_CAUSED) == ORIGIN_CAUSED:
        return "yes"
    return f"**no** (first: {ff['NPUDump'].split('.')[1]} #{ff[key]} {ff['TensorName']})"


def _cli(target: str, golden: str, fault, d: str) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-m", "accucmp.cli", "compare", "-m", target, "-g", golden, "-o", d],
                       capture_output=True, text=True, env=env, timeout=600)
    first = [ln for ln in p.stdout.splitlines() if "first failure" in ln.lower()]
    ok = p.returncode == 1 and first and fault.op.split(".")[1] in first[0] and "Traceback" not in p.stderr
    return "ok" if ok else f"**bad** rc={p.returncode} {first[:1]} {p.stderr.strip()[-120:]}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(R.TRIAL))
    ap.add_argument("--dtypes", default="fp32,bf16,fp16")
    a = ap.parse_args()
    print("| model | dtype | ops | load-replay: clean failing rows | load-replay: fault named first "
          "| plain: clean failing rows | plain: caused-here op = planted | dump warnings | CLI | s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as d:
        for name in a.models.split(","):
            spec = R.spec_of(name)
            warns: list[str] = []
            try:
                g = _dump(warns, name, f"{d}/{name}_g.h5")
            except Exception as e:
                traceback.print_exc(file=sys.stderr)
                print(f"| {name} | golden | CRASH {type(e).__name__}: {str(e)[:80]} |", flush=True)
                continue
            from dumpfile.read.reader import DumpFile
            f = DumpFile(g)
            nops = sum(1 for _ in f.ops())
            f.close()
            cli = ""
            for dn in a.dtypes.split(","):
                t0 = time.perf_counter()
                cells = []
                for load in (g, None):
                    cells.append(_cell(lambda: str(int((_judged(_dump(
                        warns, name, f"{d}/c.h5", DTYPES[dn], load=load), g)["Result"] == "fail").sum()))))
                    named = []
                    for fl in spec.faults:
                        def one(fl=fl, load=load):
                            tgt = _dump(warns, name, f"{d}/f.h5", DTYPES[dn], load=load, fault=fl)
                            return _named(_judged(tgt, g), fl, g, plain=load is None)
                        r = _cell(one)
                        if dn == "bf16" and load and fl is spec.faults[0]:
                            cli = _cell(lambda fl=fl: _cli(f"{d}/f.h5", g, fl, d))
                        named.append(f"{fl.op.split('.')[1]}#{fl.call} {r}")
                    cells.append(", ".join(named))
                nw = len(warns)
                wtxt = f"{nw}" + (f" ({warns[0]})" if nw else "")
                warns.clear()
                print(f"| {name} | {dn} | {nops} | {' | '.join(cells)} | {wtxt} | {cli if dn == 'bf16' else ''} "
                      f"| {time.perf_counter() - t0:.0f} |", flush=True)


if __name__ == "__main__":
    main()
