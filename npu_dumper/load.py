"""`npu_dumper.load(path)`: open a dump for reading (dumpfile.DumpFile), torch tensors on request."""

from __future__ import annotations

import os
from typing import Any


from dumpfile import schema as S
from dumpfile.errors import DumpFormatError
from dumpfile.read import probe
from dumpfile.read.reader import DumpFile, ValueRecord

from .capture.tensors import from_record


class TorchDumpFile(DumpFile):
    """DumpFile whose values can come back as torch tensors in their recorded dtype."""

    def __init__(self, path, *, as_torch: bool = False, device=None, **kw):
        # inside the user's process: a damaged file's metadata is read first in a watched
        # child, so that a loop inside HDF5 is a DumpFormatError, not a hung job
        probe.probe(path, probe.LOAD)
        super().__init__(path, **kw)
        self.as_torch = as_torch
        self.device = device

    def read_value(self, rec: ValueRecord) -> Any:
        val = super().read_value(rec)
        if self.as_torch and rec.type in (S.TYPE_TENSOR, S.TYPE_TENSOR_VIEW):
            return self.tensor(rec, _decoded=val)
        return val

    def tensor(self, rec: ValueRecord, *, _decoded=None):
        """The recorded tensor as a torch tensor, bit-exact, in its recorded dtype."""
        try:
            if rec.type == S.TYPE_TENSOR:
                raw = self.h5[rec.path][()]          # raw bits for bf16/float8
                t = from_record(raw, rec.dtype or None)
            elif rec.type == S.TYPE_TENSOR_VIEW:
                data = _decoded if _decoded is not None else DumpFile.read_value(self, rec)
                t = from_record(data, rec.dtype or None)
            else:
                t = None
        except KeyError:
            # (from_record's lookup of the name: a file's dtype attribute such as "longdouble")
            raise DumpFormatError(f"{self.path}: {rec.path}: its dtype attribute {rec.dtype!r} names no dtype "
                                  "of this torch; refused") from None
        if t is None:
            raise TypeError(f"{self.path}: {rec.path} is not a stored tensor")
        return t.to(self.device) if self.device is not None else t


def load(path: str | os.PathLike, *, as_torch: bool = False, device=None) -> TorchDumpFile:
    """Open a dump. `as_torch=True`: tensors read back as torch tensors (else numpy)."""
    return TorchDumpFile(path, as_torch=as_torch, device=device)
