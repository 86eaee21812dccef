"""Load-replay (npu_dumper.replay.load_replay.ReplayPolicy through torch.utils.dumper)."""

from __future__ import annotations

import copy

import h5py
import numpy as np
import pytest
import torch

import npu_dumper  # noqa: F401  (installs torch.utils.dumper)
import sample_models
from dumpfile import DumpFile
from npu_dumper.errors import DumperError
from npu_dumper.opmap import get_op_map, register_op_map, clear_user_op_map


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16),
                               torch.nn.Linear(16, 4))


def _step(model, x):
    model.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    return loss


def _dump(tmp_path, model, x, name="ref.h5"):
    path = str(tmp_path / name)
    with torch.utils.dumper(use_dump=True, dump_path=path):
        _step(model, x)
    return path


def _outputs(path):
    out = {}
    with DumpFile(path) as d:
        for op in d.ops():
            for k, v in op.outputs().items():
                if v.is_tensor:
                    out[(op.op, op.seqid, k)] = np.asarray(v.read())
    return out


def test_fp32_replay_into_same_run_is_bit_exact_and_gradients_flow(tmp_path, capsys):
    model, x = _mlp(), torch.randn(4, 8)
    ref = _dump(tmp_path, model, x)
    ref_grads = [p.grad.clone() for p in model.parameters()]
    tgt = str(tmp_path / "tgt.h5")
    with torch.utils.dumper(use_load=True, load_file_path=ref, dump_path=tgt) as d:
        _step(model, x)
    printed = capsys.readouterr().out
    assert printed.count("load-replay:") == 1
    policy = d.policies[0]
    with DumpFile(ref) as r:
        n_ref = len(r)
    assert policy.summary.matched == n_ref and not policy.summary.unmatched
    a, b = _outputs(ref), _outputs(tgt)
    assert a.keys() == b.keys() and len(a) > 10
    for key in a:
        assert a[key].dtype == b[key].dtype
        assert np.array_equal(a[key].reshape(-1).view(np.uint8), b[key].reshape(-1).view(np.uint8)), key
    # the step completed through autograd with replayed values: gradients equal the reference
    for p, g in zip(model.parameters(), ref_grads):
        assert p.grad is not None and torch.equal(p.grad, g)
    with DumpFile(tgt) as t:
        first = t.ops()[0]
        assert t.mode == "load" and first.attrs["replayed"] and "source_seqid" in first.attrs


def test_use_dump_with_load_file_path_means_replay(tmp_path):
    model, x = _mlp(), torch.randn(4, 8)
    ref = _dump(tmp_path, model, x)
    with torch.utils.dumper(use_dump=True, load_file_path=ref, dump_path=str(tmp_path / "t.h5")) as d:
        _step(model, x)
    with DumpFile(str(tmp_path / "t.h5")) as t:
        assert t.mode == "load" and len(t) == d.policies[0].summary.matched > 0


