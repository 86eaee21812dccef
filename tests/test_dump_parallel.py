"""Op-time values under DDP, FSDP2 and tensor parallel (2 gloo ranks on CPU).

One spawn runs every case on both ranks (module fixture); the tests then check the files
against independent sources: forward hooks' values of chosen layers, the model's own
weights, and the products of every recorded addmm/mm's recorded inputs.
"""

from __future__ import annotations

import json
import os
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist

from dumpfile import DumpFile

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

LAYERS = ("fc1", "fc2", "fc3")


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 8)
        self.fc3 = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def _local(t):
    t = t.detach()
    return (t.to_local() if hasattr(t, "to_local") else t).clone()


def _hooked(net, seen):
    for name in LAYERS:
        getattr(net, name).register_forward_hook(
            lambda m, a, o, name=name: seen.setdefault(name, []).append(_local(o)))


def _wrap(kind, net, world):
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel(net)
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard
        for name in LAYERS:
            fully_shard(getattr(net, name))
        return fully_shard(net)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    return parallelize_module(net, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})


def _fresh(kind, rank, world):
    """The model and batch every case starts from (a replay takes a fresh one: a model
    that already ran holds accumulated .grad and its wrapper's warmed-up buffers, which the
    replay reports as departures from the recording, rightly)."""
    torch.manual_seed(0)
    net = Net()
    model = _wrap(kind, net, world)
    torch.manual_seed(1 + (0 if kind == "tp" else rank))    # TP ranks share the batch
    return net, model, torch.randn(4, 8)


def _case(kind, rank, world, out, name, steps=2, **dump):
    torch.manual_seed(0)
    net = Net()
    weights = {k: v.detach().clone() for k, v in net.state_dict().items()}
    model = _wrap(kind, net, world)
    seen: dict = {}
    _hooked(net, seen)
    torch.manual_seed(1 + (0 if kind == "tp" else rank))    # TP ranks share the batch
    x = torch.randn(4, 8)
    with torch.utils.dumper(use_dump=True, dump_path=os.path.join(out, name), **dump) as d:
        for _ in range(steps):
            model(x).sum().backward()
    torch.save({"seen": seen, "weights": weights, "summary": {"path": d.path}},
               os.path.join(out, f"{name[:-3]}_ref{rank}.pt"))
    return model, x


def _ranks(rank, world, port, out):
    import npu_dumper  # noqa: F401 - installs torch.utils.dumper
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model, x = _case("ddp", rank, world, out, "ddp_a.h5")
        _case("ddp", rank, world, out, "ddp_b.h5")
        fsdp, xf = _case("fsdp", rank, world, out, "fsdp.h5")
        _case("fsdp", rank, world, out, "fsdp_nodedup.h5", steps=1, dedup=False)
        tp, xt = _case("tp", rank, world, out, "tp.h5")
        for twin in ("fsdp_twin_a", "fsdp_twin_b"):         # two identical FSDP2 runs
            os.makedirs(os.path.join(out, twin), exist_ok=True)
            _case("fsdp", rank, world, out, os.path.join(twin, "fsdp.h5"), steps=1)
        for name in ("fsdp", "tp"):
            _, m, xx = _fresh(name, rank, world)
            with torch.utils.dumper(load_file_path=os.path.join(out, f"{name}.h5"),
                                    dump_path=os.path.join(out, f"{name}_replay.h5")):
                for _ in range(2):              # the recording holds two steps: replay both
                    m(xx).sum().backward()
        # load-replay of a distributed run: `load_file_path` names the run, the rank rule
        # picks this rank's file; collectives run live and are listed, not substituted
        _, fresh, x = _fresh("ddp", rank, world)
        with torch.utils.dumper(load_file_path=os.path.join(out, "ddp_a.h5"),
                                dump_path=os.path.join(out, "replay.h5")) as d:
            for _ in range(2):
                fresh(x).sum().backward()
        with open(os.path.join(out, f"replay{rank}.json"), "w") as fh:
            json.dump({"text": str(d.summary["replay"]), "load": d.load_file_path}, fh)
        with torch.utils.dumper(dump_path=os.path.join(out, "s.h5"), step=3):
            model(x).sum()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import torch.multiprocessing as mp
    out = tmp_path_factory.mktemp("parallel")
    mp.spawn(_ranks, args=(2, _free_port(), str(out)), nprocs=2)
    return out


