"""A dump whose writer died inside an HDF5 flush (dumpfile.read.recovery)."""

from __future__ import annotations

import struct

import h5py
import numpy as np
import pytest
import torch

import npu_dumper
import sample_models
from dumpfile import DumpFile
from dumpfile.read import recovery
from dumpfile import schema as S


def _values(f: DumpFile) -> dict:
    out = {}
    for o in f.ops():
        for io, vals in (("in", o.inputs()), ("out", o.outputs())):
            for name, v in vals.items():
                if hasattr(v, "read"):
                    out[(o.seqid, io, name)] = v.read()
    return out


def _cut_short(path, eoa: int) -> None:
    """What a SIGKILL inside a flush leaves: not complete, and the superblock still
    recording an end of allocation below objects the file holds."""
    with h5py.File(path, "r+") as f:
        f.attrs[S.ROOT_COMPLETE] = False
    off, _ = recovery.stored_eoa(str(path))
    with open(path, "r+b") as fh:
        fh.seek(off)
        fh.write(struct.pack("<Q", eoa))


@pytest.mark.parametrize("stats_only", [False, True])
def test_a_dump_cut_short_inside_a_flush_reads_back_whole(tmp_path, stats_only):
    spec = sample_models.get("mlp")
    model, batch = spec.build(seed=0, size="tiny"), spec.make_inputs(seed=0, size="tiny")
    p = tmp_path / "d.h5"
    with npu_dumper.dumper(use_dump=True, dump_path=str(p), writer="thread", stats_only=stats_only):
        spec.train_step(model, batch)
    with DumpFile(p) as f:
        want_ops = [(o.op, o.seqid) for o in f.ops()]
        want = _values(f)
    size = p.stat().st_size
    _cut_short(p, size // 3)
    # the damage is real: plain HDF5 cannot read everything any more
    with pytest.raises(OSError, match="past end of allocation|addr overflow"):
        with h5py.File(p, "r") as f:
            f.visititems(lambda n, o: o[()] if isinstance(o, h5py.Dataset) else None)
    with DumpFile(p) as f:
        assert not f.complete
        assert [(o.op, o.seqid) for o in f.ops()] == want_ops
        got = _values(f)
    assert got.keys() == want.keys()
    for k, v in want.items():
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(v), err_msg=str(k))
    assert recovery.stored_eoa(str(p))[1] == size // 3       # the file itself is not modified


def test_only_files_past_their_recorded_end_are_read_through_recovery(tmp_path):
    p = tmp_path / "d.h5"
    with npu_dumper.dumper(use_dump=True, dump_path=str(p)):
        torch.ones(4).neg()
    assert recovery.is_cut_short(str(p)) is None            # a clean close: EOF == EOA
    with DumpFile(p) as f:
        assert f._source is None
    q = tmp_path / "other.h5"
    with h5py.File(q, "w", libver="latest") as f:           # superblock v3: not handled
        f["x"] = np.arange(3)
    assert recovery.stored_eoa(str(q)) is None
