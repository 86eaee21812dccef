"""torch.compile'd steps dumped as compiled (npu_dumper/compiled/, docs/COMPILED.md).

Faults are planted in Inductor only (its decomposition table, a post-grad pattern pass),
so the eager run is right and the compiled one is not; the compiled step's dump,
compared with the eager step's, must name the op and module of the fault in its
headline. Tiny graphs: each compiled dump compiles a few ATen ops one by one
(Inductor's C++ code, cached per test module in a temporary directory). The FX graph
cache and AOTAutograd's cache are off: their keys do not cover a patched decomposition
table or pass, and a clean compile cached by an earlier test would hide the planted fault.
"""

from __future__ import annotations

import contextlib

import h5py
import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import sample_models
from accucmp.cli.main import app
from dumpfile import schema as S
from npu_dumper import dumper
from npu_dumper.errors import DumperError

aten = torch.ops.aten


@pytest.fixture(scope="module", autouse=True)
def inductor_sandbox(tmp_path_factory):
    import torch._dynamo
    import torch._functorch.config as fcfg
    import torch._inductor.config as icfg
    mp = pytest.MonkeyPatch()
    mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
    with icfg.patch(fx_graph_cache=False), fcfg.patch(enable_autograd_cache=False):
        yield
    mp.undo()
    torch._dynamo.reset()


class SiluMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(8, 16), nn.SiLU(), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def _step(model, x, bf16: bool):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
        out = model(x)
    # (against a fixed target: the gradient of out.square().mean() through a LayerNorm
    # is zero up to rounding, which no comparison can judge)
    target = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    (out.float() - target).square().mean().backward()


def dump_pair(tmp_path, model, x, bf16=False, **kw):
    """(eager dump, compiled dump) of one step of `model` on `x`."""
    eager, comp = tmp_path / "eager.h5", tmp_path / "compiled.h5"
    with dumper(dump_path=str(eager), writer="thread"):
        _step(model, x, bf16)
    compiled = torch.compile(model)
    with dumper(dump_path=str(comp), compiled=True, writer="thread", **kw) as d:
        _step(compiled, x, bf16)
    assert d.num_ops > 0
    return eager, comp


def compare(tmp_path, comp, eager):
    r = CliRunner().invoke(app, ["compare", "-m", str(comp), "-g", str(eager), "-out", str(tmp_path / "out")])
    return r.exit_code, r.output


@contextlib.contextmanager
def planted_decomposition(op, fn):
    """Inductor decomposes `op` with `fn` (eager untouched)."""
    from torch._inductor import decomposition as D
    saved = D.decompositions.get(op)
    D.decompositions[op] = fn
    D.fast_random_decomps.cache_clear()
    try:
        yield
    finally:
        D.decompositions[op] = saved
        D.fast_random_decomps.cache_clear()


def _silu_off(scale):
    return lambda x: x * torch.sigmoid(x) * scale


@pytest.fixture(scope="module", params=[(False, 1.02), (True, 1.05)], ids=["fp32", "bf16"])
def silu_fault_pair(request, tmp_path_factory):
    """(eager dump, compiled dump) of SiluMLP with inductor's silu off by `scale` (eager
    untouched), fp32 and bf16: made once for the tests that compare them either way round."""
    bf16, scale = request.param
    torch.manual_seed(0)
    model, x = SiluMLP(), torch.randn(3, 8)
    with planted_decomposition(aten.silu.default, _silu_off(scale)):
        return dump_pair(tmp_path_factory.mktemp("silu_fault"), model, x, bf16)


def test_wrong_decomposition_named_by_op_and_module(tmp_path, silu_fault_pair):
    eager, comp = silu_fault_pair
    code, out = compare(tmp_path, comp, eager)
    head = out.splitlines()[0]
    assert code == 1, out
    assert head.startswith("FAIL") and "aten.silu.default" in head and " in act" in head, head
    # the source line of the FX node (its stack trace), after the module
    assert " in act at test_compiled.py:" in head, head
    # judged by its own error vs fp64 (recorded on every compiled node), in the dtype's words:
    # a bound of the defaults, never "(-t PointwiseUlps)" as if the user had given it
    assert "own error vs fp64" in head and "-t " not in head, head


