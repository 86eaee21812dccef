"""`accucmp convert -d DIR_OR_FILES -out OUT`: kernel dumps -> .npy/.txt (torch-free).

Registered into accucmp.cli.main's app by register(app). Exit codes (Status): 0 all
converted, 1 some files failed (each named on stderr, the rest converted), 2 bad usage or
bad input (nothing to convert, no file converted, an existing output without --force, a
cap reached, output not writable), 3 a bug of ours.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from accucmp.cli.boundary import Status, UsageProblem, boundary, fail
from accucmp.cli.options import MAX_BYTES, MAX_FILES, Force, MaxBytes, MaxFiles


def _split(values: list[str]) -> list[str]:
    out = []
    for v in values:
        out += [p for p in v.split(",") if p.strip()]
    return out


def convert_command(
    dump: Annotated[list[str], typer.Option(
        "-d", "--dump", metavar="PATHS", help="Kernel dump file or folder (searched recursively); repeat or comma-separate.")],
    out: Annotated[Optional[Path], typer.Option(
        "-out", "--out", "--output", help="Folder for the converted files (created).")] = None,
    fmt: Annotated[str, typer.Option("--format", "-f", help="npy, txt (flattened, np.savetxt) or both.")] = "npy",
    verbose: Annotated[int, typer.Option("-v", "--verbose", metavar="0|1|2", help="0 quiet, 1 summary, 2 every file.")] = 1,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar and no summary (as -v 0).")] = False,
    force: Force = False,
    max_files: MaxFiles = MAX_FILES,
    max_bytes: MaxBytes = MAX_BYTES,
) -> None:
    """Convert CANN-layout kernel dumps (ir2tbe's or CANN's) to .npy/.txt, one file per tensor."""
    with boundary(*_split(dump)):
        _convert(dump, out, fmt, 0 if quiet else verbose, force, max_files, max_bytes)


def _convert(dump, out, fmt, verbose, force, max_files, max_bytes) -> None:
    from dumpfile.errors import DumpError, DumpFormatError, DumpWriteError
    from accucmp.convert import FORMATS, convert_paths

    from accucmp.cli.options import budget

    if fmt not in FORMATS:
        raise UsageProblem(f"--format {fmt!r}: use one of {', '.join(FORMATS)}")
    sources = _split(dump)
    missing = [src for src in sources if not Path(src).exists()]
    if missing:     # a typo in -d is bad input (exit 2), not a kernel dump that failed to convert
        raise DumpFormatError(f"{missing[0]}: no such file or directory")
    out_dir = str(out) if out is not None else "."
    try:
        from accucmp.convert import find_dump_files

        from accucmp.cli.progress import progress_bar, watched

        caps = budget(max_files, max_bytes)
        total = len(find_dump_files(list(sources))[0]) if verbose >= 1 and watched() else None
        with progress_bar("converting", total, quiet=verbose < 1) as advance:
            result = convert_paths(sources, out_dir, fmt, force=force, budget=caps, advance=advance)
    except DumpWriteError:            # names the output (or the option) itself
        raise
    except (DumpError, OSError) as e:
        raise fail("accucmp", f"{out_dir}: {e}") from None
    if verbose >= 2:
        for src, files in result.converted:
            typer.echo(f"{src} -> {len(files)} file(s)")
    for _, why in result.failed:
        typer.echo(f"accucmp: convert failed: {' '.join(why.split())}", err=True)
    if not result.converted and not result.failed:
        raise fail("accucmp", f"no kernel dump files found in {', '.join(sources)}")
    if not result.converted:          # nothing converted: bad input, each file's line says why
        raise typer.Exit(Status.BAD_INPUT)
    if verbose >= 1:
        n_files = sum(len(f) for _, f in result.converted)
        typer.echo(f"converted {len(result.converted)} dump file(s) into {n_files} file(s) in {out_dir}"
                   + (f"; {len(result.failed)} failed" if result.failed else ""))
    if result.failed:
        raise typer.Exit(Status.FINDINGS)


def register(app: typer.Typer) -> None:
    app.command("convert")(convert_command)