@pytest.mark.parametrize("name", ["mlp", "transformer", "resnet"])
def test_fp32_dump_replayed_into_bf16_autocast_matches_every_recorded_op(tmp_path, capsys, name):
    spec = sample_models.get(name)
    model = spec.build(seed=0, size="tiny")
    inputs = spec.make_inputs(seed=0, size="tiny")
    target_model = copy.deepcopy(model)
    ref = str(tmp_path / "ref.h5")
    with torch.utils.dumper(use_dump=True, dump_path=ref):
        spec.train_step(model, inputs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.utils.dumper(use_load=True, load_file_path=ref, dump_path=str(tmp_path / "t.h5")) as d:
            spec.train_step(target_model, inputs)
    s = d.policies[0].summary
    with DumpFile(ref) as r:
        assert s.matched == len(r) == s.recorded_ops
    assert s.never_used == []
    # autocast's casts are extra live ops: reported, never blocking a recorded op
    assert s.unmatched["aten._to_copy.default"] > 0
    assert s.casts["float32->bfloat16"] > 0
    out = capsys.readouterr().out
    assert "aten._to_copy.default" in out and "float32->bfloat16" in out
    # The replay dump holds outputs only; an op that read a bfloat16 input (cast from the
    # golden's float32) is judged at bfloat16 precision all the same: its op attribute
    # input_dtypes says what its inputs were, so no clean op fails on the cast alone.
    from accucmp.compare.pipeline import compare_dumps
    from accucmp.compare.verdict import apply_verdict
    from accucmp.report.findings import first_failure

    table = apply_verdict(compare_dumps(str(tmp_path / "t.h5"), ref).table)
    assert set(table["IO"]) == {"output"} and len(table) > 5
    assert first_failure(table) is None, table[table["Result"] != "pass"][["NPUDump", "SeqId", "FailReason"]]
    with DumpFile(str(tmp_path / "t.h5")) as t:
        assert any("bfloat16" in str(op.attrs.get("input_dtypes", "")) for op in t.ops())


def _faulty_gelu_lib():
    lib = torch.library.Library("aten", "IMPL")

    def faulty_gelu(x, approximate="none"):
        return 0.5 * x * (1.0 + torch.erf(x * 0.7071067811865476)) * 1.01

    lib.impl("gelu", faulty_gelu, "CPU")
    return lib


@pytest.mark.filterwarnings("ignore:Warning only once for all operators")
def test_fault_in_one_kernel_is_flagged_on_that_op_only(tmp_path):
    from accucmp.compare.pipeline import compare_dumps
    from accucmp.compare.verdict import apply_verdict

    model, x = _mlp(), torch.randn(4, 8)
    ref = _dump(tmp_path, model, x)
    tgt = str(tmp_path / "tgt.h5")
    lib = _faulty_gelu_lib()
    try:
        with torch.utils.dumper(use_load=True, load_file_path=ref, dump_path=tgt):
            _step(model, x)
    finally:
        lib._destroy()
    assert torch.equal(torch.nn.functional.gelu(torch.ones(1)), torch.tensor([0.8413447141647339]))
    table = apply_verdict(compare_dumps(tgt, ref).table)
    failed = table[table["Result"] == "fail"]
    assert set(failed["NPUDump"]) == {"aten.gelu.default"}
    assert set(failed["IO"]) == {"output"}
    # every other row (gelu's backward included) is exact: errors are not inherited
    others = table[table["NPUDump"] != "aten.gelu.default"]
    assert (others["MaxAbsoluteError"].astype(float) == 0).all()


@pytest.mark.parametrize("setup", ["missing", "not_hdf5", "not_dump", "same_as_dump_path"])
def test_bad_load_file_is_refused_before_the_model_runs(tmp_path, setup):
    dump_path = str(tmp_path / "out.h5")
    if setup == "missing":
        load = str(tmp_path / "nope.h5")
    elif setup == "not_hdf5":
        load = str(tmp_path / "text.h5")
        (tmp_path / "text.h5").write_text("not hdf5")
    elif setup == "not_dump":
        load = str(tmp_path / "other.h5")
        with h5py.File(load, "w") as f:
            f["x"] = np.arange(3)
    elif setup == "empty_path":
        load = ""
    else:
        load = _dump(tmp_path, _mlp(), torch.randn(2, 8))
        dump_path = load
    ran = []
    with pytest.raises(DumperError) as err:
        with torch.utils.dumper(use_load=True, load_file_path=load, dump_path=dump_path):
            ran.append(1)
    assert not ran
    assert "\n" not in str(err.value)
    assert load in str(err.value)


def test_recorded_size_that_does_not_fit_is_unmatched_with_reason(tmp_path, capsys):
    model = _mlp()
    ref = _dump(tmp_path, model, torch.randn(4, 8))
    with torch.utils.dumper(use_load=True, load_file_path=ref, dump_path=str(tmp_path / "t.h5")) as d:
        loss = _step(model, torch.randn(3, 8))          # another batch size: nothing fits
    assert torch.isfinite(loss)
    s = d.policies[0].summary
    out = capsys.readouterr().out
    assert s.unmatched["aten.addmm.default"] == 2
    assert "shape [3, 8] vs recorded [4, 8]" in s.unmatched_why["aten.addmm.default"]
    assert "shape [3, 8] vs recorded [4, 8]" in out


def test_in_place_ops_and_transposed_inputs_keep_live_semantics(tmp_path):
    w = torch.randn(6, 5)

    def run(x):
        y = x @ w.t()            # transposed operand: live strides kept
        y.add_(1.0)              # in place: recorded values copied into the live tensor
        y.relu_()
        return y.sum()

    x = torch.randn(3, 5)
    ref = str(tmp_path / "ref.h5")
    with torch.utils.dumper(use_dump=True, dump_path=ref):
        run(x)
    tgt = str(tmp_path / "t.h5")
    with torch.utils.dumper(use_load=True, load_file_path=ref, dump_path=tgt) as d:
        out = run(x * 3)         # different live values: every op still matches by shape
    assert d.policies[0].summary.matched == d.policies[0].summary.recorded_ops
    assert torch.equal(out, run(x))   # the replayed run computed the reference's values
    a, b = _outputs(ref), _outputs(tgt)
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k], b[k]), k


