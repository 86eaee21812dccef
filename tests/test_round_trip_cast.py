"""A float32 port that rounds an activation through a coarser dtype (`h.to(bfloat16).float()`:
memory saving, a half-precision communication hook) departs from its float32 golden there.

Before, both modes passed: the plain compare judges every row after the first bfloat16 tensor
at bfloat16 precision (a tensor carries the rounding of the least precise dtype before it, by
design for a bf16 run), the input row of the op that read the rounded value passed as made by
an earlier op, and the casts, unpaired by design, are judged nowhere; the load-replay handed
that op the recorded, unrounded value. Now the dumper marks an earlier op's result a cast
rounds, while the run has computed nothing below float32 (op attribute cast_rounded), and an
op computing in float32 that reads it is named: plain, its input row judged at float32; replay,
its live input measured against the recording. A bf16 model's own round trips (its float32
islands) and autocast's casts are the run's precision: tests/test_real_models.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import npu_dumper  # noqa: F401  (installs torch.utils.dumper)
from accucmp.compare.pipeline import compare_dumps
from accucmp.compare.verdict import apply_verdict
from accucmp.report.findings import first_failure


class Net(nn.Module):
    def __init__(self, round_through: torch.dtype | None):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)
        self.round_through = round_through

    def forward(self, x):
        h = F.gelu(self.a(x))
        if self.round_through is not None:
            h = h.to(self.round_through).float()
        return self.c(F.gelu(self.b(h)))


def _step(path, round_through=None, load=None) -> str:
    net = Net(round_through)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    mode = dict(use_load=True, load_file_path=str(load)) if load else dict(use_dump=True)
    with torch.utils.dumper(dump_path=str(path), **mode):
        net(x).square().mean().backward()
    return str(path)


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    return _step(tmp_path_factory.mktemp("round_trip") / "golden.h5")


@pytest.mark.parametrize("replay", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_round_trip_through_a_coarser_dtype_is_named_where_float32_reads_it(golden, tmp_path, replay, dtype):
    target = _step(tmp_path / "t.h5", dtype, load=golden if replay else None)
    first = first_failure(apply_verdict(compare_dumps(target, golden).table))
    assert first is not None and first["Module"] == "b" and first["NPUDump"] == "aten.addmm.default", first
    assert first["Origin"] == "departs"
    name = str(dtype).replace("torch.", "")
    said = first["FailReason"]
    assert (f"went through {name}" in said) if not replay else (f"rounds to {name} by a cast" in said), said


@pytest.mark.parametrize("replay", [False, True])
def test_the_same_float32_port_without_the_round_trip_passes(golden, tmp_path, replay):
    target = _step(tmp_path / "t.h5", None, load=golden if replay else None)
    assert first_failure(apply_verdict(compare_dumps(target, golden).table)) is None


@pytest.mark.parametrize("attr", ['{"mat1": "float64"}', '{"mat1": 3}', '{"mat1": "bfloat16", "zzz": "x"}', "[1, 2]",
                                  "{", "null", '{"mat1": "' + "b" * 100000 + '"}'])
def test_a_damaged_cast_rounded_attribute_names_only_what_it_can_back(golden, tmp_path, attr):
    """A file is input from outside: an attribute that is no {input: coarser floating dtype}
    names nothing (the round trip then passes as the bf16 precision carried forward, as
    before), never a traceback; a valid entry beside junk still names its input."""
    from dumpfile import schema as S
    from tests._compare_helpers import overwrite_op_attr

    target = _step(tmp_path / "t.h5", torch.bfloat16)
    overwrite_op_attr(target, S.OP_CAST_ROUNDED, attr)
    first = first_failure(apply_verdict(compare_dumps(target, golden).table))
    if '"mat1": "bfloat16"' in attr:
        assert first is not None and "went through bfloat16" in first["FailReason"], first
    else:
        assert first is None, first


def _load_step(path, *, load_state: bool, scale: float = 1.0, target: bool, load=None) -> str:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    state = {k: v.clone() for k, v in net.state_dict().items()}
    state["2.weight"] = state["2.weight"] * scale
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    mode = dict(use_load=True, load_file_path=str(load)) if load else dict(use_dump=True)
    with torch.utils.dumper(dump_path=str(path), **mode):
        if load_state:
            net.load_state_dict(state)          # copy_ of each tensor into the parameters
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=target):
            y = net(x)
        y.float().square().mean().backward()
    return str(path)


@pytest.mark.parametrize("replay", [False, True])
def test_a_weight_overwritten_in_the_step_from_another_tensor_is_named_where_it_is_read(tmp_path, replay):
    """The same class of hole in the plain compare: `load_state_dict` inside the dump block
    (the golden's step has none) copies a 5% different weight in. The copy is unpaired by
    design and was judged nowhere, and the weight it made passed as made by an earlier op
    (inherited). A copy of a tensor no op made is now that tensor, a leaf, judged where read."""
    golden = _load_step(tmp_path / "golden.h5", load_state=False, target=False)
    mode = golden if replay else None
    clean = _load_step(tmp_path / "clean.h5", load_state=True, target=True, load=mode)
    assert first_failure(apply_verdict(compare_dumps(clean, golden).table)) is None
    bad = _load_step(tmp_path / "bad.h5", load_state=True, scale=1.05, target=True, load=mode)
    first = first_failure(apply_verdict(compare_dumps(bad, golden).table))
    assert first is not None and first["Module"] == "2" and first["NPUDump"] == "aten.addmm.default", first
    assert first["Origin"] == "departs" and "input mat2" in first["FailReason"], first["FailReason"]


class _Table(nn.Module):
    """Adds a table to a hidden state; the port copies the table into a buffer first."""

    def __init__(self, copy_first: bool):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)
        self.copy_first = copy_first

    def forward(self, x, table):
        h = F.gelu(self.a(x))
        if self.copy_first:
            buf = torch.empty_like(h)
            buf.copy_(table)
            table = buf
        return self.b(h + table)


def _table_step(path, *, copy_first: bool, scale: float, load=None) -> str:
    net = _Table(copy_first)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    table = torch.randn(6, 16, generator=torch.Generator().manual_seed(5)) * scale
    mode = dict(use_load=True, load_file_path=str(load)) if load else dict(use_dump=True)
    with torch.utils.dumper(dump_path=str(path), **mode):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=load is not None):
            y = net(x, table)
        y.float().square().mean().backward()
    return str(path)


def test_load_replay_follows_a_copy_to_its_source_not_its_destination(tmp_path):
    """A live `copy_` the recording lacks (by design: a copy) of a tensor no op made into a
    buffer an op made: what the buffer then holds is the source's, a leaf, checked where a
    replayed op reads it. Before, the replay took the destination's provenance (made by a
    replayed op), handed the reading op the recorded table, and a 5% different table passed."""
    golden = _table_step(tmp_path / "golden.h5", copy_first=False, scale=1.0)
    clean = _table_step(tmp_path / "clean.h5", copy_first=True, scale=1.0, load=golden)
    assert first_failure(apply_verdict(compare_dumps(clean, golden).table)) is None
    bad = _table_step(tmp_path / "bad.h5", copy_first=True, scale=1.05, load=golden)
    first = first_failure(apply_verdict(compare_dumps(bad, golden).table))
    assert first is not None and first["NPUDump"] == "aten.add.Tensor" and first["Origin"] == "departs", first
    assert "read through aten.copy_" in first["FailReason"], first["FailReason"]
