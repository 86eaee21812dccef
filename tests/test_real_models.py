"""Diagnosis on third-party models (Hugging Face transformers: GPT-2, BERT, RoBERTa, Llama with
grouped-query attention and SDPA, ResNet, MobileNetV2, ConvNeXt, ViT, Falcon with ALiBi,
Whisper, DeepSeek-V2 with complex rotary and MoE; random weights, tiny
sizes, no download): one training step dumped in fp32, replayed and re-run in fp32, bf16 and
fp16, clean and with one planted 7% fault in the middle of the network (tests/_real_models.py).

* clean load-replays (fp32, bf16, fp16): 0 failing rows, but where float16 cannot hold the
  golden's values (these models are cast with `model.to(float16)` and have no loss scaler: BERT's
  weight gradients of 1e-7, ConvNeXt's layer scale of 1e-6 zeroing its branches): those rows
  fail as `underflow`, none as caused here;
* a planted fault in a bf16 / fp16 load-replay: that op (that call) is the first failure;
* plain dump vs dump (fp32 golden vs a faulted fp32 run): the first "caused here" op is the
  planted one, and the ops after it are marked inherited.

The default run takes six models, clean replays in bf16/fp16 and one fault per dtype;
ACCUCMP_REAL_MODELS=all runs every model with both of its faults, and fp32 clean replays too.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from accucmp.compare.pipeline import compare_dumps  # noqa: E402
from accucmp.compare.op_policies import ORIGIN_CAUSED, ORIGIN_INHERITED, ORIGIN_UNDERFLOW  # noqa: E402
from accucmp.compare.verdict import apply_verdict  # noqa: E402
from accucmp.report.findings import first_failure  # noqa: E402
from tests import _real_models as R  # noqa: E402

ALL = os.environ.get("ACCUCMP_REAL_MODELS", "") == "all"
# the default subset (nine architectures; RoBERTa is BERT's, the 516-op MobileNetV2 the slowest;
# Falcon, Whisper and DeepSeek-V2 from the second set, benchmarks/real_models_trial.py)
FAST = ("gpt2", "bert", "llama", "resnet", "convnext", "vit", "falcon", "whisper", "deepseek_v2")
MODELS = list(R.MODELS) if ALL else list(FAST)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.fixture(scope="module")
def goldens(tmp_path_factory):
    d = tmp_path_factory.mktemp("real_models")
    cache: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in cache:
            cache[name] = R.dump(name, str(d / f"{name}_golden.h5"))
        return cache[name]
    get.dir = d
    return get


def _judged(target: str, golden: str):
    return apply_verdict(compare_dumps(target, golden).table)


def _fails(t):
    return t[t["Result"] == "fail"][["NPUDump", "SeqId", "TensorName", "ErrorUlps", "FailReason"]].to_string()


@pytest.mark.parametrize("dtype", list(DTYPES) if ALL else ["bf16", "fp16"])
@pytest.mark.parametrize("name", MODELS)
def test_clean_replay_has_no_failing_rows(goldens, name, dtype):
    g = goldens(name)
    t = _judged(R.dump(name, str(goldens.dir / f"{name}_{dtype}_clean.h5"), DTYPES[dtype], load=g), g)
    fails = t[t["Result"] == "fail"]
    if dtype == "fp16":
        # values below float16's normal range that it cannot hold (verdict's UnderflowLoss)
        assert (fails["Origin"] == ORIGIN_UNDERFLOW).all() and (fails["RangeLoss"] > 0.0625).all(), _fails(t)
    else:
        assert fails.empty, _fails(t)
    assert (t["Result"] == "pass").sum() > 50
    if dtype != "fp32":
        # the verdict judged the low-precision ops by what they were given, not the golden
        low = t[(t["IO"] == "output") & (t["DataType"] == str(DTYPES[dtype])[6:])]
        assert low["OwnErrorVsFp64"].notna().mean() > 0.8


def _faults(name):
    faults = R.MODELS[name].faults
    return [(d, f) for d in ("bf16", "fp16") for i, f in enumerate(faults) if ALL or i == ("bf16", "fp16").index(d)]


@pytest.mark.parametrize("name,dtype,fault", [(n, d, f) for n in MODELS for d, f in _faults(n)],
                         ids=lambda v: v.op.split(".")[1] if isinstance(v, R.Fault) else str(v))
def test_planted_fault_named_first_in_replay(goldens, name, dtype, fault):
    g = goldens(name)
    t = _judged(R.dump(name, str(goldens.dir / f"{name}_{dtype}_fault.h5"), DTYPES[dtype], load=g, fault=fault), g)
    ff = first_failure(t)
    assert ff is not None, "the planted fault was not seen"
    assert (ff["NPUDump"], int(ff["SeqId"])) == (fault.op, R.planted_seqid(g, fault)), _fails(t)
    # and nothing else fails: each replayed op got the golden's inputs (but for values float16
    # cannot hold, as in the clean replay)
    fails = t[(t["Result"] == "fail") & (t["Origin"] != ORIGIN_UNDERFLOW)]
    assert set(fails["NPUDump"]) == {fault.op}, _fails(t)


@pytest.mark.parametrize("name", MODELS)
def test_plain_dumps_name_the_planted_op_caused_here(goldens, name):
    g = goldens(name)
    fault = R.MODELS[name].faults[0]
    t = _judged(R.dump(name, str(goldens.dir / f"{name}_plain_fault.h5"), fault=fault), g)
    ff = first_failure(t)
    assert ff is not None and ff["Origin"] == ORIGIN_CAUSED
    assert (ff["NPUDump"], int(ff["GoldenSeqId"])) == (fault.op, R.planted_seqid(g, fault)), _fails(t)
    assert (t["Origin"] == ORIGIN_INHERITED).sum() > 0      # the error spread, and is marked so


@pytest.mark.parametrize("name", [n for n in MODELS if n in R.TRIAL])
def test_two_fp32_plain_dumps_agree(goldens, name):
    """Two identical fp32 steps: no failing row (DeepSeek-V2 copies into new_empty_strided:
    that destination's old bytes are garbage, not data; Falcon's finfo.min mask)."""
    g = goldens(name)
    t = _judged(R.dump(name, str(goldens.dir / f"{name}_plain_clean.h5")), g)
    assert (t["Result"] != "fail").all(), _fails(t)


def test_bf16_plain_dump_names_no_op_for_a_regrouped_gradient_sum(goldens):
    """Llama in bf16: RMSNorm's `x.to(float32)` makes autograd sum the norm's two gradient
    terms first, (a+b)+residual, where fp32 (no cast, one tensor) sums (residual+a)+b. The
    aligner pairs the regrouped partial sums as one region (`_to_copy+add+_to_copy ≈ add`,
    cosine 0.09); its golden input `residual` has no partner on the bf16 side, so the region
    is not "caused here" (it was named the first failure of a clean run)."""
    g = goldens("llama")
    t = _judged(R.dump("llama", str(goldens.dir / "llama_bf16_plain_clean.h5"), torch.bfloat16), g)
    caused = t[(t["Result"] == "fail") & (t["Origin"] == ORIGIN_CAUSED)]
    assert caused.empty, _fails(caused)
    region = t[(t["MatchedBy"] == "unmatched") & t["CompareFailReason"].str.contains("no partner")]
    assert len(region) > 0           # the unpaired input is listed, not silently dropped
    # every op of the bf16 run (the region's ops too) is within its own error on its own
    # inputs (the dumper measured it): nothing fails, the differences pass as inherited
    # (6 region rows failed as "inherited" before, and the compare exited 1)
    assert (t["Result"] != "fail").all(), _fails(t[t["Result"] == "fail"])
    assert ((t["Result"] == "pass") & (t["Origin"] == "inherited")).sum() > 0


def _layer(module: str) -> str:
    """'decoder.block.1.layer.0.layer_norm' -> 'decoder.block.1' (the repeated unit)."""
    parts = str(module or "").split(".")
    return ".".join(parts[:3]) if len(parts) >= 3 and parts[1] == "block" else ""


def test_t5_under_bf16_autocast_pairs_each_op_with_its_own_layer(goldens, tmp_path):
    """T5 (encoder-decoder, repeated blocks) under bf16 autocast against its fp32 dump.
    Autocast adds a cast before nearly every matmul; aligned together with them, the name
    streams fell into short runs of repeated blocks and difflib matched decoder block 0's
    backward with block 1's (112 pairs a block apart), and the compare failed on a
    backward mm input "no op of the step made" (cosine -0.007). The ops that compute are
    aligned first now (matching.pair_by_stream): every pair is within one block, and the
    run, every op within its own error on its own inputs, passes. The gradient sum of the
    tied embedding, which autograd orders differently under autocast, leaves one `add` of
    each run unpaired: not an op one run lacks, so inherited rows still pass."""
    from dumpfile.read.reader import DumpFile
    g = goldens("t5")
    spec, model, x, y = R.make("t5")
    target = str(tmp_path / "t5_autocast.h5")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        # a step before the dumped one in the same autocast region (gradient accumulation,
        # a warm-up): its weight casts are cached, so the dumped step casts activations only
        R.step(model, x, y, spec.image, spec.forward)
        with torch.utils.dumper(use_dump=True, dump_path=target):
            R.step(model, x, y, spec.image, spec.forward)
    t = _judged(target, g)
    f = DumpFile(g)
    try:
        golden_module = {op.seqid: op.module for op in f.ops()}
    finally:
        f.close()
    paired = t[t["MatchedBy"] == "name"]
    assert len(paired) > 500
    crossed = [(m, golden_module[int(s)]) for m, s in zip(paired["Module"], paired["GoldenSeqId"])
               if _layer(m) and _layer(golden_module[int(s)]) and _layer(m) != _layer(golden_module[int(s)])]
    assert not crossed, crossed[:5]
    assert (t["Result"] != "fail").all(), _fails(t[t["Result"] == "fail"])
    assert ((t["Result"] == "pass") & (t["Origin"] == ORIGIN_INHERITED)).sum() > 0


def test_fp16_run_with_a_grad_scaler_passes_with_the_scale_divided_out(goldens, tmp_path):
    """GPT-2 under fp16 autocast with GradScaler against its fp32 dump. The scaler's ops
    after the loss (`full` for the scale, `mul` of the loss and of the backward's seed) are by
    design, and every backward tensor, 65536 x the golden's, is compared with the scale
    divided out (docs/COMPARE.md, "Loss scaling"). Before, the run failed at `full`, every
    backward row 65536x off."""
    import torch.nn.functional as F
    g = goldens("gpt2")
    spec, model, x, y = R.make("gpt2")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    target = str(tmp_path / "gpt2_scaled.h5")
    with torch.utils.dumper(use_dump=True, dump_path=target):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(input_ids=x).logits.float().flatten(0, 1), y.flatten())
        scaler.scale(loss).backward()
    t = _judged(target, g)
    assert first_failure(t) is None, _fails(t[t["Result"] == "fail"])
    backward = t[(t["Phase"] == "backward") & (t["CompareStatus"] == "compared")]
    assert (backward["LossScale"] == 2.0 ** 16).sum() > 100
    assert ((t["Result"] == "pass") & (t["Origin"] == ORIGIN_INHERITED)).sum() > 0
    # the terminal says why the scaler's ops are no departure
    from typer.testing import CliRunner
    from accucmp.cli.main import app
    res = CliRunner(env={"COLUMNS": "100", "NO_COLOR": "1"}).invoke(
        app, ["compare", "-m", target, "-g", g, "-o", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    assert "the target trains with a loss scaler (GradScaler)" in " ".join(res.output.split()), res.output


def _llama_replay_headline(goldens, tmp_path, change):
    """First failure of a bf16-autocast load-replay of the Llama's golden by a model `change`d."""
    g = goldens("llama")
    spec, model, x, y = R.make("llama")
    change(model)
    target = str(tmp_path / "llama_bug.h5")
    with torch.autocast("cpu", dtype=torch.bfloat16), \
            torch.utils.dumper(use_load=True, load_file_path=g, dump_path=target):
        R.step(model, x, y, spec.image, spec.forward)
    return first_failure(_judged(target, g))


def test_replay_names_a_changed_rmsnorm_eps_as_an_argument(goldens, tmp_path):
    """Llama's RMSNorm adds its eps as a Python number to a Tensor argument (`add.Tensor`'s
    `other`). Load-replay compared only arguments the schema types as numbers, so eps 0.1
    against the recording's 1e-06 went unseen and `add` was blamed, "caused here", for
    computing what it was given."""
    def eps(model):
        model.model.layers[0].input_layernorm.variance_epsilon = 0.1
    first = _llama_replay_headline(goldens, tmp_path, eps)
    assert first["Origin"] == "departs" and first["Module"] == "model.layers.0.input_layernorm"
    assert "argument other 0.1, golden 1e-06" in first["FailReason"], first["FailReason"]


def test_replay_names_an_extra_multiply_in_its_own_block(goldens, tmp_path):
    """A forward hook scaling layer 1's gate projection by 1.05: the extra `mul` lives in
    model.layers.1.mlp, which makes a `mul` of the same shape itself. The hook's took the
    module's recorded call, and the module's own `mul` then took layer 2's, so the departure
    was named in model.layers.2.mlp; a call the recording makes in that module, with every
    such call taken, is one the live module adds."""
    def hook(model):
        model.model.layers[1].mlp.gate_proj.register_forward_hook(lambda m, i, o: o * 1.05)
    first = _llama_replay_headline(goldens, tmp_path, hook)
    assert first["Origin"] == "departs" and first["NPUDump"] == "aten.mul.Tensor"
    assert first["Module"] == "model.layers.1.mlp", (first["Module"], first["FailReason"])


def test_gradient_checkpointing_under_bf16_autocast_passes(tmp_path):
    """GPT-2 with Hugging Face gradient checkpointing under bf16 autocast against its fp32 run
    without it (no KV cache on either side). Hugging Face checkpoints a layer's `forward`, not
    its call, so no module hook marks the re-run: the layer's own ops re-run in backward (the
    residual adds) were no re-runs, and a clean run failed on an `add` "the golden run does
    not have" (28 rows), its load-replay on the re-run `native_layer_norm` (31 rows; a re-run
    was matched like any backward op, or inserted). Now the dumper also takes a forward op run
    under grad mode inside backward, under checkpoint's node or saved-tensor hooks, for a
    re-run, and load-replay runs a re-run the recording did not make live, by design.
    (Hugging Face's default, non-reentrant checkpointing: the reentrant kind also sums
    gradients where the run without it does not, extra `add`s the compare names.)"""
    from dumpfile.read.reader import DumpFile
    from npu_dumper.capture.mode import S as _S

    def run(path, checkpointing, **kw):
        spec, model, x, y = R.make("gpt2")
        model.config.use_cache = False
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if checkpointing else torch.autocast("cpu", enabled=False)
        with ctx, torch.utils.dumper(dump_path=str(path), **kw):
            R.step(model, x, y, spec.image, spec.forward)
        return str(path)

    golden = run(tmp_path / "golden.h5", False, use_dump=True)
    plain = run(tmp_path / "ckpt.h5", True, use_dump=True)
    with DumpFile(plain) as f:
        reruns = [o for o in f.ops() if o.attrs.get(_S.OP_RECOMPUTE, False)]
    assert any(o.op == "aten.add.Tensor" for o in reruns)     # the blocks' own residual adds
    replay = run(tmp_path / "ckpt_replay.h5", True, use_load=True, load_file_path=golden)
    for target in (plain, replay):
        t = _judged(target, golden)
        assert (t["Result"] != "fail").all(), (target, _fails(t[t["Result"] == "fail"]))
        assert (t["Result"] == "pass").sum() > 100
