"""npu_dumper.replay.emulation: emulate_npu (cube ops in float16) and inject_fault."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import sample_models
from npu_dumper.capture import hints
from npu_dumper.replay.emulation import (
    CUBE_OPS, EmulationOrderError, FaultSpecError, emulate_npu, inject_fault, is_cube_op,
    parse_fault,
)

aten = torch.ops.aten


def fp16_exact(t):
    return torch.equal(t, t.half().to(t.dtype))


@pytest.fixture(autouse=True)
def _clear_hint():
    hints.pop_compute_dtype()
    yield
    hints.pop_compute_dtype()


def test_registry_covers_cube_ops_both_directions_and_not_vector_ops():
    for packet in (aten.mm, aten.bmm, aten.addmm, aten.baddbmm, aten.convolution,
                   aten.convolution_backward, aten.addmm_):
        assert packet in CUBE_OPS
    assert is_cube_op(aten.mm.default)
    assert not is_cube_op(aten.gelu.default) and not is_cube_op(aten._softmax.default)


def test_matmul_takes_fp16_operands_accumulates_fp32_returns_fp16_values_in_fp32():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 64, generator=gen), torch.randn(64, 8, generator=gen)
    with emulate_npu() as emu:
        out = a @ b
        assert hints.pop_compute_dtype() == "float16"
    assert emu.cube_calls == 1 and out.dtype == torch.float32
    expected = (a.half().float() @ b.half().float()).half().float()
    assert torch.equal(out, expected)
    # fp16-level error, not zero and not more.
    rel = ((out - a @ b).norm() / (a @ b).norm()).item()
    assert 1e-5 < rel < 2e-3


def test_vector_ops_are_untouched_and_leave_no_hint():
    x = torch.randn(100)
    with emulate_npu() as emu:
        y = F.gelu(x)
        s = torch.softmax(x, 0)
    assert torch.equal(y, F.gelu(x)) and torch.equal(s, torch.softmax(x, 0))
    assert emu.cube_calls == 0 and hints.pop_compute_dtype() is None


def test_convolution_forward_and_backward_are_emulated():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 8, 8, generator=gen, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, generator=gen, requires_grad=True)
    with emulate_npu() as emu:
        y = F.conv2d(x, w, padding=1)
        y.sum().backward()
    assert emu.cube_calls == 2      # convolution + convolution_backward
    assert fp16_exact(y) and fp16_exact(x.grad) and fp16_exact(w.grad)


def test_in_place_and_out_variants_write_into_the_callers_tensor():
    a = torch.randn(5, 5)
    out = torch.zeros(5, 5)
    acc = torch.randn(5, 5)
    acc_id = acc.data_ptr()
    with emulate_npu():
        torch.mm(a, a, out=out)
        acc.addmm_(a, a)
    assert fp16_exact(out) and not torch.equal(out, torch.zeros(5, 5))
    assert fp16_exact(acc) and acc.data_ptr() == acc_id


def test_overflow_becomes_inf_unless_saturating():
    big = torch.full((2, 2), 300.0)
    with emulate_npu():
        assert torch.isinf(big @ big).all()
    with emulate_npu(saturate=True):
        assert torch.equal(big @ big, torch.full((2, 2), 65504.0))
        nan_in = torch.tensor([[float("nan"), 1.0]])
        assert torch.isfinite(nan_in @ torch.ones(2, 1)).all()
    # fp32 itself does not overflow here: the inf is the emulation's doing.
    assert torch.isfinite(big @ big).all()


def test_bfloat16_cube_dtype_and_float64_inputs():
    a = torch.randn(8, 8, dtype=torch.float64)
    with emulate_npu(cube_dtype=torch.bfloat16):
        out = a @ a
        assert hints.pop_compute_dtype() == "bfloat16"
        a @ a
    # A note no dumper took is dropped at exit, not left for a later dumper's first op.
    assert hints.pop_compute_dtype() is None
    assert out.dtype == torch.float64
    assert torch.equal(out, out.to(torch.bfloat16).double())
    with pytest.raises(ValueError):
        emulate_npu(cube_dtype=torch.int32)


@pytest.mark.parametrize("name", sample_models.names())
def test_every_sample_model_trains_under_emulation_close_to_fp32(name):
    spec = sample_models.get(name)
    inputs = spec.make_inputs(size="tiny")
    ref = spec.train_step(spec.build(size="tiny"), inputs)
    with emulate_npu() as emu:
        got = spec.train_step(spec.build(size="tiny"), inputs)
    assert emu.cube_calls > 0
    assert abs(got - ref) <= 1e-2 * abs(ref)


class _PretendDumperMode(TorchDispatchMode):
    records_ops = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_wrong_nesting_order_is_refused():
    with _PretendDumperMode():
        with pytest.raises(EmulationOrderError, match="outside"):
            with emulate_npu():
                pass
        with pytest.raises(EmulationOrderError, match="inject_fault"):
            with inject_fault("aten.gelu.default"):
                pass
    # The right order works.
    with emulate_npu(), _PretendDumperMode():
        torch.ones(2, 2) @ torch.ones(2, 2)


def test_fault_hits_only_the_kth_call_by_exactly_rel():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    good = F.gelu(x)
    with inject_fault("aten.gelu.default", rel=0.05, call=2) as fault:
        outs = [F.gelu(x) for _ in range(3)]
    assert (fault.calls, fault.hits) == (3, 1)
    assert torch.equal(outs[0], good) and torch.equal(outs[2], good)
    red = ((outs[1] - good).norm() / good.norm()).item()
    assert red == pytest.approx(0.05, rel=1e-4)
    cos = F.cosine_similarity(outs[1], good, dim=0).item()
    assert cos < 0.9999


def test_fault_every_call_packet_name_and_in_place_op():
    x = torch.randn(50)
    with inject_fault("aten.relu", rel=0.1) as fault:      # a packet: every overload
        a = torch.relu(x)
        torch.relu(x)
    with inject_fault(torch.ops.aten.relu_.default, rel=0.1) as in_place:
        b = x.clone().relu_()
    assert fault.hits == 2 and in_place.hits == 1
    assert not torch.equal(a, torch.relu(x)) and not torch.equal(b, torch.relu(x))


def test_fault_that_never_fires_or_bad_spec_is_an_error():
    with pytest.raises(FaultSpecError, match="never fired"):
        with inject_fault("aten.gelu.default"):
            torch.relu(torch.ones(3))
    with pytest.raises(FaultSpecError, match="never fired"):
        with inject_fault("aten.gelu.default", call=5):
            F.gelu(torch.ones(3))
    with pytest.raises(FaultSpecError, match="no such op"):
        inject_fault("aten.not_an_op.default")
    with pytest.raises(FaultSpecError, match="rel must be"):
        inject_fault("aten.gelu.default", rel=0)


def test_parse_fault():
    assert parse_fault("aten.gelu.default:0.05:3") == {"op": "aten.gelu.default", "rel": 0.05, "call": 3}
    assert parse_fault("aten.gelu") == {"op": "aten.gelu"}
    with pytest.raises(FaultSpecError):
        parse_fault("aten.gelu:abc")


def test_emulation_inside_the_real_dumper_is_refused(tmp_path):
    import npu_dumper
    with npu_dumper.dumper(dump_path=str(tmp_path / "d.h5"), writer="thread"):
        with pytest.raises(EmulationOrderError, match="outside"):
            with emulate_npu():
                pass
