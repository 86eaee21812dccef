"""`accucmp golden -i npu.h5 -o golden.h5`: recompute every op of a dump in float64.

Registered into accucmp.cli's app by register(app). torch is imported only inside the
command body, so `accucmp --help` and the other commands stay torch-free.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def golden_command(
    input: Annotated[Path, typer.Option("-i", "--input", help="The dump to recompute (e.g. npu.h5).")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Golden file to write (overwritten).")],
    device: Annotated[str, typer.Option("--device", help="Device to recompute on.")] = "cpu",
    dtype: Annotated[str, typer.Option("--dtype", help="Floating dtype to recompute in.")] = "float64",
    remap_devices: Annotated[bool, typer.Option(
        "--remap-devices", help="Run ops whose arguments name another device on --device.")] = False,
    dump_inputs: Annotated[bool, typer.Option(
        "--with-inputs/--outputs-only", help="Also write the upcast inputs (compare rows for inputs).")] = True,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Progress bar.")] = True,
) -> None:
    """Recompute every op of a dump from its own recorded inputs in float64 (no second device).

    Then `accucmp compare -m INPUT -g OUTPUT` shows each op's own error against the exact answer.
    """
    from dumpfile.errors import DumpError

    from .cli import _boundary

    with _boundary():       # anything unexpected: one line (ACCUCMP_DEBUG=1: the traceback)
        try:
            from npu_dumper.golden import replay

            result = replay(input, output, device=device, dtype=dtype, remap_devices=remap_devices,
                            dump_inputs=dump_inputs, progress=None if progress else False)
        except DumpError as e:
            typer.echo(f"accucmp: error: {' '.join(str(e).split())}", err=True)
            raise typer.Exit(2)
        except RuntimeError as e:  # e.g. an unavailable --device
            typer.echo(f"accucmp: error: {input}: {' '.join(str(e).split())}", err=True)
            raise typer.Exit(2)
        typer.echo(result.summary())


def register(app: typer.Typer) -> None:
    app.command("golden")(golden_command)
