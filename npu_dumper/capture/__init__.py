"""The capture side of a dump: what runs in the model's thread while a dump block is open.

    mode.py            DumpMode, the TorchDispatchMode: seqid, phase, module, the policy pipeline
    selection.py       OpFilter (which ops are recorded), the user's stack line
    walk.py            an op's arguments and results as records, from a plan per op overload
    opschema.py        an op's schema facts (argument names, writes, out=, views) and registries
    policy.py          the hooks a mode runs around each op; the registry of policy providers
    snapshots.py       TensorCapture (an op-time alias, copied before a write), the record
                       types handed to a sink, CaptureRegistry (copy-on-write), StorageGuard
    module_tracking.py which nn.Module an op ran in, forward or backward
    tensors.py         dtype names, tensor <-> numpy/record conversion
    tensor_stats.py, tensor_hash.py, tensor_hist.py   per-tensor statistics, hashes, histograms
    hints.py, dynamo_skip.py                          kernel dtype notes; no torch._dynamo import

What the sinks (the writers) read from here is the record of one op: TensorCapture and the
Value / Named / ListOf nodes, re-exported below; they import nothing else of the mode.
"""

from .snapshots import CaptureRegistry, ListOf, Named, StorageGuard, TensorCapture, Value

__all__ = ["CaptureRegistry", "ListOf", "Named", "StorageGuard", "TensorCapture", "Value"]