def _t(rec) -> torch.Tensor:
    return torch.from_numpy(np.asarray(rec.read()).copy())


def _dtensor(rec) -> dict | None:
    a = rec.attrs.get("dtensor")
    return json.loads(a if isinstance(a, str) else a.decode()) if a is not None else None


def _in_layer(o, layer: str) -> bool:
    return o.attrs.get("module", "").rsplit(".", 1)[-1] == layer


def _matmuls(f):
    """(op, recorded output, product of its recorded inputs, output's dtensor layout)."""
    for o in f.ops():
        if o.op not in ("aten.addmm.default", "aten.mm.default"):
            continue
        ins, res = o.inputs(), o.outputs()["result"]
        if o.op == "aten.addmm.default":
            ref = _t(ins["mat1"]).double() @ _t(ins["mat2"]).double()
            bias = _t(ins["self"]).double()
        else:
            ref, bias = _t(ins["self"]).double() @ _t(ins["mat2"]).double(), None
        yield o, _t(res).double(), ref, bias, _dtensor(res)


@pytest.mark.parametrize("name", ["ddp_a", "fsdp", "fsdp_nodedup", "tp"])
def test_every_recorded_matmul_is_the_product_of_its_recorded_inputs(runs, name):
    partial = {}
    for rank in (0, 1):
        with DumpFile(runs / f"{name}_rank{rank}.h5") as f:
            checked = 0
            for o, out, prod, bias, layout in _matmuls(f):
                if layout and any(p.startswith("Partial") for p in layout["placements"]):
                    # a partial sum: each rank holds its share; checked summed over ranks
                    partial.setdefault(o.seqid, []).append((out, prod, bias))
                    continue
                full = prod if bias is None else prod + bias
                torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-5,
                                           msg=f"{name} rank {rank} {o.op}/{o.seqid}")
                checked += 1
            assert checked >= 6
    for seqid, parts in partial.items():
        assert len(parts) == 2
        (o0, p0, b0), (o1, p1, b1) = parts
        # the recorded bias is the full Replicate one: added once to the reduced product
        torch.testing.assert_close(o0 + o1, p0 + p1 + (b0 if b0 is not None else 0),
                                   rtol=1e-5, atol=1e-5)
    assert (name == "tp") == bool(partial)


@pytest.mark.parametrize("name", ["ddp_a", "fsdp", "fsdp_nodedup", "tp"])
def test_recorded_layer_outputs_and_weights_are_the_values_the_model_used(runs, name):
    for rank in (0, 1):
        ref = torch.load(runs / f"{name}_ref{rank}.pt")
        with DumpFile(runs / f"{name}_rank{rank}.h5") as f:
            ops = [o for o in f.ops() if o.attrs.get("phase") == "forward"]
            outs = [(o, _t(v)) for o in ops for v in o.outputs().values()
                    if v.is_tensor and not v.uninitialized]
            for layer in LAYERS:
                for call, want in enumerate(ref["seen"][layer]):
                    # the hook's value is the output of an op the dump recorded
                    assert any(t.shape == want.shape and torch.equal(t, want) for _, t in outs), \
                        f"{name} rank {rank}: {layer} call {call} output not recorded"
                    if name != "tp":    # (TP's output hook redistributes outside the module)
                        # ... by an op that ran in that layer (DDP's paths: module.fc1)
                        mine = [t for o, t in outs if _in_layer(o, layer)]
                        assert any(torch.equal(t, want) for t in mine)
            # the weights each addmm multiplied by: the model's full weights (FSDP2 all-gathers
            # them into storage it frees after use); TP: this rank's rows of fc1's weight
            seen_w = {}
            for o, out, prod, bias, layout in _matmuls(f):
                mod = o.attrs.get("module", "").rsplit(".", 1)[-1]
                if o.op == "aten.addmm.default" and mod in LAYERS:
                    seen_w[mod] = _t(o.inputs()["mat2"]).t()
            w = ref["weights"]
            if name == "tp":
                torch.testing.assert_close(seen_w["fc1"], w["fc1.weight"].chunk(2)[rank], rtol=0, atol=0)
                torch.testing.assert_close(seen_w["fc3"], w["fc3.weight"], rtol=0, atol=0)
            else:
                for layer in LAYERS:
                    torch.testing.assert_close(seen_w[layer], w[f"{layer}.weight"], rtol=0, atol=0)


