"""How every command writes its outputs (torch-free, numpy-free): never through a link,
never over an existing file unless asked, within caps on files and bytes.

Dumps come from other people, and so do the folders they sit in: a colleague's archive
can hold `result.csv -> ~/.bashrc` or `failed_2026.../ -> /etc`. So:

- The folder the user names (`-o DIR`) is used as named (created when missing); it must
  be a directory. Every file, and every subfolder, a command makes in it is created new:
  files are written to a temporary file made with O_CREAT|O_EXCL|O_NOFOLLOW (mkstemp) in
  the target folder, then put in place with link() (which refuses any existing name, a
  symbolic link included) or, with --force, rename() (which replaces the name itself,
  never the file a link points to). A failed write leaves no partial output.
- An existing output is refused with one line unless --force is given.
- Names made from inputs are made unique within one run (NameSet).
- OutputBudget caps how many files and bytes one command writes (-p, convert, extract).

Every failure is a DumpWriteError whose one line names the output path.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import tempfile
from dataclasses import dataclass
from typing import IO, Iterator

from dumpfile.errors import DumpFormatError, DumpWriteError

DEFAULT_MAX_FILES = 10_000
DEFAULT_MAX_BYTES = 16 << 30
FORCE_HINT = "use --force to replace it"


class OutputExistsError(DumpWriteError):
    """The output path is already taken and --force was not given."""


# ---- sizes -------------------------------------------------------------------------
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}


def parse_size(text: str | int, option: str = "--max-bytes") -> int:
    """'16G', '512M', '1.5g', '1000' -> bytes (binary units: 1K = 1024)."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    if not m:
        raise DumpWriteError(f"{option} {text!r}: expected a size such as 500M, 16G or 1000000")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(n: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.4g}{unit}"
    return f"{n}B"


@dataclass
class OutputBudget:
    """Caps on what one command writes. charge() is called before a file is written,
    with its size when known, so a hostile input is stopped before the disk fills."""

    max_files: int = DEFAULT_MAX_FILES
    max_bytes: int = DEFAULT_MAX_BYTES
    files: int = 0
    bytes: int = 0
    files_option: str = "--max-files"
    bytes_option: str = "--max-bytes"

    def check(self, path: str | os.PathLike, nbytes: int, files: int = 1) -> None:
        if self.files + files > self.max_files:
            raise DumpWriteError(
                f"{os.fspath(path)}: would make {self.files + files} output files, over the cap of "
                f"{self.max_files}; raise it with {self.files_option}")
        if self.bytes + nbytes > self.max_bytes:
            raise DumpWriteError(
                f"{os.fspath(path)}: would write {format_size(self.bytes + nbytes)}, over the cap of "
                f"{format_size(self.max_bytes)}; raise it with {self.bytes_option}")

    def charge(self, path: str | os.PathLike, nbytes: int, files: int = 1) -> None:
        self.check(path, nbytes, files)
        self.files += files
        self.bytes += nbytes


# ---- folders -------------------------------------------------------------------------
def _why(e: OSError) -> str:
    return e.strerror or str(e)


def output_dir(path: str | os.PathLike) -> str:
    """The folder the user named: created with its parents when missing; must be a directory."""
    path = os.fspath(path) or "."
    try:
        os.makedirs(path, exist_ok=True)
    except FileExistsError:
        raise DumpWriteError(f"{path}: exists and is not a directory") from None
    except OSError as e:
        raise DumpWriteError(f"{path}: cannot create output directory ({_why(e)})") from e
    if not os.path.isdir(path):
        raise DumpWriteError(f"{path}: exists and is not a directory")
    return path


def new_dir(parent: str | os.PathLike, name: str) -> str:
    """A folder the command makes for itself in `parent`: always a new one (mkdir, never an
    existing folder or a link left there); a taken name gets _1, _2, ..."""
    parent = os.fspath(parent)
    for i in range(10_000):
        path = os.path.join(parent, name if i == 0 else f"{name}_{i}")
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue
        except OSError as e:
            raise DumpWriteError(f"{path}: cannot create directory ({_why(e)})") from e
    raise DumpWriteError(f"{os.path.join(parent, name)}: no free name for a new directory")


# ---- names ------------------------------------------------------------------------------
class NameSet:
    """File names made from inputs, unique within one run: the second `x` becomes `x~1`
    (two kernel dumps with the same base name from different folders both convert)."""

    def __init__(self) -> None:
        self._taken: set[str] = set()

    def unique(self, name: str) -> str:
        out, i = name, 0
        while out in self._taken:
            i += 1
            out = f"{name}~{i}"
        self._taken.add(out)
        return out


