"""Replaying a recorded dump: one core, several modes.

The core (reading a recording and rebuilding its values and calls as torch objects):
  recorded.py     a recorded value -> torch tensor (exact dtype, strides, views of one
                  base); a recorded op -> a callable OpOverload with its arguments
                  (load_call)
  op_names.py     a recorded op name -> its OpOverload; which calls draw random numbers
  index.py        the recording's metadata read fast (the catalog dataset, or one
                  low-level pass): what load-replay matches against without h5py calls
                  on the model's thread

The modes:
  load_replay.py  ReplayPolicy: live ops take the recorded inputs of the op they match
                  (torch.utils.dumper(load_file_path=...)); matching.py which recorded call,
                  source.py the load file's tensors, layout.py laid out as the live ones
  golden.py       golden replay: every recorded op recomputed offline from its own inputs
                  (fp64 by default), written as a new dump (`accucmp golden`)
  overflow.py     OverflowPolicy: record only the ops where inf/nan starts
                  (check_overflow=True, with or without a load file)
  emulation.py    emulate_npu / inject_fault: Ascend-like cube numerics and injected
                  errors, entered around a replay or a live run

`npu_dumper.golden_replay(dump_h5, out_h5, ...)` is golden.replay (`accucmp golden` on the
command line).
"""

from __future__ import annotations

from .load_replay import ReplayError, ReplayPolicy, ReplaySummary
from .op_names import resolve_op

__all__ = ["ReplayPolicy", "ReplaySummary", "ReplayError", "resolve_op"]