def test_op_map_lets_a_renamed_recorded_op_feed_the_live_one(tmp_path):
    model, x = _mlp(), torch.randn(4, 8)
    ref = _dump(tmp_path, model, x)
    # pretend the reference device named its layer-norm kernel differently
    with h5py.File(ref, "a") as f:
        f.move("aten.native_layer_norm.default", "vendor.fused_ln.default")
        del f["_npu_dumper/index"]       # the reader then walks groups
    tgt = str(tmp_path / "t.h5")
    with torch.utils.dumper(use_load=True, load_file_path=ref, dump_path=tgt,
                            op_map={"vendor.fused_ln": "aten.native_layer_norm"}) as d:
        _step(model, x)
    s = d.policies[0].summary
    assert s.by_map == 1 and s.never_used == []
    with DumpFile(tgt) as t:
        ln = [o for o in t.ops() if o.op == "aten.native_layer_norm.default"]
        assert len(ln) == 1 and ln[0].attrs["source_op"] == "vendor.fused_ln.default"


def test_get_op_map_has_device_variants_and_is_extendable():
    m = get_op_map()
    assert "aten.native_batch_norm" in m["aten.cudnn_batch_norm.default"]
    assert "aten.convolution_backward" in m.equivalents("aten.cudnn_convolution_backward")
    assert "input" in m.renames["self"] and "epsilon" in m.renames["eps"]
    assert torch.utils.get_op_map()["aten.miopen_batch_norm"] == m["aten.miopen_batch_norm"]
    try:
        register_op_map({"mylib.fused_ln": ["aten.native_layer_norm"]}, renames={"x": "input"})
        m2 = get_op_map()
        assert "mylib.fused_ln" in m2["aten.native_layer_norm"]
        assert "input" in m2.renames["x"]
    finally:
        clear_user_op_map()
    assert "mylib.fused_ln" not in get_op_map()


def test_npu_dumper_golden_replay_replays_every_op(tmp_path):
    import npu_dumper
    model, x = _mlp(), torch.randn(2, 8)
    ref = _dump(tmp_path, model, x)
    res = npu_dumper.golden_replay(ref, str(tmp_path / "g.h5"), progress=False)
    assert res.replayed == res.total > 0


def test_replay_stores_outputs_only_by_default_and_compare_pairs_only_outputs(tmp_path):
    """As the original's load mode: a matched op's inputs are the golden's by construction,
    so the replay dump holds outputs (dump_mode="all" keeps inputs), and compare makes no
    input rows for it instead of reporting every golden input as unmatched."""
    from accucmp.compare.pipeline import compare_dumps

    model, x = _mlp(), torch.randn(4, 8)
    ref = _dump(tmp_path, model, x)
    lean, full = str(tmp_path / "lean.h5"), str(tmp_path / "full.h5")
    with torch.utils.dumper(use_load=True, load_file_path=ref, dump_path=lean):
        _step(model, x)
    with torch.utils.dumper(use_load=True, load_file_path=ref, dump_path=full, dump_mode="all"):
        _step(model, x)
    with DumpFile(lean) as t, DumpFile(full) as f, DumpFile(ref) as r:
        assert t.attrs["dump_mode"] == "output" and t.recorded_io == ("output",)
        assert f.recorded_io == ("input", "output")
        assert all(not op.inputs() and op.outputs() for op in t.ops())
        assert sum(len(op.inputs()) for op in f.ops()) == sum(len(op.inputs()) for op in r.ops()) > 0
    assert _outputs(lean).keys() == _outputs(ref).keys()
    res = compare_dumps(lean, ref)
    table = res.table
    assert set(table["IO"]) == {"output"} and res.meta["compared_io"] == ["output"]
    assert (table["CompareStatus"] == "compared").all(), table["CompareStatus"].value_counts()
    assert len(table) == len(_outputs(ref))
    both = compare_dumps(full, ref).table
    assert set(both["IO"]) == {"input", "output"} and (both["CompareStatus"] == "compared").all()


