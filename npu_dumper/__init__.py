"""npu_dumper: op-level HDF5 dumps of PyTorch programs (dump, load-replay, overflow).

Importing it installs `torch.utils.dumper` (= npu_dumper.dumper) and
`torch.utils.get_op_map`, the names the Ascend PyTorch 1.5 fork's users know.
"""

from __future__ import annotations

import torch
import torch.utils

from .dumper import dumper
from .errors import DumperError
from .load import load
from .capture.tensors import from_record, to_record
from .replay.emulation import emulate_npu, inject_fault
from .upcast import upcast, upcast_from_env
from . import replay
from .replay.golden import replay as golden_replay

def get_op_map(*args, **kwargs):
    """The op-name map used to match ops across devices (npu_dumper.opmap, imported lazily)."""
    from .opmap import get_op_map as _get
    return _get(*args, **kwargs)


torch.utils.dumper = dumper
torch.utils.get_op_map = get_op_map

__all__ = ["dumper", "load", "DumperError", "to_record", "from_record", "get_op_map",
           "emulate_npu", "inject_fault", "replay", "golden_replay", "upcast", "upcast_from_env"]
