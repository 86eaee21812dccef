"""npu_dumper.upcast runs the named ops / module subtrees in float32 inside a bf16 step, and
`accucmp bisect` finds a planted low-precision fault through the NPU_DUMPER_UPCAST protocol."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from typer.testing import CliRunner

import npu_dumper
from accucmp.cli.main import app
from npu_dumper.upcast import UpcastSpecError, upcast, upcast_from_env

STEP = Path(__file__).parent / "data" / "bisect_step.py"
ROOT = Path(__file__).resolve().parent.parent


class SeenDtypes(TorchDispatchMode):
    """Entered outside upcast: records the floating input dtypes each op reached the kernel with."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        dts = {a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()}
        self.seen.append((str(func), torch._C._current_autograd_node() is not None, dts))
        return func(*args, **(kwargs or {}))


def test_named_op_runs_in_float32_and_returns_bf16():
    a = torch.randn(8, dtype=torch.bfloat16)
    b = torch.randn(8, dtype=torch.bfloat16)
    with SeenDtypes() as rec, upcast(ops=["aten.mul", "aten.mul_.Tensor"]) as up:
        out = a * b + a
        c = a.clone()
        c.mul_(b)           # in place: the caller's bf16 tensor gets the result
    seen = {f: d for f, _, d in rec.seen}
    assert seen["aten.mul.Tensor"] == {torch.float32} and seen["aten.add.Tensor"] == {torch.bfloat16}
    assert seen["aten.mul_.Tensor"] == {torch.float32}
    assert out.dtype == torch.bfloat16 and c.dtype == torch.bfloat16
    assert torch.equal(c, (a.float() * b.float()).bfloat16())
    assert up.upcast_calls == 2 and up.upcast_ops == {"aten.mul.Tensor", "aten.mul_.Tensor"}


def test_module_subtree_upcast_forward_and_backward():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()),
                                torch.nn.Linear(4, 1)).to(torch.bfloat16)
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    with SeenDtypes() as rec, upcast(modules=["1"]):
        y = model(x)
        y.sum().backward()
    fwd = [(f, d) for f, bwd, d in rec.seen if not bwd]
    bwd = [(f, d) for f, b, d in rec.seen if b]
    assert [d for f, d in fwd if f == "aten.addmm.default"] == [{torch.bfloat16}, {torch.float32}, {torch.bfloat16}]
    assert ("aten.tanh.default", {torch.float32}) in fwd
    assert ("aten.tanh_backward.default", {torch.float32}) in bwd
    assert y.dtype == torch.bfloat16 and model[1][0].weight.grad.dtype == torch.bfloat16


def test_env_protocol():
    assert isinstance(upcast_from_env({}), type(upcast_from_env({"NPU_DUMPER_UPCAST": ""})))
    u = upcast_from_env({"NPU_DUMPER_UPCAST": '{"ops": ["aten.gelu"], "modules": ["a.b"], "dtype": "float64"}'})
    assert isinstance(u, upcast) and u._mode.dtype == torch.float64 and u._mode.modules == ("a.b",)
    for bad in ("{not json", '{"opz": []}', '{"dtype": "int8x"}'):
        with pytest.raises(UpcastSpecError):
            upcast_from_env({"NPU_DUMPER_UPCAST": bad})


