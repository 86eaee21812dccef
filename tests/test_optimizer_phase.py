"""Ops an optimizer's step runs are shown as the update (Phase "optimizer", Module
"AdamW.step"), not as forward ops of the model's top level.

Before, a planted learning rate or a bf16 update rounded away was named as
`aten.mul_.Tensor #33 (forward)` with no module: a user looked for it in the model's forward.
The dumper now records op attribute `optimizer` (the class of the optimizer whose step() ran
the op, from torch.optim's global step hooks) on the ops the step runs outside any module;
compare shows them so. Checked against an independent source: the ops recorded between a
step's pre- and post-hook of the user's own registration.
"""

from __future__ import annotations

import h5py
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import npu_dumper  # noqa: F401  (installs torch.utils.dumper)
from accucmp.compare.pipeline import compare_dumps
from accucmp.compare.verdict import apply_verdict
from accucmp.report.findings import first_failure
from accucmp.report.headline import verdict_sentence
from dumpfile import schema as S
from dumpfile.read.reader import DumpFile


class Halving(torch.optim.Optimizer):
    """A user's own optimizer (a subclass: torch wraps its step with the global hooks too)."""

    def __init__(self, params, lr=0.5):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


def _step(path, *, lr=1e-3, opt="adamw"):
    """forward, backward, clip, optimizer step, zero_grad, and one more forward op."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optim = torch.optim.AdamW(net.parameters(), lr=lr) if opt == "adamw" else Halving(net.parameters())
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    # the independent record: the dumper's op count when the step starts and ends
    seen = {}
    pre = optim.register_step_pre_hook(lambda o, a, k: seen.update(start=mode_seqid()))
    post = optim.register_step_post_hook(lambda o, a, k: seen.update(end=mode_seqid()))
    with torch.utils.dumper(use_dump=True, dump_path=str(path)) as dumper:
        mode_seqid = lambda: dumper._mode.seqid      # noqa: E731
        F.mse_loss(net(x), torch.zeros(6, 4)).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optim.step()
        optim.zero_grad()
        (x * 2).sum()
    pre.remove()
    post.remove()
    return seen


def _optimizer_attrs(path) -> dict[int, str]:
    with DumpFile(str(path)) as f:
        return {op.seqid: op.attrs.get(S.OP_OPTIMIZER, "") for op in f.ops()}


@pytest.mark.parametrize("opt,name", [("adamw", "AdamW"), ("halving", "Halving")])
def test_the_ops_of_a_step_carry_their_optimizer_and_no_other_op_does(tmp_path, opt, name):
    seen = _step(tmp_path / "d.h5", opt=opt)
    attrs = _optimizer_attrs(tmp_path / "d.h5")
    labelled = {s for s, v in attrs.items() if v}
    in_step = {s for s in attrs if seen["start"] < s <= seen["end"]}
    assert labelled and labelled == in_step, (sorted(labelled), seen)
    assert {attrs[s] for s in labelled} == {name}
    with h5py.File(tmp_path / "d.h5", "r") as h5:
        assert h5.attrs[S.ROOT_FORMAT_VERSION] == "1.9"


def test_a_changed_learning_rate_is_named_in_the_optimizer_step(tmp_path):
    _step(tmp_path / "g.h5", lr=1e-3)
    _step(tmp_path / "t.h5", lr=2e-3)
    table = apply_verdict(compare_dumps(str(tmp_path / "t.h5"), str(tmp_path / "g.h5")).table)
    first = first_failure(table)
    assert first is not None and first["Phase"] == S.PHASE_OPTIMIZER and first["Module"] == "AdamW.step", first
    counts = table["Result"].value_counts().to_dict()
    assert " in AdamW.step: " in verdict_sentence(first, counts)
    # the model's own ops keep their phase and module
    fwd = table[table["NPUDump"] == "aten.addmm.default"]
    assert set(fwd["Phase"]) == {"forward"} and set(fwd["Module"]) == {"0", "2"}
    clip = table[table["NPUDump"].str.contains("norm", regex=False) & (table["Module"] == "")]
    assert not clip.empty and set(clip["Phase"]) == {"forward"}     # clipping runs outside the step


def test_a_file_without_the_attribute_or_with_a_hostile_one_shows_the_recorded_phase(tmp_path):
    _step(tmp_path / "d.h5")
    with h5py.File(tmp_path / "d.h5", "r+") as h5:
        names = [f"{op}/{s}" for op in h5 if not op.startswith("_") for s in h5[op]
                 if S.OP_OPTIMIZER in h5[op][s].attrs]
        assert names
        del h5[names[0]].attrs[S.OP_OPTIMIZER]
        h5[names[1]].attrs[S.OP_OPTIMIZER] = "x" * 5000
        h5[names[2]].attrs[S.OP_OPTIMIZER] = "Adam\x1b[2J"
    with DumpFile(str(tmp_path / "d.h5")) as f:
        shown = {op.path.strip("/"): op.shown_place for op in f.ops()}
    for name in names[:3]:
        assert shown[name] == ("forward", ""), (name, shown[name])
    assert all(shown[n] == (S.PHASE_OPTIMIZER, "AdamW.step") for n in names[3:])


def test_a_load_replay_names_a_changed_learning_rate_in_the_optimizer_step(tmp_path):
    """The replay's own departure rows (root attribute replay_departures) carry the optimizer
    too: before, the argument departure said 'the model's top level aten.mul_.Tensor'."""
    _step(tmp_path / "g.h5", lr=1e-3)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optim = torch.optim.AdamW(net.parameters(), lr=2e-3)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    with torch.utils.dumper(use_load=True, load_file_path=str(tmp_path / "g.h5"), dump_path=str(tmp_path / "r.h5")):
        F.mse_loss(net(x), torch.zeros(6, 4)).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optim.step()
        optim.zero_grad()
        (x * 2).sum()
    table = apply_verdict(compare_dumps(str(tmp_path / "r.h5"), str(tmp_path / "g.h5")).table)
    first = first_failure(table)
    assert first is not None and first["Origin"] == "departs", first
    assert first["Phase"] == S.PHASE_OPTIMIZER and first["Module"] == "AdamW.step", first
    counts = table["Result"].value_counts().to_dict()
    assert verdict_sentence(first, counts).startswith("FAIL: AdamW.step aten.mul_.Tensor: argument other"), \
        verdict_sentence(first, counts)
