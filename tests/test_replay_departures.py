"""Load-replay records how the live run departs from its recording, and compare fails on it
(issue 31): a user's own porting bugs, not kernel errors, named by module in the headline.

Golden: the fp32 step of tests/_user_bugs.py's model. Target: the same step under CPU bf16 or
fp16 autocast with one bug. Before, every bug here passed (load-replay hands each live op the
recorded inputs, so what the live run *does* left no trace): exit 0, "PASS".
"""

from __future__ import annotations

import json

import h5py
import pytest
import torch

import npu_dumper  # noqa: F401  (installs torch.utils.dumper)
from accucmp.compare.pipeline import compare_dumps
from accucmp.compare.verdict import apply_verdict
from accucmp.report.summary import summarize
from accucmp.report.headline import verdict_sentence
from dumpfile import departures as D
from dumpfile.errors import DumpFormatError

from tests import _user_bugs as U

# bug -> what the headline must say (module first), in both low precisions
EXPECTED = {
    "inserted": "FAIL: block.mlp.scale runs aten.mul.Tensor, which the golden run does not have",
    "eps": "FAIL: block.ln2 aten.native_layer_norm.default: argument eps 0.1, golden 1e-05",
    "swapped": "FAIL: block.mlp.act runs aten.silu.default, which the golden run does not have",
    "sdpa_scale": "FAIL: block.attn aten._scaled_dot_product_flash_attention_for_cpu.default: argument scale 1, "
                  "golden None (the default)",
    "missing": "FAIL: block does not run aten.add.Tensor, which the golden run has",
    "weight": "FAIL: input mat2 of aten.addmm.default in block.mlp.fc2 differs from the golden's (RelErr 0.05",
}


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    path = tmp_path_factory.mktemp("departures") / "gold.h5"
    model = U.make("clean")
    x, y = U.inputs()
    with torch.utils.dumper(use_dump=True, dump_path=str(path)):
        U.step(model, x, y)
    return path


def _verdict(target, golden):
    """(judged table, headline) of `accucmp compare -m target -g golden`."""
    table = apply_verdict(compare_dumps(str(target), str(golden)).table)
    s = summarize(table)
    return table, verdict_sentence(s.first_failure, s.counts, s.total)


def _replay_model(golden, out, model, dtype: torch.dtype | None = torch.bfloat16):
    x, y = U.inputs()
    with torch.utils.dumper(use_load=True, load_file_path=str(golden), dump_path=str(out)) as d:
        U.step(model, x, y, dtype)
    return (*_verdict(out, golden), d)


def _replay(golden, tmp_path, bug: str, dtype: torch.dtype):
    out = tmp_path / f"{bug}.h5"
    table, sentence, d = _replay_model(golden, out, U.make(bug), dtype)
    return out, table, sentence, d


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("bug", list(EXPECTED))
def test_each_user_bug_is_named_by_its_module(golden, tmp_path, bug, dtype):
    out, table, sentence, _ = _replay(golden, tmp_path, bug, dtype)
    assert sentence.startswith(EXPECTED[bug]), sentence
    assert (table["Result"] == "fail").any()
    # the departure rows carry their kind; the by-design casts of autocast are none of them
    kinds = set(table.loc[table["CompareStatus"] == "departure", "Departure"])
    assert kinds and kinds <= set(D.KINDS)
    assert not table.loc[table["CompareStatus"] == "departure", "NPUDump"].str.contains("_to_copy").any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_clean_low_precision_replay_has_no_departure_and_passes(golden, tmp_path, dtype):
    out, table, sentence, d = _replay(golden, tmp_path, "clean", dtype)
    assert sentence.startswith("PASS"), sentence
    doc = D.decode(h5py.File(out, "r").attrs[D.ROOT_ATTR])
    assert doc["rows"] == [] and doc["counts"] == {}
    assert not d.summary["replay"].departures or not any(d.summary["replay"].departures.values())


def test_fp32_replay_of_a_different_weight_fails_on_any_difference(golden, tmp_path):
    """In the recording's own precision a parameter must be the recorded one bit for bit."""
    model = U.make("clean")
    with torch.no_grad():
        model.head.bias[3] += 1e-6          # one element, a few fp32 units
    _, sentence, _ = _replay_model(golden, tmp_path / "fp32.h5", model, None)
    assert sentence.startswith("FAIL: input self of aten.addmm.default in head differs from the golden's"), sentence


def test_the_first_departure_in_execution_order_leads(golden, tmp_path):
    """Two bugs: the earlier one (ln2's eps, forward) leads, not the later weight (fc2)."""
    model = U.ConvTransformer(eps2=1e-1)
    model.load_state_dict(U.make("clean").state_dict())
    with torch.no_grad():
        model.block.mlp.fc2.weight.mul_(1.05)
    table, sentence, _ = _replay_model(golden, tmp_path / "two.h5", model)
    assert sentence.startswith(EXPECTED["eps"])
    dep = table[table["CompareStatus"] == "departure"]
    assert list(dep["Departure"])[:2] == ["argument", "input"]


@pytest.mark.parametrize("text", [
    "not json", "[1, 2]", json.dumps({"rows": [{"kind": "bogus"}]}),
    json.dumps({"rows": [{"kind": "input", "rel_err": "big"}]}), "[" * 100000 + "]" * 100000,
    "x" * (D.MAX_TEXT + 1),
])
def test_a_damaged_departures_attribute_is_refused_in_one_line(text):
    with pytest.raises(DumpFormatError) as e:
        D.decode(text, "t.h5")
    assert str(e.value).startswith("t.h5: root attribute replay_departures") and "\n" not in str(e.value)


