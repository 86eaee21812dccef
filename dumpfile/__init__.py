"""The HDF5 dump format shared by npu_dumper, accucmp and ir2tbe (torch-free).

See docs/FORMAT.md. `schema` holds names and codes, `writer.DumpWriter` writes,
`reader.DumpFile` reads.
"""

from . import schema
from .errors import DumpError, DumpFormatError, DumpWriteError
from .reader import DumpFile, OpRecord, ValueRecord, decode_raw, view_of
from .writer import DumpWriter, TensorMeta

__all__ = [
    "schema", "DumpError", "DumpFormatError", "DumpWriteError", "DumpFile", "OpRecord",
    "ValueRecord", "DumpWriter", "TensorMeta", "decode_raw", "view_of",
]
