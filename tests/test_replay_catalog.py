"""The dump's catalog (/_npu_dumper/catalog, format 1.2): load-replay reads every op's
input records from it instead of walking the groups. Its records must be the walked ones
(npu_dumper.replay.index.read_group), and replay must fall back to the walk, with the same
results, wherever the catalog is missing, out of step with the index, or partial."""

from __future__ import annotations

import json
import math
import shutil

import h5py
import numpy as np
import pytest
import torch

import npu_dumper
import sample_models
from dumpfile import schema as S
from dumpfile.write import catalog as C
from dumpfile.read.reader import DumpFile
from dumpfile.write.writer import DumpWriter, TensorMeta
from npu_dumper.replay import matching as R     # (where load-replay calls read_group)
from npu_dumper.replay.load_replay import ReplayPolicy
from npu_dumper.replay.index import _NO_VALUE, read_catalog, read_group
from npu_dumper.replay.matching import recorded_key

from ._kill_helpers import sigkill_mid_dump


# ---- comparing catalog records with walked ones --------------------------------------------
def _same_value(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _finite(v) -> bool:
    """JSON can hold it (NaN and inf it cannot: readers read those from the file)."""
    if isinstance(v, list):
        return all(_finite(x) for x in v)
    return not isinstance(v, float) or math.isfinite(v)


class _Idents:
    """Catalog identities must group datasets exactly as the walk's (file object) ones."""

    def __init__(self):
        self.c2w: dict = {}
        self.w2c: dict = {}

    def check(self, cat, walk):
        assert self.c2w.setdefault(cat, walk) == walk, "one catalog identity, two datasets"
        assert self.w2c.setdefault(walk, cat) == cat, "one dataset, two catalog identities"


def _check(cat, walk, idents: _Idents, kinds: set) -> None:
    where = walk.path
    assert type(cat).__name__ == "LightValue"
    assert (cat.path, cat.name, cat.type) == (walk.path, walk.name, walk.type), where
    kinds.add(cat.type)
    assert list(cat.attrs) == list(walk.attrs), where
    for k, v in walk.attrs.items():
        c = cat.attrs[k]
        if isinstance(v, np.ndarray):
            assert isinstance(c, np.ndarray) and c.dtype == v.dtype and np.array_equal(c, v), (where, k)
        else:
            assert type(c) is type(v) and c == v, (where, k)
    assert (cat.shape, cat.dtype, cat.is_tensor, cat.is_list) == (walk.shape, walk.dtype, walk.is_tensor, walk.is_list)
    assert repr(recorded_key(cat)) == repr(recorded_key(walk)), where   # (NaN != NaN)
    if cat.is_tensor:
        assert cat.value is _NO_VALUE
        assert (cat.file_offset, cat.stored_nbytes, cat.stored_shape) == \
            (walk.file_offset, walk.stored_nbytes, walk.stored_shape), where
        assert cat.stored_dtype == walk.stored_dtype, where
        assert cat.ident[1:] == walk.ident[1:], where
        idents.check(cat.ident[0], walk.ident[0])
        if isinstance(cat.ident[0], int):      # a strided base: the file object's own identity
            assert cat.ident[0] == walk.ident[0], where
        if cat.type != S.TYPE_TENSOR_STATS:
            np.testing.assert_array_equal(np.asarray(cat.read()), np.asarray(walk.read()))
    elif not cat.is_list:
        assert _same_value(cat.read(), walk.read()), where
        if walk.value is not _NO_VALUE and _finite(walk.value):   # the catalog has it too
            assert cat.value is not _NO_VALUE and _same_value(cat.value, walk.value), where
    assert [c.name for c in cat.children] == [c.name for c in walk.children], where
    for c, w in zip(cat.children, walk.children):
        _check(c, w, idents, kinds)


def _compare_file(path, *, described: bool = True) -> tuple[set, int]:
    """Catalog vs walk for inputs and outputs of every op; (kinds seen, ops described)."""
    kinds: set = set()
    idents = _Idents()
    n_described = 0
    with DumpFile(path) as f:
        assert f.attrs[S.ROOT_FORMAT_VERSION] == S.FORMAT_VERSION == "1.9"
        assert f.h5[S.CATALOG_PATH].shape == f.h5[S.INDEX_PATH].shape
        for group in (S.INPUT_GROUP, S.OUTPUT_GROUP):
            cat = read_catalog(f, group)
            assert cat is not None
            for op in f.ops():
                walked = read_group(f, f"{op.path}/{group}")
                recs = cat[op.path]
                if recs is None:
                    assert not described, f"{op.path} not described"
                    continue
                n_described += group == S.INPUT_GROUP
                assert list(recs) == list(walked), op.path       # argument order
                for name in walked:
                    _check(recs[name], walked[name], idents, kinds)
    return kinds, n_described


def _dump_model(path, name="transformer", **kw):
    spec = sample_models.get(name)
    model = spec.build(seed=0, size="tiny")
    inputs = spec.make_inputs(seed=0, size="tiny")
    with npu_dumper.dumper(use_dump=True, dump_path=str(path), **kw):
        spec.train_step(model, inputs)
    return spec, model, inputs


# ---- the dumper's files ------------------------------------------------------------------
@pytest.mark.parametrize("name", ["transformer", "lstm_lm"])
def test_catalog_records_equal_the_walked_ones_for_every_op(tmp_path, name):
    path = tmp_path / "ref.h5"
    _dump_model(path, name)
    kinds, described = _compare_file(path)
    with DumpFile(path) as f:
        assert described == len(f.ops()) > 20
    # tensors, views, tensor lists, dtypes, None, bools, ints, int arrays, devices
    assert {S.TYPE_TENSOR, S.TYPE_TENSOR_VIEW, S.TYPE_TENSOR_LIST, S.TYPE_SCALAR_TYPE, S.TYPE_NONE,
            S.TYPE_BOOL, S.TYPE_INT, S.TYPE_INT_ARRAY_REF, S.TYPE_MEMORY_FORMAT} <= kinds


def _without_offsets(row: bytes):
    """A catalog row less its file offsets ("off"): where HDF5 places a dataset depends on
    when the flushes ran (metadata is allocated then), which differs from run to run."""
    def strip(obj):
        if isinstance(obj, dict):
            return {k: strip(v) for k, v in obj.items() if k != "off"}
        if isinstance(obj, list):
            return [strip(v) for v in obj]
        return obj
    return strip(json.loads(row))


def test_process_writer_writes_the_same_catalog(tmp_path):
    _dump_model(tmp_path / "thread.h5", "lstm_lm", writer="thread")
    _dump_model(tmp_path / "process.h5", "lstm_lm", writer="process")
    _compare_file(tmp_path / "process.h5")
    with h5py.File(tmp_path / "thread.h5", "r") as a, h5py.File(tmp_path / "process.h5", "r") as b:
        rows = a[S.CATALOG_PATH][()].tolist()
        assert all(rows) and len(rows) == len(b[S.CATALOG_PATH])
        assert [_without_offsets(r) for r in rows] == [_without_offsets(r) for r in b[S.CATALOG_PATH][()].tolist()]


# ---- every kind of entry, and what the writer cannot describe -----------------------------
def _exotic(path, monkeypatch) -> dict:
    """Entries the sample models do not make, links to forgotten descriptions, a deferred
    op, an aborted one and one written partly around the writer. Returns op paths."""
    monkeypatch.setattr(C, "CATALOG_MAX_DESCRIPTIONS", 3)     # forget early: links read the file
    big = np.arange(256 * 128, dtype=np.float32).reshape(256, 128)
    with DumpWriter(path) as w:
        g = w.begin_op("aten.exotic.default", 1)
        inp = g[S.INPUT_GROUP]
        w.write_value(inp, "nan", float("nan"))                 # JSON has no NaN: read from the file
        w.write_value(inp, "alpha", 2.5, "Scalar")
        w.write_value(inp, "k", 7, "int?")
        w.write_value(inp, "c", 1 + 2j)                         # complex: read from the file
        w.write_value(inp, "s", "h\u00e9llo")
        w.write_value(inp, "fl", [1, 2.5, float("inf")])
        w.write_value(inp, "il", [1, 2, 3])
        w.write_value(inp, "bl", [True, False])
        w.write_value(inp, "mixed", [1, "a", None, 2.0])         # a Type 37 group
        w.write_value(inp, "none", None)
        w.write_named(inp, "dtype", "bfloat16", S.TYPE_SCALAR_TYPE)
        w.write_named(inp, "device", "cpu", S.TYPE_DEVICE)
        small = w.write_tensor(inp, "small", np.ones((3, 4), np.float32), TensorMeta("float32", (3, 4), (4, 1)))
        bigt = w.write_tensor(inp, "big_t", big, TensorMeta("float32", (256, 128), (1, 256)))  # W.t(): pwrite
        w.write_tensor(inp, "gz", big, TensorMeta("float32", (256, 128), (128, 1)), compression="gzip")
        w.write_tensor(inp, "zero_d", np.array(3.0, np.float32), TensorMeta("float32", (), ()))
        w.write_tensor(inp, "empty", np.zeros((0, 3), np.int64), TensorMeta("int64", (0, 3), (3, 1)))
        w.write_tensor(inp, "bf16", np.arange(6, dtype=np.uint16), TensorMeta(
            "bfloat16", (6,), (1,), storage_offset=5, uninitialized=True))
        w.write_tensor(inp, "c32", np.zeros((4, 2), np.float16), TensorMeta("complex32", (4,), (1,)))
        lst = w.create_list(inp, "tensors", S.TYPE_TENSOR_LIST, 12)
        for i in range(12):                                      # tensors_10 sorts before tensors_2
            w.write_tensor(lst, f"tensors_{i}", np.full(2, i, np.int32), TensorMeta("int32", (2,), (1,)))
        w.write_view(inp, "view", bigt, TensorMeta("float32", (128, 256), (256, 1)))
        w.write_stats(inp, "stats", [0, 1, 0.5, 0.1, 2, 0, 0, 4], TensorMeta("float32", (4,), (1,)))
        out = g[S.OUTPUT_GROUP]
        res = w.link(out, "result", bigt)
        w.write_value(out, "b", True)
        w.set_order(out, ["result", "b"])                       # not alphabetical
        w.end_op()

        g = w.begin_op("aten.second.default", 2)               # links to forgotten descriptions
        w.link(g[S.INPUT_GROUP], "self", small)
        w.link(g[S.INPUT_GROUP], "other", res)                  # a link to a link
        r = w.reserve_tensor(g[S.OUTPUT_GROUP], "result", (256, 128), np.float32,
                             TensorMeta("float32", (256, 128), (128, 1)))
        assert r is not None
        w.end_op(deferred=True)
        w.write_at(r[1], big)
        w.release_ops(1)

        g = w.begin_op("aten.aborted.default", 3)
        w.write_value(g[S.INPUT_GROUP], "x", 1)
        w.abort_op()

        g = w.begin_op("aten.around.default", 4)               # partly written with plain h5py
        w.write_value(g[S.INPUT_GROUP], "x", 1)
        g[S.INPUT_GROUP].create_dataset("raw", data=np.ones(3))
        w.end_op()

        g = w.begin_op("aten.nothing.default", 5)              # no inputs, no outputs
        w.end_op()
    return {"exotic": "/aten.exotic.default/1", "second": "/aten.second.default/2",
            "around": "/aten.around.default/4", "nothing": "/aten.nothing.default/5"}


def test_every_kind_of_entry_and_what_the_writer_cannot_describe(tmp_path, monkeypatch):
    path = tmp_path / "exotic.h5"
    ops = _exotic(path, monkeypatch)
    kinds, described = _compare_file(path, described=False)
    assert described == 3                                       # all but the one written around the writer
    assert {S.TYPE_TENSOR, S.TYPE_TENSOR_VIEW, S.TYPE_TENSOR_STATS, S.TYPE_TENSOR_LIST, S.TYPE_LIST,
            S.TYPE_COMPLEX, S.TYPE_STRING, S.TYPE_FLOAT_LIST, S.TYPE_BOOL_LIST, S.TYPE_INT_LIST,
            S.TYPE_SCALAR, S.TYPE_OPTIONAL_INT, S.TYPE_DOUBLE, S.TYPE_NONE, S.TYPE_DEVICE} <= kinds
    with DumpFile(path) as f:
        assert [o.path for o in f.ops()] == [ops["exotic"], ops["second"], ops["around"], ops["nothing"]]
        cat = read_catalog(f)
        assert cat[ops["around"]] is None and cat[ops["nothing"]] == {}
        first = cat[ops["exotic"]]
        assert list(first) == sorted(first)                    # no order attribute: alphabetical
        assert first["nan"].value is _NO_VALUE and math.isnan(first["nan"].read())
        assert first["c"].value is _NO_VALUE and first["c"].read() == 1 + 2j
        assert first["fl"].value is _NO_VALUE and first["fl"].read()[2] == math.inf
        assert first["s"].value == "h\u00e9llo" and first["mixed"].read() == [1, "a", None, 2.0]
        assert first["gz"].file_offset is None and first["big_t"].file_offset is not None
        assert isinstance(first["big_t"].ident[0], int)         # strided base: file identity
        outs = read_catalog(f, S.OUTPUT_GROUP)
        assert list(outs[ops["exotic"]]) == ["result", "b"]
        second = cat[ops["second"]]
        # the link to a link and the first link name one dataset
        assert second["other"].ident == outs[ops["exotic"]]["result"].ident == first["big_t"].ident
        assert outs[ops["second"]]["result"].file_offset is not None
        np.testing.assert_array_equal(outs[ops["second"]]["result"].read(), np.arange(256 * 128).reshape(256, 128))
    with h5py.File(path, "r") as h:
        rows = h[S.CATALOG_PATH][()].tolist()
        assert len(rows) == 4 and rows[2] == b""


# ---- replay: catalog, fallbacks, same results ---------------------------------------------
def _outputs(path) -> dict:
    out = {}
    with DumpFile(path) as d:
        for op in d.ops():
            for k, v in op.outputs().items():
                for leaf in (v.children if v.is_list else [v]):
                    if leaf.is_tensor:
                        out[(op.op, op.seqid, k, leaf.name)] = np.asarray(leaf.read())
    return out


def _rewrite(src, dst) -> None:
    """What h5repack does to a dump: every object copied into a new file (new offsets)."""
    with h5py.File(src, "r") as a, h5py.File(dst, "w") as b:
        for k in a:
            a.copy(a[k], b, name=k)
        b.attrs.update(a.attrs)


def test_catalog_offsets_that_are_not_the_files_are_refused(tmp_path):
    ref = tmp_path / "ref.h5"
    with DumpWriter(ref) as w:
        for seqid in (1, 2):
            g = w.begin_op("aten.neg.default", seqid)
            w.write_tensor(g[S.INPUT_GROUP], "self", np.full((128, 256), seqid, np.float32),
                           TensorMeta("float32", (128, 256), (256, 1)))
            w.end_op()
    with DumpFile(ref) as f:
        good = read_catalog(f)
        assert good is not None and all(r["self"].file_offset for r in good.values())
    moved = tmp_path / "moved.h5"
    _rewrite(ref, moved)
    with DumpFile(moved) as f:
        assert f.h5[S.CATALOG_PATH].shape == f.h5[S.INDEX_PATH].shape == (2,)
        assert read_catalog(f) is None
    with h5py.File(ref, "a") as h:         # one offset off by a few bytes
        row = json.loads(h[S.CATALOG_PATH][1])
        row["i"][0]["off"] += 8
        h[S.CATALOG_PATH][1] = json.dumps(row)
    with DumpFile(ref) as f:
        assert read_catalog(f) is None


def _replay(spec, model, inputs, ref, out, monkeypatch) -> int:
    """Replay `ref` into a step of the same model; the number of ops read_group walked."""
    walked = []

    def counting(f, group_path):
        walked.append(group_path)
        return read_group(f, group_path)

    monkeypatch.setattr(R, "read_group", counting)
    with npu_dumper.dumper(use_load=True, load_file_path=str(ref), dump_path=str(out)) as d:
        spec.train_step(model, inputs)
    monkeypatch.setattr(R, "read_group", read_group)
    policy = d.policies[0]
    assert policy.summary.matched == policy.summary.recorded_ops and not policy.summary.unmatched
    return len(walked)


def test_replay_via_catalog_and_via_fallbacks_give_bit_identical_outputs(tmp_path, monkeypatch, capsys):
    ref = tmp_path / "ref.h5"
    spec, model, inputs = _dump_model(ref, "transformer")
    with DumpFile(ref) as f:
        n_ops = len(f.ops())
    deleted, truncated, one_bad, moved = (tmp_path / f"{k}.h5" for k in ("deleted", "truncated", "one_bad", "moved"))
    for p in (deleted, truncated, one_bad):
        shutil.copy(ref, p)
    _rewrite(ref, moved)                        # datasets move, the catalog is copied as it was
    with h5py.File(deleted, "a") as h:
        del h[S.CATALOG_PATH]
    with h5py.File(truncated, "a") as h:
        h[S.CATALOG_PATH].resize((n_ops - 1,))
    with h5py.File(one_bad, "a") as h:
        h[S.CATALOG_PATH][3] = "{not json"
    for p in (deleted, truncated, moved):
        with DumpFile(p) as f:
            assert read_catalog(f) is None

    walks = {}
    for p in (ref, deleted, truncated, one_bad, moved):
        walks[p.stem] = _replay(spec, model, inputs, p, tmp_path / f"out_{p.stem}.h5", monkeypatch)
    assert walks == {"ref": 0, "deleted": n_ops, "truncated": n_ops, "one_bad": 1, "moved": n_ops}
    want = _outputs(tmp_path / "out_ref.h5")
    assert len(want) > 20
    for p in (deleted, truncated, one_bad, moved):
        got = _outputs(tmp_path / f"out_{p.stem}.h5")
        assert got.keys() == want.keys()
        for key, a in want.items():
            b = got[key]
            assert a.dtype == b.dtype and a.shape == b.shape, key
            assert a.tobytes() == b.tobytes(), key
    # and the replay, a dump itself, carries a complete catalog
    _compare_file(tmp_path / "out_ref.h5")


def test_killed_dump_replays_from_its_catalog_or_falls_back(tmp_path, monkeypatch, capsys):
    p = sigkill_mid_dump(tmp_path, settle_s=1.0)
    with DumpFile(p) as f:
        n_ops = len(f.ops())
        n_index = f.h5[S.INDEX_PATH].shape[0]
        cat = read_catalog(f)
        assert n_ops > 10
        if cat is not None:                    # flushed with the index: one row per index row
            assert len(cat) == n_index and f.h5[S.CATALOG_PATH].shape[0] == n_index
            for op in f.ops():
                if cat[op.path] is not None:
                    assert list(cat[op.path]) == list(read_group(f, f"{op.path}/{S.INPUT_GROUP}"))
        assert [o.op for o in f.ops()[:2]] == ["aten.mul.Tensor", "aten.tanh.default"]
        recorded = [o.outputs()["result"].read() for o in f.ops()[:6]]
    policy = ReplayPolicy(p, verbose=False)
    policy.begin()
    assert all(e._inputs is not None for e in policy._order)
    policy.end()
    # replay the first ops (x * 1.01, tanh, ...) from random live inputs: the recorded ones come back
    outs = []
    with npu_dumper.dumper(use_load=True, load_file_path=str(p), dump_path=str(tmp_path / "r.h5")):
        y = torch.randn(32, 32)
        for _ in range(3):
            y = y * 1.01
            outs.append(y.clone())
            y = torch.tanh(y)
            outs.append(y.clone())
    assert len(outs) == len(recorded) == 6
    for got, want in zip(outs, recorded):
        np.testing.assert_array_equal(got.numpy(), want)
