"""The `accucmp` command line: the typer app, the modules whose commands it holds, and the
entry point (`accucmp` = `main`, also `python -m accucmp.cli`).

Start-up matters (msprobe's compare CLI takes 3.5 s before doing anything), so nothing
heavy is imported at top level: pandas, h5py, numpy, matplotlib and the comparison engine
are imported inside the commands that use them, and torch never (only `golden`/`demo`
import it, in their bodies).

Each command module has a `register(app)`; each command's body runs inside the one
boundary (accucmp/cli/boundary.py) that turns a failure into one line and a Status (exit
code); main() runs the whole app inside it too, so nothing leaves as a traceback.
"""

from __future__ import annotations

import importlib
import sys

import typer

from accucmp.cli import compare as _compare
from accucmp.cli.boundary import boundary
from dumpfile import cli_boundary

app = cli_boundary.new_app(
    "accucmp", "Compare op-level dumps of two runs of a PyTorch model and find the op whose numerics went wrong.")

# in the order `accucmp --help` lists their commands
_COMMAND_MODULES = ("accucmp.cli.compare", "accucmp.cli.dumps", "accucmp.cli.convert", "accucmp.cli.golden",
                    "accucmp.cli.demo", "accucmp.cli.whatif")


def _register_commands(target: typer.Typer) -> None:
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(target)


_register_commands(app)


def normalize_argv(argv: list[str]) -> list[str]:
    """Accept msaccucmp's `-p 1` / `-p 0` spelling as well as the plain `-p` flag."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("-p", "--dump-failures") and i + 1 < len(argv) and argv[i + 1] in ("0", "1"):
            if argv[i + 1] == "1":
                out.append(a)
            i += 2
            continue
        out.append(a)
        i += 1
    return out


def main(argv: list[str] | None = None) -> None:
    if argv is None:          # the program (not a test calling main([...])): Ctrl-C is one line, exit 130
        from dumpfile import interrupts
        if not interrupts.installed():
            interrupts.install("accucmp")
    args = list(sys.argv[1:] if argv is None else argv)
    _compare.INVOKED_ARGS = args          # the report's Run table names the command line,
    cli_boundary.command_args = args      # as does the log of an internal error
    # the commands run inside the boundary already; this one catches what happens around
    # them (typer's own parsing, a command module that fails to import)
    try:
        with boundary():
            app(args=normalize_argv(args), prog_name="accucmp")
    except typer.Exit as e:     # raised by the boundary, outside click's own handling
        sys.exit(e.exit_code)


if __name__ == "__main__":  # pragma: no cover
    main()
