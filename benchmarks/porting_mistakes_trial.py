"""Porting mistakes planted in a whole training step (forward, backward, clipping, optimizer),
each judged by a plain compare and a load-replay against the clean fp32 golden.

    PYTHONPATH=. python benchmarks/porting_mistakes_trial.py [--model gpt2|cnn]
        [--precision bf16|fp16|fp32|model-bf16] [--mistakes clean,gelu_tanh,...]

gpt2: a tiny Hugging Face GPT-2 built from its config (2 layers, 32 wide) with AdamW and
  clip_grad_norm_ inside the dump block; cnn: convolutions, batch norm, pooling, bilinear
  upsampling, SGD with momentum. The target runs under autocast (bf16, fp16), in fp32, or
  cast with `model.to(bfloat16)` (model-bf16), with one mistake. Prints one line per mistake
  and mode: PASS (with the number of failing rows) or the first failure, its module, Origin and
  reason. The clean run must pass and every mistake must be named where the run departs;
under model-bf16 the clean run fails at AdamW's decay, which bfloat16 rounds away (Origin
`absorbed`), and a mistake in the optimizer after it is named behind it.
Measured results and what they found: docs/COMPARE.md, "Porting mistakes in a training step".
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import npu_dumper  # noqa: E402,F401  (installs torch.utils.dumper)
from accucmp.compare.pipeline import compare_dumps  # noqa: E402
from accucmp.compare.verdict import apply_verdict  # noqa: E402
from accucmp.report.findings import first_failure  # noqa: E402

GPT2_MISTAKES = {
    "clean": {},
    "dropout_on": dict(cfg=dict(resid_pdrop=0.1)),
    "gelu_tanh": dict(cfg=dict(activation_function="gelu")),      # gelu_new ported as nn.GELU
    "ln_eps": dict(cfg=dict(layer_norm_epsilon=1e-6)),
    "no_attn_scale": dict(cfg=dict(scale_attn_weights=False)),
    "eager_attn": dict(attn="eager"),
    "init_seed": dict(seed=1),
    "stale_grad": dict(stale_grad=True),
    "clip": dict(clip=0.05),
    "wd_all": dict(wd_all=True),
    "adam_eps": dict(eps=1e-6),
    "lr": dict(lr=2e-3),
    "no_ignore": dict(no_ignore=True),
    "ckpt_only_target": dict(ckpt=True),
    "for_loop_adam": dict(foreach=False),
    "loss_in_low_precision": dict(low_loss=True),
}

CNN_MISTAKES = {
    "clean": {}, "channels_last": dict(channels_last=True), "eval_mode": dict(eval=True),
    "bn_momentum": dict(momentum=0.01), "bn_eps": dict(bn_eps=1e-3), "ceil_mode": dict(ceil=True),
    "align_corners": dict(align=True), "pad_reflect": dict(pad_mode="reflect"), "conv_bias": dict(conv_bias=True),
    "bgr": dict(bgr=True), "no_norm_input": dict(no_norm_input=True), "max_head": dict(max_head=True),
    "nesterov": dict(nesterov=True), "inplace_relu": dict(inplace=True),
}


def _context(precision: str, target: bool):
    if target and precision in ("bf16", "fp16"):
        return torch.autocast("cpu", dtype=torch.bfloat16 if precision == "bf16" else torch.float16)
    return torch.autocast("cpu", enabled=False)


# ---- GPT-2 ---------------------------------------------------------------------------------
def _gpt2_step(path, m: dict, precision: str, target: bool, load=None) -> str:
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(**{**dict(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=32, bos_token_id=0,
                               eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
                        **(m.get("cfg") or {})})
    cfg._attn_implementation = m.get("attn", "sdpa")
    torch.manual_seed(m.get("seed", 0))
    model = GPT2LMHeadModel(cfg).train()
    if target and precision == "model-bf16":
        model.to(torch.bfloat16)
    params = list(model.named_parameters())
    decay = [p for n, p in params if m.get("wd_all") or p.dim() >= 2]
    rest = [p for n, p in params if not (m.get("wd_all") or p.dim() >= 2)]
    groups = [dict(params=decay, weight_decay=0.1)] + ([dict(params=rest, weight_decay=0.0)] if rest else [])
    opt = torch.optim.AdamW(groups, lr=m.get("lr", 1e-3), eps=m.get("eps", 1e-8), foreach=m.get("foreach"))
    if m.get("ckpt"):
        model.gradient_checkpointing_enable()
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 96, (2, 12), generator=g)
    y = (x + 1) % 96
    if not m.get("no_ignore"):
        y = y.clone()
        y[:, :3] = -100
    if m.get("stale_grad"):
        model(input_ids=x).logits.float().sum().mul(1e-3).backward()
    mode = dict(use_load=True, load_file_path=load) if load else dict(use_dump=True)
    with torch.utils.dumper(dump_path=path, **mode):
        with _context(precision, target):
            out = model(input_ids=x).logits
        logits = out if m.get("low_loss") else out.float()
        F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), m.get("clip", 1.0))
        opt.step()
        opt.zero_grad()
    return path


# ---- CNN -----------------------------------------------------------------------------------
class _Net(nn.Module):
    def __init__(self, m: dict):
        super().__init__()
        self.m = m
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=m.get("conv_bias", False),
                               padding_mode=m.get("pad_mode", "zeros"))
        self.bn1 = nn.BatchNorm2d(16, momentum=m.get("momentum", 0.1), eps=m.get("bn_eps", 1e-5))
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(32)
        self.up = nn.Conv2d(32, 16, 1)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        m = self.m
        x = F.relu(self.bn1(self.conv1(x)), inplace=m.get("inplace", False))
        x = F.max_pool2d(x, 3, 2, ceil_mode=m.get("ceil", False))
        x = F.relu(self.bn2(self.conv2(x)))
        x = F.interpolate(self.up(x), scale_factor=2, mode="bilinear", align_corners=m.get("align", False))
        pool = F.adaptive_max_pool2d if m.get("max_head") else F.adaptive_avg_pool2d
        return self.head(pool(x, 1).flatten(1))


def _cnn_step(path, m: dict, precision: str, target: bool, load=None) -> str:
    torch.manual_seed(0)
    net = _Net(m)
    g = torch.Generator().manual_seed(1)
    x = torch.rand(4, 3, 16, 16, generator=g)
    y = torch.randint(0, 10, (4,), generator=g)
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    if not m.get("no_norm_input"):
        x = ((x.flip(1) if m.get("bgr") else x) - mean) / std
    if m.get("channels_last"):
        net = net.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    if m.get("eval"):
        net.eval()
    if target and precision == "model-bf16":
        net.to(torch.bfloat16)
        x = x.to(torch.bfloat16)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, nesterov=m.get("nesterov", False))
    mode = dict(use_load=True, load_file_path=load) if load else dict(use_dump=True)
    with torch.utils.dumper(dump_path=path, **mode):
        with _context(precision, target):
            out = net(x)
        F.cross_entropy(out.float(), y).backward()
        opt.step()
        opt.zero_grad()
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=("gpt2", "cnn"), default="gpt2")
    ap.add_argument("--precision", choices=("bf16", "fp16", "fp32", "model-bf16"), default="bf16")
    ap.add_argument("--mistakes", default="")
    a = ap.parse_args()
    mistakes = GPT2_MISTAKES if a.model == "gpt2" else CNN_MISTAKES
    step = _gpt2_step if a.model == "gpt2" else _cnn_step
    names = a.mistakes.split(",") if a.mistakes else list(mistakes)
    print(f"model: {a.model}, target precision: {a.precision}")
    with tempfile.TemporaryDirectory() as d:
        golden = step(os.path.join(d, "golden.h5"), {}, a.precision, False)
        for name in names:
            for mode in ("plain", "replay"):
                path = os.path.join(d, f"{name}_{mode}.h5")
                try:
                    step(path, mistakes[name], a.precision, True, load=golden if mode == "replay" else None)
                    table = apply_verdict(compare_dumps(path, golden).table)
                except Exception as e:  # noqa: BLE001 - a crash is a finding: printed in its line
                    print(f"{name:22s} {mode:6s} ERROR {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                first = first_failure(table)
                if first is None:
                    fails = int((table["Result"] == "fail").sum())
                    print(f"{name:22s} {mode:6s} PASS (failing rows {fails})", flush=True)
                else:
                    print(f"{name:22s} {mode:6s} FAIL {first['NPUDump']} [{first.get('Module', '')}] "
                          f"{first.get('Origin', '')}: {str(first['FailReason'])[:220]}", flush=True)


if __name__ == "__main__":
    main()
