"""The HDF5 dump format shared by npu_dumper, accucmp and ir2tbe (torch-free).

See docs/FORMAT.md. `schema` holds names and codes, `write.writer.DumpWriter` writes
(`write/` is the writer core), `reader.DumpFile` reads.

The reader and writer (h5py, numpy) load on first use, so that importing
`dumpfile.errors` or `dumpfile.schema` stays instant: `accucmp --help` depends on it.
"""

import sys
from importlib import import_module
from importlib.abc import Loader, MetaPathFinder
from importlib.util import spec_from_loader

from . import schema
from .errors import DumpError, DumpFormatError, DumpWriteError

_LAZY = {
    "DumpFile": "reader", "OpRecord": "reader", "ValueRecord": "reader",
    "decode_raw": "reader", "view_of": "reader",
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


# The writers lived at dumpfile.<old> before dumpfile/write/ gathered them (FORMAT.md
# documents `dumpfile.remote_writer.prestart()`): importing an old path gives the moved
# module itself, loaded only then (importing dumpfile stays free of h5py).
_MOVED = {"dumpfile.writer": "dumpfile.write.writer", "dumpfile.remote_writer": "dumpfile.write.remote",
          "dumpfile.stats_writer": "dumpfile.write.stats"}


class _MovedModules(MetaPathFinder, Loader):
    def find_spec(self, name, path=None, target=None):
        return spec_from_loader(name, self) if name in _MOVED else None

    def create_module(self, spec):
        return import_module(_MOVED[spec.name])

    def exec_module(self, module):
        pass                                # (already executed under its new name)


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())   # (before an editable install's finder of older paths)
