"""The one reader's catalog and op index (dumpfile/read/catalog.py, opindex.py): compare read
through the catalog gives the table the group walk gives; a catalog that lies about a
tensor's storage is a row's error, never a read sized by the lie; the op index keeps what
the index says, in seqid order, and leaves out ops whose group is gone."""

from __future__ import annotations

import shutil

import h5py
import numpy as np
import pandas as pd
import pytest

from dumpfile import schema as S
from dumpfile.read import catalog
from dumpfile.read.reader import DumpFile
from accucmp.compare.pipeline import compare_dumps

from ._compare_helpers import write_dump

RNG = np.random.default_rng(7)


def _ops(noise: float):
    ops = []
    for i in range(1, 9):
        x = RNG.standard_normal((3, 5)).astype(np.float32)
        big = RNG.standard_normal(40000).astype(np.float32)           # past the eager read
        ops.append(dict(op="aten.add.Tensor" if i % 2 else "aten.mm.default", seqid=i,
                        inputs={"self": x, "other": [x, (x * 2).astype(np.float16)], "alpha": 2},
                        outputs={"result": x + np.float32(noise) * i, "big": big}))
    return ops


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("cat")
    RNG.bit_generator.state = np.random.default_rng(7).bit_generator.state
    write_dump(d / "g.h5", _ops(0.0))
    RNG.bit_generator.state = np.random.default_rng(7).bit_generator.state
    write_dump(d / "t.h5", _ops(1e-3))
    return d


def _table(t, g) -> pd.DataFrame:
    return compare_dumps(t, g).table.drop(columns=["Index"]).reset_index(drop=True)


def test_compare_through_the_catalog_equals_the_walk(pair, tmp_path, monkeypatch):
    calls = []
    real = catalog.op_values
    monkeypatch.setattr(catalog, "op_values", lambda f, op, eager=0, op_id=None: calls.append(op.path) or real(f, op, eager, op_id))
    via = _table(pair / "t.h5", pair / "g.h5")
    with DumpFile(pair / "t.h5") as f:
        hits = [real(f, op, 0) for op in f.ops()]
    assert len(calls) == 16 and all(h is not None for h in hits)    # every op read from the catalog
    for name in ("t.h5", "g.h5"):
        shutil.copy(pair / name, tmp_path / name)
        with h5py.File(tmp_path / name, "r+") as h:
            del h[S.CATALOG_PATH]
    walked = _table(tmp_path / "t.h5", tmp_path / "g.h5")
    assert len(via) == 8 * 5 and set(via["TensorName"]) >= {"other/other_1", "big"}
    pd.testing.assert_frame_equal(via, walked)
    assert (via["CompareStatus"] == "compared").all()


def test_a_catalog_lying_about_storage_is_a_row_error_not_a_wrong_read(pair, tmp_path):
    for name in ("t.h5", "g.h5"):
        shutil.copy(pair / name, tmp_path / name)
    path = "/aten.mm.default/2/output/big"
    with h5py.File(tmp_path / "t.h5", "r+") as h:
        # the dataset rewritten smaller after the catalog was written (an in-place edit that
        # kept the catalog): the catalog's stored shape is now a lie
        del h[path]
        h.create_dataset(path, data=np.zeros(10, np.float32))
        h[path].attrs[S.ATTR_TYPE] = S.TYPE_TENSOR
    t = _table(tmp_path / "t.h5", tmp_path / "g.h5")
    row = t[t["NPUDumpPath"] == path].iloc[0]
    assert row["CompareStatus"] == "corrupt" and "catalog says" in row["CompareFailReason"], row.to_dict()
    assert (t[t["NPUDumpPath"] != path]["CompareStatus"] == "compared").all()