def test_compiled_dump_records_nodes_with_names(tmp_path):
    """Each recorded op: the aten op of its FX node, the module path the eager dump
    writes, the node's source line, its node and graph; forward and backward graphs."""
    torch.manual_seed(0)
    model, x = SiluMLP(), torch.randn(3, 8)
    eager, comp = dump_pair(tmp_path, model, x)
    with h5py.File(comp, "r") as f:
        assert f.attrs[S.ROOT_COMPILED] == "node"
        ops = {}
        for name in f:
            if name.startswith("aten."):
                for seq, g in f[name].items():
                    ops[int(seq)] = (name, dict(g.attrs))
    names = [ops[k][0] for k in sorted(ops)]
    assert names[:3] == ["aten.addmm.default", "aten.silu.default", "aten.addmm.default"]
    assert "aten.silu_backward.default" in names
    silu = next(a for n, a in ops.values() if n == "aten.silu.default")
    assert silu[S.OP_MODULE] == "act" and silu[S.OP_PHASE] == S.PHASE_FORWARD
    assert silu[S.OP_FX_NODE] == "silu" and silu[S.OP_COMPILED_GRAPH].startswith("forward")
    assert "test_compiled.py" in silu[S.OP_STACK] and "self.act" in silu[S.OP_STACK]
    back = next(a for n, a in ops.values() if n == "aten.silu_backward.default")
    assert back[S.OP_MODULE] == "act" and back[S.OP_PHASE] == S.PHASE_BACKWARD
    code, out = compare(tmp_path, comp, eager)
    assert code == 0, out
    # the loss after the model ran outside the compiled graphs: said so, not "no data match"
    assert "not in the compiled graphs of" in out and "No data match" not in out, out


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_clean_sample_model_passes(tmp_path, bf16):
    spec = sample_models.get("mlp")
    model = spec.build(seed=0, size=sample_models.TINY)
    x, _ = spec.make_inputs(seed=0, size=sample_models.TINY)
    eager, comp = dump_pair(tmp_path, model, x, bf16)
    code, out = compare(tmp_path, comp, eager)
    assert code == 0, out
    assert out.startswith("PASS"), out
    # the compiled dump as the golden: the same pair passes
    code, out = compare_swapped(tmp_path, comp, eager)
    assert code == 0 and out.startswith("PASS"), out


class _ErfOff:
    """A post-grad pattern pass of Inductor rewriting erf(y) as erf(s y): a wrong
    replacement that only a compiled GELU (x/2 (1 + erf(x/sqrt 2))) goes through."""

    def __init__(self, scale: float):
        self.scale = scale

    def __call__(self, graph: torch.fx.Graph) -> None:
        for n in list(graph.nodes):
            if n.op == "call_function" and n.target is aten.erf.default:
                with graph.inserting_before(n):
                    scaled = graph.call_function(aten.mul.Tensor, (n.args[0], self.scale))
                n.args = (scaled,)

    def uuid(self):
        return f"npu_dumper-test-erf-off-{self.scale}"


# (1% in fp32; in bf16, where 1% is within rounding of a GELU output, 10%)
@pytest.mark.parametrize("bf16,scale", [(False, 1.01), (True, 1.1)], ids=["fp32", "bf16"])
def test_wrong_pattern_replacement_named(tmp_path, bf16, scale):
    import torch._inductor.config as icfg
    spec = sample_models.get("mlp")
    model = spec.build(seed=0, size=sample_models.TINY)
    x, _ = spec.make_inputs(seed=0, size=sample_models.TINY)
    with icfg.patch(post_grad_custom_pre_pass=_ErfOff(scale)):
        eager, comp = dump_pair(tmp_path, model, x, bf16)
    code, out = compare(tmp_path, comp, eager)
    head = out.splitlines()[0]
    assert code == 1, out
    assert "aten.gelu.default" in head and " in act" in head, head
    code, out = compare_swapped(tmp_path, comp, eager)
    head = out.splitlines()[0]
    assert code == 1 and "aten.gelu.default" in head and " in act" in head, out
    assert "the golden's own error vs fp64" in head, head


