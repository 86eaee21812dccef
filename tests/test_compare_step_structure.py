"""Independent compares (two plain dumps) of porting mistakes that change the structure of the
step rather than a value an op computes: an op the target leaves out whose result the step
ends with, and casts of different tensors that the name pairing joined. Real dumps of a
golden fp32 step and a target step under bf16 autocast, compared as `accucmp compare` does."""

import torch
import torch.nn as nn
import torch.nn.functional as F

import npu_dumper  # noqa: F401  (installs torch.utils.dumper)
from accucmp.compare.pipeline import compare_dumps
from accucmp.compare.verdict import apply_verdict
from accucmp.report.findings import first_failure


class TiedLM(nn.Module):
    """An embedding and an output projection that share one weight (GPT-2, BERT, Whisper)."""

    def __init__(self, tied: bool):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(16, 8)
        self.mix = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        if tied:
            self.head.weight = self.emb.weight
        else:                   # the same values, its own parameter: the tie lost on loading
            self.head.weight = nn.Parameter(self.emb.weight.detach().clone())

    def forward(self, ids):
        return self.head(torch.tanh(self.mix(self.emb(ids))))


def _dump(path, model, amp: bool) -> str:
    ids = torch.arange(12).remainder(16).view(2, 6)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if amp else torch.autocast("cpu", enabled=False)
    with ctx, torch.utils.dumper(use_dump=True, dump_path=str(path)):
        F.cross_entropy(model(ids).float().flatten(0, 1), ids.flatten()).backward()
    return str(path)


def _judged(target, golden):
    return apply_verdict(compare_dumps(target, golden).table)


def test_a_lost_weight_tie_fails_at_the_gradient_sum_the_target_never_makes(tmp_path):
    """The tied weight's two gradients are summed by one `add` in the backward that no later
    op reads (it goes to .grad). Untied, every op the target runs agrees with its partner and
    only that sum is missing: before, the compare passed."""
    golden = _dump(tmp_path / "g.h5", TiedLM(tied=True), amp=False)
    clean = _judged(_dump(tmp_path / "clean.h5", TiedLM(tied=True), amp=True), golden)
    assert first_failure(clean) is None, clean[clean["Result"] == "fail"]["FailReason"].tolist()
    for amp in (False, True):
        t = _judged(_dump(tmp_path / f"untied_{amp}.h5", TiedLM(tied=False), amp=amp), golden)
        first = first_failure(t)
        assert first is not None, t[t["CompareStatus"] == "unpaired_op"][["NPUDump", "Module", "Result"]]
        assert first["NPUDump"] == "aten.add.Tensor" and first["Phase"] == "backward"
        assert "does not run aten.add.Tensor" in first["FailReason"] and "the step ends with" in first["FailReason"]
        assert first["Module"] in ("emb", "head")
        ends = t[t["EndsStep"].astype(str) == "True"]
        assert len(ends) == 1 and ends["Result"].iloc[0] == "fail"


class Masked(nn.Module):
    """The golden multiplies the input by a keep-mask it casts in the top module; the target
    forgets the mask (a padding mask left out)."""

    def __init__(self, use_mask: bool):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)
        self.out = nn.Linear(8, 4)
        self.use_mask = use_mask

    def forward(self, x, keep):
        if self.use_mask:
            x = x * keep.to(x.dtype)
        return self.out(torch.relu(self.lin(x)))


def _dump_masked(path, use_mask: bool, amp: bool) -> str:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 8, generator=g)
    keep = torch.tensor([[True], [True], [False], [True]])
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if amp else torch.autocast("cpu", enabled=False)
    with ctx, torch.utils.dumper(use_dump=True, dump_path=str(path)):
        Masked(use_mask)(x, keep).float().square().mean().backward()
    return str(path)


def test_casts_of_different_tensors_are_not_paired_and_the_missing_mask_is_named(tmp_path):
    """Autocast's cast of a Linear's bias and the golden's cast of the mask are both
    `_to_copy` at one place of the name streams: paired, they made a size-mismatch row that
    blamed the Linear for "an input no op of the step made"."""
    golden = _dump_masked(tmp_path / "g.h5", use_mask=True, amp=False)
    clean = apply_verdict(compare_dumps(_dump_masked(tmp_path / "c.h5", True, True), golden).table)
    assert first_failure(clean) is None, clean[clean["Result"] == "fail"]["FailReason"].tolist()
    t = apply_verdict(compare_dumps(_dump_masked(tmp_path / "t.h5", False, True), golden).table)
    casts = t[(t["NPUDump"] == "aten._to_copy.default") & (t["Result"] != "unmatched")]
    assert (casts["Shape"] == casts["GoldenShape"]).all(), casts[["Module", "Shape", "GoldenShape"]]
    assert (t["CompareStatus"] != "size_mismatch").all()
    first = first_failure(t)
    assert first is not None and first["CompareStatus"] == "unpaired_op", first
    assert "does not run aten.mul.Tensor" in first["FailReason"]


