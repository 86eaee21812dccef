"""Third-party models (Hugging Face transformers, built from their Config classes: random
weights, tiny sizes, no download) and the scenarios tests/test_real_models.py and
benchmarks/real_models_table.py run on them: a golden fp32 dump, load-replays and plain
dumps in fp32 / bf16 / fp16, clean and with one planted fault in the middle of the network.

torchvision and timm cannot be used beside the CPU torch 2.13.0 (PyPI's torchvision fails to
import: 'operator torchvision::nms does not exist'; timm imports torchvision), so the conv nets
are transformers' own ResNet, MobileNetV2 and ConvNeXt (BatchNorm, max-pool with indices,
depthwise convs, ReLU6, channel LayerNorm, GELU).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.nn.functional as F

import npu_dumper  # noqa: F401  (installs torch.utils.dumper)
from npu_dumper import inject_fault


@dataclass(frozen=True)
class Fault:
    op: str
    call: int
    rel: float = 0.07


@dataclass(frozen=True)
class RealModel:
    name: str
    build: Callable[[], torch.nn.Module]
    inputs: Callable[[], tuple]            # (model input (ids or pixels), labels)
    image: bool
    faults: tuple[Fault, ...]


def _no_dropout(**kw):
    out = dict(kw)
    for k in ("hidden_dropout_prob", "attention_probs_dropout_prob", "resid_pdrop", "embd_pdrop",
              "attn_pdrop", "attention_dropout", "classifier_dropout_prob", "drop_path_rate", "dropout"):
        out.setdefault(k, 0.0)
    return out


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(**_no_dropout(vocab_size=96, n_positions=32, n_embd=32, n_layer=3, n_head=4))
    return GPT2LMHeadModel(cfg)


def _bert():
    from transformers import BertConfig, BertForMaskedLM
    cfg = BertConfig(**_no_dropout(vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                   intermediate_size=64, max_position_embeddings=32))
    return BertForMaskedLM(cfg)


def _roberta():
    from transformers import RobertaConfig, RobertaForMaskedLM
    cfg = RobertaConfig(**_no_dropout(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, max_position_embeddings=40))
    return RobertaForMaskedLM(cfg)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(**_no_dropout(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


def _resnet():
    from transformers import ResNetConfig, ResNetForImageClassification
    cfg = ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic",
                       num_labels=10)
    return ResNetForImageClassification(cfg)


def _mobilenet():
    from transformers import MobileNetV2Config, MobileNetV2ForImageClassification
    cfg = MobileNetV2Config(image_size=32, depth_multiplier=0.25, num_labels=10, classifier_dropout_prob=0.0)
    return MobileNetV2ForImageClassification(cfg)


def _convnext():
    from transformers import ConvNextConfig, ConvNextForImageClassification
    cfg = ConvNextConfig(hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, image_size=32, num_labels=10,
                         drop_path_rate=0.0)
    return ConvNextForImageClassification(cfg)


def _vit():
    from transformers import ViTConfig, ViTForImageClassification
    cfg = ViTConfig(**_no_dropout(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64, num_labels=10))
    return ViTForImageClassification(cfg)


def _tokens(vocab=96, batch=2, seq=12):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return ids, torch.randint(0, vocab, (batch, seq), generator=g)


def _pixels(size=32, batch=4):
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, 3, size, size, generator=g), torch.randint(0, 10, (batch,), generator=g)


A = "aten."
MODELS: dict[str, RealModel] = {m.name: m for m in (
    RealModel("gpt2", _gpt2, _tokens, False,
              (Fault(A + "addmm.default", 5), Fault(A + "native_layer_norm_backward.default", 3))),
    RealModel("bert", _bert, _tokens, False,
              (Fault(A + "gelu.default", 2), Fault(A + "mm.default", 30))),
    RealModel("roberta", _roberta, _tokens, False,
              (Fault(A + "native_layer_norm.default", 3), Fault(A + "gelu_backward.default", 1))),
    RealModel("llama", _llama, _tokens, False,
              (Fault(A + "_scaled_dot_product_flash_attention_for_cpu.default", 2),
               Fault(A + "mm.default", 30))),
    RealModel("resnet", _resnet, _pixels, True,
              (Fault(A + "convolution.default", 3), Fault(A + "native_batch_norm_backward.default", 2))),
    RealModel("mobilenet", _mobilenet, _pixels, True,
              (Fault(A + "convolution.default", 6), Fault(A + "convolution_backward.default", 8))),
    RealModel("convnext", _convnext, _pixels, True,
              (Fault(A + "convolution.default", 3), Fault(A + "native_layer_norm_backward.default", 1))),
    RealModel("vit", lambda: _vit(), lambda: _pixels(16), True,
              (Fault(A + "addmm.default", 6), Fault(A + "native_layer_norm_backward.default", 2))),
)}


def step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, image: bool) -> None:
    model.zero_grad(set_to_none=True)
    if image:
        logits = model(pixel_values=x).logits
        loss = F.cross_entropy(logits.float(), y)
    else:
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    loss.backward()


def make(name: str, dtype: torch.dtype = torch.float32):
    spec = MODELS[name]
    torch.manual_seed(0)
    model = spec.build().train().to(dtype)
    x, y = spec.inputs()
    if x.is_floating_point():
        x = x.to(dtype)
    return spec, model, x, y


def dump(name: str, path: str, dtype: torch.dtype = torch.float32, *, load: str | None = None,
         fault: Fault | None = None) -> str:
    """One training step of model `name` in `dtype`: a plain dump, or a load-replay of `load`."""
    spec, model, x, y = make(name, dtype)
    ctx = inject_fault(fault.op, rel=fault.rel, call=fault.call) if fault else contextlib.nullcontext()
    kw = dict(use_load=True, load_file_path=load) if load else dict(use_dump=True)
    with ctx, torch.utils.dumper(dump_path=path, **kw):
        step(model, x, y, spec.image)
    return path


def planted_seqid(golden: str, fault: Fault) -> int:
    """The golden seqid of the planted call (the k-th call of the op in the recording)."""
    from dumpfile.read.reader import DumpFile
    f = DumpFile(golden)
    try:
        seqids = [op.seqid for op in f.ops() if op.op == fault.op]
    finally:
        f.close()
    return seqids[fault.call - 1]
