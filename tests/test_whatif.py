"""accucmp whatif: the numpy casts equal torch's `.to(dtype)` bit for bit on each format's
edges, the predicted shares equal the shares counted on real casts, and the command works
on real dumps (a clear one-line error on a statistics-only one)."""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest
import torch

from accucmp import numformats as NF
from accucmp import whatif as W
from tests._cli_helpers import Op, write_dump
from typer.testing import CliRunner

import npu_dumper
from accucmp.cli.main import app

TORCH = {name: getattr(torch, f.torch_name) for name, f in NF.FORMATS.items()}


def edge_values(fmt: NF.Format, rng) -> np.ndarray:
    """float32 values on and around every edge of the format, both signs."""
    sub, mn, mx = fmt.min_subnormal, fmt.min_normal, fmt.max_finite
    ulp_max = math.ldexp(1.0, math.frexp(mx)[1] - 1 - fmt.man_bits)
    base = [0.0, sub, sub / 2, sub / 2 * 1.0000001, sub / 2 * 0.9999999, sub * 1.5, sub * 2.5, sub / 4,
            mn, mn - sub, mn - sub / 2, mn * (1 - 1e-7), mx, mx + ulp_max / 2, mx + ulp_max / 2 * 0.999999,
            mx + ulp_max / 2 * 1.000001, mx * 2, mx * 1e3, 1.0, 1.0 + math.ldexp(1.0, -fmt.man_bits - 1),
            1.0 + 3 * math.ldexp(1.0, -fmt.man_bits - 1), math.inf, math.nan, 3.4e38, 1e-45, 1.17549435e-38]
    # all ties and near-ties over the whole range of the format
    exps = rng.integers(fmt.emin - fmt.man_bits - 2, math.frexp(mx)[1] + 1, 4000)
    mant = rng.integers(0, 1 << (fmt.man_bits + 2), 4000)
    ties = np.ldexp((1 << (fmt.man_bits + 2)) + mant, exps - fmt.man_bits - 2)
    rand = rng.standard_normal(4000) * np.exp2(rng.uniform(fmt.emin - fmt.man_bits - 3, math.log2(mx) + 2, 4000))
    with np.errstate(over="ignore"):   # 2*max of bf16 is inf in float32, as intended
        v = np.concatenate([np.array(base), ties, rand]).astype(np.float32)
    return np.concatenate([v, -v])


@pytest.mark.parametrize("name", list(NF.FORMATS))
def test_round_to_equals_torch_cast_bitwise(name):
    fmt = NF.FORMATS[name]
    x = edge_values(fmt, np.random.default_rng(0))
    ours = NF.round_to(x.astype(np.float64), fmt)
    theirs = torch.from_numpy(x).to(TORCH[name]).to(torch.float64).numpy()
    assert np.array_equal(np.isnan(ours), np.isnan(theirs))
    ok = ~np.isnan(ours)
    bad = np.flatnonzero(ok & (ours != theirs))
    assert bad.size == 0, [(float(x[i]), ours[i], theirs[i]) for i in bad[:5]]
    # signs of zeros too (-tiny -> -0.0)
    assert np.array_equal(np.signbit(ours[ok]), np.signbit(theirs[ok]))


@pytest.mark.parametrize("name", list(NF.FORMATS))
def test_predicted_shares_equal_shares_of_real_casts(name):
    fmt = NF.FORMATS[name]
    x = edge_values(fmt, np.random.default_rng(1))
    (row,) = W.analyze_tensor(np.array_split(x, 7), x.shape, [name])
    y = torch.from_numpy(x).to(TORCH[name]).to(torch.float64).numpy()
    xd = x.astype(np.float64)
    nz = np.isfinite(xd) & (xd != 0)
    n = nz.sum()
    assert row["nonzero"] == n and row["nonfinite"] == (~np.isfinite(xd)).sum()
    assert row["underflow_share"] == (y[nz] == 0).sum() / n
    assert row["subnormal_share"] == ((y[nz] != 0) & (np.abs(y[nz]) < fmt.min_normal)).sum() / n
    if fmt.saturates:  # the value moved to +-max although a wider format would have rounded it elsewhere
        over = np.abs(xd[nz]) >= fmt.overflow_threshold
        assert (np.abs(y[nz][over]) == fmt.max_finite).all()
    else:
        over = np.isinf(y[nz])
    assert over.any() and row["overflow_share"] == over.sum() / n
    keep = np.ones_like(over) if fmt.saturates else ~over   # a saturated value still counts
    rel = (y[nz][keep] - xd[nz][keep]) / xd[nz][keep]
    assert row["rms_rel_error"] == pytest.approx(math.sqrt(np.mean(rel ** 2)), rel=1e-12)


