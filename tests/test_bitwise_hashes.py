"""Determinism by hashes (issue 21 item 3): statistics dumps record an XXH3-64 hash of each
tensor's bytes; `accucmp compare --bitwise` names the first op whose output bits differ and
whether its inputs already did. Checked against hashes computed here from the values a forward
hook saw and from numpy's bytes, not against the dumper's own reader alone."""

from __future__ import annotations

import h5py
import numpy as np
import pandas as pd
import pytest
import torch
import xxhash
from torch.utils._python_dispatch import TorchDispatchMode
from typer.testing import CliRunner

import npu_dumper
from accucmp.compare import bitwise
from accucmp.cli.main import app
from dumpfile import schema as S
from npu_dumper.capture.tensor_hash import content_hash
from dumpfile.read.reader import DumpFile


def _np_hash(a: np.ndarray) -> int:
    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(a).tobytes())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64,
                                   torch.bool, torch.complex64, torch.float8_e5m2])
def test_one_flipped_bit_changes_the_hash_in_every_dtype(dtype):
    x = (torch.randn(6, 5) * 3).to(dtype) if dtype != torch.bool else torch.randn(6, 5) > 0
    bits = x.clone().contiguous().view(torch.uint8).reshape(-1)
    h = content_hash(x)
    assert h == _np_hash(bits.numpy())                    # the bytes, as numpy sees them
    for byte in (0, bits.numel() // 2, bits.numel() - 1):
        for bit in (0, 7):
            flipped = bits.clone()
            flipped[byte] ^= 1 << bit
            assert content_hash(flipped.view(x.dtype).reshape(x.shape)) != h


def test_hash_is_of_the_values_the_tensor_shows():
    w = torch.randn(8, 4)
    assert content_hash(w.t()) == content_hash(w)          # storage order: W and W.t() share it
    z = torch.randn(5, dtype=torch.complex64)
    assert content_hash(z.conj()) == _np_hash(np.conj(z.numpy()))   # the conj bit resolved
    assert content_hash(w[:, 1]) == _np_hash(w.numpy()[:, 1])        # a strided view: its elements
    assert content_hash(torch.empty(0)) == xxhash.xxh3_64_intdigest(b"")
    assert content_hash(torch.tensor(2.5)) == _np_hash(np.float32(2.5))


class _FlipOneBit(TorchDispatchMode):
    """Below the dumper: flips the lowest bit of one element of the n-th `op` output, as a
    non-deterministic kernel would (the dumper records the flipped value)."""

    def __init__(self, op, nth: int):
        super().__init__()
        self.op, self.nth, self.seen = op, nth, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is self.op:
            self.seen += 1
            if self.seen == self.nth:
                out.view(-1).view(torch.int32)[3] ^= 1
        return out


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 32),
                               torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _dump(path, flip=None, hooks=None):
    model = _model()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    seen = {}
    if hooks:
        for name in hooks:
            dict(model.named_modules())[name].register_forward_hook(
                lambda m, i, o, name=name: seen.__setitem__(name, o.detach().clone()))
    import contextlib
    outer = flip if flip is not None else contextlib.nullcontext()
    with outer:
        with npu_dumper.dumper(use_dump=True, dump_path=str(path), stats_only=True):
            model(x).square().mean().backward()
    return seen


def _compare(tmp_path, target, golden, *extra):
    out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}"
    r = CliRunner().invoke(app, ["compare", "-m", str(target), "-g", str(golden), "-out", str(out), "-q", *extra])
    csvs = sorted(out.glob("result_*.csv"))
    return r, (pd.read_csv(csvs[0], dtype={"Module": str}) if csvs else None)


def test_recorded_hashes_are_of_the_values_the_op_produced(tmp_path):
    seen = _dump(tmp_path / "a.h5", hooks=["0", "2"])
    with h5py.File(tmp_path / "a.h5", "r") as f:
        assert f.attrs[S.ROOT_CONTENT_HASH] == "xxh3_64"
        assert f.attrs[S.ROOT_FORMAT_VERSION] == S.FORMAT_VERSION == "1.9"
    with DumpFile(tmp_path / "a.h5") as f:
        outs = {}
        for op in f.ops():
            if op.module in ("0", "2") and op.phase == "forward" and op.op == "aten.addmm.default":
                (rec,) = [v for v in op.outputs().values() if v.is_stats]
                outs[op.module] = rec.stats()[S.STATS_HASH_FIELD]
    assert set(outs) == {"0", "2"}
    for name, value in seen.items():                 # the forward hook's copy, hashed here
        assert outs[name] == _np_hash(value.numpy())


