"""Complex tensors in full dumps: compare counts a complex element once.

TensorComparison feeds complex values as interleaved (re, im) float64 pairs, so its element
count was twice the shape's: every complex tensor of a full dump came out as
'read 2N elements, shape says N' (corrupt), the same run against itself failed, and
a fault in an FFT op could not be told from that."""

from __future__ import annotations

import pytest

from accucmp.compare.pipeline import compare_dumps
from accucmp.compare.verdict import apply_verdict
from accucmp.report.findings import first_failure

torch = pytest.importorskip("torch")
import npu_dumper  # noqa: E402
from npu_dumper import inject_fault  # noqa: E402


def _step(path, fault=False):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 8, generator=g, requires_grad=True)
    x = torch.randn(3, 8, generator=g)
    ctx = inject_fault("aten._fft_r2c.default", rel=0.01, call=1) if fault else None
    if ctx:
        ctx.__enter__()
    try:
        with npu_dumper.dumper(use_dump=True, dump_path=str(path)):
            y = x @ w
            f = torch.fft.rfft(y)                      # complex64 output
            z = torch.fft.irfft(f * 2, n=8)
            (z.sum() + f.abs().sum()).backward()
    finally:
        if ctx:
            ctx.__exit__(None, None, None)
    return str(path)


@pytest.mark.parametrize("chunk", [1 << 22, 4])
def test_same_run_with_complex_tensors_passes(tmp_path, chunk):
    a, b = _step(tmp_path / "a.h5"), _step(tmp_path / "b.h5")
    t = apply_verdict(compare_dumps(a, b, chunk_elements=chunk).table)
    cplx = t[t["DataType"] == "complex64"]
    assert len(cplx) >= 3
    # the destinations of copy_/fill_/zero_ (their old bytes are not read) are not data
    dest = cplx["NPUDump"].str.match(r"aten\.(copy_|fill_|zero_)\.") & (cplx["TensorName"] == "self") \
        & (cplx["IO"] == "input")
    assert (cplx[dest]["CompareStatus"] == "uninitialized").all()
    assert set(cplx[~dest]["CompareStatus"]) == {"compared"}, cplx["CompareFailReason"].tolist()
    assert (cplx[~dest]["Result"] == "pass").all()
    assert (t["Result"] != "fail").all()


def test_fault_in_a_complex_op_is_named(tmp_path):
    g, f = _step(tmp_path / "g.h5"), _step(tmp_path / "f.h5", fault=True)
    t = apply_verdict(compare_dumps(f, g).table)
    ff = first_failure(t)
    assert ff["NPUDump"] == "aten._fft_r2c.default" and ff["IO"] == "output"
    assert ff["RelativeEuclideanDistance"] == pytest.approx(0.01, rel=0.05)