def torch_mxfp8(x: torch.Tensor) -> torch.Tensor:
    """Reference MXFP8 quantize-dequantize in torch (OCP MX v1.0, e4m3 elements)."""
    b = x.reshape(-1, 32).to(torch.float64)
    amax = b.abs().amax(dim=1, keepdim=True)
    e = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 8, torch.full_like(amax, -127)).clamp(-127, 127)
    scale = torch.exp2(e)
    return ((b / scale).to(torch.float32).to(torch.float8_e4m3fn).to(torch.float64) * scale).reshape(x.shape)


def test_mxfp8_matches_torch_reference_and_reports_block_loss():
    rng = np.random.default_rng(2)
    rows = []
    rows.append(np.zeros(32))                                       # all-zero block
    rows.append(np.r_[1000.0, np.full(31, 1000.0 * 2 ** -20)])      # small values lost to the big one's scale
    rows.append(np.r_[511.0, 1.0, np.full(30, 2.0 ** -9)])          # 511 -> scale 2^0, saturates at 448
    rows.append(rng.standard_normal(32) * 2.0 ** -130)              # tiny block: scale clamps at 2^-127
    rows.append(np.r_[2.0 ** -30, np.zeros(31)])                    # one nonzero value
    rows += list(rng.standard_normal((11, 32)) * np.exp2(rng.uniform(-20, 20, (11, 1))))
    x = np.stack(rows).astype(np.float32).reshape(4, 128)
    ref = torch_mxfp8(torch.from_numpy(x)).numpy().reshape(-1, 32)
    (row,) = W.analyze_tensor([x.reshape(-1)], x.shape, ["mxfp8"])
    blocks = x.astype(np.float64).reshape(-1, 32)
    ours = NF.mx_quantize(blocks)
    assert np.array_equal(ours, ref)
    nz = blocks != 0
    lost = nz & (ref == 0)
    assert row["mx_blocks"] == 16
    assert row["mx_lost_share"] == lost.sum() / nz.sum() > 0
    assert row["mx_worst_block_lost_share"] == pytest.approx(31 / 32)        # the second block
    assert row["mx_worst_block_range_binades"] == pytest.approx(20.0)
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    scale = np.exp2(np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1))) - 8, -127))
    clamped = nz & (np.abs(blocks) / scale >= 464) & (np.abs(ref) == 448 * scale)     # saturated elements
    assert clamped[2, 0] and row["overflow_share"] == clamped.sum() / nz.sum()
    assert ref[2, 0] == 448.0


def test_mxfp8_saturation_error_is_below_one_eighth():
    """docs/WHATIF.md, MXFP8 (issue 35 item 5): with the scale 2^(floor(log2 amax) - 8) the
    block maximum lands in [256, 512); e4m3's quantum there is 32, so [464, 512) would round
    to 480 > 448 and saturates to 448: off by (x - 448)/x, from 16/464 = 3.4 % up to, never
    reaching, 64/512 = 12.5 %. A block of values just below 512 x scale is saturated whole
    and its rms_rel_error approaches 1/8 (the old doc said "at most 3.5 %")."""
    scaled = np.array([464.0, 481.0, 496.0, 511.0, 511.99])
    for s in scaled:
        block = np.full((1, 32), s * 2.0 ** -9)                       # scale 2^-9: x/scale = s
        q = NF.mx_quantize(block)
        assert q[0, 0] == 448 * 2.0 ** -9
        err = (block[0, 0] - q[0, 0]) / block[0, 0]
        assert err == pytest.approx(1 - 448 / s) and err < 0.125
    x = np.full(64, 511.99 * 2.0 ** -9, np.float32)
    (row,) = W.analyze_tensor([x], x.shape, ["mxfp8"])
    assert row["overflow_share"] == 1.0
    assert 0.12 < row["rms_rel_error"] < 0.125
    # the tensor: amax 0.94 -> 481 x scale -> 448, 6.9 % off
    assert (0.94 - NF.mx_quantize(np.full((1, 32), 0.94))[0, 0]) / 0.94 == pytest.approx(1 - 448 / 481.28, rel=1e-3)