def test_the_attribute_keeps_the_first_departures_under_its_size_cap():
    rows = [{"kind": "inserted", "op": f"aten.op{i}.default", "module": "m" * 50, "seqid": i, "at": i}
            for i in range(2000)]
    text = D.encode(rows, {"inserted": 2000})
    assert len(text) < 64 * 1024
    doc = D.decode(text)
    assert doc["rows"][0]["op"] == "aten.op0.default" and doc["omitted"] == 2000 - len(doc["rows"])
    assert doc["counts"] == {"inserted": 2000}


# ---- the independent workflow: two plain dumps ------------------------------------------------
PLAIN_EXPECTED = {
    "inserted": "FAIL: block.mlp.scale runs aten.mul.Tensor, which the golden run does not have",
    "missing": "FAIL: block does not run aten.add.Tensor, which the golden run has",
    "weight": "FAIL: input mat2 of aten.addmm.default in block.mlp.fc2 differs from the golden's (",
    "eps": "in block.ln2:",
    "swapped": "in block.mlp.act:",
    "sdpa_scale": "in block.attn:",
}


@pytest.mark.parametrize("bug", list(PLAIN_EXPECTED))
def test_each_user_bug_is_named_by_its_module_in_an_independent_compare(golden, tmp_path, bug):
    model = U.make(bug)
    x, y = U.inputs()
    out = tmp_path / f"{bug}_plain.h5"
    with torch.utils.dumper(use_dump=True, dump_path=str(out)):
        U.step(model, x, y, torch.bfloat16)
    table, sentence = _verdict(out, golden)
    assert PLAIN_EXPECTED[bug] in sentence, sentence
    # autocast's casts (target only) are never departures
    dep = table[table["CompareStatus"] == "departure"]
    assert not dep["NPUDump"].str.contains("_to_copy").any()


def test_a_wrapped_model_replays_an_unwrapped_recording(golden, tmp_path):
    """DataParallel names every module 'module.<path>': the changed argument is still paired
    with its recorded call (module paths compared without wrapper components) and named."""
    table, sentence, _ = _replay_model(golden, tmp_path / "wrapped.h5", torch.nn.DataParallel(U.make("eps")))
    assert sentence.startswith("FAIL: module.block.ln2 aten.native_layer_norm.default: argument eps 0.1"), sentence
    assert set(table.loc[table["CompareStatus"] == "departure", "Departure"]) == {"argument"}


def _step_keeping_grads(model, x, y, set_to_none: bool | None, dtype=torch.bfloat16):
    """U.step and a zero_grad before it: `set_to_none` True/False zeroes the gradients as
    optimizer.zero_grad does; None leaves the last step's in .grad (the bug)."""
    zero = model.zero_grad
    model.zero_grad = (lambda *a, **k: None) if set_to_none is None else \
        (lambda *a, **k: zero(set_to_none=set_to_none))
    try:
        model.zero_grad()
        U.step(model, x, y, dtype)
    finally:
        model.zero_grad = zero


def test_a_step_that_accumulates_into_last_steps_gradients_fails(golden, tmp_path):
    """A step whose .grad was not zeroed: autograd accumulates into it with an `add_` that no
    op of the step reads, and load-replay dropped it as changing nothing (PASS). It updates
    a tensor no op of the step made, holding something: that outlives the step. Zeroing with
    set_to_none=False where the golden set .grad to None leaves the same gradients: passes."""
    for set_to_none, fails in ((None, True), (False, False), (True, False)):
        model = U.make("clean")
        x, y = U.inputs()
        g = torch.Generator().manual_seed(3)
        for p in model.parameters():       # what the step before left (not run: BN's stats stay)
            p.grad = torch.randn(p.shape, generator=g) * 1e-2
        out = tmp_path / f"acc_{set_to_none}.h5"
        with torch.utils.dumper(use_load=True, load_file_path=str(golden), dump_path=str(out)):
            _step_keeping_grads(model, x, y, set_to_none)
        table, headline = _verdict(out, golden)
        if fails:
            assert headline.startswith("FAIL: ") and "runs aten.add_.Tensor (backward)" in headline, headline
            row = table[(table["CompareStatus"] == "departure") & (table["NPUDump"] == "aten.add_.Tensor")]
            assert len(row) >= 1 and (row["Result"] == "fail").all()
        else:
            assert headline.startswith("PASS"), headline


def test_gradient_clipping_the_golden_lacks_fails_unless_it_changed_nothing(golden, tmp_path):
    """clip_grad_norm_ after the backward scales each gradient in place; nothing in the step
    reads them after, and load-replay dropped those `mul_` ops as changing nothing (PASS).
    A clipping whose factor comes out 1 leaves every gradient as it was: passes."""
    for max_norm, fails in ((1e-3, True), (1e9, False)):
        model = U.make("clean")
        x, y = U.inputs()
        out = tmp_path / f"clip_{max_norm}.h5"
        with torch.utils.dumper(use_load=True, load_file_path=str(golden), dump_path=str(out)):
            U.step(model, x, y, torch.bfloat16)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=False)
        _, headline = _verdict(out, golden)
        assert headline.startswith("FAIL: the model's top level runs aten.mul_.Tensor") if fails \
            else headline.startswith("PASS"), headline
