"""Values reached through a view entry (Type 40) keep every stored bit: the view is cut
from the stored codes and decoded afterwards (issue 16), so bfloat16 NaN payloads and
float8 codes come out as stored, through the reader and through `accucmp extract`."""

from __future__ import annotations

import numpy as np
from typer.testing import CliRunner

from accucmp.cli.main import app
from dumpfile import DumpFile, DumpWriter, TensorMeta

# bfloat16 codes: quiet NaN with payloads, a signalling-pattern NaN, -NaN, inf, 1.0, -0.0
BF16 = np.array([[0x7FC1, 0x7F81, 0xFFC3, 0x7F80],
                 [0x3F80, 0x8000, 0x7FFF, 0x0001]], dtype=np.uint16)
# float8_e5m2 codes: NaNs with different mantissas, inf, a subnormal
F8 = np.array([[0x7D, 0x7E, 0xFF, 0x7C], [0x3C, 0x80, 0x7F, 0x01]], dtype=np.uint8)


def _dump(path) -> str:
    with DumpWriter(path) as w:
        g = w.begin_op("aten.mul.Tensor", 1)
        b16 = w.write_tensor(g["output"], "result", BF16, TensorMeta("bfloat16", (2, 4), (4, 1)))
        b8 = w.write_tensor(g["output"], "f8", F8, TensorMeta("float8_e5m2", (2, 4), (4, 1)))
        w.end_op()
        g = w.begin_op("aten.t.default", 2)
        # the transpose, and a strided 2-element slice starting at storage offset 1
        w.write_view(g["input"], "self", b16, TensorMeta("bfloat16", (4, 2), (1, 4)))
        w.write_view(g["input"], "cut", b16, TensorMeta("bfloat16", (2,), (2,), storage_offset=1))
        w.write_view(g["input"], "f8", b8, TensorMeta("float8_e5m2", (4, 2), (1, 4)))
        w.end_op()
    return str(path)


def test_bf16_view_keeps_nan_payloads(tmp_path):
    with DumpFile(_dump(tmp_path / "v.h5")) as f:
        ins = f.op("aten.t.default", 2).inputs()
        got = ins["self"].read()
        assert got.dtype == np.float32 and got.shape == (4, 2)
        # bfloat16 -> float32 is exact: the upper 16 bits are the stored code
        np.testing.assert_array_equal((got.view(np.uint32) >> 16).astype(np.uint16), BF16.T)
        assert not (got.view(np.uint32) & 0xFFFF).any()
        cut = ins["cut"].read()
        np.testing.assert_array_equal((cut.view(np.uint32) >> 16).astype(np.uint16), BF16.reshape(-1)[[1, 3]])
        f8 = ins["f8"].read()
        direct = f.op("aten.mul.Tensor", 1).outputs()["f8"].read()
        np.testing.assert_array_equal(f8.view(np.uint32), direct.T.view(np.uint32))


def test_extract_materialises_views_with_the_stored_codes(tmp_path):
    src = _dump(tmp_path / "v.h5")
    out = tmp_path / "x.h5"
    r = CliRunner().invoke(app, ["extract", "-i", src, "-o", str(out), "-s", "/aten.t.default/2/"])
    assert r.exit_code == 0, r.output
    import h5py
    with h5py.File(out) as h:
        np.testing.assert_array_equal(h["/aten.t.default/2/input/self"][()], BF16.T)
        np.testing.assert_array_equal(h["/aten.t.default/2/input/f8"][()], F8.T)
