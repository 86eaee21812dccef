"""Which dump of one run folder pairs with which of the other: rank and step of a file, and
the pairing by (rank, step) (torch-free; used by ranks.py for `accucmp compare` on folders).

A file's rank and step come from its root attributes (`rank`, `world_size`, `step`) when
the file says it ran distributed, else from its name (`..._rank{r}.h5`, the dumper's
suffix under torch.distributed, with an optional `_step{n}`). Files pair on (rank, step);
a file with no partner, two files claiming the same key, or a file that is not a dump is
listed with the reason.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from dumpfile import schema as S
from dumpfile.errors import DumpError, DumpFormatError


_RANK_IN_NAME = re.compile(r"_rank(\d+)")


_STEP_IN_NAME = re.compile(r"_step(\d+)")


@dataclass(frozen=True)
class RankFile:
    path: str
    rank: int
    step: int | None
    world_size: int | None
    source: str                 # "attributes" or "name": where rank came from

    @property
    def key(self) -> tuple[int, int]:
        return (self.rank, -1 if self.step is None else self.step)

    def label(self) -> str:
        return f"rank {self.rank}" + ("" if self.step is None else f" step {self.step}")


def rank_key(path: str | os.PathLike) -> RankFile:
    """Rank, step and world size of one dump file: the pairing rule, kept in this one function.

    Root attributes win when the file says it ran distributed (world_size > 1): they are
    what torch.distributed reported. A file written outside torch.distributed holds rank 0 /
    world_size 1 whatever its name, so then the name decides (`*_rank{r}.h5`, as the dumper
    names per-rank files, or a path chosen per rank by hand). The step: root attribute
    `step`, else `_step{n}` in the name, else none. Raises DumpFormatError when the file is
    not a readable dump."""
    from dumpfile.read.reader import DumpFile

    path = os.fspath(path)
    name = os.path.basename(path)
    try:
        # DumpFile: validates the file, reads a writer-killed one as compare would, names
        # a file still being written; only the root attributes are read here
        with DumpFile(path) as f:
            a = f.attrs
            rank_a = _int_attr(a, S.ROOT_RANK)
            world = _int_attr(a, S.ROOT_WORLD_SIZE)
            step_a = _int_attr(a, S.ROOT_STEP)
    except DumpError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DumpFormatError(f"{path}: cannot open as a dump ({' '.join(str(e).split())})") from e
    m_rank = _RANK_IN_NAME.findall(name)
    m_step = _STEP_IN_NAME.findall(name)
    step = step_a if step_a is not None else (int(m_step[-1]) if m_step else None)
    if rank_a is not None and world is not None and world > 1:
        return RankFile(path, rank_a, step, world, "attributes")
    if m_rank:
        return RankFile(path, int(m_rank[-1]), step, world if world and world > 1 else None, "name")
    return RankFile(path, rank_a or 0, step, world, "attributes")


def _int_attr(attrs, name: str) -> int | None:
    v = attrs.get(name)
    if v is None:
        return None
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


@dataclass
class RankPair:
    target: RankFile
    golden: RankFile

    @property
    def key(self) -> tuple[int, int]:
        return self.target.key

    def label(self) -> str:
        return self.target.label()


@dataclass
class Pairing:
    pairs: list[RankPair]
    unpaired: list[tuple[str, str]] = field(default_factory=list)     # (path, reason)


def _dump_files(folder: Path) -> list[Path]:
    try:
        return sorted(p for p in Path(folder).iterdir() if p.suffix == ".h5" and p.is_file())
    except OSError as e:
        raise DumpFormatError(f"{folder}: cannot list the folder ({e.strerror or e})") from e


def _keyed(folder: Path, role: str, unpaired: list) -> dict[tuple[int, int], RankFile]:
    out: dict[tuple[int, int], RankFile] = {}
    for p in _dump_files(folder):
        try:
            rf = rank_key(p)
        except DumpError as e:
            msg = " ".join(str(e).split())
            msg = msg[len(str(p)) + 2:] if msg.startswith(f"{p}: ") else msg   # the path is listed beside it
            unpaired.append((str(p), f"{role}: {msg}"))
            continue
        if rf.key in out:
            unpaired.append((str(p), f"{role}: {rf.label()} is also claimed by {out[rf.key].path}; "
                                     "left out (one file per rank and step)"))
            continue
        out[rf.key] = rf
    return out


def pair_folders(target_dir: str | os.PathLike, golden_dir: str | os.PathLike) -> Pairing:
    """Pair the dumps of two run folders by (rank, step); the rest unpaired with a reason."""
    unpaired: list[tuple[str, str]] = []
    t = _keyed(Path(target_dir), "target", unpaired)
    g = _keyed(Path(golden_dir), "golden", unpaired)
    pairs = [RankPair(t[k], g[k]) for k in sorted(t.keys() & g.keys())]
    for k in sorted(t.keys() - g.keys()):
        unpaired.append((t[k].path, f"target: no golden file for {t[k].label()} in {golden_dir}"))
    for k in sorted(g.keys() - t.keys()):
        unpaired.append((g[k].path, f"golden: no target file for {g[k].label()} in {target_dir}"))
    return Pairing(pairs, unpaired)