def test_op_index_columns_and_dropped_groups(pair, tmp_path):
    shutil.copy(pair / "t.h5", tmp_path / "t.h5")
    with h5py.File(tmp_path / "t.h5", "r+") as h:
        del h["/aten.mm.default/4"]               # a tool dropped one op's group
    with DumpFile(tmp_path / "t.h5") as f:
        ops = f.ops()
        assert [o.seqid for o in ops] == [1, 2, 3, 5, 6, 7, 8] and len(f) == 7
        assert [o.op for o in ops[:2]] == ["aten.add.Tensor", "aten.mm.default"]
        assert {o.phase for o in ops} == {"forward"} and ops[2].index_row == 2 and ops[3].index_row == 4
        assert ops[3].inputs()["self"].shape == (3, 5)
        # the op index holds codes, not strings per op
        ix = f.op_index
        assert ix.names == ["aten.add.Tensor", "aten.mm.default"] and len(ix) == 7
        assert ops[0] == f.ops()[0] and ops[0] != ops[1]


def test_listing_strips_placement_outside_strings_only(tmp_path, monkeypatch):
    # a name that spells a placement key inside its JSON string: listing parses each row
    # once per distinct text with offsets left out, and must not cut into the string
    from accucmp import listing

    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    odd = 'a","off":7,"obj":"/x'
    ops = [dict(op="aten.add.Tensor", seqid=i, inputs={odd: x, "self": x * i}, outputs={"result": x})
           for i in range(1, 4)]
    write_dump(tmp_path / "d.h5", ops)
    walks = []
    real = listing._light_values
    monkeypatch.setattr(listing, "_light_values", lambda f, p: walks.append(p) or real(f, p))
    via, _ = listing.list_ops(tmp_path / "d.h5")
    assert walks == []                                    # every op from its catalog row
    with h5py.File(tmp_path / "d.h5", "r+") as h:
        del h[S.CATALOG_PATH]
    walked, _ = listing.list_ops(tmp_path / "d.h5")
    assert via == walked
    assert sorted(v.name for v in via[0].values) == sorted([odd, "self", "result"])
    assert {id(v) for v in via[0].values if v.name != "self"} == {id(v) for v in via[2].values if v.name != "self"}


@pytest.mark.parametrize("direct", ["headers", True, False], ids=["object headers", "C library", "h5py"])
def test_a_tensor_rewritten_elsewhere_behind_a_kept_catalog_reads_its_new_value(tmp_path, monkeypatch, direct):
    """A user edits a dump with h5py (deletes a small tensor and writes another value under
    its name) and keeps the catalog: the old bytes still lie at the catalog's offset, but
    the compare must show the value the file now holds, not the one the catalog points at.
    40 ops, the edited one not among those the per-file offset check samples."""
    x = np.arange(15, dtype=np.float32).reshape(3, 5)
    ops = [dict(op="aten.mm.default", seqid=i, inputs={"self": x + i}, outputs={"result": x * i})
           for i in range(1, 41)]
    t, g = tmp_path / "t.h5", tmp_path / "g.h5"
    write_dump(g, ops)
    shutil.copy(g, t)
    path = f"{S.op_group_path('aten.mm.default', 20)}/{S.OUTPUT_GROUP}/result"
    with h5py.File(t, "r+") as h:
        old, attrs = h[path][()], dict(h[path].attrs)
        h.create_dataset("edited", data=old + np.float32(5.0))     # (before the delete: the
        del h[path]                                                # old bytes stay where they were)
        h.move("edited", path)
        h[path].attrs.update(attrs)
    from dumpfile.read import objheader
    checked = []
    real_place = objheader.contiguous_place
    monkeypatch.setattr(objheader, "contiguous_place",
                        lambda fd, a: checked.append(a) or real_place(fd, a) if direct == "headers" else None)
    if not direct:
        from dumpfile import h5direct
        monkeypatch.setattr(h5direct, "_LIB", None)      # the offset check through h5py
    table = _table(t, g)
    assert (len(checked) >= 160) == (direct == "headers")     # (every tensor of both files)
    assert (table["MaxAbsoluteError"].astype(float) > 0).sum() == 1
    row = table[table["NPUDumpPath"] == path]
    assert float(row["MaxAbsoluteError"].iloc[0]) == pytest.approx(5.0)


