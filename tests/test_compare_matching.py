"""Op pairing (k-th call, stream alignment, replay seqids, op map) and tensor pairing."""

import numpy as np

from accucmp.compare.matching import canonical_op, pair_by_seqid, pair_by_stream, pair_tensors, tensor_leaves
from dumpfile import DumpFile
from tests._compare_helpers import write_dump


class Op:
    def __init__(self, op, seqid):
        self.op, self.seqid = op, seqid

    def __repr__(self):
        return f"{self.op}#{self.seqid}"


def ops(names, start=1):
    return [Op(n, i) for i, n in enumerate(names, start)]


def as_pairs(pairs):
    return [((p.target.op, p.target.seqid) if p.target else None,
             (p.golden.op, p.golden.seqid) if p.golden else None) for p in pairs]


def test_equal_streams_pair_one_to_one():
    t, g = ops(["mm", "add", "mm"]), ops(["mm", "add", "mm"], start=10)
    assert as_pairs(pair_by_stream(t, g)) == [(("mm", 1), ("mm", 10)), (("add", 2), ("add", 11)),
                                              (("mm", 3), ("mm", 12))]


def test_inserted_op_does_not_shift_later_pairs():
    g = ops(["mm", "add", "relu", "mm", "add", "relu"])
    t = ops(["mm", "add", "add", "relu", "mm", "add", "relu"])   # an extra add in the target
    pairs = pair_by_stream(t, g)
    got = as_pairs(pairs)
    assert (("mm", 5), ("mm", 4)) in got and (("add", 6), ("add", 5)) in got and (("relu", 7), ("relu", 6)) in got
    unmatched = [p for p in pairs if p.golden is None]
    assert len(unmatched) == 1 and unmatched[0].target.op == "add"
    assert "No data match" in unmatched[0].reason
    # plain k-th call would have paired the second target add with the second golden add (seqid 5)
    assert not any(p for p in pairs if p.target and p.golden and p.target.seqid == 3 and p.golden.seqid == 5)


def test_missing_op_leaves_golden_only_row_in_place():
    g = ops(["a", "b", "c", "d"])
    t = ops(["a", "c", "d"])
    got = as_pairs(pair_by_stream(t, g))
    assert got == [(("a", 1), ("a", 1)), (None, ("b", 2)), (("c", 2), ("c", 3)), (("d", 3), ("d", 4))]


def test_kth_call_inside_a_replaced_region():
    g = ops(["x", "mm", "y", "mm", "z"])
    t = ops(["x", "mm", "w", "mm", "z"])
    got = as_pairs(pair_by_stream(t, g))
    assert (("mm", 2), ("mm", 2)) in got and (("mm", 4), ("mm", 4)) in got
    assert (("w", 3), None) in got and (None, ("y", 3)) in got


def test_casts_between_repeated_layers_do_not_shift_pairs_across_layers():
    """Two layers of mm, sum, mm; the target (autocast) casts before each mm and once more
    in layer 0. Aligned together with the casts, difflib's longest block paired layer 0's
    last mm with layer 1's first; aligning the ops that compute first pairs every op with
    its own layer's, and leaves the casts unmatched."""
    cast, mm, s = "aten._to_copy.default", "aten.mm.default", "aten.sum.dim_IntList"
    g = ops([mm, s, mm, mm, s, mm], start=1)
    t = ops([cast, mm, cast, s, cast, mm, cast, mm, s, cast, mm], start=1)
    layer_g = {1: 0, 2: 0, 3: 0, 4: 1, 5: 1, 6: 1}
    layer_t = {2: 0, 4: 0, 6: 0, 8: 1, 9: 1, 11: 1}
    pairs = pair_by_stream(t, g)
    both = [(p.target.seqid, p.golden.seqid) for p in pairs if p.target and p.golden]
    assert both == [(2, 1), (4, 2), (6, 3), (8, 4), (9, 5), (11, 6)]
    assert all(layer_t[a] == layer_g[b] for a, b in both)
    assert sorted(p.target.seqid for p in pairs if p.golden is None) == [1, 3, 5, 7, 10]
    assert [p.target.seqid if p.target else None for p in pairs] == list(range(1, 12))   # target order


