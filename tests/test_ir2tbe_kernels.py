"""IR op -> kernels: the recorded kernel data equals running the decomposition by hand."""

from __future__ import annotations

import math
import os
import warnings

import pytest
import torch

from ir2tbe.acl_config import (AclConfig, AclConfigError, AclConfigWarning, check_acl_dump_env,
                               load_acl_config)
from ir2tbe.acl_dump import KernelDumpWriter, read_map, sanitize
from ir2tbe.dump_data import read_kernel_dump
from ir2tbe.kernels import lower_to_kernels

aten, prims = torch.ops.aten, torch.ops.prims

GUIDE_ACL_JSON = """{
    "dump":
    {
            "dump_list":[]
            "dump_path":"./output_IR2TBE"# 映射结果输出路径
            "dump_mode":"all"
            "dump_op_switch":"on"
    }
}
"""


def _names(mapping):
    return [k.name for k in mapping.kernels]


def test_gelu_kernels_match_erf_formula_by_hand():
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    m = lower_to_kernels(aten.gelu.default, (x,))
    assert _names(m) == ["prims.mul.default", "prims.mul.default", "prims.erf.default",
                         "prims.add.default", "prims.mul.default"]
    assert all(k.decomposed_from[0] == "aten.gelu.default" for k in m.kernels)
    erf_in = x * (1 / math.sqrt(2))
    erf = m.kernels[2]
    torch.testing.assert_close(erf.inputs[0], erf_in, rtol=0, atol=0)
    torch.testing.assert_close(erf.outputs[0], torch.erf(erf_in), rtol=0, atol=0)
    torch.testing.assert_close(m.kernels[3].outputs[0], torch.erf(erf_in) + 1, rtol=0, atol=0)
    last = m.kernels[-1]
    torch.testing.assert_close(last.outputs[0], m.decomposed_outputs, rtol=0, atol=0)
    torch.testing.assert_close(m.native_outputs, torch.nn.functional.gelu(x), rtol=0, atol=0)
    assert m.max_abs_diff is not None and m.max_abs_diff < 1e-6


def test_softmax_bf16_shows_upcast_and_each_step():
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    m = lower_to_kernels(aten._softmax.default, (x, -1, False))
    names = _names(m)
    assert names[1:-1] == ["prims.amax.default", "prims.sub.default", "prims.exp.default",
                           "prims.sum.default", "prims.div.default"]
    # the precision-changing steps are kernels too: bf16 -> fp32 first, fp32 -> bf16 last
    assert (m.kernels[0].inputs[0].dtype, m.kernels[0].outputs[0].dtype) == (torch.bfloat16, torch.float32)
    assert m.kernels[-1].outputs[0].dtype == torch.bfloat16
    xf = x.float()
    amax = xf.amax(-1, keepdim=True)
    e = torch.exp(xf - amax)
    torch.testing.assert_close(m.kernels[1].outputs[0].reshape(-1), amax.reshape(-1), rtol=0, atol=0)
    torch.testing.assert_close(m.kernels[3].outputs[0], e, rtol=0, atol=0)
    torch.testing.assert_close(m.kernels[5].outputs[0], e / e.sum(-1, keepdim=True), rtol=0, atol=0)
    torch.testing.assert_close(m.native_outputs, torch.softmax(x, -1), rtol=0, atol=0)