def test_mxfp8_pads_rows_not_multiple_of_32():
    x = np.r_[np.full(40, 1.0), np.full(40, 2.0 ** -20)].astype(np.float32).reshape(2, 40)
    (row,) = W.analyze_tensor([x.reshape(-1)], x.shape, ["mxfp8"])
    assert row["mx_blocks"] == 4 and row["mx_lost_share"] == 0.0


def test_scale_exists_only_when_the_range_fits():
    fp16 = NF.FORMATS["fp16"]
    k = NF.best_scale_log2(1e6, 1e-3, fp16)
    assert k is not None and 1e6 * 2.0 ** k <= 65504 and NF.round_to(np.array([1e-3 * 2.0 ** k]), fp16)[0] != 0
    assert NF.round_to(np.array([1e6 * 2.0 ** (k + 1)]), fp16)[0] == np.inf          # k is the largest
    assert NF.best_scale_log2(1e6, 1e-9, fp16) is None                                # 50 binades > fp16's 40
    # the edges: amax exactly max finite keeps k = 0
    assert NF.best_scale_log2(65504.0, 1.0, fp16) == 0


def test_whatif_command_on_a_dump(tmp_path):
    from tests._cli_helpers import model_ops

    from accucmp.cli.main import app
    from typer.testing import CliRunner

    ops = model_ops()
    ops.append(Op("aten.mul.Tensor", len(ops) + 1, inputs={"self": np.full((2, 64), 1e-9, np.float32)},
                  outputs={"result": np.full((2, 64), 1e6, np.float32)}, phase="backward", module="head"))
    dump = write_dump(tmp_path / "d.h5", ops)
    res = CliRunner().invoke(app, ["whatif", dump, "--dtype", "fp16,mxfp8", "-out", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    (csv_path,) = (tmp_path / "o").glob("whatif_*.csv")
    rows = list(csv.DictReader(open(csv_path)))
    assert {r["format"] for r in rows} == {"fp16", "mxfp8"} and len(rows) % 2 == 0
    bad = [r for r in rows if r["op"] == "aten.mul.Tensor" and r["format"] == "fp16"]
    assert {(r["io"], r["phase"], float(r["underflow_share"]), float(r["overflow_share"])) for r in bad} == {
        ("input", "gradient", 1.0, 0.0), ("output", "gradient", 0.0, 1.0)}
    assert "aten.mul.Tensor" in res.output and "gradient" in res.output


def test_whatif_on_statistics_only_dump_is_one_line_error(tmp_path):
    import npu_dumper
    from accucmp.cli.main import app
    from typer.testing import CliRunner

    path = tmp_path / "s.h5"
    with npu_dumper.dumper(use_dump=True, dump_path=str(path), stats_only=True):
        torch.ones(4) * 2
    res = CliRunner().invoke(app, ["whatif", str(path)])
    assert res.exit_code == 2
    err = res.output.strip().splitlines()
    assert len(err) == 1 and "statistics-only" in err[0] and "s.h5" in err[0]


def test_whatif_bad_dtype_is_usage_error(tmp_path):
    from accucmp.cli.main import app
    from typer.testing import CliRunner

    dump = write_dump(tmp_path / "d.h5", [Op("aten.relu.default", 1, inputs={"self": np.ones(3, np.float32)},
                                               outputs={"result": np.ones(3, np.float32)})])
    res = CliRunner().invoke(app, ["whatif", dump, "--dtype", "fp4"])
    assert res.exit_code == 2 and "fp4" in res.output


def test_whatif_does_not_import_torch(tmp_path):
    import subprocess
    import sys

    dump = write_dump(tmp_path / "d.h5", [Op("aten.relu.default", 1, inputs={"self": np.ones(3, np.float32)},
                                               outputs={"result": np.ones(3, np.float32)})])
    code = ("import sys\nfrom accucmp.cli.main import main\ntry:\n    main(['whatif', sys.argv[1], '-out', sys.argv[2], '-q'])\n"
            "except SystemExit as e:\n    assert not e.code, e.code\nassert 'torch' not in sys.modules\n")
    r = subprocess.run([sys.executable, "-c", code, dump, str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# ---- statistics-only dumps: histograms of log2|x| (stats_histogram=True) ------------------
def _frexp_hist(t):
    a = (t.abs() if t.is_complex() else t).double()
    a = a[torch.isfinite(a) & (a != 0)].abs()
    e = (torch.frexp(a).exponent - 1).numpy()
    u, c = np.unique(e, return_counts=True)
    out = np.empty(2 * len(u), dtype=np.int64)
    out[0::2], out[1::2] = u, c
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                   torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64])
def test_log2_histogram_counts_every_finite_nonzero_exponent(dtype):
    from npu_dumper.capture.tensor_hist import log2_histogram

    x = torch.randn(2000, generator=torch.Generator().manual_seed(3)) * torch.logspace(-44, 37, 2000)
    x[::97] = 0.0
    x[5], x[7], x[9] = float("nan"), float("inf"), -float("inf")
    x[11] = 1e-45                                         # a float32 subnormal
    t = torch.complex(x, 0.5 * x).to(dtype) if dtype.is_complex else x.to(dtype)
    assert np.array_equal(log2_histogram(t), _frexp_hist(t))
    assert np.array_equal(log2_histogram(t.reshape(40, 50).t()), _frexp_hist(t))   # any layout
    assert log2_histogram(torch.arange(5)).size == 0


def _step(path, **kw):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64))
    x = torch.randn(32, 64) * 3e3                      # fp16 overflows in the activations
    with npu_dumper.dumper(use_dump=True, dump_path=str(path), **kw):
        (m(x) * 1e-4).square().mean().backward()       # small gradients: underflow in fp8/fp16


