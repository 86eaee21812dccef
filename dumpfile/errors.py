"""Domain errors. Each message is one line that names the file and the problem;
the CLIs turn them into exit code 2 at their boundary."""


class DumpError(Exception):
    """Base class: something is wrong with a dump file or its use."""


class DumpFormatError(DumpError):
    """A file is missing, not HDF5, truncated, not a dump, or has a corrupt entry."""


class DumpWriteError(DumpError):
    """A dump could not be written (path, permissions, disk full)."""


def writer_error_message(e: BaseException, path: str) -> str:
    """The one line a writer failure is reported as: a DumpError's own message, anything
    else as "dump writer failed", always naming `path`."""
    msg = str(e) if isinstance(e, DumpError) else f"{path}: dump writer failed: {e}"
    if path not in msg:
        msg = f"{path}: {msg}"
    return msg.replace("\n", " ")


def raised_by_h5py(e: BaseException) -> bool:
    """True when the innermost frame of `e` is h5py's (its Cython modules too): an HDF5
    failure, not a bug of ours that happens to raise KeyError or ValueError. Here, not in
    the reader, so the CLI boundary can apply the rule without importing h5py."""
    tb = e.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return str(tb.tb_frame.f_globals.get("__name__", "")).startswith("h5py")
