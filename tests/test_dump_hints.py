"""A compute-dtype note from a layer below the dumper is written on its own op only."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import npu_dumper
from npu_dumper.capture import hints
from dumpfile.read.reader import DumpFile


class _NoteOnMm(TorchDispatchMode):
    """Below the dumper: notes float16 for every mm and view op (a sloppy shim)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.t):
            hints.note_compute_dtype("float16")
        return func(*args, **(kwargs or {}))


def _compute_dtypes(path):
    with DumpFile(path) as f:
        return {(o.op, o.seqid): o.attrs.get("compute_dtype") for o in f.ops()}


def test_note_of_filtered_op_does_not_leak_to_next_recorded_op(tmp_path):
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    path = tmp_path / "d.h5"
    with _NoteOnMm():
        with npu_dumper.dumper(use_dump=True, dump_path=str(path), exclude=["mm"]):
            c = a @ b            # filtered: its note must be dropped
            d = c + 1            # recorded: computed in float32, no note
            e = d.t()            # view, skipped: its note must be dropped too
            e * 2
    dtypes = _compute_dtypes(path)
    assert set(op for op, _ in dtypes) == {"aten.add.Tensor", "aten.mul.Tensor"}
    assert all(v is None for v in dtypes.values()), dtypes


def test_note_of_recorded_op_is_written(tmp_path):
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    path = tmp_path / "d.h5"
    with _NoteOnMm():
        with npu_dumper.dumper(use_dump=True, dump_path=str(path)):
            (a @ b) + 1
    dtypes = _compute_dtypes(path)
    assert dtypes[("aten.mm.default", 1)] == "float16"
    assert dtypes[("aten.add.Tensor", 2)] is None


def test_note_left_before_the_block_is_not_written(tmp_path):
    hints.note_compute_dtype("bfloat16")      # stale, from outside any dumper
    path = tmp_path / "d.h5"
    with npu_dumper.dumper(use_dump=True, dump_path=str(path)):
        torch.ones(3) * 2
    assert all(v is None for v in _compute_dtypes(path).values())
