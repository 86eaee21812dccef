"""Dump a torch.compile'd step as it really runs (docs/COMPILED.md).

`torch.utils.dumper(use_dump=True, dump_path=P, compiled=True)` around a step of a
model wrapped in `torch.compile` records, per ATen op of the compiled forward and
backward graphs, the values Inductor's compiled code computed, in the layout of an
eager dump (so `accucmp compare -m compiled.h5 -g eager.h5` pairs them op by op).
"""

from .backend import backend
from .narrow import narrow, narrow_recorded_op

__all__ = ["backend", "narrow", "narrow_recorded_op"]
