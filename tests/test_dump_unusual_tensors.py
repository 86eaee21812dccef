"""Tensors and ops off the common path: inference tensors, nested tensors, in-place ops
that return nothing. Each once crashed the dump or lost the values an op wrote."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import npu_dumper
from dumpfile import DumpFile
from dumpfile import schema as S


def test_inference_tensors_are_recorded(tmp_path):
    # (reading an inference tensor's version counter raises: the dump used to die on it)
    with torch.inference_mode():
        made_outside = torch.arange(6.0).reshape(2, 3)
    p = tmp_path / "inf.h5"
    with npu_dumper.dumper(use_dump=True, dump_path=str(p)):
        y = made_outside * 2
        with torch.inference_mode():
            z = torch.sin(y)
            pre = z.clone()
            z.add_(1)                       # in place on an inference tensor
    with DumpFile(p) as f:
        ops = {o.op: o for o in f.ops()}
        assert f.complete
        np.testing.assert_array_equal(ops["aten.mul.Tensor"].inputs()["self"].read(),
                                      made_outside.numpy())
        add = ops["aten.add_.Tensor"]
        np.testing.assert_array_equal(add.inputs()["self"].read(), pre.numpy())
        np.testing.assert_array_equal(add.outputs()["self"].read(), z.numpy())


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_nested_tensors_are_stored_as_their_components(tmp_path):
    # nn.TransformerEncoder's fast path (eval, no_grad, padding mask) makes nested tensors
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, batch_first=True)
    enc = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=True).eval()
    x = torch.randn(2, 5, 8)
    mask = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    with torch.no_grad():
        want = enc(x, src_key_padding_mask=mask)
        p = tmp_path / "nested.h5"
        with npu_dumper.dumper(use_dump=True, dump_path=str(p)):
            got = enc(x, src_key_padding_mask=mask)
    torch.testing.assert_close(got, want)
    nt = torch.nested.nested_tensor([torch.randn(2), torch.randn(3)])
    with npu_dumper.dumper(use_dump=True, dump_path=str(tmp_path / "nt.h5")):
        out = nt.sin()
    with DumpFile(tmp_path / "nt.h5") as f:
        (op,) = [o for o in f.ops() if o.op.startswith("aten.sin")]
        rec = op.outputs()["result"]
        assert rec.is_list and rec.type == S.TYPE_TENSOR_LIST
        for child, comp in zip(rec.children, out.unbind()):
            np.testing.assert_array_equal(child.read(), comp.numpy())
    with DumpFile(p) as f:
        assert f.complete and len(f.ops()) > 5


def test_in_place_ops_that_return_nothing_record_what_they_wrote(tmp_path):
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    lin(torch.randn(2, 4)).sum().backward()
    before = lin.weight.grad.clone()

    @torch.library.custom_op("npu_dumper_test::scale_", mutates_args=("x",))
    def scale_(x: torch.Tensor, s: float) -> None:
        x.mul_(s)

    p = tmp_path / "void.h5"
    with npu_dumper.dumper(use_dump=True, dump_path=str(p)):
        torch._foreach_mul_([lin.weight.grad, lin.bias.grad], 0.5)      # (clip_grad_norm_'s)
        scale_(lin.weight.grad, 3.0)
    with DumpFile(p) as f:
        ops = {o.op: o for o in f.ops()}
        fe = ops["aten._foreach_mul_.Scalar"]
        np.testing.assert_array_equal(fe.inputs()["self"].children[0].read(), before.numpy())
        np.testing.assert_array_equal(fe.outputs()["self"].children[0].read(), (before * 0.5).numpy())
        sc = ops["npu_dumper_test.scale_.default"]
        np.testing.assert_array_equal(sc.inputs()["x"].read(), (before * 0.5).numpy())
        np.testing.assert_array_equal(sc.outputs()["x"].read(), lin.weight.grad.numpy())


@pytest.mark.parametrize("stats_only", [False, True])
def test_statistics_dump_of_unusual_tensors(tmp_path, stats_only):
    with torch.inference_mode():
        a = torch.ones(3)
    p = tmp_path / "s.h5"
    with npu_dumper.dumper(use_dump=True, dump_path=str(p), stats_only=stats_only):
        torch._foreach_mul_([a.clone(), a.clone()], 2.0)
    with DumpFile(p) as f:
        (op,) = [o for o in f.ops() if o.op == "aten._foreach_mul_.Scalar"]
        out = op.outputs()["self"].children[0]
        assert (out.stats()["max"] if stats_only else out.read().max()) == 2.0


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_negative_and_conjugate_views_are_recorded_as_their_values(tmp_path, writer):
    # A capture keeps only the storage of a plain tensor and rebuilds the view in the
    # writer; a tensor with the negative or conjugate bit is not (storage, shape, stride):
    # rebuilt from its storage it would read -x or conj(z).
    z = torch.tensor([1 + 2j, -3 + 0.5j, 4 - 1j], dtype=torch.complex64)
    base = torch.arange(12.0).reshape(3, 4)
    p = tmp_path / f"negconj_{writer}.h5"
    with npu_dumper.dumper(use_dump=True, dump_path=str(p), writer=writer):
        im = z.conj().imag                  # float32 with the negative bit
        a = torch.add(im, 1)
        b = torch.mul(z.conj(), 2)          # complex64 with the conjugate bit
        c = torch.sub(base[1:, ::2], 1)     # offset, strided: rebuilt from its storage
    with DumpFile(p) as f:
        by = {o.op: o for o in f.ops()}
        # the Negative/Conjugate fallbacks resolve the bit with a clone, which sees it
        clones = [o for o in f.ops() if o.op == "aten.clone.default"]
        assert len(clones) == 2
        for op in clones:
            np.testing.assert_array_equal(op.inputs()["self"].read(), op.outputs()["result"].read())
        np.testing.assert_array_equal(by["aten.add.Tensor"].inputs()["self"].read(), im.resolve_neg().numpy())
        np.testing.assert_array_equal(by["aten.add.Tensor"].outputs()["result"].read(), a.numpy())
        np.testing.assert_array_equal(by["aten.mul.Tensor"].inputs()["self"].read(),
                                      z.conj().resolve_conj().numpy())
        np.testing.assert_array_equal(by["aten.mul.Tensor"].outputs()["result"].read(), b.numpy())
        np.testing.assert_array_equal(by["aten.sub.Tensor"].inputs()["self"].read(),
                                      base[1:, ::2].numpy())
        np.testing.assert_array_equal(by["aten.sub.Tensor"].outputs()["result"].read(), c.numpy())


def test_statistics_of_a_negative_view_are_those_of_its_values(tmp_path):
    x = torch.tensor([1.0, 2.0, 3.0, 10.0])
    p = tmp_path / "neg_stats.h5"
    with npu_dumper.dumper(use_dump=True, dump_path=str(p), stats_only=True):
        torch.add(torch._neg_view(x), 0.5)
    with DumpFile(p) as f:
        (op,) = [o for o in f.ops() if o.op == "aten.clone.default"]   # (resolves the bit)
        st = op.inputs()["self"].stats()
        assert (st["min"], st["max"]) == (-10.0, -1.0)
        assert st["mean"] == pytest.approx(-4.0)


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
@pytest.mark.parametrize("kw", [dict(writer="process"), dict(writer="thread"), dict(stats_only=True)])
def test_meta_and_quantized_tensors_do_not_stop_the_run(tmp_path, kw):
    """A meta tensor (deferred init, shape inference) has no data and quantized dtypes have
    no storage format: the writer failed ('Cannot copy out of meta tensor', 'Got
    unsupported ScalarType QUInt8') and the DumperError stopped the user's model. They
    are recorded as a string placeholder naming dtype, shape and device; the ops around
    them keep their values."""
    p = tmp_path / "m.h5"
    x = torch.arange(6.0).reshape(2, 3)
    with npu_dumper.dumper(use_dump=True, dump_path=str(p), **kw):
        m = torch.empty(3, 4, device="meta")
        (m + 1).sum()
        q = torch.quantize_per_tensor(x, 0.5, 10, torch.quint8)
        d = q.dequantize()
        y = d * 2
    np.testing.assert_array_equal(y.numpy(), x.numpy() * 2)
    with DumpFile(p) as f:
        assert f.complete
        ops = {o.op: o for o in f.ops()}
        add = ops["aten.add.Tensor"].inputs()["self"]
        assert add.read() == "<Tensor float32[3, 4] on meta: meta tensor, no data>"
        deq = ops["aten.dequantize.self"].inputs()["self"]
        assert deq.read() == "<Tensor quint8[2, 3] on cpu: dtype not stored>"
        mul = ops["aten.mul.Tensor"]
        if kw.get("stats_only"):
            assert mul.outputs()["result"].stats()["max"] == 10.0
        else:
            np.testing.assert_array_equal(mul.inputs()["self"].read(), x.numpy())
            np.testing.assert_array_equal(mul.outputs()["result"].read(), x.numpy() * 2)


@pytest.mark.filterwarnings("ignore:An output with one or more elements was resized")
@pytest.mark.parametrize("writer", ["process", "thread"])
def test_the_model_can_still_resize_tensors_the_dumper_has_written(tmp_path, writer):
    """The writer read tensors through Tensor.numpy(), which marks the storage
    non-resizable for good: the model's own `a.resize_(4, 5)` (or an out= op resizing its
    output) then failed with 'Trying to resize storage that is not resizable'."""
    import time
    p = tmp_path / "r.h5"
    with npu_dumper.dumper(use_dump=True, dump_path=str(p), writer=writer):
        a = torch.arange(6.0)                  # written by the writer ...
        out = torch.ones(2) * 3
        time.sleep(0.2)                        # ... before the model goes on
        a.resize_(4, 5)
        a.fill_(1.0)
        torch.add(torch.ones(3, 3), 1, out=out)    # out= resizes its output from 2 to 3x3
        b = a * 2
    assert out.shape == (3, 3) and float(b.sum()) == 40.0
    with DumpFile(p) as f:
        ops = {o.op: o for o in f.ops()}
        arange = next(o for name, o in ops.items() if name.startswith("aten.arange"))
        np.testing.assert_array_equal(arange.outputs()["result"].read(), np.arange(6.0))
        np.testing.assert_array_equal(ops["aten.mul.Tensor"].outputs()["result"].read(), np.full((4, 5), 2.0))
        assert ops["aten.resize_.default"].outputs()["self"].uninitialized      # it grew: garbage past 6
        np.testing.assert_array_equal(ops["aten.add.out"].outputs()["out"].read(), np.full((3, 3), 2.0))


def test_a_resize_that_shrinks_keeps_its_values(tmp_path):
    p = tmp_path / "s.h5"
    with npu_dumper.dumper(use_dump=True, dump_path=str(p)):
        a = torch.arange(12.0)
        a.resize_(2, 3)
    with DumpFile(p) as f:
        out = next(o for o in f.ops() if o.op == "aten.resize_.default").outputs()["self"]
        assert not out.uninitialized
        np.testing.assert_array_equal(out.read(), np.arange(6.0).reshape(2, 3))


def test_ctc_loss_workspace_is_marked_uninitialized(tmp_path):
    """F.ctc_loss on CPU returns log_alpha allocated with empty() and filled only where a
    target can be: two dumps of the same run differed there (garbage, 1e10) and compare
    failed the run against itself at aten._ctc_loss. It is marked like the RNN workspaces."""
    from accucmp.compare.pipeline import compare_dumps
    from accucmp.compare.verdict import apply_verdict

    def run(p):
        g = torch.Generator().manual_seed(0)
        logits = torch.randn(7, 3, 6, generator=g, requires_grad=True)
        lp = logits.log_softmax(-1)
        tgt = torch.tensor([[1, 2, 3], [2, 3, 0], [4, 1, 1]])
        with npu_dumper.dumper(use_dump=True, dump_path=str(p)):
            # (some garbage for the workspace to pick up)
            torch.full((4096,), 1e10).clone()
            loss = torch.nn.functional.ctc_loss(lp, tgt, torch.full((3,), 7), torch.tensor([3, 2, 1]))
            loss.backward()
        return str(p), float(loss.detach())

    a, la = run(tmp_path / "a.h5")
    b, lb = run(tmp_path / "b.h5")
    assert la == lb
    with DumpFile(a) as f:
        ctc = next(o for o in f.ops() if o.op.startswith("aten._ctc_loss."))
        outs = ctc.outputs()
        assert outs["result1"].uninitialized and not outs["result0"].uninitialized
        bwd = next(o for o in f.ops() if o.op.startswith("aten._ctc_loss_backward"))
        assert bwd.inputs()["log_alpha"].uninitialized
    t = apply_verdict(compare_dumps(a, b).table)
    assert (t["Result"] != "fail").all(), t[t["Result"] == "fail"][["NPUDumpPath", "FailReason"]]
    assert (t[t["NPUDumpPath"].str.contains("_ctc_loss.") & t["NPUDumpPath"].str.endswith("result0")]["Result"] == "pass").all()


@pytest.mark.parametrize("kw", [dict(writer="process"), dict(writer="thread"), dict(stats_only=True)])
def test_an_op_that_raises_is_recorded_with_its_inputs_and_the_error(tmp_path, kw):
    # the op a run dies in is the one to look at: its inputs as it got them, no outputs,
    # and `raised`; the user's exception is unchanged and the file is marked incomplete
    a, b = torch.arange(6.0).reshape(2, 3), torch.ones(2, 5)
    p = tmp_path / "raised.h5"
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        with npu_dumper.dumper(use_dump=True, dump_path=str(p), **kw):
            c = a + 1
            torch.mm(c, b)
    with DumpFile(p) as f:
        assert not f.complete
        add, mm = f.ops()
        assert add.attrs.get(S.OP_RAISED) is None
        assert mm.op == "aten.mm.default" and mm.seqid == 2
        assert mm.attrs[S.OP_RAISED].startswith("RuntimeError: mat1 and mat2 shapes cannot be multiplied")
        assert mm.outputs() == {}
        ins = mm.inputs()
        if kw.get("stats_only"):
            assert ins["self"].stats()["max"] == 6.0 and ins["mat2"].shape == (2, 5)
        else:
            np.testing.assert_array_equal(ins["self"].read(), (a + 1).numpy())
            np.testing.assert_array_equal(ins["mat2"].read(), b.numpy())
    from typer.testing import CliRunner
    from accucmp.cli.main import app
    res = CliRunner().invoke(app, ["ls", str(p), "--plain"], terminal_width=200)
    assert res.exit_code == 0
    assert "raised RuntimeError: mat1 and mat2 shapes cannot be multiplied" in res.output.splitlines()[-1]
    # the writer closed cleanly: ls says the step raised, not that the writer failed (issue 35 item 7)
    head = res.output.splitlines()[0]
    assert "the step raised at op 2 (RuntimeError: mat1 and mat2 shapes cannot be multiplied" in head, head
    assert "INCOMPLETE" not in head, head


@pytest.mark.parametrize("kw", [dict(writer="process"), dict(writer="thread"), dict(stats_only=True)])
def test_user_code_raising_in_the_block_is_told_apart_from_a_writer_that_did_not_close(tmp_path, kw):
    from typer.testing import CliRunner
    from accucmp.cli.main import app

    p = tmp_path / "user.h5"
    with pytest.raises(ValueError, match="the user's own check"):
        with npu_dumper.dumper(use_dump=True, dump_path=str(p), **kw):
            (torch.ones(3) * 2).sum()
            raise ValueError("the user's own check\nsecond line")
    with DumpFile(p) as f:
        assert not f.complete and f.step_raised == ("ValueError: the user's own check", 3, False)
    res = CliRunner().invoke(app, ["ls", str(p), "--plain"], terminal_width=200)
    head = res.output.splitlines()[0]
    assert ("ops, mode dump, the step raised after op 3 (ValueError: the user's own check); "
            "the writer closed cleanly") in head and "INCOMPLETE" not in head, head
    # a clean block: complete, nothing said
    with npu_dumper.dumper(use_dump=True, dump_path=str(p), **kw):
        torch.ones(3).sum()
    with DumpFile(p) as f:
        assert f.complete and f.step_raised is None


def test_an_interrupt_is_not_recorded_as_the_op_raising(tmp_path):
    # (KeyboardInterrupt is not the op's doing: the op is not recorded)
    class Boom(KeyboardInterrupt):
        pass

    def interrupt(*a, **k):
        raise Boom()

    p = tmp_path / "interrupted.h5"
    lib = torch.library.Library("npu_dumper_test_interrupt", "DEF")
    lib.define("stop(Tensor x) -> Tensor")
    lib.impl("stop", interrupt, "CPU")
    with pytest.raises(Boom):
        with npu_dumper.dumper(use_dump=True, dump_path=str(p)):
            torch.ones(2) * 2
            torch.ops.npu_dumper_test_interrupt.stop(torch.ones(2))
    with DumpFile(p) as f:
        assert [o.op for o in f.ops()] == ["aten.ones.default", "aten.mul.Tensor", "aten.ones.default"]


def test_a_buffer_filled_outside_the_dispatcher_is_recorded_as_the_op_read_it(tmp_path):
    """An empty-like op's result filled by a write no dispatched op makes (torch.tensor's
    memcpy into DDP's bucket-size buffer; here through numpy) and then read: the reading op's
    input is its value then, not a link to the garbage captured as the empty's result (DDP
    load-replay compared a copy_ of that buffer: 'int32 values differ'). The pause lets the
    writer store the empty's result first, as it did in the DDP run; the check does not depend
    on it: the recorded value must be the one the op read."""
    import time

    import numpy as np

    from dumpfile import DumpFile

    p = tmp_path / "fill.h5"
    with torch.utils.dumper(use_dump=True, dump_path=str(p)):
        e = torch.empty(7, dtype=torch.int32)
        time.sleep(0.3)
        e.numpy()[:] = [5, 4, 3, 2, 1, 0, 1]
        e + 1
    with DumpFile(p) as f:
        (add,) = [o for o in f.ops() if o.op == "aten.add.Tensor"]
        assert np.asarray(add.inputs()["self"].read()).tolist() == [5, 4, 3, 2, 1, 0, 1]
