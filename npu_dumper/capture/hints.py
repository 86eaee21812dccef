"""Facts a layer below the dumper tells it about the op now running.

An emulation or a device shim that runs *below* the dumper's mode (entered before
it) knows things the dumper cannot see, e.g. that a cube op computed in float16.
It calls `note_compute_dtype("float16")` while the op runs; the dumper calls
`pop_compute_dtype()` right after the op returns and writes the group attribute
`compute_dtype`, which accucmp's verdict uses. Thread-local: ops run per thread.
"""

from __future__ import annotations

import threading

_local = threading.local()
# Whether any note was ever made in this process: the dumper pops after every op, and a
# thread-local read costs more than the rest of a plain dump's per-op bookkeeping together
_noted = False


def note_compute_dtype(dtype_name: str) -> None:
    """Say that the op now running computed in `dtype_name` (e.g. "float16")."""
    global _noted
    _noted = True
    _local.compute_dtype = dtype_name


def pop_compute_dtype() -> str | None:
    """The dtype noted since the last call, or None; clears it."""
    if not _noted:
        return None
    value = getattr(_local, "compute_dtype", None)
    _local.compute_dtype = None
    return value
