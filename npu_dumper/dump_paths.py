"""Where a dump goes and which dump a rank replays: the dumper's path options checked and
named under the rank and step rule (docs/FORMAT.md "Rank and step naming").
"""

from __future__ import annotations

import datetime as _dt
import os
from typing import Any

from .errors import DumperError


def dist_rank() -> tuple[int | None, int | None]:
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:  # noqa: BLE001 - a broken distributed setup must not stop a dump
        pass
    return None, None


def path_option(name: str, value: Any) -> str | None:
    """A path option as str (bytes and os.PathLike accepted); DumperError for anything else."""
    if value is None or value == "" or value == b"":
        return None
    try:
        return os.fsdecode(os.fspath(value))
    except TypeError:
        raise DumperError(f"{name} must be a path, got {type(value).__name__} {value!r}") from None


def rank_step_name(path: str, rank: int | None, step: int | None = None) -> str:
    """The rank and step naming rule (docs/FORMAT.md "Rank and step naming"):
    `d.h5` -> `d_step{S}_rank{R}.h5` (either part only when known). A name that already
    ends in this rank's (and step's) suffix is kept, so an explicit per-rank path works."""
    suffix = (f"_step{step}" if step is not None else "") + (f"_rank{rank}" if rank is not None else "")
    if not suffix or path[:-3].endswith(suffix):
        return path
    return path[:-3] + suffix + ".h5"


def resolve_dump_path(dump_path: str | os.PathLike, mode: str, rank: int | None,
                      step: int | None = None) -> str:
    """Validate `dump_path` and return the file to write. Raises DumperError (one line)."""
    path = os.fspath(dump_path)
    if os.path.isdir(path):
        stamp = _dt.datetime.now().strftime("%Y%m%d%H%M%S")
        base = os.path.join(path, f"{mode}_{stamp}")
        path = base + ".h5"
        n = 1
        while os.path.exists(rank_step_name(path, rank, step)):
            path = f"{base}_{n}.h5"
            n += 1
    elif not path.endswith(".h5"):
        raise DumperError(f"{path}: dump_path must be an existing directory or a file name ending in .h5")
    path = rank_step_name(path, rank, step)
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise DumperError(f"{path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise DumperError(f"{path}: directory {parent} is not writable")
    if os.path.exists(path) and (os.path.isdir(path) or not os.access(path, os.W_OK)):
        raise DumperError(f"{path}: exists and is not a writable file")
    if os.path.islink(path) and not os.path.exists(path):
        raise DumperError(f"{path}: is a symbolic link to {os.readlink(path)}, which does not exist")
    return path


def resolve_load_path(load_path: str, rank: int | None, step: int | None = None) -> str:
    """The dump this rank replays: `load_file_path` under the rank and step naming rule
    when that file exists (`gold.h5` -> `gold_rank1.h5` on rank 1), else the path as given
    (one golden for every rank, or an explicit per-rank path). Tried in that order: with
    step and rank, with rank only, as given."""
    if not load_path.endswith(".h5"):
        return load_path
    for candidate in (rank_step_name(load_path, rank, step), rank_step_name(load_path, rank)):
        if candidate != load_path and os.path.isfile(candidate):
            return candidate
    return load_path
