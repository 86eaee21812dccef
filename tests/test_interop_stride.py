"""Format 1.5: `Stride` describes the stored data (the original msaccucmp applies
as_strided(data, Stride) to golden tensors), live strides are `live_stride`, FormatType
follows the memory format."""

from __future__ import annotations

import h5py
import numpy as np
import torch

from dumpfile import schema as S
from dumpfile.read.reader import DumpFile


def test_stride_describes_stored_data_and_format_follows_memory_format(tmp_path):
    from npu_dumper import dumper

    w = torch.randn(4, 6)
    conv = torch.nn.Conv2d(3, 5, 3).to(memory_format=torch.channels_last)
    img = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    p = tmp_path / "d.h5"
    with dumper(dump_path=str(p)):
        torch.mm(torch.randn(2, 6), w.t())
        conv(img)
    with DumpFile(p) as f, h5py.File(p, "r") as h:
        assert f.attrs[S.ROOT_FORMAT_VERSION] == S.FORMAT_VERSION == "1.9"
        mm = next(o for o in f.ops() if o.op == "aten.mm.default")
        conv_op = next(o for o in f.ops() if "convolution" in o.op)
        for rec, live in ((mm.inputs()["mat2"], w.t()), (conv_op.inputs()["input"], img)):
            ds = h[rec.path] if rec.type == S.TYPE_TENSOR else h[rec.attrs[S.ATTR_BASE]]
            data = ds[()].reshape(-1)
            stride = np.asarray(rec.attrs[S.ATTR_STRIDE])
            # what the original msaccucmp does with a golden tensor
            got = np.lib.stride_tricks.as_strided(data, shape=tuple(rec.shape),
                                                  strides=tuple(int(s) * data.itemsize for s in stride))
            if rec.type == S.TYPE_TENSOR:
                np.testing.assert_array_equal(got, live.detach().numpy())
            assert S.live_stride(rec.attrs) == tuple(live.stride())
            np.testing.assert_array_equal(rec.read(), live.detach().numpy())
        assert int(conv_op.inputs()["input"].attrs[S.ATTR_FORMAT_TYPE]) == S.FORMAT_NHWC
        assert int(mm.inputs()["mat2"].attrs[S.ATTR_FORMAT_TYPE]) == S.FORMAT_ND


def test_old_files_stride_is_the_live_one():
    # format <= 1.4: no live_stride, Stride was the live tensor's
    assert S.live_stride({S.ATTR_STRIDE: np.array([1, 4])}) == (1, 4)
    assert S.live_stride({S.ATTR_STRIDE: np.array([4, 1]), S.ATTR_LIVE_STRIDE: np.array([1, 2])}) == (1, 2)
