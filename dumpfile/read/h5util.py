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


# ---- a view's base (every reader of views: DumpFile, extract, load-replay) ----------
def view_base(h5: h5py.File, file_path: str, view: Any, base_attr: Any,
              view_path: str | None = None) -> h5py.Dataset:
    """The dataset a view (Type 40) is cut from, checked: the view holds one object
    reference (or a null one and a `base` path attribute, as h5copy without `-f ref`
    leaves it), and what it reaches is a plain stored tensor of this file, not the view
    itself, another view, a group, the root or a string. A view pointing at itself, a
    string dataset or the root raised internal errors (reading references as numbers) in
    ls --stats, compare, export, whatif and golden, and load-replay handed the garbage to
    the model. The base passes safety.check_dataset (a reference may reach a dataset no
    link names, which the whole-file check did not see)."""
    from dumpfile import schema as S
    from dumpfile.read import safety

    # `view_path`: the view's path as the caller opened it, for the messages. Asking h5py
    # (`view.name`) makes HDF5 search the file for the object's path (H5Iget_name): ~5-15 ms
    # a view in a GPT-2 small dump, twice per view, most of load-replay's prefetch thread
    # (12 of 14 s of CPU a step) although only a refusal prints it
    name = view.name if view_path is None else view_path
    where = f"{file_path}: {name}"
    if not isinstance(view, h5py.Dataset) or h5py.check_ref_dtype(view.dtype) is not h5py.Reference \
            or view.shape != ():
        raise DumpFormatError(f"{where}: a view (Type 40) that does not hold one object reference to its "
                              "base; refused")
    ref = view[()]
    base = None
    if ref:
        try:
            base = h5[ref]
        except (ValueError, KeyError, TypeError):
            base = None
        if base is None:
            raise DumpFormatError(f"{where}: a view whose reference reaches nothing readable; refused")
    else:
        base_path = _attr_str(base_attr)
        if not base_path or base_path not in h5:
            raise DumpFormatError(f"{where}: is a view of {base_path or 'a dataset'} that is not in this file "
                                  "(copy with `accucmp extract` or `h5copy -f ref`)")
        base = h5[base_path]
    if not isinstance(base, h5py.Dataset):
        raise DumpFormatError(f"{where}: a view whose base {base.name} is a group, not a stored tensor; refused")
    kind = base.dtype.kind
    code = base.attrs.get(S.ATTR_TYPE, S.TYPE_TENSOR)
    if kind not in "biufc" or base.dtype.fields or np.asarray(code).size != 1 \
            or np.asarray(code).dtype.kind not in "iu" or int(np.asarray(code).reshape(())) != S.TYPE_TENSOR:
        raise DumpFormatError(f"{where}: a view whose base {base.name} is not a stored tensor (the view itself, "
                              "another view, statistics or text); refused")
    safety.check_dataset(base.id, file_path, f"{name} (its base)")
    return base