def test_compiled_option_checked():
    with pytest.raises(DumperError, match="compiled must be"):
        dumper(dump_path="x.h5", compiled="kernel")
    with pytest.raises(DumperError, match="does not combine"):
        dumper(dump_path="x.h5", check_overflow=True, compiled=True)
    with pytest.raises(DumperError, match="does not replay"):
        dumper(dump_path="x.h5", load_file_path="y.h5", compiled="module")


def test_graph_level_load_replay_separates_own_error(tmp_path):
    """compiled=True with load_file_path: each compiled node runs on the eager run's
    recorded inputs, so only the faulty node fails; in the compiled run itself the
    error it makes is inherited by the next module's input too."""
    torch.manual_seed(0)
    model, x = SiluMLP(), torch.randn(3, 8)
    with planted_decomposition(aten.silu.default, _silu_off(1.02)):
        eager, comp = dump_pair(tmp_path, model, x)
        replay = tmp_path / "replay.h5"
        with dumper(load_file_path=str(eager), dump_path=str(replay), compiled=True, writer="thread") as d:
            _step(torch.compile(model), x, False)
    assert d.summary["replay"].matched == d.num_ops > 0
    import pandas as pd
    failing = {}
    for name, path in (("compiled", comp), ("replay", replay)):
        code, out = compare(tmp_path / name, path, eager)
        assert code == 1 and "aten.silu.default" in out.splitlines()[0], out
        csv = next((tmp_path / name / "out").glob("result_*.csv"))
        df = pd.read_csv(csv)
        bad = df[df["Result"].astype(str).str.lower() == "fail"]
        failing[name] = set(zip(bad["NPUDump"], bad["SeqId"]))
    assert len(failing["replay"]) == 1, failing
    assert len(failing["compiled"]) > 1, failing


class _NativeDropout(nn.Module):
    """Dropout as CUDA's eager nn.Dropout runs it: one native_dropout (values and mask), the
    op the compiled graph holds. (On CPU eager nn.Dropout runs bernoulli_, div_ and mul,
    which no compiled node pairs with: docs/COMPILED.md.)"""

    def forward(self, x):
        return torch.native_dropout(x, 0.5, True)[0]


class _DropoutMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(8, 16), _NativeDropout(), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.drop(self.fc1(x)))


def test_graph_level_replay_hands_dropout_its_recorded_mask(tmp_path):
    """A random node replayed at graph level draws its own numbers when it runs compiled;
    its outputs (the dropped values and the mask the backward reads) become the eager run's
    recorded ones, as eager load-replay does (the old code kept the compiled draws, in a
    record marked as replayed)."""
    torch.manual_seed(0)
    model, x = _DropoutMLP().train(), torch.randn(4, 8)
    eager, replay = tmp_path / "eager.h5", tmp_path / "replay.h5"
    with dumper(dump_path=str(eager), writer="thread"):
        _step(model, x, False)
    torch.manual_seed(1)            # (other draws than the eager run's)
    with dumper(load_file_path=str(eager), dump_path=str(replay), compiled=True, writer="thread") as d:
        _step(torch.compile(model), x, False)
    assert d.summary["replay"].random_replayed == 1, d.summary["replay"]
    with h5py.File(eager, "r") as fe, h5py.File(replay, "r") as fr:
        (se, ge), = fe["aten.native_dropout.default"].items()
        (sr, gr), = fr["aten.native_dropout.default"].items()
        assert gr.attrs[S.OP_RANDOM_OUTPUTS_REPLAYED]
        for name in ("result0", "result1"):
            assert (gr["output"][name][()] == ge["output"][name][()]).all(), name
    code, out = compare(tmp_path, replay, eager)
    assert code == 0, out


