"""Diagnosis on timm models (random weights, small images): a golden fp32 training step against
the same step in bf16 / fp16, as plain dumps and as a load-replay, clean and with a planted 7%
fault on the middle call of the model's convolution (or addmm, mm, layer norm).

    PYTHONPATH=. python benchmarks/timm_models_trial.py [--models resnet18,vit_tiny_patch16_224]
        [--precision model|autocast] [--dtypes bf16,fp16] [--stub-torchvision]

--precision model: the model and batch cast to the dtype (`model.to(bf16)`: batch norms keep
  bf16 statistics); autocast: fp32 weights, the step under torch.autocast (what mixed
  precision training does).
--stub-torchvision: timm imports torchvision at import time, and torchvision's wheel pulls
  another torch than the one installed here: this writes a minimal stand-in (the names timm
  imports; the models below use none of them but FrozenBatchNorm2d) into a temporary folder
  first. timm itself is then installed with `pip install --no-deps timm`. Neither is a
  dependency of the project.

Prints one markdown row per model, dtype and scenario: the clean run's verdict (PASS or the
first failure, its module, origin and reason) and whether the planted fault is named first.
Measured results: docs/COMPARE.md, "timm models".
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import npu_dumper  # noqa: E402,F401  (installs torch.utils.dumper)
from accucmp.compare.pipeline import compare_dumps  # noqa: E402
from accucmp.compare.verdict import apply_verdict  # noqa: E402
from accucmp.report.findings import first_failure  # noqa: E402
from dumpfile.read.reader import DumpFile  # noqa: E402
from npu_dumper import inject_fault  # noqa: E402

# model -> (create_model keywords, image side)
MODELS = {
    "resnet18": ({}, 32),
    "efficientnet_b0": ({}, 32),
    "mobilenetv3_small_050": ({}, 32),
    "convnext_atto": ({}, 32),
    "regnetx_002": ({}, 32),
    "vit_tiny_patch16_224": (dict(img_size=32, patch_size=8), 32),
    "deit_tiny_patch16_224": (dict(img_size=32, patch_size=8), 32),
    "swin_tiny_patch4_window7_224": (dict(img_size=56, window_size=7, depths=(1, 1, 1, 1)), 56),
    "levit_128s": (dict(img_size=64), 64),
    "coatnet_nano_rw_224": (dict(img_size=64), 64),
    "maxvit_nano_rw_256": (dict(img_size=64), 64),
    "rexnet_100": ({}, 32),
    "ghostnet_100": ({}, 32),
    "densenet121": ({}, 32),
    "poolformer_s12": ({}, 32),
    "eva02_tiny_patch14_224": (dict(img_size=28), 28),
    "nfnet_l0": ({}, 32),
    # a Linear on a strided class token: one live addmm stands in for a recorded mm + add
    # (docs/REPLAY.md, "One live op for several recorded ones")
    "xcit_nano_12_p16_224": (dict(img_size=32, depth=2), 32),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
FAULT_OPS = ("aten.convolution.default", "aten.addmm.default", "aten.mm.default", "aten.native_layer_norm.default")

_STUB = {
    "__init__.py": "__version__ = '0.0.0-stub'\nfrom . import ops, transforms, datasets, models  # noqa\n",
    "ops/__init__.py": "from . import misc  # noqa\n",
    "ops/misc.py": (
        "import torch\n"
        "class FrozenBatchNorm2d(torch.nn.Module):\n"
        "    def __init__(self, num_features, eps=1e-5):\n"
        "        super().__init__()\n"
        "        self.eps = eps\n"
        "        for n, v in (('weight', 1.0), ('bias', 0.0), ('running_mean', 0.0), ('running_var', 1.0)):\n"
        "            self.register_buffer(n, torch.full((num_features,), v))\n"
        "    def forward(self, x):\n"
        "        scale = self.weight * (self.running_var + self.eps).rsqrt()\n"
        "        shift = self.bias - self.running_mean * scale\n"
        "        return x * scale.reshape(1, -1, 1, 1) + shift.reshape(1, -1, 1, 1)\n"),
    "_any.py": (
        "import enum\n"
        "class InterpolationMode(enum.Enum):\n"
        "    NEAREST = 'nearest'; NEAREST_EXACT = 'nearest-exact'; BILINEAR = 'bilinear'; BICUBIC = 'bicubic'\n"
        "    BOX = 'box'; HAMMING = 'hamming'; LANCZOS = 'lanczos'\n"
        "def __getattr__(name):\n"
        "    if name.startswith('__'):\n"
        "        raise AttributeError(name)\n"
        "    return type(name, (), {'__init__': lambda self, *a, **k: None})\n"),
    "models/feature_extraction/__init__.py": (
        "def get_graph_node_names(*a, **k):\n    raise NotImplementedError('torchvision stub')\n"
        "def create_feature_extractor(*a, **k):\n    raise NotImplementedError('torchvision stub')\n"),
}
for _sub in ("transforms", "datasets", "models"):
    _STUB[f"{_sub}/__init__.py"] = ("from .._any import InterpolationMode, __getattr__  # noqa\n"
                                    "from . import functional  # noqa\n")
    _STUB[f"{_sub}/functional.py"] = "from .._any import InterpolationMode, __getattr__  # noqa\n"


def _stub_torchvision(where: str) -> None:
    for rel, text in _STUB.items():
        path = os.path.join(where, "torchvision", rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    sys.path.insert(0, where)


def _step(name: str, path: str, dtype: torch.dtype, precision: str, *, load: str | None = None,
          fault: tuple[str, int] | None = None) -> str:
    import timm
    kw, side = MODELS[name]
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=10, **kw).train()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(2, 3, side, side, generator=g), torch.tensor([1, 7])
    cast = precision == "model" and dtype != torch.float32
    if cast:
        model, x = model.to(dtype), x.to(dtype)
    amp = torch.autocast("cpu", dtype=dtype) if precision == "autocast" and dtype != torch.float32 \
        else contextlib.nullcontext()
    planted = inject_fault(fault[0], rel=0.07, call=fault[1]) if fault else contextlib.nullcontext()
    how = dict(use_load=True, load_file_path=load) if load else dict(use_dump=True)
    with planted, torch.utils.dumper(dump_path=path, **how):
        with amp:
            out = model(x)
        F.cross_entropy(out.float(), y).backward()
    return path


def _ops(path: str) -> list:
    f = DumpFile(path)
    try:
        return [(o.op, o.seqid) for o in f.ops()]
    finally:
        f.close()


def _fault_for(golden: str) -> tuple[str, int, int] | None:
    """(op, k, golden seqid of its k-th call): the middle call of the first op of FAULT_OPS
    the step calls at least 3 times."""
    ops = _ops(golden)
    for op in FAULT_OPS:
        seqids = [s for o, s in ops if o == op]
        if len(seqids) >= 3:
            k = len(seqids) // 2
            return op, k, seqids[k - 1]
    return None


def _cell(row) -> str:
    if row is None:
        return "PASS"
    return (f"FAIL {row['NPUDump']} [{row.get('Module', '')}] {row.get('Origin', '')}: "
            f"{str(row['FailReason'])[:150]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--precision", choices=("model", "autocast"), default="model")
    ap.add_argument("--stub-torchvision", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        if a.stub_torchvision:
            _stub_torchvision(os.path.join(d, "stub"))
        print(f"precision: {a.precision}")
        print("| model (ops) | dtype | scenario | clean run | planted fault named first |")
        print("|---|---|---|---|---|")
        for name in a.models.split(","):
            t0 = time.time()
            golden = _step(name, f"{d}/{name}_g.h5", torch.float32, a.precision)
            fault = _fault_for(golden)
            n_ops = len(_ops(golden))
            for dn in a.dtypes.split(","):
                for scenario in ("plain", "replay"):
                    load = golden if scenario == "replay" else None
                    clean = first_failure(apply_verdict(compare_dumps(
                        _step(name, f"{d}/c.h5", DTYPES[dn], a.precision, load=load), golden).table))
                    named = "-"
                    if fault is not None:
                        op, k, seqid = fault
                        ff = first_failure(apply_verdict(compare_dumps(
                            _step(name, f"{d}/f.h5", DTYPES[dn], a.precision, load=load, fault=(op, k)),
                            golden).table))
                        key = "SeqId" if load else "GoldenSeqId"
                        ok = ff is not None and ff["NPUDump"] == op and int(ff[key]) == seqid
                        named = f"{op.split('.')[1]}#{k} {'yes' if ok else 'NO: ' + _cell(ff)}"
                    print(f"| {name} ({n_ops}) | {dn} | {scenario} | {_cell(clean)} | {named} |", flush=True)
            print(f"  ({name}: {time.time() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