# ---- files -----------------------------------------------------------------------------
_UMASK: int | None = None


def _file_mode() -> int:
    """What open() would have given a new file (mkstemp makes 0600)."""
    global _UMASK
    if _UMASK is None:
        _UMASK = os.umask(0o022)
        os.umask(_UMASK)
    return 0o666 & ~_UMASK


def check_target(path: str | os.PathLike, *, force: bool = False) -> None:
    """Refuse an output name that is taken (unless force) or that names a folder."""
    path = os.fspath(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise DumpWriteError(f"{path}: cannot check output path ({_why(e)})") from e
    if stat.S_ISDIR(st.st_mode):
        raise DumpWriteError(f"{path}: is a directory, not an output file name")
    if not force:
        kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "a file" if stat.S_ISREG(st.st_mode) \
            else "a special file"
        raise OutputExistsError(f"{path}: already exists ({kind}); refusing to overwrite it ({FORCE_HINT})")


def _commit(tmp: str, path: str, force: bool) -> None:
    if force:
        try:
            os.replace(tmp, path)   # replaces the name; a link there is replaced, not followed
        except OSError as e:
            raise DumpWriteError(f"{path}: cannot put output in place ({_why(e)})") from e
        return
    try:
        os.link(tmp, path)          # atomic, and fails on any existing name, dangling links included
    except FileExistsError:
        raise OutputExistsError(f"{path}: already exists; refusing to overwrite it ({FORCE_HINT})") from None
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.EXDEV):
            raise DumpWriteError(f"{path}: cannot put output in place ({_why(e)})") from e
        # a filesystem without hard links (FAT, some network mounts): check, then rename
        if os.path.lexists(path):
            raise OutputExistsError(f"{path}: already exists; refusing to overwrite it ({FORCE_HINT})") from None
        try:
            os.rename(tmp, path)
        except OSError as e2:
            raise DumpWriteError(f"{path}: cannot put output in place ({_why(e2)})") from e2
        return
    os.unlink(tmp)


# the temporary files of outputs being written, and the outputs completed, in this process:
# a Ctrl-C removes the first and names the second (dumpfile.interrupts)
IN_PROGRESS: set[str] = set()
WRITTEN: list[str] = []


@contextlib.contextmanager
def output_path(path: str | os.PathLike, *, force: bool = False) -> Iterator[str]:
    """A temporary file next to `path` for a library that writes by name (pandas, h5py,
    np.save): yields its path; on success it becomes `path`, on failure it is removed.
    The temporary name keeps the suffix of `path` (np.save, to_excel go by it)."""
    path = os.fspath(path)
    check_target(path, force=force)
    folder = os.path.dirname(path) or "."
    base = os.path.basename(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{base[:80]}.", suffix=".part" + os.path.splitext(base)[1],
                                   dir=folder)
    except OSError as e:
        raise DumpWriteError(f"{path}: cannot write in {folder} ({_why(e)})") from e
    IN_PROGRESS.add(tmp)
    os.close(fd)
    try:
        os.chmod(tmp, _file_mode())
        yield tmp
        _commit(tmp, path, force)
        WRITTEN.append(path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    finally:
        IN_PROGRESS.discard(tmp)


@contextlib.contextmanager
def open_output(path: str | os.PathLike, mode: str = "wb", *, force: bool = False,
                encoding: str | None = None, newline: str | None = None) -> Iterator[IO]:
    """open() for a new output file, with the rules above."""
    with output_path(path, force=force) as tmp:
        try:
            with open(tmp, mode, encoding=encoding, newline=newline) as f:
                yield f
        except OSError as e:
            raise DumpWriteError(f"{os.fspath(path)}: write failed ({_why(e)})") from e


def open_append_nofollow(path: str | os.PathLike, *, encoding: str = "utf-8") -> IO:
    """Append to a file this command created earlier in the run (a mapping table growing
    op by op); O_NOFOLLOW: a link put there meanwhile is refused, not followed."""
    path = os.fspath(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), _file_mode())
    except OSError as e:
        raise DumpWriteError(f"{path}: cannot append ({_why(e)})") from e
    return os.fdopen(fd, "a", encoding=encoding, newline="")


# ---- inputs that must be regular files ----------------------------------------------------
