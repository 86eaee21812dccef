"""`accucmp whatif`, `bisect` and `calibrate`: registered by accucmp/cli/main.py.

Thin typer layer; the work is in accucmp/whatif.py (numpy only, never torch) and
accucmp/bisect.py (runs the user's script in subprocesses; never imports torch either).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from accucmp.cli.boundary import UsageProblem, boundary, require_file


def whatif_command(
    dump: Annotated[Path, typer.Argument(metavar="DUMP", help="A full dump (.h5), e.g. of an fp32 run.")],
    dtype: Annotated[str, typer.Option("--dtype", metavar="LIST", help="Comma-separated formats: bf16,fp16,fp8_e4m3,fp8_e5m2,mxfp8.")] = "bf16,fp16,fp8_e4m3,fp8_e5m2,mxfp8",
    out: Annotated[Path, typer.Option("-out", "--out", "-o", help="Output directory for whatif_*.csv.")] = Path("."),
    select: Annotated[Optional[str], typer.Option("--select", help="Regex on op name / module.")] = None,
    chunk_elements: Annotated[int, typer.Option("--chunk-elements", min=1, metavar="N", help="Elements read per chunk (bounds peak memory).")] = 1 << 22,
    top: Annotated[int, typer.Option("--top", min=0, metavar="N", help="How many worst tensors per format the summary lists.")] = 5,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No terminal summary; only the output path.")] = False,
) -> None:
    """Predict underflow/subnormal/overflow shares, rounding error and MXFP8 block loss of every recorded tensor per low-precision format."""
    with boundary(dump):
        from accucmp.numformats import parse_dtypes
        from accucmp.whatif import run_whatif, summarize

        try:
            formats = parse_dtypes(dtype)
        except ValueError as e:
            raise UsageProblem(str(e)) from None
        require_file(dump)
        skipped: list = []
        path, rows = run_whatif(dump, formats, out, select=select, chunk_elements=chunk_elements,
                                skipped=skipped)
        if not quiet:
            for line in summarize(rows, formats, top=top):
                typer.echo(line)
            if skipped:
                from dumpfile.overwritten import REASON
                op, seqid, io, name = skipped[0]
                typer.echo(f"note: {len(skipped)} tensor(s) not judged: {REASON} (e.g. {op}/{seqid} {io} {name})")
        typer.echo(f"wrote {path}")


def bisect_command(
    run: Annotated[str, typer.Option("--run", metavar="COMMAND", help="Shell command running one step; prints 'loss=<float>' (its last such line counts).")],
    golden_loss: Annotated[str, typer.Option("--golden-loss", metavar="LOSS|FILE", help="The golden loss: a number, or a file with a 'loss=<float>' line (its last; the first number after loss=).")],
    from_compare: Annotated[Optional[Path], typer.Option("--from-compare", help="Suspects: the failing ops of this compare result csv.")] = None,
    by: Annotated[str, typer.Option("--by", help="With --from-compare: suspects are failing 'op's or their 'module's.")] = "op",
    ops: Annotated[Optional[list[str]], typer.Option("--ops", metavar="OPS", help="Suspect ops, comma-separated (repeatable).")] = None,
    modules: Annotated[Optional[list[str]], typer.Option("--modules", metavar="PATHS", help="Suspect module subtrees, comma-separated (repeatable).")] = None,
    rtol: Annotated[float, typer.Option("--rtol", min=0.0, metavar="F", help="Within tolerance: |loss - golden| <= atol + rtol*|golden|.")] = 1e-3,
    atol: Annotated[float, typer.Option("--atol", min=0.0, metavar="F", help="Absolute part of the tolerance (see --rtol).")] = 0.0,
    dtype: Annotated[str, typer.Option("--dtype", help="Precision the upcast ops run in.")] = "float32",
    out: Annotated[Path, typer.Option("-out", "--out", "-o", help="Directory for bisect_cache.json.")] = Path("."),
    timeout: Annotated[Optional[float], typer.Option("--timeout", metavar="SECONDS", help="Seconds per script run.")] = None,
) -> None:
    """Find the smallest set of ops / module subtrees whose upcast brings the loss within tolerance of the golden."""
    with boundary():
        from accucmp.bisect import (BisectError, ScriptRunner, Suspect, bisect, command_line,
                             read_golden, split_names, suspects_from_compare)

        try:
            if by not in ("op", "module"):
                raise UsageProblem(f"--by {by!r}: choose op or module")
            suspects = [Suspect("op", n) for n in split_names(ops)]
            suspects += [Suspect("module", n) for n in split_names(modules)]
            if from_compare is not None:
                require_file(from_compare)
                suspects += suspects_from_compare(from_compare, by)
            if not suspects:
                raise UsageProblem("no suspects: give --from-compare result.csv, --ops or --modules")
            say = lambda s: typer.echo(s, err=True)  # noqa: E731 - progress on stderr, result on stdout
            golden = read_golden(golden_loss, say)
            runner = ScriptRunner(command_line(run), dtype, out / "bisect_cache.json", timeout, progress=say)
            res = bisect(runner, suspects, golden, rtol, atol, progress=say)
        except BisectError as e:
            raise UsageProblem(str(e)) from None
        if not res.culprits:
            typer.echo(f"nothing to upcast: loss {res.baseline:.9g} is within tolerance of golden {golden:.9g}")
        else:
            typer.echo(f"smallest set ({len(res.culprits)} of {res.suspects} suspects): "
                       + ", ".join(str(c) for c in res.culprits))
            typer.echo(f"loss {res.baseline:.9g} -> {res.fixed:.9g} with them upcast (golden {golden:.9g}); "
                       f"{res.runs} script run(s), {res.evaluations} set evaluation(s)")


def calibrate_command(
    golden: Annotated[Path, typer.Option("-g", "--golden-dump", help="The golden dump compare will use as -g.")],
    second: Annotated[Path, typer.Option("-m", "--second-dump", help="A second golden run: harmlessly perturbed, or just re-run.")],
    out: Annotated[Path, typer.Option("-out", "--out", "-o", help="Directory for noise_floor.csv.")] = Path("."),
) -> None:
    """Measure each tensor's noise floor from two golden runs, for compare to allow."""
    with boundary(golden, second):
        from accucmp.compare.calibrate import calibrate

        require_file(golden)
        require_file(second)
        path, n = calibrate(golden, second, out)
        typer.echo(f"wrote {path} ({n} tensors)")


def register(app: typer.Typer) -> None:
    app.command("calibrate")(calibrate_command)
    app.command("whatif")(whatif_command)
    app.command("bisect")(bisect_command)