def test_dtensor_arguments_hold_the_local_shard_and_its_layout(runs):
    with DumpFile(runs / "tp_rank1.h5") as f:
        assert json.loads(f.attrs["parallel_layout"])["meshes"] == [
            {"mesh_shape": [2], "mesh_dim_names": ["tp"], "mesh_ranks": [0, 1]}]
        fc1 = next(o for o in f.ops() if o.op == "aten.addmm.default" and o.attrs.get("module") == "fc1")
        w = fc1.inputs()["mat2"]
        layout = _dtensor(w)
        assert layout["placements"] == ["Shard(1)"] and layout["global_shape"] == [8, 16]
        assert layout["global_offset"] == [0, 8] and layout["coordinate"] == [1]
        assert w.shape == (8, 8)
    with DumpFile(runs / "fsdp_rank0.h5") as f:
        assert json.loads(f.attrs["parallel_layout"])["wrappers"] == ["fsdp2"]


def test_shards_of_both_ranks_reassemble_into_the_global_tensor(runs):
    from dumpfile.dtensor import assemble
    w = torch.load(runs / "tp_ref0.pt")["weights"]
    parts = {}
    for rank in (0, 1):
        with DumpFile(runs / f"tp_rank{rank}.h5") as f:
            for o in f.ops():
                if o.op == "aten.addmm.default" and o.attrs.get("module") in ("fc1", "fc2") \
                        and o.seqid < 10:
                    ins, res = o.inputs(), o.outputs()["result"]
                    for key, rec in (("w", ins["mat2"]), ("b", ins["self"]), ("out", res)):
                        parts.setdefault((o.attrs["module"], key), []).append(
                            (rec.attrs["dtensor"], rec.read()))
    # Shard(1) of W.t() (colwise), Shard(0) of W.t() (rowwise), Shard(0) / Replicate bias
    np.testing.assert_array_equal(assemble(parts[("fc1", "w")]), w["fc1.weight"].t().numpy())
    np.testing.assert_array_equal(assemble(parts[("fc2", "w")]), w["fc2.weight"].t().numpy())
    np.testing.assert_array_equal(assemble(parts[("fc1", "b")]), w["fc1.bias"].numpy())
    np.testing.assert_array_equal(assemble(parts[("fc2", "b")]), w["fc2.bias"].numpy())
    # Partial(sum): the row-parallel output summed over ranks is the layer's output
    fc2_out = torch.load(runs / "tp_ref0.pt")["seen"]["fc2"][0]
    np.testing.assert_allclose(assemble(parts[("fc2", "out")]), fc2_out.numpy(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="1 shards for a mesh of 2 ranks"):
        assemble(parts[("fc1", "w")][:1])


def _failing(target, golden):
    import warnings

    from accucmp.compare.pipeline import compare_dumps
    from accucmp.compare.verdict import apply_verdict
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)     # h5py's "invalid value in cast"
        table = apply_verdict(compare_dumps(str(target), str(golden)).table)
    return table, table[table["Result"] == "fail"]


def test_identical_ddp_runs_compare_with_no_failing_row(runs):
    for rank in (0, 1):
        table, bad = _failing(runs / f"ddp_b_rank{rank}.h5", runs / f"ddp_a_rank{rank}.h5")
        assert bad.empty, bad[["NPUDump", "SeqId", "TensorName", "FailReason"]].to_string()
        # the reducer's out= buckets are there, not judged
        assert (table["CompareStatus"] == "uninitialized").any()
        compared = table[table["CompareStatus"] == "compared"]
        assert len(compared) > 100 and (compared["MaxAbsoluteError"] == 0).all()


def test_ddp_out_buffers_are_marked_and_reducer_ops_are_backward(runs):
    with DumpFile(runs / "ddp_a_rank0.h5") as f:
        ops = f.ops()
        outs = [v for o in ops for n, v in o.inputs().items() if n == "out"]
        assert outs and all(v.uninitialized for v in outs)
        phases = [o.attrs.get("phase") for o in ops]
        # two steps: forward, backward, forward, backward; the reducer's copies into .grad
        # and its allreduce at the end of backward belong to backward
        changes = [p for i, p in enumerate(phases) if i == 0 or p != phases[i - 1]]
        assert changes == ["forward", "backward", "forward", "backward"], changes
        # (DDP's forward broadcasts rebuilt bucket indices: forward)
        assert all(o.attrs.get("phase") == "backward" for o in ops if o.op.startswith("c10d.allreduce"))
        assert int(f.attrs["rank"]) == 0 and int(f.attrs["world_size"]) == 2
        assert json.loads(f.attrs["parallel_layout"])["wrappers"] == ["ddp"]


