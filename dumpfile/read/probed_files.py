"""Files a probe already passed, remembered across processes (probe.py).

A load-replay or `npu_dumper.load` of a file makes its metadata reads first in a watched
child (probe.py): ~0.2 s to start an interpreter with h5py, and the reads themselves, which
grow with the file's ops (GPT-2 small's 1,132-op golden: 0.74 s in all; 18,000 ops: ~4 s). Within one process a file is probed once; a user bisecting a port replays
the same golden in one process after another, and each paid it again. So a probe that
passed is written down here, under the file's identity and change time (device, inode,
size, modification and change times in ns: what safety._CHECKED keys on) with the largest
size a dataset of it declares, and a later process that finds the same identity, with its
own size limit (safety.max_dataset_bytes: a quarter of the memory available then) at least
that large, skips the child: the same bytes, read the same way, cannot loop where they did
not, and pass the same check.

Any change to the file (written in place, replaced, copied elsewhere) changes its change
time or inode, which no file's content can set back: the key no longer matches and the file
is probed again. A record that cannot be read or written (no home, read-only, a line this
version did not write) is the same as no record: the probe runs as before.

The record: `$ACCUCMP_PROBE_RECORD`, by default `$XDG_CACHE_HOME/accucmp/probed-files`
(`~/.cache/...`); an empty value turns it off. Lines of `v1 dev ino size mtime ctime largest
purpose`, appended (one short write with O_APPEND: lines of processes writing at once do
not mix), at most RECORD_BYTES (older lines dropped when it grows past it); never written
through a symlink.
"""

from __future__ import annotations

import os
import tempfile

RECORD_ENV = "ACCUCMP_PROBE_RECORD"
RECORD_BYTES = 256 << 10
_VERSION = "v1"


def record_path() -> str | None:
    """Where the record lives, or None when it is turned off."""
    if RECORD_ENV in os.environ:
        return os.environ[RECORD_ENV].strip() or None
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
    if not os.path.isabs(base):
        return None          # (no home to speak of: "~" left as it is)
    return os.path.join(base, "accucmp", "probed-files")


def _lines(path: str) -> list[str]:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return []
    try:
        with os.fdopen(fd, "rb") as f:
            data = f.read(RECORD_BYTES * 2)     # (bounded, whatever the file has become)
    except OSError:
        return []
    return data.decode("ascii", "replace").splitlines()


def _line(identity: tuple, largest: int, purpose: str) -> str:
    return " ".join([_VERSION, *(str(int(v)) for v in identity), str(int(largest)), purpose])


def known(identity: tuple, purpose: str, limit: int) -> bool:
    """Whether a probe of `purpose` passed on the file with this identity and change time
    (safety._file_key's first five fields) and its largest dataset is within `limit`."""
    path = record_path()
    if path is None or not purpose.isalnum():
        return False
    head = " ".join([_VERSION, *(str(int(v)) for v in identity)]) + " "
    for line in _lines(path):
        if not line.startswith(head):
            continue
        fields = line[len(head):].split(" ")
        if len(fields) == 2 and fields[1] == purpose and fields[0].isdigit() and int(fields[0]) <= limit:
            return True
    return False


def add(identity: tuple, largest: int, purposes: tuple[str, ...]) -> None:
    """Write down that probes of `purposes` passed on the file with this identity, whose
    largest dataset declares `largest` bytes (any limit at least that passes it)."""
    path = record_path()
    if path is None or not all(p.isalnum() for p in purposes):
        return
    text = "".join(_line(identity, largest, p) + "\n" for p in purposes)
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except OSError:
        return
    try:
        os.write(fd, text.encode("ascii"))
        size = os.fstat(fd).st_size
    except OSError:
        return
    finally:
        os.close(fd)
    if size > RECORD_BYTES:
        _shrink(path)


def _shrink(path: str) -> None:
    """Keep the newer half of the record (a new file put in place of the old one)."""
    lines = _lines(path)
    keep = lines[len(lines) // 2:]
    directory = os.path.dirname(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".probed-files.")
    except OSError:
        return
    try:
        with os.fdopen(fd, "w", encoding="ascii", errors="replace") as f:
            f.write("".join(line + "\n" for line in keep))
        os.replace(tmp, path)        # (replaces a symlink itself, never writes through one)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
