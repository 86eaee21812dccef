"""`accucmp ls`, `extract` and `export`: look into a dump, copy ops out of it, convert it
to or from the original Ascend layout. Thin typer layer over accucmp.listing,
accucmp.extract and accucmp.report.export; each runs inside the one boundary
(accucmp/cli/boundary.py). torch-free.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from accucmp.cli.boundary import UsageProblem, boundary, require_file
from accucmp.cli.options import MAX_BYTES, Force, MaxBytes, budget, parse_thresholds
from accucmp.cli.progress import console as _console


# ---- ls --------------------------------------------------------------------
# ops past which a terminal gets the plain listing instead of a rich table
RICH_MAX_OPS = 2000


def ls_command(
    dump: Annotated[Path, typer.Argument(metavar="DUMP", help="A dump file (.h5).")],
    select: Annotated[Optional[str], typer.Option("--select", help="Regex on op name / module.")] = None,
    stats: Annotated[bool, typer.Option("--stats", help="Show min/max/mean/NaN/Inf of each tensor (reads the data).")] = False,
    limit: Annotated[Optional[int], typer.Option("--limit", "-n", min=0, metavar="N", help="Show at most N ops.")] = None,
    plain: Annotated[bool, typer.Option("--plain", help="Plain text even on a terminal.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
) -> None:
    """List the ops of a dump in execution (seqid) order: phase, module, shapes, dtypes."""
    with boundary(dump):
        from accucmp.listing import list_ops, render
        from accucmp.cli.progress import progress_bar

        require_file(dump)
        # only --stats reads tensor data (a listing without it is instant)
        rows, info = list_ops(dump, select=select, stats=stats, limit=limit,
                              progress=lambda n: progress_bar("reading ops", n, quiet=quiet or not stats))
        on_terminal = sys.stdout.isatty()
        if on_terminal and not plain and len(rows) > RICH_MAX_OPS:
            # a rich table lays out every cell first (~0.5 ms an op: 25 s for 50k ops)
            print(f"accucmp ls: {len(rows)} ops, more than {RICH_MAX_OPS}: plain text "
                  f"(-n N or --select for a table)", file=sys.stderr)
            plain = True
        render(rows, info, console=_console(), plain=plain or not on_terminal, stats=stats)


# ---- extract ---------------------------------------------------------------
def extract(
    input_file: Annotated[Path, typer.Option("-i", "--input", help="Dump to copy ops from.")],
    output_file: Annotated[Path, typer.Option("-o", "--output", help="Dump to write (appended to when it exists).")],
    source: Annotated[Optional[list[str]], typer.Option("-s", "--source", metavar="/OP/SEQID/", help="/op/seqid/ to copy (repeatable; /op/ copies every call of op).")] = None,
    dest: Annotated[Optional[list[str]], typer.Option("-d", "--dest", metavar="/OP/SEQID/", help="/op/seqid/ to write it as (repeatable, pairs with -s; default: the same path).")] = None,
    from_report: Annotated[Optional[Path], typer.Option("--from-report", help="Copy every failing op of this result csv.")] = None,
    threshold: Annotated[Optional[list[str]], typer.Option("--threshold", "-t", metavar="NAME=VALUE", help="With --from-report: re-judge with this threshold first.")] = None,
    pv: Annotated[bool, typer.Option("-p", "-v", "-pv", hidden=True, help="Accepted for h5copy compatibility.")] = False,
    max_bytes: MaxBytes = MAX_BYTES,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
) -> None:
    """Copy ops into a small dump (the h5copy workflow) that works as a load file for replay."""
    with boundary(input_file):
        from accucmp.extract import extract_ops, ops_from_report

        require_file(input_file)
        pairs = _pair_paths(source or [], dest or [])
        if from_report is not None:
            require_file(from_report)
            pairs += [(p, p) for p in ops_from_report(from_report, input_file, parse_thresholds(threshold))]
        if not pairs:
            raise UsageProblem("nothing to copy: give -s /op/seqid/ or --from-report result.csv")
        from accucmp.cli.progress import progress_bar

        written = extract_ops(input_file, output_file, pairs, budget=budget(max_bytes=max_bytes),
                              progress=lambda n: progress_bar("copying ops", n, quiet=quiet))
        typer.echo(f"copied {len(written)} op(s) to {output_file}")
        for path in written:
            typer.echo(f"  {path}")


def _pair_paths(sources: list[str], dests: list[str]) -> list[tuple[str, str]]:
    if dests and len(dests) != len(sources):
        raise UsageProblem(f"-d given {len(dests)} time(s) for {len(sources)} -s: give one -d per -s or none")
    return list(zip(sources, dests or sources))


# ---- export ----------------------------------------------------------------
def export_command(
    input: Annotated[Path, typer.Option("-i", "--input", help="Dump to convert.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="File to write (new; an existing one only with --force).")],
    layout: Annotated[str, typer.Option(
        "--layout", help="legacy: the original Ascend layout the real msaccucmp reads; "
                         "native: an original-layout file into this project's format.")] = "legacy",
    device_type: Annotated[str, typer.Option(
        "--device-type", help="legacy: DeviceType written on every tensor: keep, npu (the "
                              "original's -m file must say NPU), cpu or cuda.")] = "keep",
    force: Force = False,
) -> None:
    """Convert between this project's dump format and the original Ascend layout (docs/FORMAT.md)."""
    with boundary(input):
        from accucmp.report.export import ExportError, run_export

        if device_type not in ("keep", "npu", "cpu", "cuda"):
            raise UsageProblem(f"--device-type {device_type!r}: use keep, npu, cpu or cuda")
        try:
            counts = run_export(str(input), str(output), layout, device_type=device_type, force=force)
        except ExportError as e:      # a layout the export cannot write: the user's choice
            raise UsageProblem(str(e)) from None
        typer.echo(f"wrote {output} ({layout}): {counts['ops']} ops, {counts['tensors']} tensors")
        from accucmp.report.export import not_carried

        for line in not_carried(counts, layout):
            typer.echo(f"  not carried: {line}")


def register(app: typer.Typer) -> None:
    app.command("ls")(ls_command)
    app.command("extract")(extract)
    app.command("export")(export_command)
