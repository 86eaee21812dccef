"""Statistics-only dumps as tables (format 1.1): read back, compare, list, survive SIGKILL."""

import contextlib
import io
import math
import time

import h5py
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import npu_dumper
import sample_models
from accucmp.cli.main import app
from accucmp.compare.pipeline import compare_dumps
from accucmp.compare.verdict import apply_verdict
from dumpfile import DumpFile
from dumpfile import schema as S

from ._kill_helpers import killed_dump_tail, sigkill_mid_dump

ENV = {"COLUMNS": "120"}


def _step(path, stats_only, spec, seed=0, **kw):
    model = spec.build(seed=seed, size="tiny")
    inputs = spec.make_inputs(seed=seed, size="tiny")
    with npu_dumper.dumper(use_dump=True, dump_path=str(path), stats_only=stats_only, **kw):
        spec.train_step(model, inputs)


@pytest.fixture(scope="module")
def mlp_dumps(tmp_path_factory):
    d = tmp_path_factory.mktemp("stats_table")
    spec = sample_models.get("mlp")
    _step(d / "full.h5", False, spec)
    _step(d / "s1.h5", True, spec)
    _step(d / "s2.h5", True, spec)
    return d


def _stats_of(arr) -> dict:
    a = np.asarray(arr, dtype=np.float64).reshape(-1)
    fin = a[np.isfinite(a)]
    return {"min": fin.min(), "max": fin.max(), "mean": fin.mean(),
            "std": fin.std(ddof=1) if fin.size > 1 else 0.0, "norm": np.sqrt((fin * fin).sum()),
            "nan_count": np.isnan(a).sum(), "inf_count": np.isinf(a).sum(), "numel": a.size}


def test_table_file_has_no_op_groups_and_new_version(mlp_dumps):
    with h5py.File(mlp_dumps / "s1.h5", "r") as f:
        assert f.attrs[S.ROOT_FORMAT_VERSION] == S.FORMAT_VERSION == "1.9"
        assert bool(f.attrs[S.ROOT_STATS_ONLY]) and bool(f.attrs[S.ROOT_COMPLETE])
        assert set(f.keys()) == {S.META_GROUP}
        assert S.CATALOG_PATH not in f          # (1.2's catalog describes op groups: none here)
        assert f[S.STATS_TABLE_PATH].shape[0] > 0


def test_stats_dump_reads_back_like_the_full_dump(mlp_dumps):
    with DumpFile(mlp_dumps / "full.h5") as full, DumpFile(mlp_dumps / "s1.h5") as st:
        assert st.stats_only and st.is_table and not full.is_table
        f_ops, s_ops = full.ops(), st.ops()
        key = lambda o: (o.seqid, o.op, o.phase, o.module, o.grad_fn)  # noqa: E731
        assert [key(o) for o in s_ops] == [key(o) for o in f_ops] and len(s_ops) > 10
        n_tensors = 0
        for fo, so in zip(f_ops, s_ops):
            assert so.attrs[S.OP_PHASE] == fo.phase and so.attrs[S.OP_SEQID] == fo.seqid
            for side in ("inputs", "outputs"):
                fv, sv = getattr(fo, side)(), getattr(so, side)()
                assert list(sv) == list(fv), (so.path, side)
                for name, frec in fv.items():
                    srec = sv[name]
                    assert srec.type == (S.TYPE_TENSOR_STATS if frec.is_tensor else frec.type)
                    leaves = list(zip(srec.children, frec.children)) if frec.is_list else [(srec, frec)]
                    for s_leaf, f_leaf in leaves:
                        assert s_leaf.name == f_leaf.name
                        if not f_leaf.is_tensor:
                            assert s_leaf.read() == f_leaf.read()
                            continue
                        n_tensors += 1
                        assert s_leaf.dtype == f_leaf.dtype and s_leaf.shape == f_leaf.shape
                        assert s_leaf.path == f_leaf.path
                        if f_leaf.uninitialized:
                            assert s_leaf.uninitialized
                            continue
                        got, want = s_leaf.stats(), _stats_of(f_leaf.read())
                        assert got == s_leaf.read()
                        for k in S.STATS_FIELDS:
                            assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-6), (s_leaf.path, k)
        assert n_tensors > 30