def test_whatif_of_a_statistics_dump_agrees_with_the_values(tmp_path):
    from accucmp.whatif import SOURCE_HISTOGRAM, run_whatif

    _step(tmp_path / "full.h5")
    _step(tmp_path / "stats.h5", stats_only=True, stats_histogram=True)
    formats = ["bf16", "fp16", "fp8_e4m3", "fp8_e5m2"]
    _, full = run_whatif(tmp_path / "full.h5", formats, tmp_path / "a")
    _, hist = run_whatif(tmp_path / "stats.h5", formats, tmp_path / "b")
    key = lambda r: (r["op"], r["seqid"], r["io"], r["name"], r["format"])   # noqa: E731
    by_key = {key(r): r for r in hist}
    assert len(full) == len(hist) > 100 and set(by_key) == {key(r) for r in full}
    overflowing = underflowing = 0
    for v in full:
        h = by_key[key(v)]
        assert h["source"] == SOURCE_HISTOGRAM and h["nonzero"] == v["nonzero"]
        assert h["underflow_share"] == v["underflow_share"]                       # exact
        assert h["overflow_share"] <= v["overflow_share"] <= h["overflow_share_max"]
        assert h["subnormal_share"] >= v["subnormal_share"]                       # upper bound
        assert h["subnormal_share"] - v["subnormal_share"] <= 0.1   # the round-up sliver of one binade
        if v["rms_rel_error"] > 0:
            assert 0.4 < h["rms_rel_error"] / v["rms_rel_error"] < 2.5            # an estimate
        overflowing += v["overflow_share"] > 0
        underflowing += v["underflow_share"] > 0
    assert overflowing and underflowing                  # the step reaches both edges


def test_whatif_of_a_statistics_dump_without_histograms_is_one_line(tmp_path):
    _step(tmp_path / "stats.h5", stats_only=True)
    r = CliRunner().invoke(app, ["whatif", str(tmp_path / "stats.h5"), "-out", str(tmp_path / "o")])
    assert r.exit_code == 2
    assert len(r.output.strip().splitlines()) == 1 and "stats_histogram=True" in r.output
    with pytest.raises(npu_dumper.DumperError, match="stats_only"):
        npu_dumper.dumper(use_dump=True, dump_path=str(tmp_path / "x.h5"), stats_histogram=True)
