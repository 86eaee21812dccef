"""Profiler labels are bookkeeping, not numerics (issue 35 item 3): `optimizer.zero_grad()`
and `optimizer.step()` inside a dump block run under `torch.profiler.record_function`,
which dispatches `profiler::_record_function_enter_new/_exit` (a label in, a ScriptObject
out). The dumper does not record them, golden replay skips them in an older dump that
holds them (it listed them as not replayable with a RuntimeError), and compare leaves them
out of the pairing (dumpfile/bookkeeping.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import npu_dumper  # noqa: E402,F401  (installs torch.utils.dumper)
from dumpfile import DumpFile  # noqa: E402
from dumpfile.bookkeeping import is_bookkeeping  # noqa: E402
from npu_dumper.capture import opschema  # noqa: E402


def _step(path, *, with_optimizer: bool):
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randn(2, 4)
    with torch.utils.dumper(use_dump=True, dump_path=str(path)):
        if with_optimizer:
            opt.zero_grad()
        m(x).sum().backward()
        if with_optimizer:
            with torch.no_grad():
                opt.step()
    with DumpFile(str(path)) as f:
        return [(o.seqid, o.op) for o in f.ops()]


def test_profiler_labels_are_not_recorded(tmp_path):
    ops = _step(tmp_path / "opt.h5", with_optimizer=True)
    assert not [op for _, op in ops if op.startswith("profiler.")], ops
    assert [s for s, _ in ops] == list(range(1, len(ops) + 1))      # they take no seqid
    # the step inside the labels is the step without them, op for op
    plain = _step(tmp_path / "plain.h5", with_optimizer=False)
    assert ops[:len(plain)] == plain
    assert [op for _, op in ops[len(plain):]] == ["aten.add_.Tensor", "aten.add_.Tensor"]   # SGD's step


def _older_dump(path, monkeypatch) -> list[str]:
    """A dump as the dumper wrote it before: the profiler ops recorded."""
    with monkeypatch.context() as mp:
        mp.setattr(opschema, "BOOKKEEPING_NAMESPACES", {})
        mp.setattr(opschema, "_OP_INFO", {})
        ops = [op for _, op in _step(path, with_optimizer=True)]
    assert "profiler._record_function_enter_new.default" in ops
    return ops


def test_golden_replay_and_compare_skip_an_older_dumps_profiler_ops(tmp_path, monkeypatch):
    from accucmp.compare.pipeline import compare_dumps
    from accucmp.compare.verdict import apply_verdict
    from npu_dumper import golden_replay

    src = tmp_path / "old.h5"
    ops = _older_dump(src, monkeypatch)
    result = golden_replay(str(src), str(tmp_path / "golden.h5"))
    assert result.not_replayed == [], result.not_replayed
    assert result.replayed == sum(not is_bookkeeping(op) for op in ops)
    table = apply_verdict(compare_dumps(str(src), str(tmp_path / "golden.h5")).table)
    assert not table["NPUDump"].astype(str).str.startswith("profiler.").any()
    assert (table["Result"] != "unmatched").all(), table[["NPUDump", "Result"]]


def test_bookkeeping_is_by_namespace():
    assert is_bookkeeping("profiler._record_function_exit._RecordFunction")
    assert is_bookkeeping("profiler::_record_function_enter_new")
    assert not is_bookkeeping("aten.add_.Tensor")
    info = opschema.op_info(torch.ops.profiler._record_function_enter_new.default)
    assert info.bookkeeping and not opschema.op_info(torch.ops.aten.add.Tensor).bookkeeping