def test_op_attributes_and_lists_round_trip(tmp_path):
    x = torch.randn(3, 4)
    p = tmp_path / "s.h5"
    with npu_dumper.dumper(use_dump=True, dump_path=str(p), stats_only=True, record_stack=True):
        y = torch.cat([x, x * 2], dim=1)
        z = y.to(torch.bfloat16)
        torch.stack([z, z]).sum()
    with DumpFile(p) as f:
        ops = {o.op: o for o in f.ops()}
        cat = ops["aten.cat.default"]
        assert "test_dump_stats_table.py" in cat.attrs[S.OP_STACK]
        ins = cat.inputs()
        assert ins["tensors"].is_list and ins["tensors"].type == S.TYPE_TENSOR_LIST
        assert [c.name for c in ins["tensors"].children] == ["tensors_0", "tensors_1"]
        assert ins["tensors"].children[1].stats()["max"] == pytest.approx(float((x * 2).max()))
        assert ins["dim"].read() == 1 and ins["dim"].type == S.TYPE_INT
        conv = ops["aten._to_copy.default"]
        assert conv.inputs()["dtype"].read() == "bfloat16"
        assert conv.outputs()["result"].dtype == "bfloat16"
        assert f.op("aten.cat.default", cat.seqid).seqid == cat.seqid


def test_compare_stats_vs_full_and_vs_stats(mlp_dumps):
    for target, golden in (("s1", "full"), ("full", "s1"), ("s1", "s2")):
        t = apply_verdict(compare_dumps(mlp_dumps / f"{target}.h5", mlp_dumps / f"{golden}.h5").table)
        compared = t[t["CompareStatus"] == "stats"]
        assert len(compared) > 30, (target, golden)
        assert (compared["Result"] == "pass").all(), compared[["NPUDumpPath", "FailReason"]]


def test_compare_finds_a_perturbed_op_from_statistics(tmp_path):
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 16)
    x = torch.randn(8, 16)
    for name, scale in (("g", 1.0), ("t", 1.5)):
        with npu_dumper.dumper(use_dump=True, dump_path=str(tmp_path / f"{name}.h5"), stats_only=True):
            h = torch.relu(lin(x))
            (h * scale).sum()
    res = CliRunner().invoke(app, ["compare", "-m", str(tmp_path / "t.h5"), "-g", str(tmp_path / "g.h5"),
                                   "-o", str(tmp_path)], env=ENV)
    assert res.exit_code == 1, res.output
    assert "aten.mul.Tensor" in res.output


def test_cli_ls_and_compare_on_table_files(mlp_dumps, tmp_path):
    r = CliRunner()
    res = r.invoke(app, ["ls", str(mlp_dumps / "s1.h5")], env=ENV)
    assert res.exit_code == 0, res.output
    assert "statistics only" in res.output and "aten.addmm.default" in res.output
    res = r.invoke(app, ["ls", "--stats", str(mlp_dumps / "s1.h5")], env=ENV)
    assert res.exit_code == 0 and "min=" in res.output, res.output
    res = r.invoke(app, ["compare", "-m", str(mlp_dumps / "s1.h5"), "-g", str(mlp_dumps / "full.h5"),
                         "-o", str(tmp_path)], env=ENV)
    assert res.exit_code == 0, res.output
    res = r.invoke(app, ["extract", "-i", str(mlp_dumps / "s1.h5"), "-o", str(tmp_path / "x.h5"),
                         "-s", "/aten.addmm.default/1/", "-d", "/aten.addmm.default/1/"], env=ENV)
    assert res.exit_code == 2 and "statistics-only" in res.output


def test_load_reads_table_files(mlp_dumps):
    with npu_dumper.load(mlp_dumps / "s1.h5", as_torch=True) as f:
        op = f.ops()[0]
        rec = next(iter(op.outputs().values()))
        assert rec.is_stats and isinstance(rec.read(), dict)


def test_sigkilled_stats_dump_reads_up_to_its_last_flush(tmp_path):
    p = sigkill_mid_dump(tmp_path, settle_s=2.0, stats_only=True)
    for o in killed_dump_tail(p):      # the last flushed ops have their statistics
        st = o.inputs()["self"].stats()
        assert st["numel"] == 1024 and math.isfinite(st["mean"])


def test_file_creation_failure_surfaces_in_the_users_thread(tmp_path):
    # the writer thread creates a statistics file; a failure there (here: the file is held
    # open by a reader, so HDF5 cannot truncate it) is a one-line DumperError in the block
    from npu_dumper.errors import DumperError
    p = tmp_path / "held.h5"
    with npu_dumper.dumper(use_dump=True, dump_path=str(p), stats_only=True):
        torch.ones(3) * 2
    with h5py.File(p, "r"):
        with pytest.raises(DumperError, match="held.h5: cannot create dump file") as ei:
            with npu_dumper.dumper(use_dump=True, dump_path=str(p), stats_only=True):
                for _ in range(3):
                    torch.ones(3) * 2
                    time.sleep(0.05)
        assert "\n" not in str(ei.value)
    with DumpFile(p) as f:           # the earlier dump is untouched
        assert [o.op for o in f.ops()] == ["aten.ones.default", "aten.mul.Tensor"] and f.complete