def test_narrow_names_the_decomposition(tmp_path):
    """The failing op rebuilt alone from the eager dump's inputs, bisected by PyTorch's
    compiler bisector: the planted decomposition is named (by the API and by
    `python -m npu_dumper.compiled narrow`); a clean op narrows to None."""
    from dumpfile.read.reader import DumpFile
    from npu_dumper.compiled import narrow_recorded_op
    from npu_dumper.compiled.cli import app as narrow_app
    torch.manual_seed(0)
    model, x = SiluMLP(), torch.randn(3, 8)
    eager = tmp_path / "eager.h5"
    with dumper(dump_path=str(eager), writer="thread"):
        _step(model, x, False)
    with DumpFile(str(eager)) as f:
        seq = {o.op: o.seqid for o in f.ops()}
    silu = seq["aten.silu.default"]
    with planted_decomposition(aten.silu.default, _silu_off(1.02)):
        found = narrow_recorded_op(eager, "aten.silu.default", silu)
        clean = narrow_recorded_op(eager, "aten.addmm.default", seq["aten.addmm.default"])
        cli = CliRunner().invoke(narrow_app, ["narrow", str(eager), "--op", "aten.silu", "--seqid", str(silu)])
    assert found is not None and found.subsystem == "decomposition", found
    assert "aten.silu" in str(found.debug_info), found
    assert clean is None
    # the command: one line naming the op, the subsystem and what the bisector found; exit 1
    assert cli.exit_code == 1, cli.output
    line, = cli.stdout.splitlines()     # (the bisector's progress: on stderr)
    assert line.startswith(f"aten.silu.default #{silu}: ") and "subsystem decomposition" in line, line
    assert "aten.silu" in line.split("subsystem decomposition", 1)[1], line