def _dump_step(path, *, clip: float | None = None, zero: str = "none", stale: bool = False) -> str:
    """TiedLM's step under bf16 autocast; `clip`: clip_grad_norm_ after the backward;
    `zero`: "none" (.grad left as found), "set_to_none" or "zeros" (zero_grad inside the
    block); `stale`: .grad holds a gradient from before the step (a step not zeroed)."""
    model = TiedLM(tied=True)
    ids = torch.arange(12).remainder(16).view(2, 6)
    if stale or zero != "none":
        g = torch.Generator().manual_seed(3)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g) * 1e-2
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.utils.dumper(use_dump=True, dump_path=str(path)):
        if zero != "none":
            model.zero_grad(set_to_none=zero == "set_to_none")
        F.cross_entropy(model(ids).float().flatten(0, 1), ids.flatten()).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=False)
    return str(path)


def test_what_changes_the_gradients_after_the_backward_fails_and_what_leaves_them_passes(tmp_path):
    """Gradient clipping the golden lacks scales every gradient in place after the backward
    (`mul_`), and a step whose .grad was not zeroed adds into last step's (`add_`): no later
    op reads either, so both passed. A clipping whose factor comes out 1 leaves the same
    gradients, as does zero_grad() inside the block: pass."""
    golden = _dump(tmp_path / "g.h5", TiedLM(tied=True), amp=False)
    for name, kw, fails in (("clip", dict(clip=1e-3), "aten.linalg_vector_norm.default"),
                            ("noclip", dict(clip=1e9), None),
                            ("stale", dict(stale=True), "aten.add_.Tensor"),
                            ("none", dict(zero="set_to_none"), None)):
        t = _judged(_dump_step(tmp_path / f"{name}.h5", **kw), golden)
        first = first_failure(t)
        if fails is None:
            assert first is None, (name, first)
        else:
            assert first is not None and first["NPUDump"] == fails, (name, first)
            assert (t[t["EndsStep"].astype(str) == "True"]["Result"] == "fail").any(), name


def _dump_opt_step(path, *, amp: bool, lr: float = 1e-3, weight_decay: float = 1e-2, impl: str = "foreach") -> str:
    """TiedLM's step with an AdamW step (foreach, or `impl` "fused" / "loop") inside the
    block: zero-initialised biases make the first update the gradient's sign, which bf16
    flips on its smallest elements."""
    model = TiedLM(tied=True)
    with torch.no_grad():
        model.mix.bias.zero_()
    how = {"foreach": dict(foreach=True), "fused": dict(fused=True), "loop": dict(foreach=False)}[impl]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, **how)
    ids = torch.arange(12).remainder(16).view(2, 6)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if amp else torch.autocast("cpu", enabled=False)
    with ctx, torch.utils.dumper(use_dump=True, dump_path=str(path)):
        F.cross_entropy(model(ids).float().flatten(0, 1), ids.flatten()).backward()
        opt.step()
    return str(path)


def test_an_optimizer_step_in_the_block_is_judged_by_its_own_error_and_its_step_sizes(tmp_path):
    """Adam's first update is m / sqrt(v) ~ sign(gradient): a bf16 run's gradients flip it on
    their smallest elements, and the foreach update, never measured against float64 (its
    results are lists), was blamed for 100+ u it only inherited. Each member of a foreach
    op's result (and of what an in-place one wrote) is measured now. A doubled learning rate
    reaches the update as per-parameter step sizes (a ScalarList): recorded, it fails there.
    Before that, AdamW's decoupled weight decay multiplies by 1 - lr * wd: 0.99998 against
    0.99999, 1e-5 relative, within float32's bound; the op ran with another argument than the
    golden's, so it fails there first (the first place the run departs)."""
    golden = _dump_opt_step(tmp_path / "g.h5", amp=False)
    clean = _judged(_dump_opt_step(tmp_path / "c.h5", amp=True), golden)
    assert first_failure(clean) is None, clean[clean["Result"] == "fail"][["NPUDump", "TensorName", "FailReason"]]
    upd = clean[clean["NPUDump"].str.startswith("aten._foreach_addcdiv_") & (clean["IO"] == "output")]
    assert len(upd) == 3 and upd["OwnErrorVsFp64"].notna().all()     # emb (= head), mix weight, bias
    t = _judged(_dump_opt_step(tmp_path / "lr.h5", amp=True, lr=2e-3), golden)
    first = first_failure(t)
    assert first is not None and first["NPUDump"] == "aten._foreach_mul_.Scalar", first
    assert first["ArgsDiffer"] == "scalar 0.99998, golden 0.99999" and first["DecidedBy"] == "ArgsDiffer", first
    upd = t[t["NPUDump"].str.startswith("aten._foreach_addcdiv_") & (t["Result"] == "fail")]
    assert len(upd) and upd["ArgsDiffer"].astype(str).str.startswith("scalars [-0.02").all()
    assert upd["ArgsDiffer"].astype(str).str.contains("golden [-0.01", regex=False).all()