@pytest.mark.parametrize("make", [
    lambda: torch.randn(64, 33),
    lambda: torch.randn(40, 50).t(),
    lambda: torch.randn(1000, dtype=torch.float64) * 1e-3 + 5,      # spread tiny against the mean
    lambda: torch.tensor([1.0, float("nan"), 3.0, float("inf")]),
    lambda: torch.full((100,), 7.5),
    lambda: torch.tensor([2.5]),
    lambda: torch.randn(3, 4).to(torch.bfloat16),
    lambda: torch.arange(10),
    lambda: torch.randn(300, 1000),                                   # large: row norms, a remainder
    lambda: torch.randn(1000, 300).t(),                               # large, transposed
    lambda: torch.randn(1 << 16, dtype=torch.float64),
    lambda: torch.cat([torch.randn(1 << 16), torch.tensor([float("inf")])]),
])
def test_fast_tensor_stats_equals_the_reference(make):
    from npu_dumper.sinks.stats import fast_tensor_stats, in_memory_order
    from npu_dumper.capture.tensor_stats import tensor_stats
    t = make()
    want = tensor_stats(t)
    got = fast_tensor_stats(in_memory_order(t))
    scratch = {torch.float32: torch.empty(1)}      # too small: replaced, then reused
    assert fast_tensor_stats(in_memory_order(t), scratch) == got
    assert fast_tensor_stats(in_memory_order(t), scratch) == got
    assert len(got) == len(want) == len(S.STATS_FIELDS)
    # bit-identical (TensorIterator reduces a permuted tensor in the same memory order)
    assert all(a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(got, want)), (got, want)


@pytest.mark.parametrize("make", [
    lambda: torch.randn(1 << 20),
    lambda: torch.randn(1 << 20) * 1e-3 + 1.0,                        # all one sign
    lambda: torch.randn(1024, 1000).t(),                               # transposed, n % 256 != 0
    lambda: torch.rand(3, 5, 7001) * 5e17,       # the total of squares (1e40) overflows float32
])
def test_sum_of_squares_of_large_tensors_is_accurate(make):
    # float32 row norms combined in float64: within 1e-7 of an exact float64 sum
    from npu_dumper.capture.tensor_stats import ROWS_FROM, sum_of_squares
    t = make()
    assert t.numel() >= ROWS_FROM
    want = float((t.double() ** 2).sum())
    assert abs(sum_of_squares(t) / want - 1) < 1e-7


def test_root_device_attributes_of_statistics_dumps(mlp_dumps, tmp_path):
    # written by the writer thread at the first tensor; by the block's exit when no tensor came
    with h5py.File(mlp_dumps / "s1.h5", "r") as f:
        assert f.attrs[S.ROOT_DEVICE] == "cpu" and f.attrs[S.ROOT_DEVICE_TYPE] == 0
        assert f.attrs[S.ROOT_COMPLETE]
    with npu_dumper.dumper(use_dump=True, dump_path=str(tmp_path / "empty.h5"), stats_only=True):
        pass
    with h5py.File(tmp_path / "empty.h5", "r") as f:
        assert f.attrs[S.ROOT_DEVICE] == "cpu" and f.attrs[S.ROOT_DEVICE_TYPE] == 0


@pytest.mark.parametrize("threads", [1, 2])
def test_batched_statistics_are_bit_identical_to_the_reference(threads):
    # many small tensors of repeated sizes (a layer's activations and gradients), some
    # transposed, NaN/Inf, constant, tiny spread, float64, and ones the batch leaves out
    from npu_dumper.capture.tensor_stats import ROWS_FROM, batchable, tensor_stats

    from .test_stats_batched import batch_stats_with_threads
    g = torch.Generator().manual_seed(0)
    ts = []
    for n in (2, 3, 7, 24, 96, 1000, 4097, 12288, ROWS_FROM - 1):
        for _ in range(3):
            ts.append(torch.randn(n, generator=g) * 3 + 0.5)
    ts += [torch.randn(40, 50, generator=g).t(), torch.randn(50, 40, generator=g),
           torch.tensor([1.0, float("nan"), 3.0]), torch.tensor([1.0, float("inf"), 3.0]),
           torch.full((100,), 7.5), torch.randn(1000, dtype=torch.float64) * 1e-3 + 5,
           torch.randn(1000, dtype=torch.float64), torch.randn(1000, dtype=torch.float64),
           torch.tensor([2.5]), torch.arange(10), torch.randn(3, 4).to(torch.bfloat16),
           torch.randn(ROWS_FROM + 5, generator=g)]
    assert sum(batchable(t) for t in ts) > 30 and not all(batchable(t) for t in ts)
    for t, row in zip(ts, batch_stats_with_threads(ts, threads)):
        want = tensor_stats(t)
        assert all(a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(row, want)), (t.shape, row, want)


