"""The writer's per-op fast paths (attribute items made once per description, low-level op
groups and view datasets) write the same objects the plain h5py calls made."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from dumpfile import schema as S
from dumpfile.errors import DumpWriteError
from dumpfile.write.writer import DumpWriter, TensorMeta


def _attrs(obj) -> dict:
    return {k: np.asarray(v).tolist() for k, v in obj.attrs.items()}


def test_tensors_sharing_and_not_sharing_a_description_get_their_own_attributes(tmp_path):
    """Attribute items are cached per tensor description: tensors that share one read the
    same attributes, any field that differs (shape, stride, dtype, offset, uninitialized)
    reads back as its own value, and the catalog agrees with the attributes."""
    metas = [
        TensorMeta("float32", (2, 3), (3, 1)),
        TensorMeta("float32", (2, 3), (3, 1)),                        # same description
        TensorMeta("float32", (3, 2), (2, 1)),                        # other shape
        TensorMeta("float32", (2, 3), (1, 2)),                        # other stride: live_stride
        TensorMeta("bfloat16", (2, 3), (3, 1)),                       # other dtype
        TensorMeta("float32", (2, 3), (3, 1), storage_offset=4),      # an offset
        TensorMeta("float32", (2, 3), (3, 1), uninitialized=True),
        TensorMeta("float32", (2, 3), (3, 1), extra={S.ATTR_DTENSOR: "{}"}),   # not cached
    ]
    path = tmp_path / "a.h5"
    w = DumpWriter(path)
    w.begin_op("aten.add.Tensor", 1)
    inp, _ = w.io_groups()
    for i, m in enumerate(metas):
        dt = np.uint16 if m.dtype == "bfloat16" else np.float32
        w.write_tensor(inp, f"t{i}", np.arange(6, dtype=dt).reshape(m.shape), m)
    w.end_op()
    w.close()
    with h5py.File(path, "r") as f:
        g = f["aten.add.Tensor/1/input"]
        for i, m in enumerate(metas):
            want = {k: np.asarray(v).tolist() for k, v in m.attrs(S.TYPE_TENSOR).items()}
            assert _attrs(g[f"t{i}"]) == want, i
        assert _attrs(g["t3"])[S.ATTR_LIVE_STRIDE] == [1, 2]
        assert _attrs(g["t5"])[S.ATTR_STORAGE_OFFSET] == 4 and S.ATTR_STORAGE_OFFSET not in _attrs(g["t0"])
        assert _attrs(g["t6"])[S.ATTR_UNINITIALIZED] is True and S.ATTR_UNINITIALIZED not in _attrs(g["t0"])
    from dumpfile import DumpFile
    with DumpFile(path) as d:
        recs = d.ops()[0].inputs()
        assert [recs[f"t{i}"].shape for i in range(len(metas))] == [tuple(m.shape) for m in metas]
        assert recs["t4"].dtype == "bfloat16" and recs["t0"].dtype == "float32"


def test_order_rewritten_and_non_ascii_names(tmp_path):
    """`order` made from a cached item: writing it again replaces it (as h5py's
    `attrs[k] = v` did), an empty one and non-ASCII names read back; an op name that is not
    ASCII takes h5py's own group path; an op group made twice is refused in one line."""
    path = tmp_path / "o.h5"
    w = DumpWriter(path)
    w.begin_op("mylib.opé.default", 1)
    inp, out = w.io_groups()
    w.set_order(inp, ["self", "other", "alpha"])
    w.set_order(inp, ["self", "other"])
    w.set_order(out, [])
    w.end_op()
    w.begin_op("aten.add.Tensor", 2)
    inp2, _ = w.io_groups()
    w.set_order(inp2, ["é", "x"])
    w.end_op()
    with pytest.raises(DumpWriteError, match="already exists"):
        w.begin_op("aten.add.Tensor", 2)
    w.close()
    with h5py.File(path, "r") as f:
        g = f["mylib.opé.default/1"]
        assert g.attrs[S.OP_NAME] == "mylib.opé.default"
        assert list(g["input"].attrs["order"]) == ["self", "other"]
        assert list(g["output"].attrs["order"]) == []
        assert list(f["aten.add.Tensor/2/input"].attrs["order"]) == ["é", "x"]
        t = h5py.h5a.open(g["input"].id, b"order").get_type()
        assert t.is_variable_str() and t.get_cset() == h5py.h5t.CSET_UTF8


def test_view_dataset_is_a_scalar_object_reference_to_its_base(tmp_path):
    path = tmp_path / "v.h5"
    w = DumpWriter(path)
    w.begin_op("aten.mm.default", 1)
    _, out = w.io_groups()
    base = w.write_tensor(out, "result", np.arange(12, dtype=np.float32).reshape(3, 4),
                          TensorMeta("float32", (3, 4), (4, 1)))
    w.end_op()
    w.begin_op("aten.mm.default", 2)
    inp, _ = w.io_groups()
    w.write_view(inp, "self", base, TensorMeta("float32", (4, 3), (1, 4)))
    w.end_op()
    w.close()
    with h5py.File(path, "r") as f:
        ds = f["aten.mm.default/2/input/self"]
        assert h5py.check_ref_dtype(ds.dtype) is not None and ds.shape == ()
        assert ds.id.get_create_plist().get_layout() == h5py.h5d.CONTIGUOUS
        assert f[ds[()]].name == base
        assert ds.attrs[S.ATTR_TYPE] == S.TYPE_TENSOR_VIEW
        # the base hard-linked into the view's op group (format 1.5), named by the attribute
        assert f[ds.attrs[S.ATTR_BASE]].name in (base, ds.attrs[S.ATTR_BASE])
        assert ds.attrs[S.ATTR_BASE].startswith("/aten.mm.default/2/")
        np.testing.assert_array_equal(f[ds.attrs[S.ATTR_BASE]][()], np.arange(12).reshape(3, 4))
