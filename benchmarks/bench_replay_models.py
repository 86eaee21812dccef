"""Load-replay on other models than GPT-2: time and peak memory against the plain bf16 step.

bench_replay_scale.py measures load-replay at the size of a real model on one model (GPT-2
small). Issue 34's goal is for models the project has not tuned to as well, so this runs
the same four kinds of step on Hugging Face models of other families, built from their
default configs (random weights from a fixed seed, no download), each kind in its own
Python process (its own peak RSS, VmHWM), one training step, torch.set_num_threads(1):

  plain-fp32     the step (the dump's 1x)
  dump           the step under a full dump -> the golden file
  plain-bf16     the step under bf16 autocast (the replays' 1x)
  replay         the bf16-autocast step load-replaying the golden (own error on, the default)
  replay-noown   the same with own_error=False

Models (batch 2): bert (BertForMaskedLM, base: 12 layers, 768 wide, 128 tokens), vit
(ViTForImageClassification, base, 224x224), llama (LlamaForCausalLM: 8 layers, 768 wide,
grouped-query attention 12/4 heads, SwiGLU 2048, vocab 32000, 128 tokens), convnext
(ConvNextForImageClassification, tiny, 224x224), resnet50 (ResNetForImageClassification,
bottleneck 3-4-6-3, 224x224).

    python benchmarks/bench_replay_models.py [--models bert,vit,...] [--rounds N] [--tmp DIR]
           [--kinds plain-fp32,dump,plain-bf16,replay,replay-noown] [--old-code DIR] [--verdict]

--old-code DIR: the dump and each replay kind also as `<kind>-old`, with PYTHONPATH=DIR (an
  export of an older commit: `git archive <rev> | tar -x -C DIR`), in the same rounds: before
  and after (the old dump writes a file of its own; every replay reads the new dump's golden).
--verdict: after each replay, `accucmp compare` of its dump against the golden (not timed),
  and its verdict printed: the replay is of the same step, from the same state (the golden's
  model state is restored after the replay's bf16 warm-up: BatchNorm's running statistics
  move with every training step), so a failure names an op whose bf16 kernel adds more
  error than its class allows, or a departure of the benchmark itself.

The golden's pages are dropped from the page cache before each replay kind (a golden dumped
with O_DIRECT, or elsewhere, is not cached). The ratios are each kind's median over its
plain step's median, measured in the same run; the load average is printed before
and after (on a machine shared with other work the seconds move, the peak RSS does not).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bench_replay_scale import _evict, _vm_kb   # (the page-cache drop and /proc readings)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODELS = ("bert", "vit", "llama", "convnext", "resnet50")
KINDS = ("plain-fp32", "dump", "plain-bf16", "replay", "replay-noown")
BASE = {"dump": "plain-fp32", "plain-fp32": "plain-fp32"}   # each kind's 1x (else plain-bf16; "-old" as its kind)


def _build(name: str):
    """(step, parameter count) for one model: a training step returning the loss."""
    import torch
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    images = labels = ids = None
    if name == "bert":
        from transformers import BertConfig, BertForMaskedLM
        model = BertForMaskedLM(BertConfig())
        ids = torch.randint(0, 30522, (2, 128), generator=g)
    elif name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM
        model = LlamaForCausalLM(LlamaConfig(
            hidden_size=768, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=12,
            num_key_value_heads=4, vocab_size=32000))
        ids = torch.randint(0, 32000, (2, 128), generator=g)
    else:
        if name == "vit":
            from transformers import ViTConfig as Config, ViTForImageClassification as Model
            config = Config(num_labels=1000)
        elif name == "convnext":
            from transformers import ConvNextConfig as Config, ConvNextForImageClassification as Model
            config = Config(num_labels=1000)
        elif name == "resnet50":
            from transformers import ResNetConfig as Config, ResNetForImageClassification as Model
            config = Config(depths=[3, 4, 6, 3], hidden_sizes=[256, 512, 1024, 2048],
                            layer_type="bottleneck", num_labels=1000)
        else:
            raise SystemExit(f"unknown model {name!r} (known: {', '.join(MODELS)})")
        model = Model(config)
        images = torch.randn(2, 3, 224, 224, generator=g)
        labels = torch.randint(0, 1000, (2,), generator=g)
    model.train()

    def step():
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)                 # the same dropout masks in every step
        out = model(input_ids=ids, labels=ids) if ids is not None else \
            model(pixel_values=images, labels=labels)
        out.loss.backward()
        return float(out.loss.detach())
    step.model = model
    return step, sum(p.numel() for p in model.parameters())


def child(spec: dict) -> dict:
    import contextlib
    import torch
    import npu_dumper
    try:
        from npu_dumper.replay import heap
    except ImportError:                          # (older code: --old-code)
        heap = None
    torch.set_num_threads(1)
    kind = spec["kind"]
    step, n_params = _build(spec["model"])
    bf16 = kind not in ("plain-fp32", "dump")
    amp = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    golden_buffers = None
    if kind.startswith("replay"):
        # the state the golden was dumped from (after the dump's fp32 warm-up step): the
        # replay's step starts from it, after a warm-up of its own in bf16 (kernels, caches).
        # Only the buffers move (no optimizer: the parameters stay), BatchNorm's statistics
        step()
        golden_buffers = [b.clone() for b in step.model.buffers()]
    with amp():
        step()                                       # warm-up, plain
    if golden_buffers is not None:
        with torch.no_grad():
            for b, saved in zip(step.model.buffers(), golden_buffers):
                b.copy_(saved)
        del golden_buffers
    t0, c0 = time.perf_counter(), time.process_time()
    summary = ""
    with amp():
        if kind.startswith("plain"):
            step()
        elif kind == "dump":
            with npu_dumper.dumper(use_dump=True, dump_path=spec["golden"]) as d:
                step()
            summary = f"{d.num_ops} ops"
        else:
            options = {"own_error": False} if kind == "replay-noown" else {}
            with contextlib.redirect_stdout(sys.stderr):
                with npu_dumper.dumper(use_load=True, load_file_path=spec["golden"], dump_path=spec["out"],
                                       **options) as d:
                    step()
            summary = f"{d.summary['replay'].matched} ops replayed" + (
                f", heap trimmed {heap.trims}x" if heap is not None else "")
    return {"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0,
            "peak_mb": _vm_kb("VmHWM") / 1024, "params": n_params, "summary": summary}


def _files(model: str, kind: str, tmp: str) -> tuple[str, str]:
    """(the model's golden, the file `kind` writes: a replay's dump)."""
    return os.path.join(tmp, f"{model}_golden.h5"), os.path.join(tmp, f"{model}_{kind}.h5")


def _run(model: str, kind: str, tmp: str, old_code: str | None = None) -> dict:
    golden, out = _files(model, kind, tmp)
    for path in (golden,) if kind == "dump" else (out,):
        if os.path.exists(path):
            os.remove(path)
    if kind.startswith("replay"):
        _evict(golden)
    code = old_code if kind.endswith("-old") else ROOT
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([code, HERE]), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    # (the old code's dump writes a file of its own: the replays read the new code's golden)
    spec = json.dumps({"model": model, "kind": kind.removesuffix("-old"),
                       "golden": out if kind == "dump-old" else golden, "out": out})
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", spec],
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{model} {kind}: child failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _verdict(model: str, kind: str, tmp: str) -> str:
    """`accucmp compare` of a replay's dump against the golden: its verdict sentence (which
    names the first failing op, its module and why), and the failing tensor."""
    golden, out = _files(model, kind, tmp)
    summary = os.path.join(tmp, f"{model}_{kind}_verdict.json")
    proc = subprocess.run([sys.executable, "-m", "accucmp.cli", "compare", "-m", out, "-g", golden, "-q",
                           "-o", os.path.join(tmp, f"{model}_{kind}_cmp"), "--summary-json", summary],
                          env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True)
    if proc.returncode not in (0, 1):
        return f"compare exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"
    with open(summary) as f:
        got = json.load(f)
    first = got.get("first_failure")
    return got["sentence"] + (f" [{first.get('tensor')}]" if first and first.get("tensor") else "")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--tmp", default=None)
    ap.add_argument("--old-code", default=None)
    ap.add_argument("--verdict", action="store_true")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(json.loads(a.child))))
        return
    kinds = [k for k in a.kinds.split(",") if k]
    if "replay" in ",".join(kinds) and "dump" not in kinds:
        kinds.insert(0, "dump")
    if a.old_code:
        kinds += [f"{k}-old" for k in kinds if k.startswith("replay") or k == "dump"]
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    rows = []
    verdicts: list[tuple[str, str, str]] = []
    with tempfile.TemporaryDirectory(dir=a.tmp) as tmp:
        for model in [m for m in a.models.split(",") if m]:
            runs: dict[str, list[dict]] = {k: [] for k in kinds}
            for r in range(a.rounds):
                for kind in kinds:
                    res = _run(model, kind, tmp, a.old_code)
                    runs[kind].append(res)
                    print(f"  {model:9s} round {r + 1} {kind:13s} {res['wall']:6.2f} s {res['peak_mb']:6.0f} MB"
                          f"  {res['summary']}", flush=True)
                    if a.verdict and kind.startswith("replay") and r == 0:
                        verdicts.append((model, kind, _verdict(model, kind, tmp)))
                        print(f"  {model:9s} {kind:13s} verdict: {verdicts[-1][2]}", flush=True)
            med = {k: {f: statistics.median(x[f] for x in v) for f in ("wall", "cpu", "peak_mb")}
                   for k, v in runs.items() if v}
            rows.append((model, runs[kinds[0]][0]["params"], med))
            for kind in kinds:                      # (each model's files go before the next)
                for p in _files(model, kind, tmp):
                    if os.path.exists(p):
                        os.remove(p)
    print(f"\nbf16-autocast load-replay of an fp32 dump, one training step, batch 2, 1 thread; "
          f"medians of {a.rounds} round(s); ratios against plain-bf16 (the dump's: plain-fp32)")
    print(f"  {'model':9s} {'params':>7s} {'kind':13s} {'time':>7s} {'vs plain':>8s} {'CPU':>7s} "
          f"{'vs plain':>8s} {'peak RSS':>8s} {'vs plain':>8s}")
    for model, params, med in rows:
        for kind, m in med.items():
            base = med.get(BASE.get(kind.removesuffix("-old"), "plain-bf16"))
            rt = f"{m['wall'] / base['wall']:.2f}x" if base else "-"
            rc = f"{m['cpu'] / base['cpu']:.2f}x" if base else "-"
            rm = f"{m['peak_mb'] / base['peak_mb']:.2f}x" if base else "-"
            print(f"  {model:9s} {params / 1e6:6.0f}M {kind:13s} {m['wall']:6.2f}s {rt:>8s} {m['cpu']:6.2f}s "
                  f"{rc:>8s} {m['peak_mb']:7.0f}M {rm:>8s}")
    if verdicts:
        print("\nverdicts of the replays (accucmp compare, replay dump vs golden):")
        for model, kind, v in verdicts:
            print(f"  {model:9s} {kind:13s} {v}")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