def test_layer_norm_kernels_match_by_hand():
    g = torch.Generator().manual_seed(2)
    x, w, b = torch.randn(3, 8, generator=g), torch.randn(8, generator=g), torch.randn(8, generator=g)
    m = lower_to_kernels(aten.native_layer_norm.default, (x, [8], w, b, 1e-5))
    names = _names(m)
    assert "prims.rsqrt.default" in names and "prims.var.default" in names
    var = x.var(-1, unbiased=False, keepdim=True)
    rstd = torch.rsqrt(var + 1e-5)
    rsqrt = m.kernels[names.index("prims.rsqrt.default")]
    torch.testing.assert_close(rsqrt.outputs[0], rstd, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(m.kernels[-1].outputs[0], (x - x.mean(-1, keepdim=True)) * rstd * w + b,
                               rtol=1e-5, atol=1e-5)
    out, mean, rstd_native = m.native_outputs
    torch.testing.assert_close(out, torch.nn.functional.layer_norm(x, [8], w, b, 1e-5), rtol=0, atol=0)
    assert m.max_abs_diff < 1e-5


def test_convolution_is_one_kernel_with_its_data():
    g = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(1, 2, 5, 5, generator=g), torch.randn(3, 2, 3, 3, generator=g), torch.randn(3, generator=g)
    args = (x, w, b, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    m = lower_to_kernels(aten.convolution.default, args)
    assert _names(m) == ["aten.convolution.default"] and m.kernels[0].depth == 0
    k = m.kernels[0]
    assert [tuple(t.shape) for t in k.inputs] == [(1, 2, 5, 5), (3, 2, 3, 3), (3,)]
    torch.testing.assert_close(k.outputs[0], torch.nn.functional.conv2d(x, w, b, padding=1), rtol=0, atol=0)
    assert m.max_abs_diff == 0.0


def test_inplace_op_mutates_once_and_random_op_keeps_stream():
    x = torch.ones(4)
    m = lower_to_kernels(aten.add_.Tensor, (x, torch.full((4,), 2.0)))
    assert torch.equal(x, torch.full((4,), 3.0))            # native ran once on the real tensor
    assert m.kernels[0].inputs[0].tolist() == [1.0] * 4     # kernels saw the pre-op value
    torch.manual_seed(0)
    m = lower_to_kernels(aten.native_dropout.default, (torch.ones(64), 0.5, True))
    after = torch.rand(3)
    torch.manual_seed(0)
    native = aten.native_dropout.default(torch.ones(64), 0.5, True)
    assert torch.equal(m.native_outputs[0], native[0]) and torch.equal(after, torch.rand(3))
    assert m.max_abs_diff == 0.0


def test_writer_layout_names_and_map_lead_back_to_ir_op(tmp_path):
    x = torch.randn(2, 4)
    cfg = AclConfig(dump_path=str(tmp_path / "kd"), dump_mode="all", dump_op_switch="on")
    w = KernelDumpWriter(cfg)
    m = lower_to_kernels(aten.gelu.default, (x,))
    written = w.write(m, 17)
    assert len(written) == len(m.kernels)
    rows = read_map(w.map_path)
    assert len(rows) == len(m.kernels)
    root = os.path.dirname(w.map_path)
    for row, k in zip(rows, m.kernels):
        assert (row["ir_op"], row["seqid"], row["kernel_op"]) == ("aten.gelu.default", "17", k.name)
        path = os.path.join(root, row["file"])
        rel = os.path.relpath(path, tmp_path / "kd").split(os.sep)
        assert len(rel[0]) == 14 and rel[1:4] == ["0", "17", "0"]     # {time}/{device}/{model_id}/{index}
        op_type, op_name, task, stream, stamp = rel[4].split(".")
        assert op_type == sanitize(k.name) and op_name == f"aten_gelu_default_17_{k.order}"
        assert stream == "0" and stamp.isdigit()
        d = read_kernel_dump(path)
        assert d.op_name == k.name
        torch.testing.assert_close(torch.from_numpy(d.outputs[0].array()), k.outputs[0], rtol=0, atol=0)
        assert d.outputs[0].original_op == "aten.gelu.default"
    assert sanitize("a.b/c\\d e") == "a_b_c_d_e"


def test_writer_honours_dump_mode_switch_and_list(tmp_path):
    x = torch.randn(2, 4)
    m = lower_to_kernels(aten.gelu.default, (x,))
    w = KernelDumpWriter(AclConfig(dump_path=str(tmp_path / "in"), dump_mode="input", dump_op_switch="on"))
    d = read_kernel_dump(w.write(m, 1)[0].path)
    assert len(d.inputs) == 1 and d.outputs == []
    w = KernelDumpWriter(AclConfig(dump_path=str(tmp_path / "off"), dump_mode="all", dump_op_switch="off"))
    with pytest.warns(UserWarning, match="dump_op_switch"):
        assert w.write(m, 1) == []
    assert not (tmp_path / "off").exists()
    w = KernelDumpWriter(AclConfig(dump_path=str(tmp_path / "l"), dump_op_switch="on", dump_list=("prims.erf*",)))
    assert [x.kernel.name for x in w.write(m, 1)] == ["prims.erf.default"]
    assert w.write(lower_to_kernels(aten.relu.default, (x,)), 2) == []
    w = KernelDumpWriter(AclConfig(dump_path=str(tmp_path / "g"), dump_op_switch="on", dump_list=("gelu",)))
    assert len(w.write(m, 1)) == len(m.kernels)


# ---- acl.json -------------------------------------------------------------------
def test_acl_json_guide_example_is_repaired_with_a_warning(tmp_path):
    p = tmp_path / "acl.json"
    p.write_text(GUIDE_ACL_JSON, encoding="utf-8")
    with pytest.warns(AclConfigWarning, match='read it as: {"dump": {"dump_list": \\[\\], "dump_path"'):
        cfg = load_acl_config(p)
    assert (cfg.dump_path, cfg.dump_mode, cfg.enabled, cfg.dump_list) == ("./output_IR2TBE", "all", True, ())


def test_acl_json_strict_file_no_warning_and_defaults(tmp_path):
    p = tmp_path / "acl.json"
    p.write_text('{"dump": {"dump_path": "out", "dump_list": [{"model_name": "m", "layer": ["gelu"]}]}}')
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_acl_config(p)
    assert (cfg.dump_mode, cfg.dump_op_switch, cfg.dump_list) == ("output", "off", ("gelu",))


@pytest.mark.parametrize("text, match", [
    ('{"dump": {"dump_mode": "everything", "dump_op_switch": "on"}}', "unknown dump_mode 'everything'"),
    ('{"dumps": {}}', 'no "dump" key'),
    ('{"dump": {"dump_op_switch": "yes"}}', "dump_op_switch must be"),
    ('{"dump": {"dump_list": "gelu"}}', "dump_list must be a list"),
    ("{ this is not json", "not valid JSON"),
])
def test_acl_json_errors_are_one_line(tmp_path, text, match):
    p = tmp_path / "acl.json"
    p.write_text(text)
    with pytest.raises(AclConfigError, match=match) as info:
        load_acl_config(p)
    assert str(info.value).startswith(str(p)) and "\n" not in str(info.value)


def test_acl_json_missing_file_and_env_refusal(tmp_path):
    with pytest.raises(AclConfigError, match="no such file"):
        load_acl_config(tmp_path / "acl.json")
    with pytest.raises(AclConfigError, match="ACL_DUMP_DATA=1"):
        check_acl_dump_env({"ACL_DUMP_DATA": "1"})
    check_acl_dump_env({"ACL_DUMP_DATA": "0"})
