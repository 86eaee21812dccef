"""`python -m npu_dumper.compiled narrow EAGER.h5 --seqid N [--op aten.silu]`: the compiler
pass or decomposition that makes one op's compiled result differ from eager (narrow.py),
the op rebuilt from an eager dump's recorded inputs. A thin typer layer over
narrow_recorded_op; failures leave through the boundary accucmp and ir2tbe share
(dumpfile/cli_boundary.py): bad input one line and exit 2.

Exit: 0 the op compiled alone matches eager; 1 it differs (the line names what the
bisector found); 2 bad input.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from dumpfile.cli_boundary import boundary, new_app, require_file

PROG = "npu_dumper.compiled"

app = new_app(PROG, "Narrow a compiled op's error down to the compiler pass or decomposition (docs/COMPILED.md).")


@app.callback()
def _commands() -> None:
    """(a group: `narrow` stays a subcommand, as the docs spell it)"""


@app.command("narrow")
def narrow_command(
    dump: Annotated[Path, typer.Argument(metavar="EAGER.h5", help="Eager dump holding the op's inputs.")],
    seqid: Annotated[int, typer.Option("--seqid", help="The op's seqid in EAGER.h5 (compare's GoldenSeqId).")],
    op: Annotated[Optional[str], typer.Option(
        "--op", help="The op it must be (aten.silu.default or aten.silu): a check on --seqid.")] = None,
) -> None:
    """Rebuild one op of EAGER.h5 from its recorded inputs, compile it alone with torch.compile
    and bisect Inductor (PyTorch's compiler bisector) to what makes it differ from eager."""
    with boundary(dump, prog=PROG):
        require_file(dump)
        from .narrow import narrow_line
        # the bisector prints its progress ("Moving to the next system: aot_eager") on
        # stdout: sent to stderr, so stdout holds the one line of the result
        with contextlib.redirect_stdout(sys.stderr):
            line, differs = narrow_line(str(dump), op, seqid)
        typer.echo(line)
    raise typer.Exit(1 if differs else 0)


def main(argv: list[str] | None = None) -> None:
    import sys

    from dumpfile import cli_boundary, interrupts

    if argv is None and not interrupts.installed():       # the program: Ctrl-C is one line, exit 130
        interrupts.install(PROG)
    cli_boundary.command_args = list(sys.argv[1:] if argv is None else argv)
    try:
        with boundary(prog=PROG):      # typer's own parsing
            app(args=argv, prog_name=f"python -m {PROG}")
    except typer.Exit as e:
        sys.exit(e.exit_code)
