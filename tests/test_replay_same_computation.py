"""Load-replay: when a live run that calls other ops than its recording computes the same thing,
and when it does not (npu_dumper/replay/departures.py `missing`, load_replay.py `_stood_in_for`).

Found on a Hugging Face GPT-2 training step (benchmarks-style trial of porting mistakes):

* With activation checkpointing, GPT-2 keeps no key/value cache. The golden's cache appends
  the keys to an empty past, `cat([empty, k])`, a copy of k that the attention then reads; the
  clean replay failed on "does not run aten.cat". A recorded op the live run skips whose
  recorded result is one of its recorded inputs bit for bit computed nothing: no departure.
* GPT-2's `gelu_new` (the tanh approximation, eight pointwise ops) ported as `nn.GELU()` (the
  erf form, one op). The two differ by 2e-4 of the result, 1/20 of a bfloat16 unit, so the
  live `gelu` agreed with the recorded ops "within 4 u" and was taken as their stand-in, while
  its backward (eleven recorded ops, over the stand-in limit of eight) was named as inserted:
  the port was found late, in backward. A stand-in must now compute the recorded ops'
  function: run in float64 on their recorded inputs it must give their recorded result within
  what the recording's own rounding explains. The erf form against the recorded erf form
  stands in, forward and backward; against the tanh form it is a departure, named at the
  forward op.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import npu_dumper  # noqa: F401  (installs torch.utils.dumper)
from accucmp.compare.pipeline import compare_dumps
from accucmp.compare.verdict import apply_verdict
from accucmp.report.headline import verdict_sentence
from accucmp.report.summary import summarize


def gelu_tanh_decomposed(x):
    """Hugging Face's NewGELUActivation, as GPT-2 runs it: eight pointwise ops."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def gelu_erf_decomposed(x):
    """The erf form written out: what F.gelu computes, in five ops."""
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


ACTIVATIONS = {"tanh_decomposed": gelu_tanh_decomposed, "erf_decomposed": gelu_erf_decomposed,
               "erf": F.gelu, "relu": F.relu}


class Act(nn.Module):
    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def forward(self, x):
        return ACTIVATIONS[self.name](x)


class Block(nn.Module):
    """An MLP, then an attention-like product whose keys may go through a cache that appends
    them to an empty past (GPT-2's DynamicCache without checkpointing)."""

    def __init__(self, act: str, cache: bool):
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.fc2 = nn.Linear(64, 16)
        self.k = nn.Linear(16, 16)
        self.act, self.cache = Act(act), cache

    def forward(self, x):
        h = self.fc2(self.act(self.fc1(x)))
        k = self.k(h)
        if self.cache:
            k = torch.cat([k.new_zeros(k.shape[0], 0, k.shape[2]), k], dim=1)
        return torch.softmax(h @ k.transpose(1, 2), dim=-1) @ h


def _model(act: str, cache: bool) -> Block:
    torch.manual_seed(0)
    return Block(act, cache)


def _inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, 12, 16, generator=g), torch.randn(2, 12, 16, generator=g)


def _step(model, dtype):
    x, y = _inputs()
    with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        out = model(x)
    F.mse_loss(out.float(), y).backward()


def _golden(path, act: str, cache: bool = True):
    with torch.utils.dumper(use_dump=True, dump_path=str(path)):
        _step(_model(act, cache), None)
    return path


def _replay(golden, out, act: str, cache: bool, dtype=torch.bfloat16):
    with torch.utils.dumper(use_load=True, load_file_path=str(golden), dump_path=str(out)) as d:
        _step(_model(act, cache), dtype)
    table = apply_verdict(compare_dumps(str(out), str(golden)).table)
    s = summarize(table)
    return verdict_sentence(s.first_failure, s.counts, s.total), d.summary["replay"]


@pytest.fixture(scope="module")
def goldens(tmp_path_factory):
    d = tmp_path_factory.mktemp("same_computation")
    return {act: _golden(d / f"{act}.h5", act) for act in ("tanh_decomposed", "erf_decomposed")}


def test_a_skipped_copy_of_an_input_is_no_departure(goldens, tmp_path):
    said, summary = _replay(goldens["erf_decomposed"], tmp_path / "t.h5", "erf_decomposed", cache=False)
    assert said.startswith("PASS"), said
    assert summary.skipped_copies == 1
    assert "returned one of their inputs unchanged" in str(summary)