def test_casts_between_layers_pair_the_same_against_the_original_tools_names():
    """The golden in the original tool's spelling (`mm`, `_to_copy`): its casts are casts
    too, so the alignment is the one two of our dumps get."""
    cast, mm, s = "aten._to_copy.default", "aten.mm.default", "aten.sum.dim_IntList"
    t = ops([cast, mm, cast, s, cast, mm, cast, mm, s, cast, mm], start=1)
    ours = ops([mm, s, mm, cast, mm, s, mm], start=1)
    theirs = ops([canonical_op(o.op) for o in ours], start=1)
    assert theirs[0].op == "mm" and theirs[3].op == "_to_copy"
    from accucmp.compare.matching import _by_design
    assert all(_by_design(n) for n in ("_to_copy", "aten._to_copy.default", "clone", "aten.clone.default"))
    assert not any(_by_design(n) for n in ("mm", "aten.mm.default", "sum_dim_IntList"))
    pairs = lambda g: [(p.target.seqid if p.target else None, p.golden.seqid if p.golden else None)  # noqa: E731
                       for p in pair_by_stream(t, g)]
    assert pairs(theirs) == pairs(ours)


def test_a_cast_both_runs_have_still_pairs():
    """Casts take part in the alignment between the computing ops around them: a model's own
    cast, in both runs, pairs; the one only autocast adds does not."""
    cast, mm, add = "aten._to_copy.default", "aten.mm.default", "aten.add.Tensor"
    g = ops([mm, cast, add, mm])
    t = ops([cast, mm, cast, add, cast, mm])
    got = as_pairs(pair_by_stream(t, g))
    assert ((cast, 3), (cast, 2)) in got
    assert ((mm, 2), (mm, 1)) in got and ((add, 4), (add, 3)) in got and ((mm, 6), (mm, 4)) in got
    assert ((cast, 1), None) in got and ((cast, 5), None) in got


def test_op_map_pairs_cudnn_with_native():
    assert canonical_op("aten.cudnn_batch_norm.default") == canonical_op("aten.native_batch_norm.default")
    t = ops(["aten.mm.default", "aten.cudnn_batch_norm.default"])
    g = ops(["aten.mm.default", "aten.native_batch_norm.default"])
    pairs = pair_by_stream(t, g)
    assert [p.matched_by for p in pairs] == ["name", "map"]


def test_replay_pairs_by_identical_seqid():
    g = ops(["a", "b", "c", "d"])
    t = [Op("a", 1), Op("c", 3), Op("d", 4)]   # b not replayed
    pairs = pair_by_seqid(t, g, {("b", 2): "no recorded inputs"})
    assert as_pairs(pairs) == [(("a", 1), ("a", 1)), (None, ("b", 2)), (("c", 3), ("c", 3)), (("d", 4), ("d", 4))]
    assert "no recorded inputs" in pairs[1].reason
    assert all(p.matched_by == "seqid" for p in pairs if p.target and p.golden)


def test_tensor_pairing_by_name_rename_and_lists(tmp_path):
    a = np.ones(3, np.float32)
    write_dump(tmp_path / "t.h5", [dict(op="aten.cat.default", seqid=1,
                                        inputs={"tensors": [a, a], "self": a, "dim": 0}, outputs={"result": a})])
    write_dump(tmp_path / "g.h5", [dict(op="aten.cat.default", seqid=1,
                                        inputs={"tensors": [a, a, a], "input": a}, outputs={"result": a})])
    with DumpFile(tmp_path / "t.h5") as tf, DumpFile(tmp_path / "g.h5") as gf:
        t_in = tensor_leaves(tf.ops()[0].inputs())
        g_in = tensor_leaves(gf.ops()[0].inputs())
        assert "dim" not in t_in
        got = [(n, t is not None, g is not None) for n, t, g in pair_tensors(t_in, g_in)]
    assert got == [("tensors/tensors_0", True, True), ("tensors/tensors_1", True, True),
                   ("self", True, True), ("tensors/tensors_2", False, True)]


