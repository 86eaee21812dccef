"""Do two versions of load-replay give the same verdicts? `accucmp compare` CSVs side by side.

For each model (the sample models at their tiny size, and a small Hugging Face GPT-2 from its
config when transformers is importable): one fp32 full dump (the golden, made by this
checkout), then the same training step load-replaying it under bf16 autocast (and, with
--fp32, in fp32) once with this checkout's code and once with the code in OLD (PYTHONPATH),
each in its own process; each replay is compared with the golden by `accucmp compare`
(this checkout's), and the two CSVs are compared row by row: the rows (op, tensor, IO) and
their Result must be identical; every other column that differs is listed with its largest
relative difference.

    python benchmarks/check_replay_verdicts.py --old DIR [--fp32] [MODEL ...]

DIR: an export of the older commit (`git archive <rev> | tar -x -C DIR`). Exit 0 when every
model's rows and results agree, 1 otherwise.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SAMPLE = ("mlp", "resnet", "shufflenet", "transformer", "lstm_lm")
# columns that name files or times, not the verdict
_IGNORED = {"TargetFile", "GoldenFile"}


def _child(spec: dict) -> None:
    import contextlib
    import io
    import torch
    import npu_dumper
    torch.set_num_threads(1)
    name = spec["model"]
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel
        from transformers.utils import logging as hf_logging
        hf_logging.set_verbosity_error()
        torch.manual_seed(0)
        cfg = GPT2Config(vocab_size=512, n_positions=64, n_embd=128, n_layer=2, n_head=4,
                         bos_token_id=0, eos_token_id=0)
        model = GPT2LMHeadModel(cfg).train()
        ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))

        def step():
            model.zero_grad(set_to_none=True)
            torch.manual_seed(1)
            model(input_ids=ids, labels=ids).loss.backward()
    else:
        import sample_models
        m = sample_models.get(name)
        model, batch = m.build(seed=0, size="tiny"), m.make_inputs(seed=0, size="tiny")

        def step():
            torch.manual_seed(1)
            m.train_step(model, batch)
    if spec["kind"] == "golden":
        with npu_dumper.dumper(use_dump=True, dump_path=spec["out"]):
            step()
        return
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if spec["kind"] == "bf16" else contextlib.nullcontext()
    with contextlib.redirect_stdout(io.StringIO()), amp:
        with npu_dumper.dumper(use_load=True, load_file_path=spec["golden"], dump_path=spec["out"]):
            step()


def _run(spec: dict, pythonpath: str) -> None:
    env = dict(os.environ, PYTHONPATH=pythonpath, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
                       env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{spec['model']} {spec['kind']} ({pythonpath}): exit {p.returncode}\n{p.stderr[-2000:]}")


def _compare(target: str, golden: str, out: str) -> list[dict]:
    os.makedirs(out, exist_ok=True)
    code = "import sys; from accucmp.cli.main import main; sys.argv[0] = 'accucmp'; sys.exit(main())"
    p = subprocess.run([sys.executable, "-c", code, "compare", "-m", target, "-g", golden, "-o", out],
                       env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True)
    if p.returncode not in (0, 1):
        raise SystemExit(f"compare {target}: exit {p.returncode}\n{p.stderr[-2000:]}")
    name = next(f for f in os.listdir(out) if f.endswith(".csv"))
    with open(os.path.join(out, name), newline="") as f:
        return list(csv.DictReader(f))


def _rel(a: str, b: str) -> float | None:
    try:
        x, y = float(a), float(b)
    except ValueError:
        return None
    if x == y or (x != x and y != y):
        return 0.0
    return abs(x - y) / max(abs(x), abs(y), 1e-300)


def diff_rows(old: list[dict], new: list[dict]) -> tuple[list[str], dict[str, float]]:
    """(problems with rows or results, {other column: largest relative difference})."""
    problems: list[str] = []
    key = ("Index", "NPUDump", "GroundTruth", "IO", "TensorName")
    key = tuple(k for k in key if old and k in old[0])
    if len(old) != len(new):
        problems.append(f"{len(old)} rows before, {len(new)} after")
    cols: dict[str, float] = {}
    for i, (a, b) in enumerate(zip(old, new)):
        if tuple(a.get(k) for k in key) != tuple(b.get(k) for k in key):
            problems.append(f"row {i}: {[a.get(k) for k in key]} vs {[b.get(k) for k in key]}")
            continue
        if a.get("Result") != b.get("Result"):
            problems.append(f"row {i} {[a.get(k) for k in key]}: Result {a.get('Result')} -> {b.get('Result')}")
        for c in a:
            if c in _IGNORED or a[c] == b.get(c):
                continue
            r = _rel(a[c], b.get(c, ""))
            cols[c] = max(cols.get(c, 0.0), r if r is not None else float("inf"))
    return problems, cols


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child")
    ap.add_argument("--old")
    ap.add_argument("--fp32", action="store_true", help="also an fp32 replay")
    ap.add_argument("models", nargs="*")
    a = ap.parse_args()
    if a.child:
        _child(json.loads(a.child))
        return 0
    if not a.old:
        raise SystemExit("--old DIR is required")
    models = a.models or [*SAMPLE, "gpt2"]
    kinds = ["bf16"] + (["fp32"] if a.fp32 else [])
    bad = 0
    with tempfile.TemporaryDirectory(prefix="check_replay_verdicts_") as tmp:
        for model in models:
            golden = os.path.join(tmp, f"{model}_golden.h5")
            _run({"model": model, "kind": "golden", "out": golden}, ROOT)
            for kind in kinds:
                rows = {}
                for label, path in (("old", os.path.abspath(a.old)), ("new", ROOT)):
                    out = os.path.join(tmp, f"{model}_{kind}_{label}.h5")
                    _run({"model": model, "kind": kind, "golden": golden, "out": out}, path)
                    rows[label] = _compare(out, golden, os.path.join(tmp, f"{model}_{kind}_{label}"))
                problems, cols = diff_rows(rows["old"], rows["new"])
                fails = sum(r.get("Result") == "fail" for r in rows["new"])
                status = "SAME rows and results" if not problems else "DIFFER"
                other = ", ".join(f"{c} (max rel {v:.1e})" for c, v in sorted(cols.items())) or "none"
                print(f"{model:12s} {kind}: {len(rows['new'])} rows, {fails} failing: {status}; "
                      f"other columns that differ: {other}")
                for p in problems[:10]:
                    print(f"    {p}")
                bad += bool(problems)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
