"""The one place where a command's failure becomes a line on stderr and an exit code,
shared by every `accucmp` command (through accucmp/cli/boundary.py) and by `ir2tbe`. It
lives in dumpfile, the bottom layer, because ir2tbe sits below accucmp and may not import
it (tests/test_import_layers.py), as dumpfile/version.py holds the shared --version.

- Bad input (a dump, csv or acl.json that is missing, damaged or not what the command
  takes; a bad option value; a file we cannot read or write): `PROG: error: FILE: problem`
  and exit 2 (Status.BAD_INPUT). The user can fix it.
- A bug in our code (any other exception): `PROG: internal error ...: please report it`
  with the path of a log file holding the traceback, exit 3 (Status.INTERNAL). The user
  cannot fix it, and must not be shown a traceback that reads like their fault.
- Ctrl-C: exit 130; the reader of our output went away (`| head`): exit 141, silently.

ACCUCMP_DEBUG=1 (for ir2tbe also IR2TBE_DEBUG=1) re-raises both kinds so a developer
sees the traceback where it happens. Light: typer and the standard library only.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import shlex
import stat
import sys
import tempfile
import traceback
from enum import IntEnum
from pathlib import Path
from typing import Iterator

import click
import typer


def new_app(prog: str, help: str) -> typer.Typer:
    """The typer app of one of our commands, with the settings both share: `-h`, no shell
    completion, no rich tracebacks (the boundary decides what a failure prints), `--version`,
    help laid out to read whole at 80 columns (dumpfile/cli_help.py)."""
    from dumpfile.cli_help import HELP_SETTINGS
    from dumpfile.version import add_version_option

    app = typer.Typer(name=prog, help=help, no_args_is_help=True, add_completion=False,
                      pretty_exceptions_enable=False, **HELP_SETTINGS,
                      context_settings={"help_option_names": ["-h", "--help"]})
    add_version_option(app, prog)
    return app


class Status(IntEnum):
    """Exit codes of every command (README, "Exit codes")."""

    OK = 0
    FINDINGS = 1        # compare/report: some tensor fails; convert: some file failed; demo: not shown
    BAD_INPUT = 2       # the user's file or option: one line naming it
    INTERNAL = 3        # a bug in our code: please report, traceback in a log file
    INTERRUPTED = 130   # 128 + SIGINT, as a shell reports a Ctrl-C'd tool
    BROKEN_PIPE = 141   # 128 + SIGPIPE: the reader of our output went away (`| head`)


# The arguments the entry point was given (main() sets them; else sys.argv): the log says
# which command met the bug.
command_args: list[str] | None = None

# Where an internal error asks to be reported: the README section that says what to send.
REPORT_AT = 'README.md, "Reporting a bug"'


class UsageProblem(Exception):
    """Bad option values (a threshold that is not NAME=VALUE, an unknown format)."""


def one_line(msg: object) -> str:
    """`msg` on one line with nothing a terminal would act on: whitespace runs (newlines
    included) become one space, other control characters their escapes (a file name or
    an HDF5 object name in a message is text from outside: dumpfile.printable)."""
    from dumpfile.printable import printable

    return printable(" ".join(str(msg).split()))


def fail(prog: str, msg: object) -> typer.Exit:
    """Print PROG: error: MSG and return the Exit to raise (for a command that knows the
    problem is bad input without an exception to carry it)."""
    typer.echo(f"{prog}: error: {one_line(msg)}", err=True)
    return typer.Exit(Status.BAD_INPUT)


def require_file(p: Path) -> None:
    """A dump / csv argument must name an existing regular file (a FIFO would block us)."""
    from dumpfile.errors import DumpFormatError

    if not os.path.exists(p):
        raise DumpFormatError(f"{p}: no such file")
    if os.path.isdir(p):
        raise DumpFormatError(f"{p}: is a directory, not a dump file")
    if not os.path.isfile(p):
        raise DumpFormatError(f"{p}: not a regular file (a FIFO or device is not a dump)")


def _naming(msg: str, files: tuple) -> str:
    """An error message that names a file: prefixed with the command's input(s) when it
    names none of them (an OSError from deep inside a library names nothing)."""
    names = [str(f) for f in files if f is not None]
    if not names or any(n in msg for n in names):
        return msg
    return f"{' / '.join(names)}: {msg}"


def _quiet_broken_pipe() -> None:
    """Stop without a word, as other Unix tools do. stdout is pointed at /dev/null so the
    interpreter's final flush of what is still buffered does not fail again and warn."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout is not a file descriptor (tests)
        pass


def _debug(prog: str) -> bool:
    return bool(os.environ.get("ACCUCMP_DEBUG") or os.environ.get(f"{prog.upper()}_DEBUG"))


def is_bad_input(e: BaseException) -> bool:
    """Failures the user's input causes. OSError covers the user's files and folders (no
    such file, permission, disk full, h5py's "unable to open"); MemoryError a file that
    asks for more than the machine has; and what HDF5 raises on damaged bytes the reader
    did not wrap (dumpfile.errors.raised_by_h5py). Anything else is ours."""
    from dumpfile.errors import DumpError, raised_by_h5py

    if isinstance(e, (DumpError, UsageProblem, OSError, MemoryError)):
        return True
    return isinstance(e, (RuntimeError, KeyError, ValueError)) and raised_by_h5py(e)


