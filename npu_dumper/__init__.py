"""npu_dumper: op-level HDF5 dumps of PyTorch programs (dump, load-replay, overflow).

Importing it installs `torch.utils.dumper` (= npu_dumper.dumper) and
`torch.utils.get_op_map`, the names the Ascend PyTorch 1.5 fork's users know.
"""

from __future__ import annotations

import sys

import torch
import torch.utils

from .dumper import dumper
from .errors import DumperError
from .load import load
from .tensors import from_record, to_record
from .replay.emulation import emulate_npu, inject_fault
from .upcast import upcast, upcast_from_env
# The replay package is callable: npu_dumper.replay(dump_h5, out_h5, device=, dtype=) runs
# the golden replay (npu_dumper.replay.golden.replay), the name the issue and docs use.
from . import replay
from .replay import emulation as _emulation, golden as _golden, index as _index, \
    overflow as _overflow, recorded as _recorded

# The replay modes lived at npu_dumper.<name> before npu_dumper/replay/ gathered them:
# scripts (and accucmp.demo) that import the old paths get the same module objects.
for _old, _module in (("emulation", _emulation), ("golden", _golden), ("replay_index", _index),
                      ("overflow", _overflow), ("recorded", _recorded)):
    sys.modules.setdefault(f"{__name__}.{_old}", _module)
    globals().setdefault(_old, _module)
del _old, _module

# The sinks lived at npu_dumper.<old> before npu_dumper/sinks/ gathered them.
from .sinks import process as _process, stats as _stats, thread as _thread, worker_threads as _workers
for _old, _module in (("writer_thread", _thread), ("writer_process", _process),
                      ("stats_writer", _stats), ("worker_threads", _workers)):
    sys.modules.setdefault(f"{__name__}.{_old}", _module)
del _old, _module


def get_op_map(*args, **kwargs):
    """The op-name map used to match ops across devices (npu_dumper.opmap, imported lazily)."""
    from .opmap import get_op_map as _get
    return _get(*args, **kwargs)


torch.utils.dumper = dumper
torch.utils.get_op_map = get_op_map

__all__ = ["dumper", "load", "DumperError", "to_record", "from_record", "get_op_map",
           "emulate_npu", "inject_fault", "replay", "upcast", "upcast_from_env"]