def test_statistics_dump_batches_small_tensors_and_keeps_op_time_values(tmp_path):
    # ops queued behind each other are batched; an in-place write right after an op must
    # not change the statistics recorded for it (copy-on-write waits for the batch's copy)
    from torch.utils._python_dispatch import _disable_current_modes
    from npu_dumper.capture.tensor_stats import tensor_stats
    p = tmp_path / "b.h5"
    x = torch.randn(64, 8)
    seen = []
    with npu_dumper.dumper(use_dump=True, dump_path=str(p), stats_only=True) as d:
        for i in range(200):
            y = x * (i + 1)
            with _disable_current_modes():      # (not recorded)
                seen.append((x.clone(), y))
            x.add_(1.0)             # writes the input just recorded
    assert d._writer.num_batched > 50
    want = [(tensor_stats(a), tensor_stats(b)) for a, b in seen]
    with DumpFile(p) as f:
        muls = [o for o in f.ops() if o.op == "aten.mul.Tensor"]
        assert len(muls) == 200
        for o, (wx, wy) in zip(muls, want):
            got_x = o.inputs()["self"].stats()
            got_y = o.outputs()["result"].stats()
            assert [got_x[k] for k in S.STATS_FIELDS] == wx
            assert [got_y[k] for k in S.STATS_FIELDS] == wy


@pytest.mark.parametrize("stats", [False, True])
def test_ls_of_a_table_file_from_its_columns_equals_the_per_op_records(tmp_path, monkeypatch, stats):
    from accucmp import listing
    spec = sample_models.get("lstm_lm")
    model, batch = spec.build(seed=0, size="tiny"), spec.make_inputs(seed=0, size="tiny")
    p = str(tmp_path / "s.h5")
    with npu_dumper.dumper(use_dump=True, dump_path=p, stats_only=True):
        spec.train_step(model, batch)
        torch.cat([torch.ones(2), torch.zeros(3)])
        torch.ones(2) * complex(1, 2)
        # statistics written as whole numbers, NaN and Inf counts, large and tiny values
        torch.tensor([float("nan"), 1.0, float("inf"), -float("inf")]) * 2
        torch.arange(6.0) * 1e16
        torch.tensor([1e-30, 3e-30]) + 0
    fast, info = listing.list_ops(p, stats=stats)
    with DumpFile(p) as f:
        assert len(listing._table_lines(f, stats)) == info["ops"]      # (the fast path ran)
    monkeypatch.setattr(listing, "_table_lines", lambda f, stats: None)
    slow, _ = listing.list_ops(p, stats=stats)
    assert fast == slow and info["ops"] > 20
    assert any("/" in v.name for ln in slow for v in ln.values)           # list children
    assert any(v.value for ln in slow for v in ln.values)
    assert stats == any(v.stats for ln in slow for v in ln.values)
    # the text shown: the columns' formatting (listing._stats_suffixes) equals describe_value's
    # per value, plain and rich
    from rich.console import Console
    shown, tables = [], []
    for lines in (fast, slow):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            listing.render(lines, info, console=None, plain=True, stats=stats)
        shown.append(buf.getvalue())
        console = Console(file=io.StringIO(), width=400)
        listing.render(lines, info, console=console, plain=False, stats=stats)
        tables.append(console.file.getvalue())
    assert shown[0] == shown[1] and tables[0] == tables[1]
    if stats:
        assert " nan=1 inf=2" in shown[0] and "max=500000000000000000" not in shown[0]
        assert "max=5e+16" in shown[0] and "min=0 max=1 mean=0.4" in shown[0] and "min=1e-30" in shown[0]
        assert sum(v.described is not None for ln in fast for v in ln.values) > 100