def _env():
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def test_bisect_finds_planted_fault_in_fewer_runs_than_each_module(tmp_path, monkeypatch):
    import subprocess

    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.delenv("NPU_DUMPER_UPCAST", raising=False)
    golden = subprocess.run([sys.executable, str(STEP), "--fp32"], capture_output=True, text=True, env=_env())
    (tmp_path / "golden.txt").write_text(golden.stdout)
    modules = ["layers.0", "layers.1", "layers.2", "layers.3", "layers.4", "layers.5", "act", "norm"]
    run = f"{sys.executable} {STEP}"
    args = ["bisect", "--run", run, "--golden-loss", str(tmp_path / "golden.txt"),
            "--modules", ",".join(modules), "-out", str(tmp_path)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "smallest set (1 of 8 suspects): module layers.3" in res.output
    runs = int(res.output.split(" script run(s)")[0].rsplit(" ", 1)[1])
    assert runs < 1 + len(modules)          # trying each module: a baseline plus one run each
    assert "run 1: upcast 0 suspect(s)" in res.output   # progress
    # cached by suspect set: the same bisect again runs the script no more
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0 and "0 script run(s)" in again.output and "module layers.3" in again.output


def test_bisect_failing_script_is_one_line_error(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nprint('loss=1.0')\nsys.exit('CUDA error: out of memory')\n")
    res = CliRunner().invoke(app, ["bisect", "--run", f"{sys.executable} {bad}", "--golden-loss", "1.0",
                                   "--ops", "aten.gelu", "-out", str(tmp_path)])
    assert res.exit_code == 2
    lines = res.output.strip().splitlines()
    assert lines[-1].startswith("accucmp: error: run") and "exit code 1" in lines[-1] and "out of memory" in lines[-1]
    noloss = tmp_path / "noloss.py"
    noloss.write_text("print('done')\n")
    res = CliRunner().invoke(app, ["bisect", "--run", f"{sys.executable} {noloss}", "--golden-loss", "1.0",
                                   "--ops", "aten.gelu", "-out", str(tmp_path)])
    assert res.exit_code == 2 and "no 'loss=<float>' line" in res.output.strip().splitlines()[-1]


def test_bisect_suspects_that_cannot_explain_the_loss(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("print('loss=2.0')\n")
    res = CliRunner().invoke(app, ["bisect", "--run", f"{sys.executable} {script}", "--golden-loss", "1.0",
                                   "--ops", "aten.gelu,aten.mm", "-out", str(tmp_path)])
    assert res.exit_code == 2 and "not among them" in res.output


def test_bisect_search_needs_two_culprits():
    from accucmp.bisect import Suspect, bisect

    class Fake:
        runs = evaluations = 0

        def loss(self, s):
            self.runs += 1
            self.evaluations += 1
            names = {x.name for x in s}
            return 1.0 + 0.5 * ("c" not in names) + 0.25 * ("f" not in names)

    sus = [Suspect("op", n) for n in "abcdefgh"]
    res = bisect(Fake(), sus, golden=1.0)
    assert [s.name for s in res.culprits] == ["c", "f"] and res.fixed == 1.0


def test_suspects_from_compare_csv(tmp_path):
    from accucmp.bisect import BisectError, suspects_from_compare

    p = tmp_path / "result.csv"
    p.write_text("NPUDump,Module,Result\naten.addmm.default,layers.0,pass\naten.gelu.default,act,fail\n"
                 "aten.addmm.default,layers.3,fail\naten.gelu.default,act,fail\n")
    assert [s.name for s in suspects_from_compare(p)] == ["aten.gelu.default", "aten.addmm.default"]
    assert [str(s) for s in suspects_from_compare(p, by="module")] == ["module act", "module layers.3"]
    p.write_text("NPUDump,Module,Result\naten.addmm.default,layers.0,pass\n")
    with pytest.raises(BisectError, match="no failing"):
        suspects_from_compare(p)


def _buggy_matmul_inside(module, fault):
    """A dispatch mode that applies `fault` to the bf16 addmm/mm outputs computed inside
    `module`'s forward: a kernel bug planted in one place of a model we did not write."""
    inside = [False]
    module.register_forward_pre_hook(lambda m, a: inside.__setitem__(0, True))
    module.register_forward_hook(lambda m, a, o: inside.__setitem__(0, False))

    class BuggyBf16Matmul(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if inside[0] and func.overloadpacket in (torch.ops.aten.addmm, torch.ops.aten.mm) \
                    and out.dtype == torch.bfloat16:
                out = fault(out)
            return out
    return BuggyBf16Matmul


class _InProcess:
    """bisect's runner protocol in-process: the loss of `step()` under the planted bug and the
    suspects' upcast (the same search, without the subprocess protocol's interpreter start-up)."""

    def __init__(self, bug, step):
        self.bug, self.step = bug, step
        self.runs = self.evaluations = 0

    def loss(self, suspects):
        from npu_dumper.upcast import parse_spec, spec_json

        self.runs += 1
        self.evaluations += 1
        with self.bug(), upcast(**parse_spec(spec_json(suspects))), torch.no_grad():
            return self.step()


def test_bisect_in_process_on_torch_transformer_encoder():
    """A model this project did not write (torch.nn.TransformerEncoder), bf16, with a buggy
    bf16 matmul in one of its 16 leaf modules: the search names that module in fewer set
    evaluations than trying each one (here in-process: the same search, without the
    per-run interpreter start-up of the subprocess protocol)."""
    from accucmp.bisect import Suspect, bisect
    from npu_dumper.upcast import parse_spec, spec_json

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0)
    model = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    x = torch.randn(6, 3, 32)
    target = torch.randn(6, 3, 32)
    golden = torch.nn.functional.mse_loss(model(x), target).item()
    model = model.to(torch.bfloat16)
    BuggyBf16Matmul = _buggy_matmul_inside(model.get_submodule("layers.1.linear1"), lambda out: out + 0.5)

    runner = _InProcess(BuggyBf16Matmul, lambda: torch.nn.functional.mse_loss(
        model(x.to(torch.bfloat16)).float(), target).item())

    leaves = [n for n, m in model.named_modules() if n and not list(m.children())]
    assert len(leaves) == 16 and "layers.1.linear1" in leaves
    res = bisect(runner, [Suspect("module", n) for n in leaves], golden, rtol=2e-3)
    assert [s.name for s in res.culprits] == ["layers.1.linear1"]
    assert res.evaluations < 1 + len(leaves), res.evaluations


def test_outputs_keep_the_dtype_the_op_would_have_produced():
    a = torch.randn(8, dtype=torch.bfloat16)
    with upcast(ops=["aten.mul", "aten.sum"]):
        scaled = a * torch.tensor(3.0)                 # 0-dim float32: promotion keeps bf16
        total = torch.sum(a, dtype=torch.float32)      # asks for float32
        plain = a.sum()
    assert scaled.dtype == torch.bfloat16 and total.dtype == torch.float32 and plain.dtype == torch.bfloat16
    assert torch.equal(scaled, (a.float() * 3.0).bfloat16())
    assert total == a.float().sum()


def test_bisect_in_process_on_hugging_face_gpt2():
    """A third-party model (Hugging Face GPT-2 from its config, random weights, no download),
    bf16, with a buggy bf16 matmul in one MLP projection: bisect over its leaf modules names
    that module in fewer evaluations than trying each one."""
    transformers = pytest.importorskip("transformers")
    from accucmp.bisect import Suspect, bisect
    from npu_dumper.upcast import parse_spec, spec_json

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0, initializer_range=0.2)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        golden = model(ids, labels=ids).loss.item()
    model = model.to(torch.bfloat16)
    culprit = "transformer.h.1.mlp.c_fc"   # a 3x fault there moves the loss 1.4%
    BuggyBf16Matmul = _buggy_matmul_inside(model.get_submodule(culprit), lambda out: out * 3)

    runner = _InProcess(BuggyBf16Matmul, lambda: model(ids, labels=ids).loss.float().item())

    leaves = [n for n, m in model.named_modules() if n and not list(m.children())]
    assert culprit in leaves and len(leaves) >= 20
    res = bisect(runner, [Suspect("module", n) for n in leaves], golden, rtol=3e-3)   # bf16's own: 6e-4
    assert [s.name for s in res.culprits] == [culprit]
    assert res.evaluations < 1 + len(leaves), res.evaluations


def test_golden_loss_file_with_a_time_after_the_loss_says_which_line_it_read(tmp_path):
    """issue 35 item 4: `loss=2.31074309  (1.11s)` was refused ("no 'loss=<float>' line")."""
    from accucmp.bisect import find_loss, parse_loss, read_golden

    log = tmp_path / "golden.log"
    log.write_text("epoch 0\nstep 1 loss=2.5 lr=0.1\nloss=2.31074309  (1.11s)\ndone\n")
    said = []
    assert read_golden(str(log), said.append) == 2.31074309
    assert said == [f"golden loss 2.31074309 read from {log} (line 3: loss=2.31074309  (1.11s))"]
    assert find_loss("LOSS = -1.5e-3, acc=0.9") == (-1.5e-3, 1, "LOSS = -1.5e-3, acc=0.9")
    assert parse_loss("loss=1\nloss=2 (0.5s)\n") == 2.0     # a script's last loss line counts
    assert parse_loss("val_loss: 3\nno loss here") is None
    # the command line says it too, on stderr
    res = CliRunner().invoke(app, ["bisect", "--run", "true", "--golden-loss", str(log), "--ops", "x",
                                   "-out", str(tmp_path)])
    assert f"golden loss 2.31074309 read from {log} (line 3:" in res.output
