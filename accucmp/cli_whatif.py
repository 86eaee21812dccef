"""`accucmp whatif` (and `bisect`, `calibrate` when present): registered by accucmp/cli.py.

Thin typer layer; the work is in accucmp/whatif.py (numpy only, never torch) and
accucmp/bisect.py (runs the user's script in subprocesses; never imports torch either).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer


def whatif_command(
    dump: Annotated[Path, typer.Argument(help="A full dump (.h5), e.g. of an fp32 run.")],
    dtype: Annotated[str, typer.Option("--dtype", help="Comma-separated: bf16,fp16,fp8_e4m3,fp8_e5m2,mxfp8.")] = "bf16,fp16,fp8_e4m3,fp8_e5m2,mxfp8",
    out: Annotated[Path, typer.Option("-out", "--out", "-o", help="Output directory for whatif_*.csv.")] = Path("."),
    select: Annotated[Optional[str], typer.Option("--select", help="Regex on op name / module.")] = None,
    chunk_elements: Annotated[int, typer.Option("--chunk-elements", min=1, help="Elements read per chunk (bounds peak memory).")] = 1 << 22,
    top: Annotated[int, typer.Option("--top", min=0, help="How many worst tensors per format the summary lists.")] = 5,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No terminal summary; only the output path.")] = False,
) -> None:
    """Predict underflow/subnormal/overflow shares, rounding error and MXFP8 block loss of every recorded tensor per low-precision format."""
    from .cli import UsageProblem, _boundary, _require_file

    with _boundary():
        from .whatif import parse_dtypes, run_whatif, summarize

        try:
            formats = parse_dtypes(dtype)
        except ValueError as e:
            raise UsageProblem(str(e)) from None
        _require_file(dump)
        path, rows = run_whatif(dump, formats, out, select=select, chunk_elements=chunk_elements)
        if not quiet:
            for line in summarize(rows, formats, top=top):
                typer.echo(line)
        typer.echo(f"wrote {path}")


def register(app: typer.Typer) -> None:
    app.command("whatif")(whatif_command)
