"""Errors the dumper raises at block entry or exit. One line each, naming the file."""

from dumpfile.errors import DumpError


class DumperError(DumpError):
    """Bad arguments or files given to torch.utils.dumper / npu_dumper.dumper."""
