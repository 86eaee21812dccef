"""Statistics computed in batches (tensor_stats.stack_for_stats / rows_stats, the statistics
writer's path for small tensors) equal the per-tensor reference for every dtype."""

from __future__ import annotations

import math

import pytest
import torch

import npu_dumper
from dumpfile import schema as S
from dumpfile import DumpFile
from npu_dumper.capture.tensor_stats import batch_tensor_stats, batchable, tensor_stats


def _same(row, want) -> bool:
    return len(row) == len(want) and all(
        a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(row, want))


def _mixed() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ts = []
    for n in (2, 5, 96, 1000):
        for _ in range(3):
            base = torch.randn(n, generator=g) * 4 + 1
            ts += [base.to(torch.bfloat16), base.to(torch.float16), base.double(),
                   (base * 100).to(torch.int64), (base * 10).to(torch.int32),
                   (base * 10).to(torch.int8), base.abs().mul(20).to(torch.uint8), base > 1,
                   torch.complex(base, base.flip(0)), base.clone()]
    ts += [
        torch.randn(6, 8, generator=g).to(torch.bfloat16).t(),         # transposed
        torch.randn(6, 8, generator=g).to(torch.bfloat16),             # same numel, other shape
        torch.tensor([1.0, float("nan"), 2.0], dtype=torch.float16),
        torch.tensor([1.0, float("inf"), -float("inf")], dtype=torch.bfloat16),
        torch.tensor([float("nan"), float("nan")], dtype=torch.bfloat16),
        torch.tensor([1.0, float("nan")], dtype=torch.complex64),
        torch.zeros(0, dtype=torch.bfloat16), torch.zeros(0, dtype=torch.int64),
        torch.tensor(3.5, dtype=torch.float16), torch.tensor(7), torch.tensor(True),
        torch.tensor([True, True, False]), torch.full((50,), 9, dtype=torch.int16),
        torch.full((64,), 1000.0, dtype=torch.bfloat16) + torch.linspace(0, 1, 64).to(torch.bfloat16),
        torch.tensor([2**62, 2**62 - 1, -5], dtype=torch.int64),     # large, tiny spread
        torch.tensor([-0.0, 0.0, -0.0], dtype=torch.float16),
    ]
    return ts


def batch_stats_with_threads(ts: list, threads: int) -> list:
    """batch_tensor_stats(ts) computed with `threads` intra-op threads (sums over more
    than one thread are where a batch could round differently from one tensor)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return batch_tensor_stats(ts)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("threads", [1, 2])
def test_batched_statistics_equal_the_reference_for_every_dtype(threads):
    ts = _mixed()
    # the batch takes every small real dtype; complex, empty and one-element ones go alone
    for t in ts:
        real = not t.is_complex()
        assert batchable(t) == (real and t.numel() >= 2), (t.dtype, t.shape)
    for t, row in zip(ts, batch_stats_with_threads(ts, threads)):
        assert _same(row, tensor_stats(t)), (t.dtype, t.shape, row, tensor_stats(t))


def test_statistics_dump_of_mixed_dtypes_records_the_reference_numbers(tmp_path):
    # the small tensors of ops queued behind each other are batched by the statistics
    # writer (half precision, integers, bool too); it records the reference's numbers
    p = tmp_path / "m.h5"
    xs = _mixed() * 3
    with npu_dumper.dumper(use_dump=True, dump_path=str(p), stats_only=True) as d:
        for x in xs:
            x.clone()
    assert d._writer.num_batched > len(xs) // 2
    with DumpFile(p) as f:
        ops = sorted(f.ops(), key=lambda o: o.seqid)
        assert [o.op for o in ops] == ["aten.clone.default"] * len(xs)
        for o, x in zip(ops, xs):
            want = tensor_stats(x)
            for rec in (o.inputs()["self"], o.outputs()["result"]):
                got = rec.stats()
                assert _same([got[k] for k in S.STATS_FIELDS], want), (x.dtype, x.shape, got, want)


def _bits(row) -> list:
    import struct
    return [struct.pack("<d", x) if x == x else "nan" for x in row]


def test_one_element_statistics_are_bit_identical_to_the_reference():
    # the writer's shortcut for one-element tensors (Python arithmetic on .item()) against
    # tensor_stats' torch reductions, bit for bit: signed zeros, float32 rounding of the
    # square, its overflow and underflow, subnormals, large integers, NaN/Inf
    from npu_dumper.capture.tensor_stats import fast_tensor_stats
    g = torch.Generator().manual_seed(3)
    values = [0.0, -0.0, 1.0, -2.5, 3.4028234663852886e38, 1.9e19, 1.85e19, 1e-30, 1e-45, 1e-40,
              65504.0, 1e300, 1e-200, 5e-324, float("nan"), float("inf"), -float("inf")]
    values += (torch.randn(200, generator=g) * torch.logspace(-30, 30, 200)).tolist()
    ts = []
    for v in values:
        for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            ts.append(torch.tensor([v], dtype=dt))
        ts.append(torch.tensor(v, dtype=torch.float32))          # 0-d
    for v in (0, 1, -7, 255, 2**31 - 1, 2**53 + 1, 2**62 + 12345, -2**63):
        for dt in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
            try:
                ts.append(torch.tensor([v], dtype=dt))
            except RuntimeError:
                pass                                              # out of the dtype's range
    ts += [torch.tensor([True]), torch.tensor(False), torch.tensor([1 + 2j])]
    for t in ts:
        assert _bits(fast_tensor_stats(t)) == _bits(tensor_stats(t)), (t, fast_tensor_stats(t), tensor_stats(t))
