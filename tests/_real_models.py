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
    # logits from (model, x) where the model takes more than input_ids / pixel_values
    # (encoder-decoders, audio features); None: input_ids= or pixel_values=
    forward: Callable | None = None


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


# ---- a second set: architectures the first set lacks (benchmarks/real_models_trial.py) ----

def _t5():
    from transformers import T5Config, T5ForConditionalGeneration
    cfg = T5Config(vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                   relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
                   decoder_start_token_id=0, pad_token_id=0)
    return T5ForConditionalGeneration(cfg)


def _enc_dec(model, x):
    # teacher forcing on the same tokens: the decoder's self- and cross-attention both run
    return model(input_ids=x, decoder_input_ids=x).logits


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(**_no_dropout(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
    cfg._attn_implementation = "sdpa"
    return Qwen2ForCausalLM(cfg)


def _distilbert():
    from transformers import DistilBertConfig, DistilBertForMaskedLM
    cfg = DistilBertConfig(vocab_size=96, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=32,
                           dropout=0.0, attention_dropout=0.0, qa_dropout=0.0, seq_classif_dropout=0.0)
    return DistilBertForMaskedLM(cfg)


def _gpt_neox():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    cfg = GPTNeoXConfig(**_no_dropout(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, max_position_embeddings=32, rotary_pct=0.5,
                                      hidden_dropout=0.0))
    return GPTNeoXForCausalLM(cfg)


def _falcon():
    from transformers import FalconConfig, FalconForCausalLM
    # ALiBi instead of rotary, multi-query attention, parallel attention + MLP
    cfg = FalconConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=True,
                       multi_query=True, parallel_attn=True, hidden_dropout=0.0, attention_dropout=0.0)
    return FalconForCausalLM(cfg)


def _swin():
    from transformers import SwinConfig, SwinForImageClassification
    # shifted windows with a relative position bias table, patch merging
    cfg = SwinConfig(**_no_dropout(image_size=16, patch_size=2, embed_dim=16, depths=[2, 1], num_heads=[2, 4],
                                   window_size=4, mlp_ratio=2.0, num_labels=10, hidden_dropout_prob=0.0,
                                   attention_probs_dropout_prob=0.0))
    return SwinForImageClassification(cfg)


def _whisper():
    from transformers import WhisperConfig, WhisperForConditionalGeneration
    cfg = WhisperConfig(vocab_size=96, num_mel_bins=8, encoder_layers=1, decoder_layers=1, d_model=32,
                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                        decoder_ffn_dim=64, max_source_positions=8, max_target_positions=16, dropout=0.0,
                        attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0, bos_token_id=1,
                        eos_token_id=2, decoder_start_token_id=1)
    return WhisperForConditionalGeneration(cfg)


def _audio():
    g = torch.Generator().manual_seed(1)
    # 8 mel bins x 16 frames (two stride-2 convs -> max_source_positions 8); 12 decoder tokens
    return torch.randn(2, 8, 16, generator=g), torch.randint(0, 96, (2, 12), generator=g)


def _speech(model, x):
    ids = torch.arange(12).remainder(96).repeat(x.shape[0], 1)
    return model(input_features=x, decoder_input_ids=ids).logits


def _mobilevit():
    from transformers import MobileViTConfig, MobileViTForImageClassification
    cfg = MobileViTConfig(image_size=32, patch_size=2, hidden_sizes=[16, 24, 32], neck_hidden_sizes=[8, 8, 16, 16, 24,
                          32, 48], num_attention_heads=2, mlp_ratio=2.0, num_labels=10, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0)
    return MobileViTForImageClassification(cfg)


def _deepseek_v2():
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM
    # complex rotary (torch.polar / view_as_complex), multi-head latent attention, MoE
    cfg = DeepseekV2Config(vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                           n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=16,
                           q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8,
                           max_position_embeddings=32, attention_dropout=0.0)
    return DeepseekV2ForCausalLM(cfg)


TRIAL: dict[str, RealModel] = {m.name: m for m in (
    RealModel("t5", _t5, _tokens, False,
              (Fault(A + "mm.default", 50), Fault(A + "rsqrt.default", 6)), _enc_dec),
    RealModel("qwen2", _qwen2, _tokens, False,
              (Fault(A + "silu.default", 2), Fault(A + "addmm.default", 3))),
    RealModel("distilbert", _distilbert, _tokens, False,
              (Fault(A + "native_layer_norm.default", 3), Fault(A + "mm.default", 14))),
    RealModel("gpt_neox", _gpt_neox, _tokens, False,
              (Fault(A + "gelu.default", 2), Fault(A + "cat.default", 8))),
    RealModel("falcon", _falcon, _tokens, False,
              (Fault(A + "bmm.default", 3), Fault(A + "_softmax_backward_data.default", 1))),
    RealModel("swin", _swin, lambda: _pixels(16), True,
              (Fault(A + "roll.default", 2), Fault(A + "addmm.default", 10))),
    RealModel("whisper", _whisper, _audio, False,
              (Fault(A + "convolution.default", 2), Fault(A + "addmm.default", 7)), _speech),
    RealModel("mobilevit", _mobilevit, _pixels, True,
              (Fault(A + "native_batch_norm.default", 16), Fault(A + "bmm.default", 8))),
    RealModel("deepseek_v2", _deepseek_v2, _tokens, False,
              (Fault(A + "polar.default", 1), Fault(A + "_grouped_mm.default", 3))),
)}


# the three of the second set that found the most (tests/test_real_models.py runs them):
# Falcon's finfo(dtype).min mask, Whisper's float16 gradients at the underflow edge,
# DeepSeek-V2's complex rotary and copy_ into new_empty_strided
for _n in ("falcon", "whisper", "deepseek_v2"):
    MODELS[_n] = TRIAL[_n]

def step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, image: bool,
         forward: Callable | None = None) -> None:
    model.zero_grad(set_to_none=True)
    if forward is not None:
        logits = forward(model, x)
        loss = F.cross_entropy(logits.float().flatten(0, -2), y.flatten())
    elif image:
        logits = model(pixel_values=x).logits
        loss = F.cross_entropy(logits.float(), y)
    else:
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    loss.backward()


def spec_of(name: str) -> RealModel:
    return MODELS[name] if name in MODELS else TRIAL[name]


def make(name: str, dtype: torch.dtype = torch.float32):
    spec = spec_of(name)
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
        step(model, x, y, spec.image, spec.forward)
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