def test_bitwise_compare_names_the_op_where_bits_first_differ(tmp_path):
    _dump(tmp_path / "g.h5")
    _dump(tmp_path / "g2.h5")
    r, same = _compare(tmp_path, tmp_path / "g2.h5", tmp_path / "g.h5", "--bitwise")
    assert r.exit_code == 0, r.output
    assert same["BitIdentical"].astype(str).str.lower().eq("true").sum() > 20
    assert (same["Result"] == "fail").sum() == 0

    _dump(tmp_path / "t.h5", flip=_FlipOneBit(torch.ops.aten.addmm.default, 2))
    # the statistics alone cannot see one low bit: the plain compare passes
    r, plain = _compare(tmp_path, tmp_path / "t.h5", tmp_path / "g.h5")
    assert r.exit_code == 0 and (plain["Result"] == "fail").sum() == 0
    r, t = _compare(tmp_path, tmp_path / "t.h5", tmp_path / "g.h5", "--bitwise")
    assert r.exit_code == 1, r.output
    fails = t[t["Result"] == "fail"].sort_values(["SeqId", "Index"])
    first = fails.iloc[0]
    assert first["NPUDump"] == "aten.addmm.default" and first["Module"] == "2" and first["IO"] == "output"
    assert first["FailReason"] == bitwise.CAUSED_HERE
    with DumpFile(tmp_path / "t.h5") as f:    # the second addmm of the step is that op
        addmms = [op.seqid for op in f.ops() if op.op == "aten.addmm.default"]
    assert first["SeqId"] == addmms[1]
    later = fails[fails["SeqId"] > first["SeqId"]]
    assert len(later) and set(later["FailReason"]) <= {bitwise.OUTPUT_INHERITED, bitwise.INPUT_DIFFERS,
                                                       bitwise.CAUSED_HERE}
    assert (later["FailReason"] == bitwise.INPUT_DIFFERS).any()


def test_bitwise_needs_hashes(tmp_path):
    model = _model()
    with npu_dumper.dumper(use_dump=True, dump_path=str(tmp_path / "full.h5")):
        model(torch.randn(2, 16)).sum()
    r, _ = _compare(tmp_path, tmp_path / "full.h5", tmp_path / "full.h5", "--bitwise")
    assert r.exit_code == 2
    line = r.output.strip()
    assert len(line.splitlines()) == 1 and "full.h5" in line and "content hashes" in line


def test_hashing_leaves_the_users_storage_resizable(tmp_path):
    """The statistics writer hashes captures rebuilt on the user's own storage: reading
    its bytes must not mark that storage non-resizable (Tensor.numpy() does, for good),
    or the model's later resize_ (an out= op growing its output) fails."""
    x = torch.randn(4)
    with npu_dumper.dumper(use_dump=True, dump_path=str(tmp_path / "s.h5"), stats_only=True):
        x * 2
    x.resize_(100)                          # raised "storage that is not resizable"
    assert x.numel() == 100
    y = torch.randn(3)
    h = content_hash(y)
    y.resize_(50)
    assert h == _np_hash(y[:3].numpy())


def test_large_tensors_hash_the_bytes_the_op_saw(tmp_path):
    # tensors of 32k elements and more are hashed one by one, a dense one straight from its
    # storage's bytes: a slice at an offset hashes as the slice, a transposed weight as its
    # storage (W.t() and W share a hash), an output as the forward hook's copy
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 256)
    x = torch.randn(300, 256)
    seen = {}
    lin.register_forward_hook(lambda m, i, o: seen.__setitem__("out", o.detach().clone()))
    p = tmp_path / "big.h5"
    with npu_dumper.dumper(use_dump=True, dump_path=str(p), stats_only=True):
        y = lin(x[44:])
        (y * 2).sum().backward()
    with DumpFile(p) as f:
        (op,) = [op for op in f.ops() if op.op == "aten.addmm.default"]
        ins, outs = op.inputs(), op.outputs()
        got = {k: v.stats()[S.STATS_HASH_FIELD] for k, v in {**ins, **outs}.items() if v.is_stats}
    assert got["mat1"] == _np_hash(x[44:].numpy()) != _np_hash(x[:256].numpy())
    assert got["mat2"] == _np_hash(lin.weight.detach().numpy())
    assert got["result"] == _np_hash(seen["out"].numpy())
    assert got["self"] == _np_hash(lin.bias.detach().numpy())
