"""The writer's attribute path (dumpfile.write.writer.set_attrs over dumpfile.h5direct) makes the
attributes h5py's `attrs[k] = v` makes: same values, numpy dtypes and HDF5 type classes,
with the direct C calls and without them, and h5py's errors where HDF5 refuses."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from dumpfile import h5direct
from dumpfile.write.writer import set_attrs

VALUES = {
    "int": 7, "neg": -3, "big": 2**62, "float": 1.5, "nan": float("nan"), "bool": True,
    "np_int32": np.int32(5), "np_f16": np.float16(0.25), "uint8": np.uint8(200),
    "text": "AddmmBackward0", "unicode": "层.3 – ünïcode", "empty_text": "",
    "stride": np.array([1024, 1], dtype=np.int64),
    "shape0": np.zeros(0, dtype=np.int64), "matrix": np.arange(6.0).reshape(2, 3),
    "bools": np.array([True, False]),
}


def _described(obj: h5py.HLObject) -> dict:
    out = {}
    for k in obj.attrs:
        aid = obj.attrs.get_id(k)
        v = obj.attrs[k]
        out[k] = (repr(v.tolist() if isinstance(v, np.ndarray) else v), str(aid.dtype),
                  aid.shape, aid.get_type().get_class())
    return out


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "h5py-only"])
def test_set_attrs_matches_h5py_attribute_assignment(tmp_path, monkeypatch, direct):
    if direct and not h5direct.available():
        pytest.skip("the HDF5 library is not reachable through ctypes here")
    if not direct:
        monkeypatch.setattr(h5direct, "_LIB", None)
    with h5py.File(tmp_path / "a.h5", "w") as f:
        ours, ref = f.create_group("ours"), f.create_group("ref")
        set_attrs(ours, VALUES, fresh=True)
        for k, v in VALUES.items():
            ref.attrs[k] = v
        assert _described(ours) == _described(ref)
        assert ours.attrs["unicode"] == "层.3 – ünïcode"
        # a C string would end at the NUL: refused as h5py refuses it, never cut short
        with pytest.raises(ValueError, match="NULL"):
            set_attrs(ours, {"nul_text": "a\0b"}, fresh=True)
        with pytest.raises(UnicodeEncodeError):
            set_attrs(ours, {"surrogate": "bad\udcff"}, fresh=True)


def test_an_attribute_that_exists_is_overwritten_not_left_half_made(tmp_path):
    with h5py.File(tmp_path / "a.h5", "w") as f:
        g = f.create_group("g")
        g.attrs["seqid"] = 1
        # `fresh` promised wrongly: HDF5 refuses the create; h5py's path overwrites
        set_attrs(g, {"phase": "forward", "seqid": 2, "module": "layers.0"}, fresh=True)
        assert (g.attrs["phase"], g.attrs["seqid"], g.attrs["module"]) == ("forward", 2, "layers.0")


def test_a_refused_write_raises_h5py_error_instead_of_passing_silently(tmp_path):
    p = tmp_path / "ro.h5"
    with h5py.File(p, "w") as f:
        f.create_group("g")
    with h5py.File(p, "r") as f:
        with pytest.raises((OSError, KeyError, RuntimeError)):
            set_attrs(f["g"], {"seqid": 3}, fresh=True)
        assert "seqid" not in f["g"].attrs