@contextlib.contextmanager
def boundary(*files, prog: str = "accucmp") -> Iterator[None]:
    """Wrap a command's body: every failure leaves as one line on stderr and a Status.
    `files`: the command's inputs, named in a bad-input message that names none of them."""
    try:
        yield
    except (typer.Exit, click.ClickException, click.Abort):   # click's own: it prints and exits
        raise
    except BrokenPipeError:       # an OSError, but not bad input: nobody reads our output any more
        _quiet_broken_pipe()
        raise typer.Exit(Status.BROKEN_PIPE)
    except KeyboardInterrupt:
        if _debug(prog):
            raise
        typer.echo(f"{prog}: interrupted", err=True)
        raise typer.Exit(Status.INTERRUPTED)
    except Exception as e:
        if _debug(prog):
            raise
        missing = _missing_extra(e)
        if missing is not None:
            raise fail(prog, missing) from None
        if is_bad_input(e):
            from dumpfile.errors import DumpError

            msg = one_line(e) if isinstance(e, (DumpError, UsageProblem)) else \
                _naming(f"{type(e).__name__}: {one_line(e)}", files)
            raise fail(prog, msg) from None
        typer.echo(internal_error_line(prog, e), err=True)
        raise typer.Exit(Status.INTERNAL) from None


# Modules of the optional extras (pyproject.toml): the base install is the torch-free
# comparison side, so a command of the dump side on a machine without torch is a missing
# install the user can fix (exit 2), not a bug of ours.
EXTRA_OF_MODULE = {"torch": "torch", "xxhash": "torch", "openpyxl": "xlsx"}
DISTRIBUTION_NAME = "npu-accuracy-toolkit"


def _missing_extra(e: BaseException) -> str | None:
    """The one line for an optional dependency this install leaves out, else None."""
    if not isinstance(e, ModuleNotFoundError) or not e.name:
        return None
    top = e.name.split(".", 1)[0]
    extra = EXTRA_OF_MODULE.get(top)
    if extra is None:
        return None
    first = "install torch first (e.g. pip install torch), then " if extra == "torch" else ""
    return (f"this needs {top}, which this install leaves out (the comparison side runs without "
            f"it): {first}pip install '{DISTRIBUTION_NAME}[{extra}]'")


def internal_error_line(prog: str, e: BaseException) -> str:
    """The one line a bug is reported as; writes the traceback to a new log file."""
    log, why_not = write_log(prog, e)
    where = f"with the log file {log}" if log else f"(its traceback could not be saved: {why_not})"
    return (f"{prog}: internal error (a bug in {prog}, not a problem with your input): "
            f"{type(e).__name__}: {one_line(e)[:300]}; please report it ({REPORT_AT}) {where}")


def log_dir() -> Path:
    """$XDG_STATE_HOME/accucmp (default ~/.local/state/accucmp): the user's own state folder."""
    base = os.environ.get("XDG_STATE_HOME", "")
    if not os.path.isabs(base):          # the spec says to ignore a relative value
        base = os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "accucmp"


def write_log(prog: str, e: BaseException) -> tuple[str | None, str | None]:
    """(path, None) of a new log file holding `e`'s traceback, or (None, why not).

    Created exclusively and never through a link: in log_dir(), a folder of ours (not a
    link, owned by us), opened by descriptor so it cannot be swapped while we write; when
    that fails, a new file from tempfile.mkstemp (O_EXCL, mode 0600)."""
    text = _log_text(prog, e)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    name = f"{prog}-internal-error-{stamp}-{os.getpid()}.log"
    try:
        return _write_in_state_dir(name, text), None
    except OSError as first:
        try:
            fd, path = tempfile.mkstemp(prefix=f"{prog}-internal-error-{stamp}-", suffix=".log")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            return path, None
        except OSError as second:
            return None, f"{log_dir()}: {one_line(first)}; {tempfile.gettempdir()}: {one_line(second)}"


def _write_in_state_dir(name: str, text: str) -> str:
    d = log_dir()
    os.makedirs(d, mode=0o700, exist_ok=True)
    nofollow = getattr(os, "O_NOFOLLOW", 0)
    dfd = os.open(d, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | nofollow)
    try:
        st = os.fstat(dfd)
        if not stat.S_ISDIR(st.st_mode) or (hasattr(os, "getuid") and st.st_uid != os.getuid()):
            raise PermissionError(f"{d}: not a folder of this user")
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | nofollow, 0o600, dir_fd=dfd)
    finally:
        os.close(dfd)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    return str(d / name)


def _log_text(prog: str, e: BaseException) -> str:
    from dumpfile.version import package_version

    try:
        version = package_version()
    except Exception:  # noqa: BLE001 - the log must be written whatever else is broken
        version = "unknown"
    head = [f"{prog} internal error, {datetime.datetime.now().isoformat(timespec='seconds')}",
            f"command: {shlex.join([prog] + list(sys.argv[1:] if command_args is None else command_args))}",
            f"version: {version}; Python {platform.python_version()}; {platform.platform()}", ""]
    return "\n".join(head) + "".join(traceback.format_exception(type(e), e, e.__traceback__))