def test_ls_column_formatting_equals_the_per_value_one():
    from accucmp import listing
    values = np.array([0.0, -0.0, 1.0, -3.0, 0.5, -2.5, 1e15, 1e15 - 1, -(1e15 - 1), 123456.7, 1e-300,
                       5e-324, 1.7976931348623157e308, float("nan"), float("inf"), -float("inf"),
                       2.0 ** 52 + 1, 0.1 + 0.2, 99999.5, 12345.0])
    assert listing._fmt_column(values) == [listing._fmt(float(v)) for v in values]
    with np.errstate(over="ignore"):                  # (float32: the largest becomes Inf)
        single = values.astype(np.float32)
    assert listing._fmt_column(single) == [listing._fmt(float(v)) for v in single]


def test_ls_on_a_terminal_lists_many_ops_as_plain_text(tmp_path, monkeypatch, capsys):
    # a rich table of 50k ops takes ~25 s to lay out: past RICH_MAX_OPS the terminal gets
    # the plain listing (said on stderr); fewer ops (or -n) still get the table
    import sys
    from pathlib import Path
    from accucmp.cli import dumps
    from dumpfile.stats_table import IO_INPUT, IO_OUTPUT, tensor_row
    from dumpfile.write.stats import StatsDumpWriter
    p = tmp_path / "many.h5"
    n = dumps.RICH_MAX_OPS + 1
    with StatsDumpWriter(str(p), mode="dump") as w:
        for i in range(1, n + 1):
            stats = [-1.0 * i, 2.5, 0.01, 0.9, 8.0, 0.0, 0.0, 4.0]
            w.add_op("aten.add.Tensor", i, [tensor_row(i, IO_INPUT, "self", "float32", (4,), 0, stats),
                                            tensor_row(i, IO_OUTPUT, "result", "float32", (4,), 0, stats)])
    dumps.ls_command(Path(p), stats=True, plain=True, quiet=True)
    piped = capsys.readouterr()
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    dumps.ls_command(Path(p), stats=True, quiet=True)
    terminal = capsys.readouterr()
    assert terminal.out == piped.out and len(piped.out.splitlines()) == n + 2
    assert f"{n} ops, more than {dumps.RICH_MAX_OPS}: plain text" in terminal.err and not piped.err
    assert "min=-2001 max=2.5 mean=0.01" in terminal.out
    dumps.ls_command(Path(p), stats=True, quiet=True, limit=3)
    table = capsys.readouterr()
    assert "\t" not in table.out and "seqid" in table.out and " -3 " in table.out and not table.err


def test_ls_stats_table_at_80_columns_keeps_every_number_whole(tmp_path):
    # the rich table of `ls --stats` on an 80-column terminal: each statistic in a column
    # that does not wrap, on its tensor's row (a table of op / inputs / outputs cells folded
    # "mean=-0.000761" and "2" onto two lines); NaN/Inf counts shown where a tensor has them
    import io
    from rich.console import Console
    from accucmp import listing
    from dumpfile.stats_table import IO_INPUT, IO_OUTPUT, tensor_row
    from dumpfile.write.stats import StatsDumpWriter
    p = tmp_path / "s.h5"
    expected = []
    with StatsDumpWriter(str(p), mode="dump") as w:
        for i in range(1, 6):
            a = [-6.70123e-05 * i, 7.193e-05, -0.000761234 * i, 0.9, 8.0, 0.0, 0.0, 65536.0]
            b = [-7.801 * i, 2.376, -9.487e-08, 0.9, 8.0, float(i == 3), 2.0 * (i == 3), 65536.0]
            w.add_op("aten.gelu_backward.default", i,
                     [tensor_row(i, IO_INPUT, "grad_output", "float32", (64, 1024), 0, a),
                      tensor_row(i, IO_OUTPUT, "result", "float32", (64, 1024), 0, b)])
            expected += [[listing._fmt(x) for x in s[:3]] for s in (a, b)]
    lines, info = listing.list_ops(p, stats=True)
    console = Console(file=io.StringIO(), width=80, color_system=None)
    listing.render(lines, info, console=console, plain=False, stats=True)
    out = console.file.getvalue().splitlines()
    assert max(map(len, out)) <= 80
    rows = [ln for ln in out if "grad_output" in ln or "result" in ln]
    assert len(rows) == len(expected) == 10
    for row, numbers in zip(rows, expected):
        assert row.split()[-3:] == numbers or row.split()[-4:-1] == numbers, row
    assert "-0.0007612" in rows[0] and "-0.003806" in rows[8]
    counted = [ln for ln in out if ln.rstrip().endswith("1/2")]
    assert len(counted) == 1 and "result" in counted[0] and "-23.4" in counted[0]