def test_narrow_command_bad_input(tmp_path):
    """Bad input to the narrow command: one line naming the file and the problem, exit 2
    (nothing compiles: each is refused before the bisector runs)."""
    import subprocess
    import sys
    from npu_dumper.compiled.cli import app as narrow_app
    torch.manual_seed(0)
    eager, model, x = tmp_path / "eager.h5", SiluMLP(), torch.randn(3, 8)
    with dumper(dump_path=str(eager), writer="thread"):
        _step(model, x, False)
    not_dump = tmp_path / "notes.h5"
    not_dump.write_text("not a dump")
    cases = {(str(eager), "999", None): "no op with seqid 999",
             (str(eager), "1", "aten.silu"): "seqid 1 is aten.addmm.default, not aten.silu",
             (str(tmp_path / "missing.h5"), "1", None): "no such file",
             (str(not_dump), "1", None): "not an HDF5 file"}
    for (path, seqid, op), problem in cases.items():
        args = ["narrow", path, "--seqid", seqid] + (["--op", op] if op else [])
        r = CliRunner().invoke(narrow_app, args)
        assert r.exit_code == 2, r.output
        line, = r.output.strip().splitlines()
        assert path in line and problem in line, line
    # the module's entry point, as a user runs it
    r = subprocess.run([sys.executable, "-m", "npu_dumper.compiled", "narrow", str(eager), "--seqid", "999"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert "no op with seqid 999" in r.stderr and "Traceback" not in r.stderr, r.stderr


class _Swish(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(x)


class SwishMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.swish, self.fc2 = nn.Linear(8, 16), _Swish(), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.swish(self.fc1(x)))


class _SwishPatternOff:
    """A post-grad pattern pass rewriting mul(x, sigmoid(x)) as 1.02 x sigmoid(x): a
    pattern over two ops, visible only when both are in one compiled piece."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        for n in list(graph.nodes):
            if n.op == "call_function" and n.target is aten.mul.Tensor and len(n.args) == 2:
                a, b = n.args
                if isinstance(b, torch.fx.Node) and b.target is aten.sigmoid.default and b.args[0] is a:
                    with graph.inserting_after(n):
                        off = graph.call_function(aten.mul.Tensor, (n, 1.02))
                    n.replace_all_uses_with(off, delete_user_cb=lambda u: u is not off)

    def uuid(self):
        return "npu_dumper-test-swish-pattern-off"


def test_pattern_over_two_ops_needs_module_split(tmp_path):
    """What a cut hides: split per op, the two ops of the pattern are compiled apart and
    the fault is not reproduced (PASS); split per module, they compile together and the
    headline names the op and module."""
    import torch._inductor.config as icfg
    torch.manual_seed(0)
    model, x = SwishMLP(), torch.randn(3, 8)
    verdicts = {}
    with icfg.patch(post_grad_custom_pre_pass=_SwishPatternOff()):
        for split in ("node", "module"):
            d = tmp_path / split
            d.mkdir()
            eager, comp = d / "eager.h5", d / "compiled.h5"
            with dumper(dump_path=str(eager), writer="thread"):
                _step(model, x, False)
            with dumper(dump_path=str(comp), compiled=split, writer="thread"):
                _step(torch.compile(model), x, False)
            verdicts[split] = compare(d, comp, eager)
            verdicts["swapped " + split] = compare_swapped(d, comp, eager)
    assert verdicts["node"][0] == 0, verdicts["node"][1]
    assert verdicts["swapped node"][0] == 0, verdicts["swapped node"][1]
    for role in ("module", "swapped module"):
        code, out = verdicts[role]
        head = out.splitlines()[0]
        assert code == 1 and "aten.mul.Tensor" in head and " in swish" in head, out


class _WithConstant(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        # a tensor made in forward: the trace lifts it into the graph module as a constant
        # (get_attr _tensor_constant0, as transformers' causal masks)
        return self.fc(x) * torch.tensor([0.5, 1.0, 2.0, 4.0])


def test_graph_constants(tmp_path):
    torch.manual_seed(0)
    model, x = _WithConstant(), torch.randn(2, 4)
    eager, comp = dump_pair(tmp_path, model, x)
    code, out = compare(tmp_path, comp, eager)
    assert code == 0, out


class _Attention(nn.Module):
    """One attention head behind a SiLU: its key bias's gradient is 0 in exact arithmetic
    (softmax ignores what q . b_k adds to every key alike), so the compiled and the eager
    run both hold rounding noise there, 100% apart."""

    def __init__(self):
        super().__init__()
        self.fc, self.act = nn.Linear(8, 8), nn.SiLU()
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.act(self.fc(x))
        return torch.softmax(self.q(h) @ self.k(h).transpose(-1, -2), -1) @ self.v(h)


def test_cancelling_sum_is_noise_not_a_failure_fp32(tmp_path):
    """A sum that is 0 in exact arithmetic (the key bias's gradient) differs 100% between a
    compiled and an eager fp32 run: each compiled node's own error against float64 on its
    own inputs (recorded in float32 too) with how much its sum cancels passes it as
    inherited noise (the old code failed it: RelErr 0.68 > 1e-4)."""
    import pandas as pd
    torch.manual_seed(0)
    eager, comp = dump_pair(tmp_path, _Attention(), torch.randn(2, 5, 8))
    code, out = compare(tmp_path, comp, eager)
    assert code == 0, out
    df = pd.read_csv(next((tmp_path / "out").glob("result_*.csv")))
    bias = df[(df["NPUDump"] == "aten.sum.dim_IntList") & (df["Module"] == "k") & (df["IO"] == "output")]
    assert len(bias) == 1, df[["NPUDump", "Module"]]
    row = bias.iloc[0]
    assert row["RelativeEuclideanDistance"] > 0.1 and row["OwnCancellation"] > 1e3, row
    assert row["Result"] == "pass" and row["Origin"] == "inherited", row
    # every compiled node recorded its own error, its arguments and which inputs ops made
    with h5py.File(comp, "r") as f:
        attrs = dict(f["aten.sum.dim_IntList"][str(int(row["SeqId"]))].attrs)
    assert S.OP_OWN_ERROR in attrs and attrs[S.OP_MADE_INPUTS] == '["self"]', attrs


def test_normalisation_mean_measured_as_a_cancelling_sum():
    """A LayerNorm's saved mean is a sum of its input's elements: near 0 for a centred input
    (BERT's residual sums: 7e-8 apart, compiled against eager, at |mean| 7.5e-5), its own
    error is recorded with how much it cancels, even in float32 (op_computed: a compiled
    node)."""
    import json
    from npu_dumper.capture.policy import OpEvent
    from npu_dumper.replay.own_error import PlainOwnError
    torch.manual_seed(0)
    x = torch.randn(4, 32)
    x = x - x.mean(-1, keepdim=True) + 1e-4
    args = (x, [32], torch.ones(32), torch.zeros(32), 1e-5)
    func = aten.native_layer_norm.default
    ev = OpEvent(func, "aten.native_layer_norm.default", args, {}, 1, S.PHASE_FORWARD, "norm", "")
    ev.outputs = func(*args)
    PlainOwnError().op_computed(ev)
    own = json.loads(ev.group_attrs[S.OP_OWN_ERROR])
    assert len(own["result1"]) == 4 and own["result1"][3] > 1e3, own     # kappa of the mean
    assert len(own["result0"]) == 3, own                                  # no sum: no kappa


def test_headline_names_the_source_line_within_80_columns():
    """The headline: op, module, then the source line's file and line (the csv's Source column
    keeps the whole line), fitted to a terminal of 80 columns; the details show the line."""
    import io
    from rich.console import Console
    from accucmp.report.summary import Summary, print_summary
    src = ("/opt/venv/lib/python3.11/site-packages/transformers/models/some_really_long_model_name/"
           "modeling_some_really_long_model_name.py:1234 in forward: hidden = self.LayerNorm(hidden + residual)")
    row = {"NPUDump": "aten.native_layer_norm_backward.default", "SeqId": 72, "Phase": "backward",
           "Module": "model.encoder.layer.11.attention.output.LayerNorm", "Source": src, "Result": "fail",
           "Origin": "caused here", "DecidingMetric": "RelativeEuclideanDistance", "DecidingValue": 0.02,
           "DecidingBound": 1e-4, "DecidedBy": "RelativeEuclideanDistanceFloor", "PrecisionDtype": "float32",
           "NPUDumpPath": "/aten.native_layer_norm_backward.default/72/output/result0", "Severity": 200.0}
    s = Summary(counts={"fail": 1, "pass": 9}, total=10, first_failure=row, worst=[row])
    buf = io.StringIO()
    print_summary(None, console=Console(file=buf, width=80, force_terminal=True, color_system=None), summary=s)
    lines = buf.getvalue().splitlines()
    assert all(len(ln) <= 80 for ln in lines), "\n".join(ln for ln in lines if len(ln) > 80)
    head = " ".join(ln.strip() for ln in lines[:3])
    assert head.startswith("FAIL") and ":1234" in head and " at modeling_" in head, lines[:3]
    assert any("source:" in ln for ln in lines), lines


def compare_swapped(tmp_path, comp, eager):
    """The compiled dump as the golden (-g), the eager one as the target (-m)."""
    r = CliRunner().invoke(app, ["compare", "-m", str(eager), "-g", str(comp), "-out", str(tmp_path / "swapped")])
    return r.exit_code, r.output


def test_roles_swapped_clean_pair_passes(tmp_path):
    """The compiled dump as the golden: its nodes' own errors judge the pair as they do with
    the compiled dump as the target, so rounding noise on an exact-zero result (the key
    bias's gradient) passes as inherited (the old code used the own error of the target
    only: RelErr 0.68 > 1e-4, FAIL)."""
    import pandas as pd
    torch.manual_seed(0)
    eager, comp = dump_pair(tmp_path, _Attention(), torch.randn(2, 5, 8))
    code, out = compare_swapped(tmp_path, comp, eager)
    assert code == 0 and out.startswith("PASS"), out
    # the loss outside the compiled graphs: said so in this role too (the old code: "No data match")
    assert "not in the compiled graphs of" in out and "No data match" not in out, out
    df = pd.read_csv(next((tmp_path / "swapped").glob("result_*.csv")))
    bias = df[(df["NPUDump"] == "aten.sum.dim_IntList") & (df["Module"] == "k") & (df["IO"] == "output")]
    row = bias.iloc[0]
    assert row["RelativeEuclideanDistance"] > 0.1 and row["OwnErrorOf"] == "golden", row
    assert row["Result"] == "pass" and row["Origin"] == "inherited", row


def test_roles_swapped_fault_named_in_the_golden(tmp_path, silu_fault_pair):
    """A compile-only fault with the compiled run as the golden: the headline names the op
    and module, and says the golden's (compiled) op is what differs (the old code: fp32
    named it by its distance from eager alone, as if the eager op were wrong; bf16 passed
    the fault as inherited, judged by the eager target's own error)."""
    eager, comp = silu_fault_pair
    code, out = compare_swapped(tmp_path, comp, eager)
    head = out.splitlines()[0]
    assert code == 1, out
    assert head.startswith("FAIL") and "aten.silu.default" in head and " in act" in head, head
    assert "golden's own error vs fp64" in head, head