def test_load_replay_under_ddp_takes_each_ranks_file_and_lists_collectives(runs):
    for rank in (0, 1):
        rep = json.load(open(runs / f"replay{rank}.json"))
        assert rep["load"].endswith(f"ddp_a_rank{rank}.h5")
        assert "collective: its result depends on the other ranks" in rep["text"]
        table, bad = _failing(runs / f"replay_rank{rank}.h5", runs / f"ddp_a_rank{rank}.h5")
        assert bad.empty, bad[["NPUDump", "SeqId", "TensorName", "FailReason"]].to_string()
        assert (table["CompareStatus"] == "compared").sum() > 30


@pytest.mark.parametrize("name", ["fsdp", "tp"])
def test_load_replay_under_fsdp2_and_tp_has_no_failing_row(runs, name):
    for rank in (0, 1):
        table, bad = _failing(runs / f"{name}_replay_rank{rank}.h5", runs / f"{name}_rank{rank}.h5")
        assert bad.empty, bad[["NPUDump", "SeqId", "TensorName", "FailReason"]].to_string()
        assert (table["CompareStatus"] == "compared").sum() >= 10


def test_functional_collective_outputs_are_recorded_after_the_collective(runs):
    # RowwiseParallel's output redistribute: _c10d_functional.all_reduce returns before the
    # reduction has run; the recorded output is the sum of both ranks' inputs
    got = []
    for rank in (0, 1):
        with DumpFile(runs / f"tp_rank{rank}.h5") as f:
            ar = [o for o in f.ops() if o.op == "_c10d_functional.all_reduce.default"]
            got.append([(_t(o.inputs()["input"]), _t(o.outputs()["result"])) for o in ar])
    assert len(got[0]) == len(got[1]) >= 2
    for (i0, o0), (i1, o1) in zip(*got):
        assert not torch.equal(i0, i1)
        torch.testing.assert_close(o0, i0 + i1)
        assert torch.equal(o0, o1)


def test_golden_replay_of_a_rank_file_lists_collectives_with_the_reason(runs, tmp_path):
    import npu_dumper
    res = npu_dumper.golden_replay(runs / "ddp_a_rank1.h5", tmp_path / "g.h5")
    why = {w for op, _, w in res.not_replayed if op.startswith("c10d.")}
    assert why == {"collective: its result depends on the other ranks; not replayed"}
    assert res.replayed > 50
    with DumpFile(tmp_path / "g.h5") as g:
        assert int(g.attrs["rank"]) == 1


def test_step_and_rank_name_the_file(runs):
    for rank in (0, 1):
        with DumpFile(runs / f"s_step3_rank{rank}.h5") as f:
            assert int(f.attrs["step"]) == 3 and int(f.attrs["rank"]) == rank


def test_two_identical_fsdp2_runs_compare_clean_folder_to_folder(runs, tmp_path):
    """FSDP2's copy-out (fsdp::split_with_sizes_copy) writes into a list of buffers nobody
    wrote before: recorded as uninitialized, not compared (before: 'RelErr 1.6e+19' at
    fsdp.split_with_sizes_copy.default #12, exit 1, on two identical runs)."""
    from typer.testing import CliRunner

    from accucmp.cli.main import app

    r = CliRunner().invoke(app, ["compare", "-m", str(runs / "fsdp_twin_b"), "-g", str(runs / "fsdp_twin_a"),
                                 "-o", str(tmp_path), "-q"])
    assert r.exit_code == 0, r.output
    with DumpFile(runs / "fsdp_twin_a" / "fsdp_rank0.h5") as f:
        split = [o for o in f.ops() if o.op == "fsdp.split_with_sizes_copy.default"]
        assert split
        outs = split[0].inputs()["out"].children
        assert outs and all(c.uninitialized for c in outs)