def test_a_skipped_op_that_computed_something_is_named(tmp_path):
    """The golden's activation is a relu (it changes values); the target leaves it out."""
    golden = _golden(tmp_path / "g.h5", "relu")

    ACTIVATIONS["none"] = lambda x: x
    try:
        with torch.utils.dumper(use_load=True, load_file_path=str(golden), dump_path=str(tmp_path / "t.h5")) as d:
            _step(_model("none", True), torch.bfloat16)
    finally:
        del ACTIVATIONS["none"]
    table = apply_verdict(compare_dumps(str(tmp_path / "t.h5"), str(golden)).table)
    s = summarize(table)
    said = verdict_sentence(s.first_failure, s.counts, s.total)
    assert said.startswith("FAIL") and "does not run aten.relu" in said, said
    assert d.summary["replay"].skipped_copies == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_erf_gelu_stands_in_for_the_recorded_erf_form_forward_and_backward(goldens, tmp_path, dtype):
    said, summary = _replay(goldens["erf_decomposed"], tmp_path / "t.h5", "erf", cache=True, dtype=dtype)
    assert said.startswith("PASS"), said
    stood = [r for r in summary.regrouped if r.startswith("act:")]
    assert len(stood) == 2 and "aten.gelu.default" in stood[0] and "aten.gelu_backward.default" in stood[1], \
        summary.regrouped


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_erf_gelu_for_the_recorded_tanh_form_is_named_at_the_forward_op(goldens, tmp_path, dtype):
    """Within 4 u of the live dtype of the recorded result (so it stood in before), but another
    function: named where the forward runs it, with the size of the difference."""
    said, summary = _replay(goldens["tanh_decomposed"], tmp_path / "t.h5", "erf", cache=True, dtype=dtype)
    assert said.startswith("FAIL: act runs aten.gelu.default, which the golden run does not have: it agrees "
                           "with the recorded aten.mul.Tensor+aten.pow.Tensor_Scalar"), said
    assert "computes another function" in said
    assert not [r for r in summary.regrouped if r.startswith("act:")]


class Rec:
    """A recorded op as the replay holds it (what stand_in reads of an OpRecord)."""

    def __init__(self, op, inputs, out):
        self.op, self._inputs, self._out = op, inputs, out

    def inputs(self):
        return self._inputs

    def outputs(self):
        return {"result": self._out}


class Value:
    """A recorded value (what stand_in reads of a ValueRecord): a tensor, or a plain value."""

    def __init__(self, t=None, v=None):
        self.t, self.v, self.name = t, v, ""
        self.is_tensor, self.is_list, self.children = t is not None, False, []
        self.type = "value" if t is None else "tensor"
        self.shape = None if t is None else tuple(t.shape)

    def read(self):
        return self.v


def test_the_function_check_measures_the_gap_between_the_two_forms():
    """function_gap against an independent float64 computation of the two forms."""
    from npu_dumper.replay.stand_in import function_gap

    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 32, generator=g) * 2
    a = x * 0.5
    b = torch.erf(x * (1 / math.sqrt(2.0)))
    run = [Rec("aten.mul.Tensor", {"self": Value(x), "other": Value(v=0.5)}, Value(a)),
           Rec("aten.mul.Tensor", {"self": Value(x), "other": Value(v=1 / math.sqrt(2.0))},
               Value(x * (1 / math.sqrt(2.0)))),
           Rec("aten.erf.default", {"self": Value(x * (1 / math.sqrt(2.0)))}, Value(b)),
           Rec("aten.add.Tensor", {"self": Value(b), "other": Value(v=1.0)}, Value(b + 1.0)),
           Rec("aten.mul.Tensor", {"self": Value(a), "other": Value(b + 1.0)}, Value(a * (b + 1.0)))]
    live = x.to(torch.bfloat16)
    x64 = x.double()
    erf64 = torch.nn.functional.gelu(x64)
    tanh64 = torch.nn.functional.gelu(x64, approximate="tanh")
    same = function_gap(torch.ops.aten.gelu.default, (live,), {}, run, lambda r: r.t)
    other = function_gap(torch.ops.aten.gelu.default, (live,), {"approximate": "tanh"}, run, lambda r: r.t)
    assert same is not None and other is not None
    assert same[0] < 1e-12 < same[1]
    want = float((tanh64 - erf64).norm() / erf64.norm())
    assert other[0] == pytest.approx(want, rel=1e-6) and other[0] > other[1]


def test_the_function_check_runs_no_op_that_a_file_could_size():
    """The recorded ops are the file's: a factory op or one sized by an argument (repeat,
    new_zeros) is not run, and nothing runs on a tensor larger than the run's records hold."""
    from npu_dumper.replay.stand_in import _recompute, _sized_by_inputs

    assert _sized_by_inputs(torch.ops.aten.mul.Tensor) and _sized_by_inputs(torch.ops.aten.mm.default)
    assert not _sized_by_inputs(torch.ops.aten.repeat.default)
    assert not _sized_by_inputs(torch.ops.aten.new_zeros.default)
    assert not _sized_by_inputs(torch.ops.aten.full.default)

    x = torch.randn(4, 4)
    # a view to a size the file declares, then an op on it: refused before anything is computed
    huge = [Rec("aten.expand.default", {"self": Value(x), "size": Value(v=[1 << 20, 4, 4])}, Value(x)),
            Rec("aten.mul.Tensor", {"self": Value(x), "other": Value(x)}, Value(x * x))]
    assert _recompute(huge, lambda r: r.t)[0] is None      # (mul would get the expanded view)
    out, _, _ = _recompute([Rec("aten.repeat.default", {"self": Value(x), "repeats": Value(v=[1 << 20, 1])},
                                Value(x))], lambda r: r.t)
    assert out is None
    same = [Rec("aten.mul.Tensor", {"self": Value(x), "other": Value(x)}, Value(x * x))]
    assert _recompute(same, lambda r: r.t)[0] is not None