def test_replay_against_a_golden_that_is_not_its_source(tmp_path):
    """A load-replay dump carries its source's seqids. Compared against another run's dump
    (here one with two extra ops first), seqid pairing paired addmm with zeros, gelu with
    add, ...: 11 'size mismatch' failures on a clean run. When most seqid pairs name
    different ops, compare pairs by aligning the op streams and says why."""
    from accucmp.compare.pipeline import compare_dumps
    from accucmp.compare.verdict import apply_verdict
    from dumpfile import schema as S

    rng = np.random.default_rng(0)
    names = ["aten.addmm.default", "aten.gelu.default", "aten.addmm.default", "aten.sum.default", "aten.mm.default"]
    vals = [rng.standard_normal((4, 8)).astype(np.float32) for _ in names]
    src = [dict(op=n, seqid=i + 1, inputs={"self": v}, outputs={"result": v * 2}) for i, (n, v) in enumerate(zip(names, vals))]
    extra = [dict(op="aten.zeros.default", seqid=1, outputs={"result": np.zeros(1, np.float32)}),
             dict(op="aten.add.Tensor", seqid=2, inputs={"self": np.zeros(1, np.float32)},
                  outputs={"result": np.ones(1, np.float32)})]
    other = extra + [dict(o, seqid=o["seqid"] + 2) for o in src]
    replayed = [dict(o, inputs={}) for o in src]
    write_dump(tmp_path / "replay.h5", replayed, mode=S.MODE_LOAD)
    write_dump(tmp_path / "source.h5", src)
    write_dump(tmp_path / "other.h5", other)
    good = compare_dumps(str(tmp_path / "replay.h5"), str(tmp_path / "source.h5"))
    assert good.meta["pairing"] == "seqid" and not good.meta["warnings"]
    res = compare_dumps(str(tmp_path / "replay.h5"), str(tmp_path / "other.h5"))
    assert res.meta["pairing"] == "stream"
    assert any("seqids do not line up" in w for w in res.meta["warnings"])
    t = apply_verdict(res.table)
    paired = t[t["Result"] != "unmatched"]
    assert (paired["Result"] == "pass").all(), paired[["NPUDump", "GoldenOp", "FailReason"]]
    assert list(paired["GoldenSeqId"]) == [s + 2 for s in paired["SeqId"]]
    un = t[(t["Result"] == "unmatched") & (t["IO"] == "output")]
    assert sorted(un["GroundTruthPath"].str.split("/").str[1]) == ["aten.add.Tensor", "aten.zeros.default"]


def test_structure_counts_ops_one_run_lacks_for_the_rows_after_them():
    """An op both runs leave a call of unpaired (a gradient sum autograd orders differently
    under autocast) is the same computation elsewhere, not an op one run lacks: it does not
    stop rows from passing as inherited. An op only one run has does, for the rows after
    it (GradScaler's multiply after the loss leaves the forward's rows as they were)."""
    from accucmp.compare.matching import OpPair
    from accucmp.compare.pipeline import structure_before

    def op(name, seqid, module=""):
        o = Op(name, seqid)
        o.module = module
        return o
    mm, add, mul = "aten.mm.default", "aten.add.Tensor", "aten.mul.Tensor"
    pairs = [OpPair(op(mm, 1), op(mm, 1), "name"),
             OpPair(None, op(add, 2, "dec.embed"), "unmatched"),
             OpPair(op("aten._to_copy.default", 3), None, "unmatched"),
             OpPair(op(add, 5, "enc.embed"), None, "unmatched")]
    assert structure_before(pairs, pairs) == ()
    pairs += [OpPair(op(mm, 6), op(mm, 4), "name"),
              OpPair(op(mul, 7, "block.scale"), None, "unmatched"),
              OpPair(op(mm, 8), op(mm, 5), "name"),
              OpPair(None, op("aten.relu.default", 6, "act"), "unmatched")]
    assert structure_before(pairs, pairs) == (
        (5, "1 op(s) with no partner: aten.mul.Tensor (target) in block.scale"),
        (7, "2 op(s) with no partner: aten.mul.Tensor (target) in block.scale, aten.relu.default (golden) in act"))
