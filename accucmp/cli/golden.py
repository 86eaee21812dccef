"""`accucmp golden -i npu.h5 -o golden.h5`: recompute every op of a dump in float64.

Registered into accucmp.cli.main's app by register(app). torch is imported only inside the
command body, so `accucmp --help` and the other commands stay torch-free.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from accucmp.cli.boundary import UsageProblem, boundary, require_file
from accucmp.cli.options import Force


def golden_command(
    input: Annotated[Path, typer.Option("-i", "--input", help="The dump to recompute (e.g. npu.h5).")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Golden file to write (an existing one only with --force).")],
    device: Annotated[str, typer.Option("--device", help="Device to recompute on.")] = "cpu",
    dtype: Annotated[str, typer.Option("--dtype", help="Floating dtype to recompute in.")] = "float64",
    remap_devices: Annotated[bool, typer.Option(
        "--remap-devices", help="Run ops whose arguments name another device on --device.")] = False,
    dump_inputs: Annotated[bool, typer.Option(
        "--with-inputs/--outputs-only", help="Also write the upcast inputs (compare rows for inputs).")] = True,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Progress bar (on a terminal).")] = True,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar (as --no-progress).")] = False,
    force: Force = False,
) -> None:
    """Recompute every op of a dump from its own recorded inputs in float64 (no second device).

    Then `accucmp compare -m INPUT -g OUTPUT` shows each op's own error against the exact answer.
    """
    from dumpfile.errors import DumpError, DumpFormatError
    from dumpfile.safe_output import check_target, output_path

    with boundary(input):
        require_file(input)
        from dumpfile import DumpFile

        with DumpFile(input):   # a bad input is named first (torch-free, before minutes of replay)
            pass
        if os.path.lexists(output) and os.path.exists(output) and os.path.samefile(input, output):
            raise DumpFormatError(f"{output}: golden output would overwrite the dump it replays")
        check_target(output, force=force)       # before minutes of replay, not after
        _check_device(device)
        from npu_dumper.replay.golden import replay

        # written to a temporary file beside OUTPUT, put in place when complete:
        # never through a link at OUTPUT, never over a file without --force
        with output_path(output, force=force) as tmp:
            try:
                result = replay(input, tmp, device=device, dtype=dtype, remap_devices=remap_devices,
                                dump_inputs=dump_inputs,
                                progress=None if progress and not quiet else False)
            except DumpError as e:   # the user knows OUTPUT, not its temporary name
                e.args = tuple(str(a).replace(tmp, str(output)) for a in e.args) if e.args else e.args
                raise
            if result.total == 0:   # nothing recomputed is not a golden
                raise DumpFormatError(f"{input}: dump holds no op; nothing to recompute")
        result.path = str(output)
        typer.echo(result.summary())


def _check_device(device: str) -> None:
    """A --device this machine cannot run on is the user's choice (exit 2), said before the
    replay starts; torch raises RuntimeError for a bad name, AssertionError for CUDA missing."""
    import torch

    try:
        torch.empty(0, device=torch.device(device))
    except (RuntimeError, AssertionError) as e:
        raise UsageProblem(f"--device {device!r}: {' '.join(str(e).split())}") from None


def register(app: typer.Typer) -> None:
    app.command("golden")(golden_command)