def test_a_changed_weight_decay_fails_at_its_multiply_though_within_every_bound(tmp_path):
    """AdamW's weight decay 0.1 against the golden's 0.01 multiplies each weight by 0.9999
    instead of 0.99999: 9e-5 relative, under float32's 1e-4 floor, and the bf16 run passed.
    The op ran with another argument than the golden's: the run departs there, and the row
    fails whatever the size (DecidedBy ArgsDiffer); the terminal does not offer a threshold."""
    golden = _dump_opt_step(tmp_path / "g.h5", amp=False)
    target = _dump_opt_step(tmp_path / "wd.h5", amp=True, weight_decay=0.1)
    t = _judged(target, golden)
    first = first_failure(t)
    assert first is not None and first["NPUDump"] == "aten._foreach_mul_.Scalar", first
    assert first["ArgsDiffer"] == "scalar 0.9999, golden 0.99999" and first["DecidedBy"] == "ArgsDiffer"
    assert first["Origin"] == "caused here" and first["RelativeEuclideanDistance"] < 1e-4
    assert "the op ran with other arguments than the golden's" in first["FailReason"], first["FailReason"]
    # the same rows judged without their arguments pass: the size alone does not fail them
    assert first_failure(apply_verdict(t.assign(ArgsDiffer=""))) is None
    from typer.testing import CliRunner
    from accucmp.cli.main import app
    res = CliRunner(env={"COLUMNS": "100", "NO_COLOR": "1"}).invoke(
        app, ["compare", "-m", target, "-g", golden, "-o", str(tmp_path / "out")])
    out = " ".join(res.output.split())
    assert res.exit_code == 1 and "FAIL: first op caused here is aten._foreach_mul_.Scalar" in out, res.output
    assert "decided by: what the run does, not a bound" in out and "-t ArgsDiffer" not in out, res.output


def test_another_implementation_of_the_optimizer_is_one_region_judged_by_its_results(tmp_path):
    """A fused AdamW (one `_fused_adamw_` after a `_foreach_add_.Scalar` of the step counts)
    against the golden's foreach one (whose `_foreach_add_.Scalar` adds eps to the square
    roots, the parameters' shapes): the name pairing joined the two adds, and the verdict
    blamed that add for a size mismatch ("caused here") in a clean port. The lone pair of
    other shapes among unpaired ops is split; the two steps align as one region, judged by
    the parameters they leave; a per-parameter loop (CPU's default) likewise. A learning
    rate 1.2x the golden's fails in that region."""
    golden = _dump_opt_step(tmp_path / "g.h5", amp=False)
    for impl in ("fused", "loop"):
        for amp in (False, True):
            t = _judged(_dump_opt_step(tmp_path / f"{impl}{amp}.h5", amp=amp, impl=impl), golden)
            assert first_failure(t) is None, (impl, amp, t[t["Result"] == "fail"][["NPUDump", "TensorName", "FailReason"]])
            assert (t["CompareStatus"] != "size_mismatch").all(), (impl, amp)
            region = t[t["NPUDump"].str.contains("+", regex=False) & (t["IO"] == "output")]
            assert len(region) >= 3 and (region["Result"] == "pass").all(), (impl, amp, region)
        bad = _judged(_dump_opt_step(tmp_path / f"{impl}_lr.h5", amp=True, impl=impl, lr=1.2e-3), golden)
        first = first_failure(bad)
        assert first is not None and "+" in first["NPUDump"] and first["IO"] == "output", (impl, first)
        assert ("_fused_adamw_" if impl == "fused" else "addcdiv") in first["NPUDump"] + first["GroundTruthPath"]


def test_a_long_argument_list_that_differs_is_named_by_its_first_difference():
    from accucmp.compare.rows import args_differ

    steps = [-0.01] * 40
    assert args_differ({"scalars": steps, "eps": 1e-5}, {"scalars": steps, "eps": 1e-5}) == ""
    assert args_differ({"scalars": steps[:3] + [-0.02] + steps[4:]}, {"scalars": steps}) == \
        "scalars[3] -0.02, golden -0.01"
    assert args_differ({"scalars": [-0.02] * 40}, {"scalars": steps}) == \
        "scalars[0] -0.02, golden -0.01 (40 of 40 differ)"
    assert args_differ({"dims": [0, 1]}, {"dims": [1, 0]}) == "dims [0, 1], golden [1, 0]"