def test_a_dump_without_inputs_is_refused_for_replay_and_golden_replay(tmp_path):
    """A load-replay dump holds outputs only: replaying it (load or golden fp64) would
    recompute nothing; both say so in one line before any op runs, and leave no file."""
    from typer.testing import CliRunner

    from accucmp.cli.main import app

    model, x = _mlp(), torch.randn(4, 8)
    ref = _dump(tmp_path, model, x)
    lean = str(tmp_path / "lean.h5")
    with torch.utils.dumper(use_load=True, load_file_path=ref, dump_path=lean):
        _step(model, x)
    again = tmp_path / "again.h5"
    with pytest.raises(DumperError, match="holds no op inputs") as ei:
        with torch.utils.dumper(use_load=True, load_file_path=lean, dump_path=str(again)):
            _step(model, x)
    assert "\n" not in str(ei.value) and lean in str(ei.value)
    assert not again.exists()
    # an existing file at dump_path is left as it was: the load file is judged first
    before = open(ref, "rb").read()
    with pytest.raises(DumperError, match="holds no op inputs"):
        with torch.utils.dumper(use_load=True, load_file_path=lean, dump_path=ref):
            _step(model, x)
    assert open(ref, "rb").read() == before
    r = CliRunner().invoke(app, ["golden", "-i", lean, "-o", str(tmp_path / "g.h5")], terminal_width=200)
    assert r.exit_code == 2 and "holds no op inputs" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "g.h5").exists()


# ---- a damaged load file: one line naming it, never live values passed off as its own ------
def _tiny_dump(path):
    lin = torch.nn.Linear(8, 8)
    with npu_dumper.dumper(use_dump=True, dump_path=str(path)):
        lin(torch.ones(2, 8)).relu().sum().backward()
    return lin


def test_a_load_file_damaged_in_its_index_is_refused_at_entry(tmp_path):
    from h5py import h5o
    good = tmp_path / "g.h5"
    lin = _tiny_dump(good)
    with h5py.File(good, "r") as f:
        addr = h5o.get_info(f["/_npu_dumper/index"].id).addr
    with open(good, "r+b") as fh:          # garbage over the index's object header
        fh.seek(addr)
        fh.write(b"\xff" * 64)
    with pytest.raises(DumperError) as ei:
        with npu_dumper.dumper(load_file_path=str(good), dump_path=str(tmp_path / "r.h5")):
            lin(torch.ones(2, 8)).sum()
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith(f"{good}: corrupt or unreadable dump")


def test_a_load_file_unreadable_mid_run_stops_the_replay_naming_it(tmp_path, monkeypatch):
    from npu_dumper.replay import load_replay as R
    good = tmp_path / "g.h5"
    lin = _tiny_dump(good)

    def unreadable(self, ev, entry, live):     # what h5py raises on a damaged object header
        raise KeyError("Unable to synchronously open object (bad object header version number)")
    monkeypatch.setattr(R.ReplayPolicy, "_substitute", unreadable)
    with pytest.raises(DumperError) as ei:
        with npu_dumper.dumper(load_file_path=str(good), dump_path=str(tmp_path / "r.h5")):
            lin(torch.ones(2, 8)).sum()
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith(
        f"{good}: corrupt or unreadable dump (Unable to synchronously open object "
        "(bad object header version number)) at /aten.")


def test_a_cast_only_the_live_run_makes_says_no_recorded_call_fits(tmp_path):
    """A bf16 model upcasting (`x.to(float32)`, a no-op in the fp32 recording) adds live
    `_to_copy` calls; the reason must not read as if the recorded cast in their place were
    theirs (it was `input 'self' shape [4] vs recorded [48]` alone: Llama's RMSNorm casts met
    the rotary embedding's recorded cast)."""
    def step(x):
        ids = torch.arange(4).to(x.dtype)               # one recorded _to_copy (int -> float)
        return (x.to(torch.float32) * 2).to(x.dtype) + ids

    ref = str(tmp_path / "ref.h5")
    with torch.utils.dumper(use_dump=True, dump_path=ref):
        step(torch.randn(3, 4))
    with torch.utils.dumper(use_load=True, load_file_path=ref, dump_path=str(tmp_path / "t.h5")) as d:
        step(torch.randn(3, 4).bfloat16())
    why = d.policies[0].summary.unmatched_why["aten._to_copy.default"]
    assert why.startswith("no unused recorded call fits"), why
    assert "the recorded call in its place" in why, why
