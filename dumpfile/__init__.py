"""The HDF5 dump format shared by npu_dumper, accucmp and ir2tbe (torch-free).

See docs/FORMAT.md. `schema` holds names and codes, `write.writer.DumpWriter` writes
(`write/` is the writer core), `read.reader.DumpFile` reads (the `read` subpackage also holds the safety checks and recovery).

The reader and writer (h5py, numpy) load on first use, so that importing
`dumpfile.errors` or `dumpfile.schema` stays instant: `accucmp --help` depends on it.
"""

from importlib import import_module

from . import schema
from .errors import DumpError, DumpFormatError, DumpWriteError

_LAZY = {
    "DumpFile": "read.reader", "OpRecord": "read.reader", "ValueRecord": "read.reader",
    "decode_raw": "read.reader", "view_of": "read.reader",
    "DumpWriter": "write.writer", "TensorMeta": "write.writer",
}

__all__ = ["schema", "DumpError", "DumpFormatError", "DumpWriteError", *_LAZY]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dumpfile' has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value

