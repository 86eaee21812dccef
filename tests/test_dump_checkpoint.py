"""Activation checkpointing: forward ops re-run during backward.

torch.utils.checkpoint calls a block's forward again inside backward. Before: those ops
were attributed to the backward node that asked for the re-run (a Linear's addmm under
the GELU after it), and the block was taken for a new root module, so later names lost
their prefix. Now they carry the re-run block's path and a `recompute` attribute, and
compare names them as such when only one run re-ran them."""

from __future__ import annotations

import pytest

from accucmp.compare.pipeline import compare_dumps
from accucmp.compare.verdict import apply_verdict
from dumpfile import DumpFile
from dumpfile import schema as S

torch = pytest.importorskip("torch")
import npu_dumper  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.act = torch.nn.GELU()

    def forward(self, x):
        return self.act(self.lin(x))


class Net(torch.nn.Module):
    def __init__(self, reentrant: bool | None):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block() for _ in range(2)])
        self.head = torch.nn.Linear(8, 2)
        self.reentrant = reentrant           # None: no checkpointing

    def forward(self, x):
        for b in self.blocks:
            x = b(x) if self.reentrant is None else checkpoint(b, x, use_reentrant=self.reentrant)
        return self.head(x)


def _dump(path, reentrant):
    torch.manual_seed(0)
    net = Net(reentrant)
    x = torch.randn(4, 8, requires_grad=True)
    with npu_dumper.dumper(use_dump=True, dump_path=str(path)):
        net(x).square().mean().backward()
    with DumpFile(path) as f:
        return [(o.seqid, o.op, o.phase, o.module, bool(o.attrs.get(S.OP_RECOMPUTE, False)))
                for o in f.ops()]


@pytest.mark.parametrize("reentrant", [False, True])
def test_recomputed_ops_carry_their_block_and_the_recompute_attribute(tmp_path, reentrant):
    plain = _dump(tmp_path / "plain.h5", None)
    ckpt = _dump(tmp_path / "ckpt.h5", reentrant)
    recomputed = [o for o in ckpt if o[4]]
    assert recomputed, ckpt
    assert all(o[2] == S.PHASE_BACKWARD for o in recomputed)
    # a Linear's addmm re-run is the Linear's, under its block (not a new root "lin")
    assert {o[3] for o in recomputed if o[1] == "aten.addmm.default"} == {"blocks.0.lin", "blocks.1.lin"}
    # the forward pass is the plain run's, op for op, with the same modules
    fwd = [o[1:4] for o in ckpt if o[2] == S.PHASE_FORWARD]
    assert fwd == [o[1:4] for o in plain if o[2] == S.PHASE_FORWARD]
    assert not any(o[4] for o in plain)
    # the head (never checkpointed) keeps its name in backward after the re-runs
    assert any(o[3] == "head" for o in ckpt if o[2] == S.PHASE_BACKWARD)
    if reentrant:
        # the re-run's graph is what backward runs through: its ops know their modules too
        grads = [o for o in ckpt if o[1] == "aten.gelu_backward.default"]
        assert {o[3] for o in grads} == {"blocks.0.act", "blocks.1.act"}


def test_compare_names_ops_only_one_run_recomputed(tmp_path):
    _dump(tmp_path / "plain.h5", None)
    ckpt = _dump(tmp_path / "ckpt.h5", False)
    t = apply_verdict(compare_dumps(str(tmp_path / "ckpt.h5"), str(tmp_path / "plain.h5")).table)
    assert (t.loc[t["Result"] != "unmatched", "Result"] == "pass").all()
    unmatched = t[t["Result"] == "unmatched"]
    recomputed_seqids = {o[0] for o in ckpt if o[4]}
    assert recomputed_seqids
    flagged = unmatched[unmatched["CompareFailReason"].str.contains("activation checkpointing")]
    assert set(flagged["SeqId"]) == recomputed_seqids


def test_a_whole_model_re_run_flags_the_root_modules_own_ops(tmp_path):
    """The root's own code (module path "") re-run in backward is a re-run too."""
    torch.manual_seed(0)
    net = Net(None)

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, x):
            return self.net(x) * 2.0          # an op of the root's own code

    root = Scaled()
    x = torch.randn(4, 8, requires_grad=True)
    with npu_dumper.dumper(use_dump=True, dump_path=str(tmp_path / "c.h5")):
        checkpoint(root, x, use_reentrant=True).square().mean().backward()
    with DumpFile(tmp_path / "c.h5") as f:
        ops = [(o.op, o.phase, o.module, bool(o.attrs.get(S.OP_RECOMPUTE, False))) for o in f.ops()]
    assert ("aten.mul.Tensor", S.PHASE_BACKWARD, "", True) in ops, ops
    assert ("aten.addmm.default", S.PHASE_BACKWARD, "net.head", True) in ops, ops
