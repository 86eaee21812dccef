"""Aligning op streams that compute one thing with different ops (accucmp/compare/align.py):
real dumps of two runs, the target with the fused op, the golden with its decomposition."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import npu_dumper  # noqa: F401  (installs torch.utils.dumper)
from npu_dumper import inject_fault
from accucmp.compare.pipeline import CompareError, compare_dumps
from accucmp.compare.verdict import apply_verdict


class _Attn(nn.Module):
    def __init__(self, fused: bool):
        super().__init__()
        self.fused, self.qkv = fused, nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 5, 3, 2, 8).permute(2, 0, 3, 1, 4).unbind(0)
        if self.fused:
            return F.scaled_dot_product_attention(q, k, v)
        return ((q @ k.transpose(-2, -1)) / 8 ** 0.5).softmax(-1) @ v


class _Linear(nn.Module):
    def __init__(self, fused: bool):
        super().__init__()
        self.fused, self.lin = fused, nn.Linear(16, 16)

    def forward(self, x):
        return self.lin(x) if self.fused else x @ self.lin.weight.t() + self.lin.bias


class _Norm(nn.Module):
    def __init__(self, fused: bool):
        super().__init__()
        self.fused, self.ln = fused, nn.LayerNorm(16)

    def forward(self, x):
        if self.fused:
            return self.ln(x)
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        return (x - mean) * torch.rsqrt(var + self.ln.eps) * self.ln.weight + self.ln.bias


class _Net(nn.Module):
    def __init__(self, block, fused: bool):
        super().__init__()
        self.block, self.out = block(fused), nn.Linear(16, 4)

    def forward(self, x):
        h = self.block(x)
        if h.dim() == 4:
            h = h.transpose(1, 2).reshape(2, 5, 16)
        return self.out(torch.relu(h))


def _dump(path, block, fused, fault=None):
    torch.manual_seed(0)
    net, x = _Net(block, fused), torch.randn(2, 5, 16)
    import contextlib
    ctx = inject_fault(fault, rel=0.07, call=1) if fault else contextlib.nullcontext()
    with ctx, torch.utils.dumper(dump_path=str(path), use_dump=True):
        net(x).sum().backward()
    return str(path)


def _compare(tmp_path, block, fault=None, **kw):
    t = _dump(tmp_path / "t.h5", block, True, fault)
    g = _dump(tmp_path / "g.h5", block, False)
    res = compare_dumps(t, g, **kw)
    return apply_verdict(res.table), res.meta


def _regions(table):
    return table[table["MatchedBy"] == "region"]


def test_sdpa_against_matmul_softmax_matmul(tmp_path):
    table, meta = _compare(tmp_path, _Attn)
    reg = _regions(table)
    fwd = reg[reg["Phase"] == "forward"]
    bwd = reg[reg["Phase"] == "backward"]
    assert set(fwd["NPUDump"]) == {"aten._scaled_dot_product_flash_attention_for_cpu"}
    assert "aten._softmax" in fwd["GoldenOp"].iloc[0] and "aten.bmm" in fwd["GoldenOp"].iloc[0]
    assert "output" in set(fwd["IO"])
    assert set(bwd["NPUDump"]) == {"aten._scaled_dot_product_flash_attention_for_cpu_backward"}
    assert {"grad_query", "grad_value"} <= {n.split(":")[-1] for n in bwd[bwd["IO"] == "output"]["TensorName"]}
    assert len(meta["aligned_regions"]) == 2 and "≈" in meta["aligned_regions"][0]
    assert (reg["Result"] == "pass").all()                  # clean: the region's rows pass
    assert (table["Result"] != "fail").all()
    # ops left over are listed as unmatched, never judged
    assert (table[table["MatchedBy"] == "unmatched"]["Result"] == "unmatched").all()


def test_fault_inside_fused_attention_is_named(tmp_path):
    table, _ = _compare(tmp_path, _Attn, fault="aten._scaled_dot_product_flash_attention_for_cpu")
    fails = table[table["Result"] == "fail"]
    first = fails.iloc[0]
    assert first["MatchedBy"] == "region" and first["IO"] == "output"
    assert first["NPUDump"] == "aten._scaled_dot_product_flash_attention_for_cpu"
    # its inputs agree: the region is where the error starts
    ins = _regions(table)[(_regions(table)["Phase"] == "forward") & (_regions(table)["IO"] == "input")]
    assert len(ins) and (ins["Result"] == "pass").all()


def test_addmm_against_mm_add(tmp_path):
    table, meta = _compare(tmp_path, _Linear)
    reg = _regions(table)
    fwd = reg[reg["Phase"] == "forward"]
    assert set(fwd["NPUDump"]) == {"aten.addmm"} and set(fwd["GoldenOp"]) == {"aten.mm+aten._unsafe_view+aten.add.Tensor"}
    assert (reg["Result"] == "pass").all() and (table["Result"] != "fail").all()
    bad, _ = _compare(tmp_path, _Linear, fault="aten.addmm")
    first = bad[bad["Result"] == "fail"].iloc[0]
    assert first["MatchedBy"] == "region" and first["NPUDump"] == "aten.addmm" and first["IO"] == "output"


def test_layer_norm_against_decomposition(tmp_path):
    table, meta = _compare(tmp_path, _Norm)
    reg = _regions(table)
    fwd = reg[(reg["Phase"] == "forward") & (reg["IO"] == "output")]
    assert "aten.native_layer_norm" in set(fwd["NPUDump"])
    assert "aten.rsqrt" in fwd["GoldenOp"].iloc[0]
    assert (reg["Result"] == "pass").all() and (table["Result"] != "fail").all()
    bad, _ = _compare(tmp_path, _Norm, fault="aten.native_layer_norm")
    first = bad[bad["Result"] == "fail"].iloc[0]
    assert first["MatchedBy"] == "region" and first["NPUDump"] == "aten.native_layer_norm"


def test_align_map_module_rename(tmp_path):
    """Different module paths cannot be inferred: the override file maps them."""
    t = _dump(tmp_path / "t.h5", _Linear, True)
    g = _dump(tmp_path / "g.h5", _Linear, False)
    amap = tmp_path / "map.txt"
    amap.write_text("# target = golden\nop aten.addmm = aten.mm + aten._unsafe_view + aten.add\n")
    res = compare_dumps(t, g, align_map=str(amap))
    assert any("(op map)" in r for r in res.meta["aligned_regions"])
    bad = tmp_path / "bad.txt"
    bad.write_text("modul a = b\n")
    with pytest.raises(CompareError, match=r"bad.txt:1: expected"):
        compare_dumps(t, g, align_map=str(bad))


def test_cli_align_map_and_bad_map(tmp_path):
    import subprocess
    import sys
    t = _dump(tmp_path / "t.h5", _Linear, True)
    g = _dump(tmp_path / "g.h5", _Linear, False)
    good = tmp_path / "map.json"
    good.write_text('{"ops": {"aten.addmm": "aten.mm+aten._unsafe_view+aten.add"}}')
    run = lambda m: subprocess.run([sys.executable, "-m", "accucmp.cli", "compare", "-m", t, "-g", g,  # noqa: E731
                                    "-o", str(tmp_path / "out"), "--align-map", str(m)],
                                   capture_output=True, text=True)
    ok = run(good)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "aligned region (op map): aten.addmm ≈ aten.mm+aten._unsafe_view+aten.add.Tensor" in ok.stdout
    bad = tmp_path / "bad.json"
    bad.write_text('{"opz": {}}')
    res = run(bad)
    assert res.returncode == 2 and "bad.json: expected" in res.stderr and "Traceback" not in res.stderr


def _adam_dump(path, foreach, fault=None):
    import contextlib
    torch.manual_seed(0)
    net, x = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 3)), torch.randn(4, 8)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2, foreach=foreach)
    net(x).sum().backward()
    ctx = inject_fault(fault, rel=0.07, call=1) if fault else contextlib.nullcontext()
    with ctx, torch.utils.dumper(dump_path=str(path), use_dump=True):
        opt.step()
    return str(path)


def test_foreach_adam_against_per_parameter_adam(tmp_path):
    g = _adam_dump(tmp_path / "g.h5", False)
    res = compare_dumps(_adam_dump(tmp_path / "t.h5", True), g)
    table = apply_verdict(res.table)
    reg = _regions(table)
    assert len(res.meta["aligned_regions"]) == 1
    assert reg["NPUDump"].iloc[0].startswith("aten._foreach_add_.Tensor+aten._foreach_lerp_.Scalar")
    assert "ops)" in reg["GoldenOp"].iloc[0]                 # the per-parameter ops, shortened
    outs = reg[reg["IO"] == "output"]
    # the four parameters' updates, each against its own per-parameter result
    assert sorted(outs["Shape"]) == ["(3)", "(3,8)", "(8)", "(8,8)"]
    assert (reg["Result"] == "pass").all() and (table["Result"] != "fail").all()
    bad = apply_verdict(compare_dumps(_adam_dump(tmp_path / "f.h5", True, "aten._foreach_sqrt"), g).table)
    fails = bad[bad["Result"] == "fail"]
    assert len(fails) and (fails["MatchedBy"] == "region").all() and (fails["IO"] == "output").all()


def _gpt2_dump(path, impl, fault=None):
    import contextlib
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation=impl)
    model = transformers.GPT2LMHeadModel(cfg).train()
    if model.config._attn_implementation != impl:
        pytest.skip(f"transformers gives {model.config._attn_implementation!r} for {impl!r}")
    x = torch.randint(0, 96, (2, 12))
    ctx = inject_fault(fault, rel=0.07, call=2) if fault else contextlib.nullcontext()
    with ctx, torch.utils.dumper(dump_path=str(path), use_dump=True):
        F.cross_entropy(model(input_ids=x).logits.flatten(0, 1), x.flatten()).backward()
    return str(path)


def test_gpt2_sdpa_against_eager(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    g = _gpt2_dump(tmp_path / "g.h5", "eager")
    res = compare_dumps(_gpt2_dump(tmp_path / "t.h5", "sdpa"), g)
    table = apply_verdict(res.table)
    # every attention of both layers, forward and backward, is one region
    reg = _regions(table).drop_duplicates(["Phase", "Module"])
    assert sorted(zip(reg["Phase"], reg["Module"])) == [
        (p, f"transformer.h.{i}.attn") for p in ("backward", "forward") for i in (0, 1)]
    assert res.meta["unmatched_target_ops"] == 0
    # the eager path's own mask building (where, arange, ...) is listed, not judged
    assert res.meta["unmatched_golden_ops"] > 0
    assert "aten.where.self" in set(table[table["Result"] == "unmatched"]["NPUDump"])
    assert (table["Result"] != "fail").all()
    bad = apply_verdict(compare_dumps(_gpt2_dump(tmp_path / "f.h5", "sdpa",
                                                 "aten._scaled_dot_product_flash_attention_for_cpu"), g).table)
    first = bad[bad["Result"] == "fail"].iloc[0]
    assert (first["MatchedBy"], first["Module"], first["IO"]) == ("region", "transformer.h.1.attn", "output")


class _Manual(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(16, 16)

    def forward(self, x):
        return x @ self.inner.weight.t() + self.inner.bias


class _Renamed(nn.Module):
    """The golden's module path differs (block.proj vs block.lin): not inferable."""

    def __init__(self, fused: bool):
        super().__init__()
        self.fused = fused
        if fused:
            self.lin = nn.Linear(16, 16)
        else:
            self.proj = _Manual()

    def forward(self, x):
        return self.lin(x) if self.fused else self.proj(x)


