"""Load-replay's index of a recording: every op's inputs read in one low-level pass.

The replay's main thread must not call h5py while the model runs: h5py serialises every
call behind one lock, which the dump's writer thread holds much of the time, and its
high-level objects (Group.__getitem__, AttributeManager) cost 0.1-1 ms an entry. So the
prefetch thread reads each recorded op's input group ahead, as records that carry what
replay needs later: the attributes (Type, dtype, shape, Stride, storage_offset, ...),
non-tensor values already read, each tensor's identity (`ident`, shared by hard links to
one dataset, so one stored tensor is read once) and, for plain contiguous datasets, the
file offset and size of its bytes (read with os.preadv, without h5py).

The records are dumpfile's (`dumpfile.read.light.LightValue`, the one reader every command
uses): `read_group` is its layout walk of one group, `read_catalog` builds every op's
records from the file's catalog (format 1.2+, ~0.05 ms an op instead of ~0.7 ms) and says
None where it cannot be used (dumpfile.read.catalog); ops it does not describe are walked.
"""

from __future__ import annotations

from dumpfile.read.catalog import read_catalog  # noqa: F401  (replay's entry point)
from dumpfile.read.light import NO_VALUE as _NO_VALUE, LightValue as IndexedValue, walk_group  # noqa: F401
from dumpfile.read.reader import DumpFile, ValueRecord


def read_group(f: DumpFile, group_path: str) -> dict[str, ValueRecord]:
    """The entries of an op's input/ or output/ group, in argument order (as DumpFile.values),
    with their layout and values (light.walk_group(layout=True, values=True))."""
    return walk_group(f, group_path, layout=True, values=True)


__all__ = ["IndexedValue", "read_catalog", "read_group"]
