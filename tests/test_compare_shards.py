"""Shards put back together (accucmp/compare/shards.py): a run whose ops hold DTensors is
compared as the global tensors its ranks' layouts make.

First on hand-written rank files (every placement, a 2-d mesh, replicas that differ, ranks
out of step), then on real dumps of a tiny transformer LM, 2 gloo ranks on CPU
(tests/_dist_shard_runs.py): tensor parallel against the single-process reference, one
wrong shard named by rank, op and module, FSDP2's reduce-scattered gradients against the
reference's, FSDP2 against DDP.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from accucmp.cli.main import app
from accucmp.compare.pipeline import compare_dumps
from accucmp.compare.fsdp_gradients import fsdp_gradient_files
from accucmp.compare.shards import ATTR_ASSEMBLED, ShardError, assemble_run, holds_dtensors, shard_of
from accucmp.compare.verdict import apply_verdict
from dumpfile import DumpFile, DumpWriter, TensorMeta
from dumpfile import schema as S

from ._cli_helpers import Op, bf16_bits, contiguous_stride, write_dump

runner = CliRunner(env={"COLUMNS": "160", "NO_COLOR": "1"})


# ---- hand-written rank files ------------------------------------------------------
def _layout(mesh_shape, coord, placements, global_shape, offset):
    n = int(np.prod(mesh_shape))
    return json.dumps({"mesh_shape": list(mesh_shape), "mesh_dim_names": None, "mesh_ranks": list(range(n)),
                       "coordinate": list(coord), "placements": list(placements),
                       "global_shape": list(global_shape), "global_stride": list(contiguous_stride(global_shape)),
                       "global_offset": list(offset)})


def _write_rank(path, rank, world, mesh_shape, ops):
    """ops: [(op, seqid, module, {"input/self": (array, layout json or None), ...})]"""
    root = {S.ROOT_RANK: rank, S.ROOT_WORLD_SIZE: world,
            S.ROOT_PARALLEL_LAYOUT: json.dumps({"wrappers": [], "meshes": [
                {"mesh_shape": list(mesh_shape), "mesh_dim_names": None, "mesh_ranks": list(range(world))}]})}
    with DumpWriter(path, root_attrs=root) as w:
        for op, seqid, module, tensors in ops:
            g = w.begin_op(op, seqid, module=module)
            for rel, (arr, lay, *dtype) in tensors.items():
                io, name = rel.split("/")
                uninit = lay == "UNINIT"
                if dtype == ["bfloat16"]:
                    arr = bf16_bits(arr)
                meta = TensorMeta(dtype=dtype[0] if dtype else str(arr.dtype), shape=tuple(arr.shape),
                                  stride=contiguous_stride(arr.shape),
                                  uninitialized=uninit, extra={S.ATTR_DTENSOR: lay} if lay and not uninit else {})
                w.write_tensor(g[io], name, np.ascontiguousarray(arr), meta)
            w.end_op()


def _read(path, op, seqid, rel):
    with DumpFile(path) as f:
        io, name = rel.split("/")
        rec = (f.op(op, seqid).inputs() if io == "input" else f.op(op, seqid).outputs())[name]
        return np.asarray(rec.read()), rec.attrs


def test_every_placement_of_a_1d_mesh_becomes_the_global_tensor(tmp_path):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((4, 6)).astype(np.float32)        # Shard(0)
    b = rng.standard_normal((6, 4)).astype(np.float32)        # Shard(1)
    r = rng.standard_normal((5,)).astype(np.float32)          # Replicate
    p = [rng.standard_normal((4, 4)).astype(np.float32) for _ in range(2)]   # Partial(sum) shares
    run = tmp_path / "run"
    run.mkdir()
    for k in range(2):
        _write_rank(run / f"d_rank{k}.h5", k, 2, [2], [
            ("aten.mm.default", 1, "fc", {
                "input/self": (a[2 * k:2 * k + 2], _layout([2], [k], ["Shard(0)"], a.shape, [2 * k, 0])),
                "input/mat2": (b[:, 2 * k:2 * k + 2], _layout([2], [k], ["Shard(1)"], b.shape, [0, 2 * k])),
                "input/bias": (r, _layout([2], [k], ["Replicate()"], r.shape, [0])),
                "output/result": (p[k], _layout([2], [k], ["Partial(sum)"], (4, 4), [0, 0]))}),
            ("aten.relu.default", 2, "act", {"input/self": (r, None), "output/result": (np.maximum(r, 0), None)})])
    assert holds_dtensors(run)
    done = assemble_run(run, tmp_path / "asm.h5")
    assert done.dtensor_ops == 1 and done.replicated_ops == 1 and not done.disagreements
    out = tmp_path / "asm.h5"
    for rel, want in (("input/self", a), ("input/mat2", b), ("input/bias", r)):
        got, attrs = _read(out, "aten.mm.default", 1, rel)
        np.testing.assert_array_equal(got, want)
        assert S.ATTR_DTENSOR not in attrs and tuple(attrs[S.ATTR_SHAPE]) == want.shape
    got, attrs = _read(out, "aten.mm.default", 1, "output/result")
    np.testing.assert_allclose(got, p[0] + p[1], rtol=1e-6)
    shards = json.loads(attrs[ATTR_ASSEMBLED])["shards"]
    assert [s["rank"] for s in shards] == [0, 1]
    np.testing.assert_array_equal(_read(out, "aten.relu.default", 2, "input/self")[0], r)
    with DumpFile(out) as f:
        assert int(f.attrs[S.ROOT_WORLD_SIZE]) == 1


def test_bfloat16_shards_keep_their_bits_and_partial_sums_round_once(tmp_path):
    rng = np.random.default_rng(2)
    w = rng.standard_normal((4, 4)).astype(np.float32)
    p = [rng.standard_normal((3,)).astype(np.float32) for _ in range(2)]
    as_bf16 = lambda a: (bf16_bits(a).astype(np.uint32) << 16).view(np.float32)    # noqa: E731
    run = tmp_path / "run"
    run.mkdir()
    for k in range(2):
        _write_rank(run / f"d_rank{k}.h5", k, 2, [2], [("aten.mm.default", 1, "fc", {
            "input/mat2": (w[2 * k:2 * k + 2], _layout([2], [k], ["Shard(0)"], w.shape, [2 * k, 0]), "bfloat16"),
            "output/result": (p[k], _layout([2], [k], ["Partial(sum)"], (3,), [0]), "bfloat16")})])
    assemble_run(run, tmp_path / "asm.h5")
    got, attrs = _read(tmp_path / "asm.h5", "aten.mm.default", 1, "input/mat2")
    assert attrs[S.ATTR_DTYPE] == "bfloat16"
    np.testing.assert_array_equal(got, as_bf16(w))                       # the shards' bits, placed
    got, _ = _read(tmp_path / "asm.h5", "aten.mm.default", 1, "output/result")
    np.testing.assert_array_equal(got, as_bf16(as_bf16(p[0]) + as_bf16(p[1])))   # summed, rounded once


def test_a_2d_mesh_shards_on_both_dims_and_replicates_on_one(tmp_path):
    g = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    run = tmp_path / "run"
    run.mkdir()
    for rank in range(4):
        i, j = divmod(rank, 2)                     # coordinate on a (2, 2) mesh
        both = g[4 * i:4 * i + 4, 3 * j:3 * j + 3]
        rows = g[4 * i:4 * i + 4]
        _write_rank(run / f"d_rank{rank}.h5", rank, 4, [2, 2], [
            ("aten.add.Tensor", 1, "m", {
                "input/self": (both, _layout([2, 2], [i, j], ["Shard(0)", "Shard(1)"], g.shape, [4 * i, 3 * j])),
                "input/other": (rows, _layout([2, 2], [i, j], ["Shard(0)", "Replicate()"], g.shape, [4 * i, 0]))})])
    assemble_run(run, tmp_path / "asm.h5")
    for rel in ("input/self", "input/other"):
        np.testing.assert_array_equal(_read(tmp_path / "asm.h5", "aten.add.Tensor", 1, rel)[0], g)


def test_replicas_that_differ_are_findings_naming_the_rank(tmp_path):
    w = np.ones((4,), np.float32)
    run = tmp_path / "run"
    run.mkdir()
    for k in range(2):
        mine = w * (1.05 if k == 1 else 1.0)
        _write_rank(run / f"d_rank{k}.h5", k, 2, [2], [
            ("aten.mul.Tensor", 1, "blk.ln", {"input/self": (mine, _layout([2], [k], ["Replicate()"], w.shape, [0]))}),
            ("aten.relu.default", 2, "blk.act", {"input/self": (mine.astype(np.float32), None)}),
            # an empty-like op's garbage differs across ranks by design: no finding
            ("aten.empty.memory_format", 3, "blk", {"output/result": (np.full(3, k, np.float32), "UNINIT")})])
    done = assemble_run(run, tmp_path / "asm.h5")
    assert len(done.disagreements) == 2
    assert re.search(r"input self of aten\.mul\.Tensor #1 in blk\.ln .*rank 1's replica differs from rank 0's",
                     done.disagreements[0])
    assert "aten.relu.default #2 in blk.act: rank 1's value differs" in done.disagreements[1]


def _redistribution_run(run, collective: bool):
    """DTensor's redistribution of a Partial share to Shard: the share cut in chunks,
    concatenated (a local op, each rank's own values), reduce-scattered."""
    rng = np.random.default_rng(5)
    shares = [rng.standard_normal((4, 2)).astype(np.float32) for _ in range(2)]
    run.mkdir()
    for k in range(2):
        buf = np.concatenate([shares[k][:2], shares[k][2:]])[::-1].copy()     # not the share's own bytes
        ops = [("aten.mm.default", 1, "fc2", {"output/result": (shares[k], _layout([2], [k], ["Partial(sum)"],
                                                                                     (4, 2), [0, 0]))}),
               ("aten.cat.default", 2, "fc2", {"input/tensors": (buf, None), "output/result": (buf, None)})]
        if collective:
            ops.append(("_c10d_functional.reduce_scatter_tensor.default", 3, "fc2", {
                "input/input": (buf, None), "output/result": (buf[2 * k:2 * k + 2].copy(), None)}))
        _write_rank(run / f"d_rank{k}.h5", k, 2, [2], ops)


def test_a_buffer_a_collective_reduces_differs_across_ranks_by_design(tmp_path):
    _redistribution_run(tmp_path / "rs", True)
    done = assemble_run(tmp_path / "rs", tmp_path / "rs.h5")
    assert not done.disagreements and done.collective_ops == 1
    # the same local op with no collective reading it: the ranks disagree
    _redistribution_run(tmp_path / "plain", False)
    done = assemble_run(tmp_path / "plain", tmp_path / "plain.h5")
    assert [d.split(":")[0] for d in done.disagreements] == ["input tensors of aten.cat.default #2 in fc2",
                                                             "output result of aten.cat.default #2 in fc2"]


def test_a_local_op_that_cuts_a_dtensor_s_shards_is_joined_not_a_finding(tmp_path):
    """DTensor's Replicate-to-Shard(1) redistribution: each rank clones its chunk of the
    whole tensor (a local op whose values differ across ranks), the next op reads it as
    the DTensor's local shard."""
    x = np.random.default_rng(6).standard_normal((2, 4, 3)).astype(np.float32)
    run = tmp_path / "run"
    run.mkdir()
    for k in range(2):
        chunk = x[:, 2 * k:2 * k + 2].copy()
        _write_rank(run / f"d_rank{k}.h5", k, 2, [2], [
            ("aten.clone.default", 1, "ffn", {"input/self": (chunk, None), "output/result": (chunk, None)}),
            ("aten.native_layer_norm.default", 2, "ffn.ln2", {
                "input/input": (chunk, _layout([2], [k], ["Shard(1)"], x.shape, [0, 2 * k, 0]))})])
    done = assemble_run(run, tmp_path / "asm.h5")
    assert not done.disagreements and done.sharded_local_ops == ["aten.clone.default #1 in ffn"]
    for rel in ("input/self", "output/result"):
        got, attrs = _read(tmp_path / "asm.h5", "aten.clone.default", 1, rel)
        np.testing.assert_array_equal(got, x)
        assert json.loads(attrs[ATTR_ASSEMBLED])["placements"] == ["Shard(1)"]


def test_ranks_out_of_step_are_one_line(tmp_path):
    x = np.ones((2,), np.float32)
    lay = _layout([2], [0], ["Replicate()"], x.shape, [0])
    run = tmp_path / "run"
    run.mkdir()
    _write_rank(run / "d_rank0.h5", 0, 2, [2], [("aten.mul.Tensor", 1, "", {"input/self": (x, lay)})])
    _write_rank(run / "d_rank1.h5", 1, 2, [2], [("aten.add.Tensor", 1, "", {"input/self": (x, lay)})])
    with pytest.raises(ShardError, match=r"op #1 is aten\.mul\.Tensor .* and aten\.add\.Tensor .*ran different ops"):
        assemble_run(run, tmp_path / "asm.h5")
    assert not (tmp_path / "asm.h5").exists()


@pytest.mark.parametrize("bad", ["{not json", json.dumps({"placements": ["Shard(0)"]}),
                                 "HUGE"])
def test_a_damaged_layout_is_one_line_naming_the_file(tmp_path, bad):
    x = np.ones((2,), np.float32)
    run = tmp_path / "run"
    run.mkdir()
    for k in range(2):
        lay = _layout([2], [k], ["Shard(0)"], [10 ** 12] if bad == "HUGE" else [4], [2 * k]) \
            if bad == "HUGE" or k == 0 else bad
        _write_rank(run / f"d_rank{k}.h5", k, 2, [2], [("aten.mul.Tensor", 1, "", {"input/self": (x, lay)})])
    with pytest.raises(ShardError) as e:
        assemble_run(run, tmp_path / "asm.h5")
    msg = str(e.value)
    assert "\n" not in msg and ("d_rank1.h5: /aten.mul.Tensor/1/input/self" in msg if bad != "HUGE"
                                 else "holds more elements than its 2 shards" in msg)
    assert not list(tmp_path.glob("asm.h5*"))
    res = runner.invoke(app, ["compare", "-m", str(run), "-g", str(run / "d_rank0.h5"), "-o", str(tmp_path / "o")])
    assert res.exit_code == 2 and res.output.count("\n") == 1, res.output


def _sharded_run(folder, w, dim):
    """A 2-rank run whose one op holds `w` sharded on `dim`."""
    folder.mkdir()
    n = w.shape[dim] // 2
    for k in range(2):
        local = np.take(w, range(k * n, k * n + n), axis=dim)
        off = [0, 0]
        off[dim] = k * n
        _write_rank(folder / f"d_rank{k}.h5", k, 2, [2], [
            ("aten.mm.default", 1, "fc", {"input/mat2": (local, _layout([2], [k], [f"Shard({dim})"], w.shape, off))})])


def test_runs_sharded_another_way_are_both_put_together(tmp_path):
    w = np.random.default_rng(3).standard_normal((4, 6)).astype(np.float32)
    _sharded_run(tmp_path / "rows", w, 0)
    _sharded_run(tmp_path / "cols", w, 1)
    res = runner.invoke(app, ["compare", "-m", str(tmp_path / "rows"), "-g", str(tmp_path / "cols"),
                              "-o", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    assert res.output.count("shards put together") == 2 and "PASS: 1 tensors within bounds" in res.output
    assert len(list((tmp_path / "o").glob("assembled_*.h5"))) == 2


def test_the_rank_whose_shard_holds_the_first_failing_element_is_named(tmp_path):
    w = np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32)
    run = tmp_path / "run"
    run.mkdir()
    for k in range(2):
        local = w[:, 4 * k:4 * k + 4] * (1.05 if k == 1 else 1.0)
        _write_rank(run / f"d_rank{k}.h5", k, 2, [2], [
            ("aten.mm.default", 1, "mlp.fc1", {
                "input/mat2": (local.astype(np.float32), _layout([2], [k], ["Shard(1)"], w.shape, [0, 4 * k]))})])
    assemble_run(run, tmp_path / "asm.h5")
    write_dump(tmp_path / "ref.h5", [Op("aten.mm.default", 1, {"mat2": w}, {}, module="mlp.fc1")])
    said = shard_of(str(tmp_path / "asm.h5"), "/aten.mm.default/1/input/mat2", str(tmp_path / "ref.h5"),
                    "/aten.mm.default/1/input/mat2")
    assert said.startswith("first failing element [0, 4] lies in rank 1's shard ([0:4, 4:8] of [4, 8], Shard(1))")
    assert said.endswith("shards off: rank 1")


# ---- real runs: tiny LM, 2 gloo ranks --------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    from ._dist_shard_runs import dump_runs
    return Path(dump_runs(tmp_path_factory.mktemp("shard_runs"), ("tp", "tp_bug", "tp_ln_bug", "sp", "fsdp",
                                                                         "fsdp_bf16", "fsdp_bug", "fsdp_bf16_bug",
                                                                         "fsdp_bf16_replay", "ddp")))


def _compare(tmp_path, target, golden, *extra):
    res = runner.invoke(app, ["compare", "-m", str(target), "-g", str(golden), "-o", str(tmp_path / "out"),
                              "--workers", "1", *extra])
    return res, sorted((tmp_path / "out").glob("result_*.csv"))


def _rank_tables(csvs):
    """The result table of each rank (the folder's `_ranks.csv` summary left out)."""
    return [pd.read_csv(csv) for csv in csvs if not csv.name.endswith("_ranks.csv")]


def test_tensor_parallel_run_against_the_single_process_reference_passes(runs, tmp_path):
    res, csvs = _compare(tmp_path, runs / "tp", runs / "ref.h5")
    assert res.exit_code == 0, res.output
    assert res.output.startswith("accucmp: shards put together:") and "\nPASS" in res.output
    t = pd.read_csv(csvs[0])
    assert not (t.CompareStatus == "size_mismatch").any()
    mm = t[t.NPUDump.isin(["aten.addmm.default", "aten.mm.default"]) & (t.CompareStatus == "compared")]
    assert len(mm) >= 40 and mm.MaxAbsoluteError.max() < 1e-6
    # the parallelized layers are in it, at their global shapes, and the GELU between them
    fc = t[t.Module.isin(["block.mlp.fc1", "block.mlp.fc2", "block.mlp.act"])]
    assert set(fc.NPUDump) >= {"aten.addmm.default", "aten.gelu.default", "aten.gelu_backward.default"}
    assert "(16,32)" in set(fc.Shape) and (fc.CompareStatus == "compared").all()


def test_sequence_parallel_run_against_the_single_process_reference_passes(runs, tmp_path):
    res, csvs = _compare(tmp_path, runs / "sp", runs / "ref_sp.h5")
    assert res.exit_code == 0, res.output
    assert "\nPASS" in res.output and "ranks disagree" not in res.output
    t = pd.read_csv(csvs[0])
    ln2 = t[(t.Module == "block.ffn.ln2") & (t.CompareStatus == "compared")]
    # the whole sequence (4 tokens), put together from the ranks' halves
    assert (ln2.Shape == "(4,4,16)").sum() >= 3 and not ln2.Shape.str.startswith("(4,2,").any()
    assert not (t.CompareStatus == "size_mismatch").any()


def test_one_wrong_shard_is_named_by_rank_op_and_module(runs, tmp_path):
    res, _ = _compare(tmp_path, runs / "tp_bug", runs / "ref.h5", "--summary-json", str(tmp_path / "s.json"))
    assert res.exit_code == 1, res.output
    assert "first failing op is aten.addmm.default #20 in block.mlp.fc1" in res.output
    line = next(x for x in res.output.splitlines() if x.strip().startswith("shard:"))
    assert "input mat2 of aten.addmm.default #20 in block.mlp.fc1" in line
    assert "lies in rank 1's shard" in line and line.endswith("shards off: rank 1")
    rec = json.loads((tmp_path / "s.json").read_text())
    assert rec["sharded"]["lines"] == [line]


def test_a_replicated_weight_off_on_one_rank_leads_the_verdict(runs, tmp_path):
    res, _ = _compare(tmp_path, runs / "tp_ln_bug", runs / "ref.h5", "--summary-json", str(tmp_path / "s.json"))
    assert res.exit_code == 1, res.output
    first_fail = next(x for x in res.output.splitlines() if x.startswith("FAIL"))
    said = "the ranks disagree where they must be equal: input weight of aten.native_layer_norm.default #19 " \
           "in block.ln2: rank 1's value differs from rank 0's"
    assert said in first_fail
    rec = json.loads((tmp_path / "s.json").read_text())
    assert rec["verdict"] == "FAIL" and rec["exit_code"] == 1 and said in rec["sentence"]
    assert Path(rec["sharded"]["assembled"][0]).is_file()


def test_same_layout_folders_compare_rank_by_rank(runs, tmp_path):
    res, _ = _compare(tmp_path, runs / "tp_bug", runs / "tp")
    assert res.exit_code == 1, res.output
    assert "shards put together" not in res.output
    assert "first failing op is on rank 1" in res.output


@pytest.mark.parametrize("target,golden,words", [
    ("fsdp", "ddp", "(FSDP2: parameters and reduced gradients sharded in flat buffers"),
    ("ddp", "fsdp", "(FSDP2: parameters and reduced gradients sharded in flat buffers"),
    ("tp", "ddp", "holds DTensors (tensor parallel: every rank sees the whole batch)")])
def test_layouts_that_pair_no_tensor_with_its_like_are_one_line(runs, tmp_path, target, golden, words):
    res, csvs = _compare(tmp_path, runs / target, runs / golden)
    assert res.exit_code == 2, res.output
    assert res.output.count("\n") == 1 and words in res.output and "size mismatch" not in res.output
    assert not csvs
    assert not holds_dtensors(runs / "fsdp")        # FSDP2 records no DTensor layout


# every parameter of the model: emb, ln1 (2), qkv (2), proj (2), ln2 (2), fc1 (2), fc2 (2), head (2)
_PARAMS = 15


@pytest.mark.parametrize("kind", ["fsdp", "fsdp_bf16"])
def test_fsdp2_reduce_scattered_gradients_put_together_match_the_reference(runs, tmp_path, kind):
    target, golden, n = fsdp_gradient_files(runs / kind, runs / "ref.h5", tmp_path)
    assert n == _PARAMS
    t = apply_verdict(compare_dumps(str(target), str(golden)).table)
    assert len(t) == _PARAMS and (t.CompareStatus == "compared").all() and (t.Result == "pass").all()
    fc1 = t[(t.Module == "block.mlp.fc1") & (t.NPUDump == "aten.mm.default")]
    assert list(fc1.Shape) == ["(32,16)"]          # the whole weight's gradient, from both ranks' shards
    if kind == "fsdp":
        assert t.MaxAbsoluteError.max() < 1e-6
    else:                                           # bfloat16 gradients, reduced in float32
        assert set(t.ComputeDtype) == {"bfloat16"} and t.MaxAbsoluteError.max() > 1e-5


def test_fsdp2_shard_off_on_one_rank_fails_the_gradients(runs, tmp_path):
    target, golden, n = fsdp_gradient_files(runs / "fsdp_bug", runs / "ref.h5", tmp_path)
    t = apply_verdict(compare_dumps(str(target), str(golden)).table)
    assert n == _PARAMS and (t.Result == "fail").any()
    fc1 = t[(t.Module == "block.mlp.fc1") & (t.NPUDump == "aten.mm.default")]
    assert (fc1.Result == "fail").all()


def test_fsdp2_bf16_run_against_the_fp32_reference(runs, tmp_path):
    """A bfloat16 MixedPrecisionPolicy run against the fp32 reference (judged at the run's
    dtype): FSDP2's _foreach_copy_ casts of its flat shards are parallelism, not unmatched
    rows; every parameter's reduce-scattered gradient is compared."""
    res, csvs = _compare(tmp_path, runs / "fsdp_bf16", runs / "ref.h5")
    assert res.exit_code == 0, res.output
    for t in _rank_tables(csvs):
        assert not ((t.NPUDump == "aten._foreach_copy_.default") & (t.Result == "unmatched")).any()
        g = t[t.MatchedBy == "after reduce-scatter"]
        assert len(g) == _PARAMS and (g.Result == "pass").all() and set(g.ComputeDtype) == {"bfloat16"}


def test_fsdp2_bf16_run_against_the_fp32_fsdp2_run(runs, tmp_path):
    """Two FSDP2 runs, rank for rank: the bfloat16 MixedPrecisionPolicy's `_foreach_copy_`
    (its cast of the flat shards into the all-gather input) is a cast, no op the fp32 run
    lacks; and gloo's reduce-scatter copies its result into the output buffer (`copy_` after
    the collective) from a tensor no recorded op made, which is the collective's result, not
    a parameter or the batch. Each was named as the clean run's departure."""
    res, csvs = _compare(tmp_path, runs / "fsdp_bf16", runs / "fsdp")
    assert res.exit_code == 0, res.output
    assert "PASS" in res.output.splitlines()[0], res.output
    for t in _rank_tables(csvs):
        assert not (t.Result == "fail").any()
        assert (t.NPUDump == "aten._foreach_copy_.default").any()


def test_fsdp2_bf16_load_replay_of_the_fp32_fsdp2_run(runs, tmp_path):
    """Each rank of the bfloat16-policy run load-replays its rank of the fp32 run. The
    policy's allocations of other sizes (its cast buffers) run live, not as "the same call
    with a changed argument", and the reduce-scatter's copy-in reads the collective's result,
    not a parameter: a clean replay named both as departures (77 failing rows)."""
    res, csvs = _compare(tmp_path, runs / "fsdp_bf16_replay", runs / "fsdp")
    assert res.exit_code == 0, res.output
    assert "PASS" in res.output.splitlines()[0], res.output
    for t in _rank_tables(csvs):
        assert not (t.Result == "fail").any()
        assert "departure" not in set(t.CompareStatus)
        assert (t.MatchedBy == "seqid").sum() > 50


def test_fsdp2_bf16_wrong_weight_shard_fails_where_the_gathered_weight_is_read(runs, tmp_path):
    """Rank 1's shard of fc1.weight x1.05 under the bfloat16 policy: the all-gathered weight
    (written in place by FSDP2's copy-out, an op compare lists as parallelism) is judged as a
    parameter at the first op reading it, not passed as inherited from an op no one compares."""
    res, csvs = _compare(tmp_path, runs / "fsdp_bf16_bug", runs / "ref.h5")
    assert res.exit_code == 1, res.output
    for t in _rank_tables(csvs):
        w = t[(t.Module == "block.mlp.fc1") & (t.NPUDump == "aten.addmm.default") & (t.Phase == "forward")
              & (t.TensorName == "mat2")]
        assert len(w) == 1 and (w.Result == "fail").all() and (w.MadeBy == "leaf").all(), w.to_string()
        assert "no op of the step made it" in w.FailReason.iloc[0]
