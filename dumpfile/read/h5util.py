"""HDF5 failures turned into one-line DumpFormatErrors naming the file, and the lookups
that must not read damage as absence (torch-free)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import h5py
import numpy as np

from dumpfile.errors import DumpFormatError, raised_by_h5py
from dumpfile.read import recovery

# What h5py raises when HDF5 fails on damaged bytes (a bad B-tree or object header
# signature, a message not aligned, a read that runs off its buffer): RuntimeError,
# KeyError, OSError or ValueError, with a message that does not name the file.
H5_ERRORS = (OSError, RuntimeError, KeyError, ValueError)
READ_ERRORS = recovery.READ_ERRORS


def h5_message(e: BaseException) -> str:
    """The first line of an HDF5 failure's message (without the quotes KeyError's str() adds)."""
    msg = e.args[0] if isinstance(e, KeyError) and e.args else e
    lines = str(msg).strip().splitlines()
    return lines[0].strip() if lines else type(e).__name__


def corrupt_dump_error(path: str, e: BaseException, where: str = "") -> DumpFormatError:
    """`{path}: corrupt or unreadable dump ({first line of the HDF5 message})[ at {where}]`."""
    return DumpFormatError(f"{path}: corrupt or unreadable dump ({h5_message(e)})"
                           + (f" at {where}" if where else ""))


def existing(h5: h5py.File, path: str) -> Any | None:
    """The object at `path`, or None when there is none. Not `h5.get()`: it answers None
    for a damaged object too, which read as "no values"; damage raises here (whether the
    path exists is asked on failure only: a path lookup costs)."""
    try:
        return h5[path]
    except KeyError:
        if path in h5:
            raise
        return None


def members(group: h5py.Group) -> Iterator[tuple[str, Any]]:
    """(name, object) of a group's members, each looked up by name. Not `.items()`: it
    yields None for an object it cannot open, so damage read as absence (a damaged op
    skipped, then dropped from a file rebuilt without it); a lookup raises instead."""
    for name in group.keys():
        yield name, group[name]


@contextlib.contextmanager
def h5_errors(path: str, where: str = "") -> Iterator[None]:
    """Turn an HDF5 failure raised inside the block into a DumpFormatError naming `path`
    (the file the block reads). Errors that h5py did not raise pass unchanged."""
    try:
        yield
    except H5_ERRORS as e:
        if not raised_by_h5py(e):
            raise
        raise corrupt_dump_error(path, e, where) from e


def _attr_str(v: Any) -> str:
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    return "" if v is None else str(v)


# ---- the order of a group's members (every reader: DumpFile.values, light, catalog) ----
def suffix_index(key: str) -> tuple[int, str]:
    """Sort key of a list's members (item_0, item_1, ... item_10): by their numeric suffix."""
    tail = key.rsplit("_", 1)[-1]
    return (int(tail) if tail.isdigit() else 1 << 62, key)


def ordered_names(names: list[str], order: Any) -> list[str]:
    """A group's member names in argument order: those its `order` attribute lists first,
    then the others in link (name) order."""
    if order is None or isinstance(order, h5py.Empty):
        return names
    present = set(names)
    listed = [_attr_str(n) for n in np.asarray(order).reshape(-1)]
    known = set(listed)
    return [n for n in listed if n in present] + [n for n in names if n not in known]