def test_align_map_module_paths(tmp_path):
    t = _dump(tmp_path / "t.h5", _Renamed, True)
    g = _dump(tmp_path / "g.h5", _Renamed, False)
    plain = apply_verdict(compare_dumps(t, g).table)
    assert not len(_regions(plain)) and (plain["Result"] == "unmatched").any()
    amap = tmp_path / "map.txt"
    amap.write_text("module block.lin = block.proj\n")
    res = compare_dumps(t, g, align_map=str(amap))
    table = apply_verdict(res.table)
    assert any("(module map): aten.addmm ≈ aten.mm" in r for r in res.meta["aligned_regions"])
    assert (_regions(table)["Result"] == "pass").all() and (table["Result"] != "fail").all()


def test_statistics_only_dumps_align_by_shape(tmp_path):
    """No values stored: regions are found by shapes, outputs paired with the last ops'."""
    def dump(path, fused):
        torch.manual_seed(0)
        net, x = _Net(_Linear, fused), torch.randn(2, 5, 16)
        with torch.utils.dumper(use_dump=True, dump_path=str(path), stats_only=True):
            net(x).sum().backward()
        return str(path)
    table = apply_verdict(compare_dumps(dump(tmp_path / "t.h5", True), dump(tmp_path / "g.h5", False)).table)
    out = _regions(table)[(_regions(table)["Phase"] == "forward") & (_regions(table)["IO"] == "output")]
    assert list(out["GroundTruthPath"]) == ["/aten.add.Tensor/3/output/result"]   # not the mm's
    assert (table["Result"] != "fail").all()
