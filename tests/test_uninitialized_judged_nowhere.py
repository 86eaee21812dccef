"""Uninitialised memory is judged nowhere (issue 31, part 5): an empty-like op's output and a
buffer an op overwrites without reading it (dropout's `bernoulli_` into an `empty_like`, fill_,
out=) hold whatever the allocator left. The overflow check, `compare --bitwise` and `whatif`
skip them with the reason; a real overflow written into such a buffer is still reported."""

from __future__ import annotations

import math

import torch
from typer.testing import CliRunner

import npu_dumper  # noqa: F401 - installs torch.utils.dumper
from accucmp.cli.main import app
from dumpfile import DumpFile
from dumpfile.overwritten import holds_no_data
from npu_dumper.capture.policy import OpEvent
from npu_dumper.replay.overflow import OverflowPolicy

runner = CliRunner()


def _dropout_step(**kw) -> None:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 4))
    x = torch.randn(4, 8)
    with torch.utils.dumper(**kw):
        m(x).sum().backward()


def _event(func, args, kwargs, outputs) -> OpEvent:
    return OpEvent(func, str(func), args, kwargs, seqid=2, phase="forward", outputs=outputs)


def test_overflow_check_ignores_an_empty_like_buffer_holding_nan():
    # the buffer's bytes are garbage: NaN there is no overflow (it reported
    # `aten.empty_like SeqId 2 is overflow!` whenever the allocator left NaN bits)
    pol = OverflowPolicy(verbose=False)
    like = torch.ones(4, 16)
    ev = _event(torch.ops.aten.empty_like.default, (like,), {}, torch.full((4, 16), math.nan))
    pol.before_op(ev)
    assert pol.should_record(ev) is False


def test_overflow_into_a_garbage_out_buffer_is_still_reported():
    # an out= buffer holding NaN garbage is not an input that "already overflowed": the inf
    # the op writes into it starts there (it was taken for inherited and never reported)
    pol = OverflowPolicy(verbose=False)
    a, b = torch.full((4,), 3e38), torch.full((4,), 10.0)
    buf = torch.full((4,), math.nan)
    ev = _event(torch.ops.aten.mul.out, (a, b), {"out": buf}, None)
    pol.before_op(ev)
    ev.outputs = torch.mul(a, b, out=buf)
    assert pol.should_record(ev) is True
    assert "inf" in ev.group_attrs["overflow"]


def test_dropouts_bernoulli_buffer_is_recorded_uninitialized(tmp_path):
    # (a full dump stored it as a link to empty_like's output, which carried the attribute;
    # a statistics dump recorded it as data)
    _dropout_step(use_dump=True, dump_path=str(tmp_path / "d.h5"), stats_only=True)
    with DumpFile(str(tmp_path / "d.h5")) as f:
        bern = [op for op in f.ops() if op.op.startswith("aten.bernoulli_")]
        assert bern, [op.op for op in f.ops()]
        assert bern[0].inputs()["self"].uninitialized
        assert not bern[0].outputs()["self"].uninitialized       # the mask it drew is data


def test_bitwise_of_two_identical_seeded_statistics_runs_passes(tmp_path):
    for name in ("a.h5", "b.h5"):
        _dropout_step(use_dump=True, dump_path=str(tmp_path / name), stats_only=True, stats_histogram=True)
    res = runner.invoke(app, ["compare", "--bitwise", "-m", str(tmp_path / "a.h5"), "-g", str(tmp_path / "b.h5"),
                              "-out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    assert "skipped" in res.output


def test_whatif_leaves_the_buffer_out_with_a_note(tmp_path):
    _dropout_step(use_dump=True, dump_path=str(tmp_path / "s.h5"), stats_only=True, stats_histogram=True)
    res = runner.invoke(app, ["whatif", str(tmp_path / "s.h5"), "--dtype", "bf16", "-o", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "bernoulli_.float/3 input self" not in res.output
    assert "not judged: uninitialized memory" in res.output
    assert "empty_like" in res.output


def test_torch_free_table_names_the_destinations_of_older_dumps():
    # dumps written before bernoulli_ was listed carry no `uninitialized` attribute there
    assert holds_no_data("aten.bernoulli_.float", "input", "self")
    assert holds_no_data("aten.empty_like.default", "output", "result")
    assert not holds_no_data("aten.bernoulli_.float", "output", "self")
    assert not holds_no_data("aten.add_.Tensor", "input", "self")
