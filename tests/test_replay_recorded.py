"""npu_dumper.replay.recorded: rebuilding calls from recorded ops, and golden replay."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from dumpfile import DumpFile, golden_info
from npu_dumper.replay.golden import replay
from npu_dumper.replay.op_names import resolve_op
from npu_dumper.replay.recorded import load_call, tensor_to_storage, with_strides

from ._replay_helpers import record

aten = torch.ops.aten


def test_resolve_op_names():
    assert resolve_op("aten.addmm.default") is aten.addmm.default
    assert resolve_op("aten::add.Tensor") is aten.add.Tensor
    assert resolve_op("aten.relu") is aten.relu.default
    assert resolve_op("add_Tensor") is aten.add.Tensor          # the original's wrapper names
    assert resolve_op("nosuchns.nosuchop.default") is None
    assert resolve_op("aten.addmm.nosuchoverload") is None


def test_custom_namespace_op_resolves(tmp_path):
    lib = torch.library.Library("bhelper_ns", "DEF")
    try:
        lib.define("twice(Tensor x) -> Tensor")
        lib.impl("twice", lambda x: x * 2, "CPU")
        op = resolve_op("bhelper_ns.twice.default")
        assert op is torch.ops.bhelper_ns.twice.default
        x = torch.arange(4.0)
        record(tmp_path / "c.h5", [(op, (x,), {})])
        with DumpFile(tmp_path / "c.h5") as d:
            call = load_call(d.ops()[0])
        assert call.ok and torch.equal(call.call(), x * 2)
    finally:
        lib._destroy()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2,
                                   torch.int64, torch.bool, torch.complex64])
def test_tensors_round_trip_bit_exact(tmp_path, dtype):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(3, 5, generator=g) * 3
    base[0, 0] = -0.0
    x = base.to(dtype) if dtype != torch.bool else base > 0
    if dtype.is_floating_point and dtype.itemsize == 2:
        x[1, 1] = float("inf")
        x[1, 2] = float("nan")
    record(tmp_path / "t.h5", [(aten.clone.default, (x,), {})])
    with DumpFile(tmp_path / "t.h5") as d:
        call = load_call(d.ops()[0])
    assert call.ok, call.why_not
    (y,) = call.args
    assert y.dtype == x.dtype and y.shape == x.shape
    bits = {1: torch.uint8, 2: torch.int16, 8: torch.int64}
    if dtype.is_floating_point:
        assert torch.equal(y.view(bits[dtype.itemsize]), x.view(bits[dtype.itemsize]))
    else:
        assert torch.equal(y, x)


def test_recorded_strides_kept_when_asked(tmp_path):
    x = torch.randn(4, 6).t()          # strides (1, 6)
    record(tmp_path / "s.h5", [(aten.clone.default, (x,), {})])
    with DumpFile(tmp_path / "s.h5") as d:
        plain = load_call(d.ops()[0]).args[0]
        strided = load_call(d.ops()[0], keep_strides=True).args[0]
    assert plain.is_contiguous() and torch.equal(plain, x)
    assert strided.stride() == x.stride() and torch.equal(strided, x)
    # an expanded layout cannot be written into: contiguous instead, same values
    e = with_strides(torch.ones(3, 4), (0, 1))
    assert e.is_contiguous()


def test_args_placed_by_schema_and_kwonly(tmp_path):
    a, b = torch.randn(3), torch.randn(3)
    record(tmp_path / "k.h5", [(aten.add.Tensor, (a, b), {"alpha": 2}),
                               (aten.sum.dim_IntList, (a.view(1, 3), [1], True), {"dtype": torch.float64})])
    with DumpFile(tmp_path / "k.h5") as d:
        add, s = (load_call(o) for o in d.ops())
    assert add.ok and add.kwargs == {"alpha": 2} and len(add.args) == 2
    assert torch.equal(add.call(), a + 2 * b)
    assert s.ok and s.kwargs["dtype"] is torch.float64 and s.call().dtype == torch.float64


def test_unreplayable_ops_give_reasons_not_exceptions(tmp_path):
    x = torch.randn(4, 4)
    record(tmp_path / "u.h5", [(aten.native_dropout.default, (x, 0.5, True), {}),
                               (aten.relu.default, (x,), {})])
    with DumpFile(tmp_path / "u.h5") as d:
        drop, relu = d.ops()
        assert "random" in load_call(drop).why_not
        # the relu call works; asking for a foreign op schema names the missing input
        mm = load_call(relu, func=aten.mm.default)
        assert not mm.ok and "'self'" not in mm.why_not and "mat2" in mm.why_not
        assert load_call(relu, device="cpu").ok


def test_golden_replay_of_fp32_ops_is_within_fp32_rounding(tmp_path):
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(16, 32, generator=g), torch.randn(32, 8, generator=g), torch.randn(8, generator=g)
    outs = record(tmp_path / "f.h5", [
        (aten.addmm.default, (b, x, w), {}),
        (aten.gelu.default, (x,), {}),
        (aten.native_layer_norm.default, (x, [32], None, None, 1e-5), {}),
        (aten._softmax.default, (x, 1, False), {}),
        (aten._to_copy.default, (x,), {"dtype": torch.bfloat16}),
    ])
    res = replay(tmp_path / "f.h5", tmp_path / "golden.h5", progress=False)
    assert res.total == 5 and res.replayed == 5 and res.not_replayed == []
    with DumpFile(tmp_path / "golden.h5") as gd:
        assert gd.mode == "golden" and gd.attrs["compute_dtype"] == "float64"
        gops = gd.ops()
        assert [o.seqid for o in gops] == [1, 2, 3, 4, 5]
        assert gops[0].attrs["module"] == "m"
        for op, out in zip(gops, outs):
            outs_rec = op.outputs()
            first = list(outs_rec.values())[0]
            gold = np.asarray(first.read())
            assert first.dtype == "float64"
            mine = (out[0] if isinstance(out, tuple) else out).float().numpy().astype(np.float64)
            rel = np.abs(mine - gold).max() / max(np.abs(gold).max(), 1e-30)
            if op.op == "aten._to_copy.default":   # the cast's own rounding is its error
                assert 0 < rel <= 2.0 ** -8
            else:
                assert rel < 64 * 2.0 ** -24, (op.op, rel)


def test_golden_lists_what_it_cannot_replay(tmp_path):
    x = torch.randn(4, 4)
    record(tmp_path / "r.h5", [(aten.native_dropout.default, (x, 0.5, True), {}),
                               (aten.relu.default, (x,), {})])
    res = replay(tmp_path / "r.h5", tmp_path / "g.h5", progress=False)
    assert res.replayed == 1 and res.not_replayed[0][:2] == ("aten.native_dropout.default", 1)
    assert "random" in res.summary()
    with DumpFile(tmp_path / "g.h5") as gd:
        listed = golden_info.read_not_replayed(gd.h5)
        assert gd.h5.attrs["num_not_replayed"] == 1
    assert "random" in listed[("aten.native_dropout.default", 1)]


def test_golden_cli(tmp_path, monkeypatch):
    from accucmp.cli.main import app
    monkeypatch.setenv("COLUMNS", "120")
    x = torch.randn(4, 4)
    record(tmp_path / "d.h5", [(aten.relu.default, (x,), {})])
    runner = CliRunner()
    ok = runner.invoke(app, ["golden", "-i", str(tmp_path / "d.h5"), "-o", str(tmp_path / "g.h5")])
    assert ok.exit_code == 0, ok.output
    assert "1/1 ops" in ok.output
    bad = runner.invoke(app, ["golden", "-i", str(tmp_path / "missing.h5"), "-o", str(tmp_path / "g.h5")])
    assert bad.exit_code == 2 and "missing.h5" in bad.output and "Traceback" not in bad.output
    notdump = tmp_path / "x.h5"
    notdump.write_text("hello")
    bad = runner.invoke(app, ["golden", "-i", str(notdump), "-o", str(tmp_path / "g.h5")])
    assert bad.exit_code == 2 and "not an HDF5" in bad.output


def test_tensor_to_storage_bf16_is_raw_bits():
    t = torch.tensor([1.0, -2.5, 3.140625], dtype=torch.bfloat16)
    data, name = tensor_to_storage(t)
    assert name == "bfloat16" and data.dtype == np.uint16
    assert (data.astype(np.uint32) << 16).view(np.float32).tolist() == [1.0, -2.5, 3.140625]


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_golden_replay_of_a_real_cpu_fp32_dump_is_within_fp32_rounding(tmp_path, name):
    import npu_dumper  # noqa: F401
    import sample_models
    from accucmp.compare.pipeline import compare_dumps
    from accucmp.compare.verdict import apply_verdict

    spec = sample_models.get(name)
    model, inputs = spec.build(seed=0, size="tiny"), spec.make_inputs(seed=0, size="tiny")
    ref = str(tmp_path / "ref.h5")
    with torch.utils.dumper(use_dump=True, dump_path=ref):
        spec.train_step(model, inputs)
    res = replay(ref, tmp_path / "golden.h5", progress=False)
    assert res.replayed == res.total > 10 and not res.not_replayed
    table = apply_verdict(compare_dumps(ref, str(tmp_path / "golden.h5")).table)
    assert set(table["Result"]) <= {"pass", "skipped"}, table[table["Result"] != "pass"]["FailReason"].tolist()
    fp32 = table[(table["DataType"] == "float32") & (table["IO"] == "output")]
    red_ulps = fp32["RelativeEuclideanDistance"].astype(float) / 2.0 ** -24
    assert len(fp32) > 10 and red_ulps.max() < 16            # a few rounding units per op
    inputs_rows = table[table["IO"] == "input"]
    assert (inputs_rows["MaxAbsoluteError"].astype(float).fillna(0) == 0).all()   # same inputs


def test_golden_inputs_of_in_place_ops_are_as_before_the_op(tmp_path):
    x = torch.full((3,), 2.0)
    record(tmp_path / "i.h5", [(aten.mul_.Tensor, (x.clone(), torch.full((3,), 3.0)), {})])
    replay(tmp_path / "i.h5", tmp_path / "g.h5", progress=False)
    with DumpFile(tmp_path / "g.h5") as g:
        op = g.ops()[0]
        assert np.asarray(op.inputs()["self"].read()).tolist() == [2.0, 2.0, 2.0]
        assert np.asarray(list(op.outputs().values())[0].read()).tolist() == [6.0, 6.0, 6.0]


def test_golden_inputs_of_hidden_writes_are_as_before_the_op(tmp_path):
    """Training-mode batch norm writes running_mean/var without a schema write mark: the
    golden file recorded them after the op (updated), and compare failed the same run's
    batch norm input against its own golden replay (RelativeEuclideanDistance 1)."""
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm2d(4)
    conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last)
    import npu_dumper
    with npu_dumper.dumper(use_dump=True, dump_path=str(tmp_path / "d.h5")):
        bn(conv(x)).relu().sum()       # (a plain sum of a batch-normed tensor is 0 + rounding noise)
    replay(tmp_path / "d.h5", tmp_path / "g.h5", progress=False)
    with DumpFile(tmp_path / "d.h5") as d, DumpFile(tmp_path / "g.h5") as g:
        rec = next(o for o in d.ops() if "batch_norm" in o.op)
        gold = g.op(rec.op, rec.seqid)
        for name in ("running_mean", "running_var"):
            before = np.asarray(rec.inputs()[name].read())
            assert before.tolist() == ([0.0] * 4 if name == "running_mean" else [1.0] * 4)
            np.testing.assert_array_equal(np.asarray(gold.inputs()[name].read()), before)
    from accucmp.compare.pipeline import compare_dumps
    from accucmp.compare.verdict import apply_verdict
    t = apply_verdict(compare_dumps(str(tmp_path / "d.h5"), str(tmp_path / "g.h5")).table)
    assert (t["Result"] != "fail").all(), t[t["Result"] == "fail"][["NPUDumpPath", "FailReason"]]


def test_golden_replay_of_sparse_gradients(tmp_path):
    """nn.Embedding(sparse=True): the backward builds a sparse COO gradient. Golden replay
    aborted the whole file on it ('unsupported memory format option Contiguous', blamed on
    the dump) and left a file with complete=False; sparse results are stored dense, as the
    dumper stores them."""
    import npu_dumper
    torch.manual_seed(0)
    emb = torch.nn.Embedding(20, 8, sparse=True)
    with npu_dumper.dumper(use_dump=True, dump_path=str(tmp_path / "d.h5")):
        emb(torch.tensor([[1, 2, 3], [4, 5, 1]])).sum().backward()
    res = replay(tmp_path / "d.h5", tmp_path / "g.h5", progress=False)
    assert res.not_replayed == [] and res.replayed == res.total
    with DumpFile(tmp_path / "d.h5") as d, DumpFile(tmp_path / "g.h5") as g:
        assert g.complete
        rec = next(o for o in d.ops() if "sparse_coo" in o.op)
        got = np.asarray(g.op(rec.op, rec.seqid).outputs()["result"].read())
        want = np.asarray(rec.outputs()["result"].read())
        assert got.shape == (20, 8) and np.allclose(got, want, rtol=1e-6, atol=1e-7)
        assert np.count_nonzero(got.any(axis=1)) == 5       # rows 1..5, row 1 summed twice


def test_golden_lists_an_op_whose_result_cannot_be_stored(tmp_path, monkeypatch):
    import npu_dumper.replay.golden as golden
    x = torch.arange(6.0).reshape(2, 3)
    record(tmp_path / "i.h5", [(aten.exp.default, (x,), {}), (aten.neg.default, (x,), {})])
    real = golden.tensor_to_storage

    def refuse_exp_results(t):
        if t.dtype == torch.float64 and torch.equal(t, x.double().exp()):
            raise RuntimeError("cannot store this")
        return real(t)
    monkeypatch.setattr(golden, "tensor_to_storage", refuse_exp_results)
    res = replay(tmp_path / "i.h5", tmp_path / "g.h5", progress=False)
    assert [(op, why.split(":")[0]) for op, _, why in res.not_replayed] == [("aten.exp.default", "result cannot be stored")]
    with DumpFile(tmp_path / "g.h5") as g:
        assert g.complete and [o.op for o in g.ops()] == ["aten.neg.default"]


def test_golden_replay_of_an_op_returning_a_script_object(tmp_path):
    """torch.profiler.record_function (used inside nn.TransformerEncoderLayer's fast path)
    runs profiler._record_function_enter_new, which returns a ScriptObject: golden replay
    raised 'TypeError: no Type code for ScriptObject' out of `accucmp golden` (a traceback,
    and a file left complete=False). Since issue 35 the dumper does not record profiler
    labels at all (dumpfile/bookkeeping.py; an older dump's are skipped by golden replay:
    tests/test_dump_profiler_labels.py): the dump and its golden hold the numeric ops only."""
    import npu_dumper
    from typer.testing import CliRunner

    from accucmp.cli.main import app
    x = torch.arange(6.0).reshape(2, 3)
    with npu_dumper.dumper(use_dump=True, dump_path=str(tmp_path / "d.h5")):
        with torch.profiler.record_function("block"):
            y = x * 2
        torch.exp(y)
    with DumpFile(tmp_path / "d.h5") as d:
        assert [o.op for o in d.ops()] == ["aten.mul.Tensor", "aten.exp.default"]
    r = CliRunner().invoke(app, ["golden", "-i", str(tmp_path / "d.h5"), "-o", str(tmp_path / "g.h5")])
    assert r.exit_code == 0, r.output
    with DumpFile(tmp_path / "g.h5") as g:
        assert g.complete
        ops = {o.op: o for o in g.ops()}
        assert not [name for name in ops if name.startswith("profiler.")]
        np.testing.assert_allclose(np.asarray(ops["aten.exp.default"].outputs()["result"].read()),
                                   np.exp(x.double().numpy() * 2))
