"""Load-replay's low-level index (npu_dumper.replay.index) reads what DumpFile reads, and
replay's zero-copy tensors (mapped from the load file) never write into it."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

import npu_dumper
from dumpfile import schema as S
from dumpfile.read.reader import DumpFile
from npu_dumper.replay.load_replay import ReplayPolicy
from npu_dumper.replay.matching import recorded_key as _recorded_key
from npu_dumper.replay.index import read_group


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(300, 300)       # 360 KB weight: read through the mapping
        self.norm = torch.nn.LayerNorm(300)

    def forward(self, x):
        h = torch.cat([self.lin(x), x.t().t()], dim=0)          # a tensor list
        h = torch.nn.functional.gelu(h).sum(dim=[0], keepdim=True)  # int list, bool
        h = h.to(torch.float64).to(torch.float32)                # dtype arguments
        return self.norm(h * 0.5 + x[:1])                        # scalars, views


def _dump(path):
    model = _Net()
    x = torch.randn(8, 300, generator=torch.Generator().manual_seed(1), requires_grad=True)
    with npu_dumper.dumper(use_dump=True, dump_path=str(path)):
        model(x).square().sum().backward()
    return model, x


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(np.asarray(a), np.asarray(b))
    return a == b


def _check(fast, slow, seen_kinds):
    assert fast.path == slow.path and fast.type == slow.type
    seen_kinds.add(fast.type)
    for k, v in fast.attrs.items():
        assert _same(v, slow.attrs[k]), (fast.path, k)
    for k in (S.ATTR_TYPE, S.ATTR_DTYPE, S.ATTR_SHAPE, S.ATTR_STRIDE, S.ATTR_STORAGE_OFFSET, S.ATTR_BASE):
        assert (k in fast.attrs) == (k in slow.attrs), (fast.path, k)
    assert _recorded_key(fast) == _recorded_key(slow)
    if not fast.is_tensor and not fast.is_list:
        assert fast.read() == slow.read() and type(fast.read()) is type(slow.read())
    assert [c.name for c in fast.children] == [c.name for c in slow.children]
    for fc, sc in zip(fast.children, slow.children):
        _check(fc, sc, seen_kinds)


def test_index_reads_what_the_reader_reads_and_links_share_identity(tmp_path):
    path = tmp_path / "ref.h5"
    _dump(path)
    kinds: set[int] = set()
    idents: dict = {}
    with DumpFile(path) as f:
        for op in f.ops():
            fast = read_group(f, f"{op.path}/{S.INPUT_GROUP}")
            slow = op.inputs()
            assert list(fast) == list(slow)          # argument order kept
            for name in fast:
                _check(fast[name], slow[name], kinds)
                leaves = fast[name].children if fast[name].is_list else [fast[name]]
                for leaf in leaves:
                    if leaf.is_tensor:
                        assert leaf.ident[0] == hash(f.h5[leaf.path].id)
                        idents.setdefault(leaf.ident, set()).add(hash(f.h5[leaf.path].id))
    assert {S.TYPE_TENSOR, S.TYPE_TENSOR_LIST, S.TYPE_SCALAR_TYPE, S.TYPE_BOOL, S.TYPE_DOUBLE} <= kinds
    assert kinds & {S.TYPE_INT_LIST, S.TYPE_INT_ARRAY_REF}
    # one identity per stored object: hard links to one dataset are one entry
    assert all(len(v) == 1 for v in idents.values())


def test_mapped_recorded_tensors_are_bit_exact_and_leave_the_load_file_untouched(tmp_path):
    ref = tmp_path / "ref.h5"
    model, x = _dump(ref)
    before = hashlib.sha256(ref.read_bytes()).hexdigest()
    policy = ReplayPolicy(ref, verbose=False, prefetch_ops=0)
    policy.begin()
    try:
        assert policy._tensors._mapping
        w = next(r for e in policy._order for r in e.inputs.values()
                 if r.is_tensor and r.numel == 300 * 300 and r.type == S.TYPE_TENSOR
                 and getattr(r, "file_offset", None) is not None)
        t = policy._load(w)
        expect = torch.from_numpy(np.asarray(w.read()))
        assert torch.equal(t.reshape(expect.shape), expect)
        t.add_(1.0)                     # a write into a handed-on tensor stays private
        assert policy._load(w) is t     # one tensor per stored object
    finally:
        policy.end()
    assert hashlib.sha256(ref.read_bytes()).hexdigest() == before


def test_live_input_is_kept_only_when_its_bits_equal_the_recording():
    from npu_dumper.replay.layout import bitwise_equal

    a = torch.randn(64, 32)
    assert bitwise_equal(a, a.clone())
    assert bitwise_equal(a.t(), a.t().contiguous())          # layouts differ, values equal
    assert not bitwise_equal(torch.zeros(3), -torch.zeros(3))  # equal as numbers, not as bits
    nan = torch.tensor([float("nan"), 1.0])
    assert bitwise_equal(nan, nan.clone())                   # the same NaN bits
    assert not bitwise_equal(a, a.to(torch.float64).to(torch.float32).to(torch.bfloat16))
    b = a.clone()
    b[-1, -1] = torch.nextafter(b[-1, -1], torch.tensor(1e9))  # one ulp, in the last element
    assert not bitwise_equal(a, b)


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "offset", "gappy", "bf16"])
def test_bitwise_equal_finds_a_difference_anywhere_in_any_layout(layout):
    """The memcmp path (both tensors laid out alike over a dense span) and the torch.equal
    path (gaps between elements) see a one-ulp change at any element, and nothing outside
    the tensor's elements (the gaps, the storage before its offset) counts."""
    from npu_dumper.replay.layout import bitwise_equal

    def make(base):
        if layout == "transposed":
            return base.t()
        if layout == "offset":
            return base.view(-1)[5:].view(-1)[:200]
        if layout == "gappy":
            return base[:, ::2]
        if layout == "bf16":
            return base.to(torch.bfloat16)
        return base

    base = torch.randn(24, 16, generator=torch.Generator().manual_seed(0))
    a, b = make(base), make(base.clone())
    assert bitwise_equal(a, b)
    other = base.clone()
    if layout == "gappy":
        other[:, 1::2] += 1.0           # only the gaps differ
        assert bitwise_equal(a, make(other))
    if layout == "offset":
        other.view(-1)[:5] += 1.0       # only the storage before the offset differs
        assert bitwise_equal(a, make(other))
    for flat in (0, 77, a.numel() - 1):
        c = make(base.clone())
        idx = torch.unravel_index(torch.tensor(flat), c.shape)
        v = c[idx]
        # one ulp in float32; bf16: the sign bit (-0.0 differs from 0.0 too)
        c[idx] = torch.nextafter(v, torch.tensor(1e9)) if layout != "bf16" else -v
        assert not bitwise_equal(a, c), flat
