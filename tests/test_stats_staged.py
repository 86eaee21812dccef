"""The statistics writer's batch path on real data: small dense tensors staged by their
bytes (TensorCapture.take_bytes) and reduced row-wise, the reference's later tiers for many
rows at once, and the row cells kept per description. Every recorded number is checked
against an independent float64 computation (numpy) of the tensor as the op saw it, and
bit for bit against the per-tensor reference."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch
import xxhash
from torch.utils._python_dispatch import _disable_current_modes

import npu_dumper
from dumpfile import DumpFile
from dumpfile import schema as S
from npu_dumper.capture.tensor_stats import rows_stats, tensor_stats


def _bits(row) -> list:
    return [struct.pack("<d", x) if x == x else "nan" for x in row]


def _independent(t: torch.Tensor) -> dict:
    """min/max/mean/std/norm of the finite values, NaN/Inf counts, numel: numpy, float64."""
    a = t.detach().to(torch.float64).numpy().reshape(-1) if not t.is_complex() else \
        t.detach().abs().to(torch.float64).numpy().reshape(-1)
    fin = a[np.isfinite(a)]
    out = {"nan_count": float(np.isnan(a).sum()), "inf_count": float(np.isinf(a).sum()),
           "numel": float(a.size)}
    if fin.size:
        out.update({"min": fin.min(), "max": fin.max(), "mean": fin.mean(),
                    "std": fin.std(ddof=1) if fin.size > 1 else 0.0,
                    "norm": math.sqrt(float((fin * fin).sum()))})
    return out


def _assert_matches(got: dict, t: torch.Tensor, where) -> None:
    want = _independent(t)
    for k in ("nan_count", "inf_count", "numel", "min", "max"):
        if k in want:
            assert got[k] == want[k], (where, k, got[k], want[k])
    scale = max(abs(want.get("mean", 0.0)), want.get("std", 0.0), 1e-30)
    for k in ("mean", "std"):
        if k in want:
            assert abs(got[k] - want[k]) <= 1e-6 * scale, (where, k, got[k], want[k])
    if "norm" in want:
        assert got["norm"] == pytest.approx(want["norm"], rel=1e-6), (where, got["norm"], want["norm"])


def _storage_bytes(t: torch.Tensor) -> bytes:
    # the content hash's bytes: the elements in storage order (dense tensors)
    order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), -t.shape[d]))
    p = t.permute(order)
    p = p if p.is_contiguous() else t.contiguous()
    return p.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_later_tiers_of_many_rows_are_bit_identical_to_the_reference(dtype):
    # constant rows (BatchNorm weights), tiny spread against the mean (second and third
    # tier), signed zeros, NaN/Inf rows and ordinary rows, all in one matrix
    g = torch.Generator().manual_seed(5)
    for n in (2, 3, 17, 256, 1000, 4097):
        rows = [torch.ones(n), torch.zeros(n), -torch.zeros(n), torch.full((n,), -3.25),
                torch.randn(n, generator=g) * 1e-3 + 5, torch.randn(n, generator=g) * 1e-2 + 1,
                torch.randn(n, generator=g).double() * 1e-5 + 3, torch.rand(n, generator=g) * 0.3 + 1,
                torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e20 + 1e22]
        bad = torch.randn(n, generator=g)
        bad[n // 2] = float("nan")
        rows.append(bad)
        m = torch.stack([r.to(dtype) for r in rows])
        for i, got in enumerate(rows_stats(m)):
            assert _bits(got) == _bits(tensor_stats(m[i].clone())), (n, i, got, tensor_stats(m[i].clone()))


def test_staged_statistics_are_the_op_time_values_of_each_tensor(tmp_path):
    # many tensors of one dtype and size (one staged matrix: rows mixed up between tensors
    # would fail), transposed and sliced ones, other dtypes, and an input overwritten in
    # place right after the op that read it (the writer must record the value before)
    from npu_dumper.capture.tensor_hash import content_hash
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(16, 24, generator=g) * (i + 1) + i for i in range(60)]
    extra = [torch.randn(24, 16, generator=g).t(), torch.randn(16, 48, generator=g)[:, ::2],
             torch.randn(30, generator=g).to(torch.bfloat16), torch.arange(50, dtype=torch.int32),
             torch.full((40,), 2.5), torch.randn(33, generator=g) > 0]
    seen = []
    p = tmp_path / "s.h5"
    with npu_dumper.dumper(use_dump=True, dump_path=str(p), stats_only=True) as d:
        for x in xs + extra:
            y = x * 3 if x.dtype != torch.bool else x.logical_not()
            with _disable_current_modes():          # (not recorded)
                seen.append((x.clone(), x.stride(), y))
            if x.dtype in (torch.float32, torch.int32):
                x.add_(1)                          # writes the input just recorded
    assert d._writer.num_batched > 60
    with DumpFile(p) as f:
        ops = [o for o in sorted(f.ops(), key=lambda o: o.seqid) if o.op in
               ("aten.mul.Tensor", "aten.logical_not.default")]
        assert len(ops) == len(seen)
        for o, (x, stride, y) in zip(ops, seen):
            rx, ry = o.inputs()["self"], o.outputs()["result"]
            for rec, t in ((rx, x), (ry, y)):
                got = rec.stats()
                _assert_matches(got, t, (o.op, o.seqid, rec.name))
                assert _bits([got[k] for k in S.STATS_FIELDS]) == _bits(tensor_stats(t)), (o.seqid, rec.name)
            # the hash is of the bytes the op saw, in storage order
            x_as_seen = torch.empty_strided(x.shape, stride, dtype=x.dtype).copy_(x)
            assert rx.stats()["hash"] == xxhash.xxh3_64_intdigest(_storage_bytes(x_as_seen))
            assert rx.stats()["hash"] == content_hash(x_as_seen)
            assert ry.stats()["hash"] == content_hash(y)


def test_large_tensors_read_from_their_storage_are_the_values_the_op_saw(tmp_path):
    # tensors of 32k elements and more go one by one; a dense one held as its storage is
    # reduced as a 1-d tensor over its elements and hashed from its bytes: a transposed
    # tensor, a slice at an offset, bfloat16, int32, NaN/Inf, a constant (the later tiers);
    # then each again, written in place right after the op (the numbers must be the op's)
    from npu_dumper.capture.tensor_hash import content_hash
    g = torch.Generator().manual_seed(11)
    big = torch.randn(263, 160, generator=g)
    nan = torch.randn(200, 200, generator=g)
    nan[3, 7], nan[50, 1] = float("nan"), float("inf")
    xs = [torch.randn(160, 256, generator=g).t(), big[7:], (torch.randn(300, 120, generator=g) * 3 + 1)
          .to(torch.bfloat16), torch.arange(-20000, 20000, dtype=torch.int32).view(200, 200),
          nan, torch.full((40000,), 0.1), torch.randn(256, 256, generator=g) * 1e-3 + 7.0]
    seen = []
    p = tmp_path / "big.h5"
    with npu_dumper.dumper(use_dump=True, dump_path=str(p), stats_only=True):
        for written in (False, True):
            for x in xs:
                y = x * 3
                with _disable_current_modes():      # (not recorded)
                    seen.append((x.clone(), x.stride(), y))
                if written:
                    x.add_(1)                      # writes the input just recorded
    with DumpFile(p) as f:
        ops = [o for o in sorted(f.ops(), key=lambda o: o.seqid) if o.op == "aten.mul.Tensor"]
        assert len(ops) == len(seen) == 2 * len(xs)
        for o, (x, stride, y) in zip(ops, seen):
            rx, ry = o.inputs()["self"], o.outputs()["result"]
            for rec, t in ((rx, x), (ry, y)):
                got = rec.stats()
                _assert_matches(got, t, (o.seqid, rec.name))
                assert _bits([got[k] for k in S.STATS_FIELDS]) == _bits(tensor_stats(t)), (o.seqid, rec.name)
            x_as_seen = torch.empty_strided(x.shape, stride, dtype=x.dtype).copy_(x)
            assert rx.stats()["hash"] == xxhash.xxh3_64_intdigest(_storage_bytes(x_as_seen))
            assert ry.stats()["hash"] == content_hash(y)


def test_value_rows_kept_per_value_are_the_values_each_op_had(tmp_path):
    # one op, one argument name, values that compare equal but are different rows
    # (1, 1.0, True; 0.0 and -0.0), repeated so that the kept rows are used
    values = [1, 1.0, True, 0.0, -0.0, 2, float("inf"), 1, 1.0, True, -0.0, 0.0, 2]
    p = tmp_path / "v.h5"
    with npu_dumper.dumper(use_dump=True, dump_path=str(p), stats_only=True):
        for v in values:
            torch.full((3,), v)
    with DumpFile(p) as f:
        fulls = [o for o in sorted(f.ops(), key=lambda o: o.seqid) if o.op == "aten.full.default"]
        assert len(fulls) == len(values)
        for o, v in zip(fulls, values):
            got = o.inputs()["fill_value"].read()
            assert type(got) is type(v) and got == v, (o.seqid, got, v)
            if isinstance(v, float) and v == 0:
                assert math.copysign(1.0, got) == math.copysign(1.0, v)
            out = o.outputs()["result"].stats()
            if math.isinf(v):
                assert out["inf_count"] == 3
            else:
                assert out["max"] == float(v) and out["inf_count"] == 0
