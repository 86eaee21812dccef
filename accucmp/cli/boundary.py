"""accucmp's error boundary, exit codes (Status) and input checks: implemented once in
dumpfile/cli_boundary.py, below ir2tbe, which shares it; named here for the commands."""

from dumpfile.cli_boundary import (REPORT_AT, Status, UsageProblem, boundary, fail,  # noqa: F401
                                   internal_error_line, log_dir, one_line, require_file, write_log)