def test_load_replay_reads_a_large_tensor_rewritten_behind_a_kept_catalog_from_its_new_place(tmp_path):
    """Load-replay's raw reads (pread/mmap at the catalog's offset, large tensors) check the
    offset against the dataset itself: an edited golden gives the op its new value."""
    import torch
    from npu_dumper.replay.source import RecordedTensors

    x = np.arange(32768, dtype=np.float32)             # 128 KiB: read raw, not through h5py
    ops = [dict(op="aten.neg.default", seqid=i, inputs={"self": x + i}, outputs={"result": -(x + i)})
           for i in range(1, 41)]
    g = tmp_path / "g.h5"
    write_dump(g, ops)
    path = f"{S.op_group_path('aten.neg.default', 20)}/{S.INPUT_GROUP}/self"
    with h5py.File(g, "r+") as h:
        old, attrs = h[path][()], dict(h[path].attrs)
        h.create_dataset("edited", data=old + np.float32(5.0))
        del h[path]
        h.move("edited", path)
        h[path].attrs.update(attrs)
    with DumpFile(g) as f:
        recs = catalog.read_catalog(f)
        assert recs is not None                          # the kept catalog is used
        rec = recs[S.op_group_path("aten.neg.default", 20)]["self"]
        src = RecordedTensors()
        src.open(f, str(g))
        try:
            got = src.load(rec)
        finally:
            src.close()
    torch.testing.assert_close(got, torch.from_numpy(x + 25.0), rtol=0, atol=0)


def test_object_header_places_equal_hdf5s_for_every_dataset_of_a_dump(tmp_path):
    """dumpfile.read.objheader reads a contiguous dataset's place from its object header:
    for every dataset of a real dump (a sample model, full dump) it equals HDF5's offset and
    storage size, or says it cannot tell (None: no storage, a layout message outside the
    header's first block, version-2 headers: the caller asks HDF5)."""
    import torch
    import npu_dumper
    import sample_models
    from h5py import h5l
    from dumpfile.read import objheader

    spec = sample_models.get("lstm_lm")
    model, batch = spec.build(seed=0, size="tiny"), spec.make_inputs(seed=0, size="tiny")
    p = tmp_path / "d.h5"
    with npu_dumper.dumper(use_dump=True, dump_path=str(p)):
        spec.train_step(model, batch)
        torch.zeros(0) + 1                               # (an empty tensor: no storage)
    with h5py.File(tmp_path / "v2.h5", "w", libver="latest") as h:
        h["a/b"] = np.arange(10.0)
        h["c"] = np.ones(3, dtype=np.float32)

    def places(path):
        seen = []
        with h5py.File(path, "r") as h:
            fd = h.id.get_vfd_handle()

            def visit(name, obj):
                if isinstance(obj, h5py.Dataset):
                    parent, _, leaf = name.rpartition("/")
                    group = h[parent or "/"]                # (held: the link proxy does not)
                    link = group.id.links.get_info(leaf.encode())
                    assert link.type == h5l.TYPE_HARD
                    offset = obj.id.get_offset()
                    seen.append((objheader.contiguous_place(fd, link.u),
                                 None if offset is None else (offset, obj.id.get_storage_size())))
            h.visititems(visit)
        return seen

    seen = places(p)
    told = [(place, hdf5) for place, hdf5 in seen if place is not None]
    stored = [hdf5 for _, hdf5 in seen if hdf5 is not None]
    assert len(seen) > 100 and len(told) >= 0.9 * len(stored)        # nearly all (the others: HDF5)
    assert all(place == hdf5 for place, hdf5 in told)
    assert [place for place, _ in places(tmp_path / "v2.h5")] == [None, None]
