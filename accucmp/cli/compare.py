"""`accucmp compare` and `accucmp report`: the verdict on two dumps, and the verdict
re-applied to a saved result. Thin: options are checked here, the work is in
accucmp.compare (streaming, ranks) and accucmp.report; both run inside the one boundary
(accucmp/cli/boundary.py) and exit Status.OK (all pass), FINDINGS (some fail, or none
could be compared) or BAD_INPUT.

Never imports torch, nor anything heavy at import time (`accucmp --help` stays fast):
pandas, h5py and the engine are imported inside the commands.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated, Optional

import typer

from accucmp.cli.boundary import Status, UsageProblem, boundary, require_file
from accucmp.cli.options import (MAX_BYTES, MAX_FILES, AlignMapFile, Force, MaxBytes, MaxFiles, Tolerance, budget,
                                 parse_algorithms, parse_formats, parse_thresholds, with_tolerance)
from accucmp.cli.progress import console as _console

INVOKED_ARGS: list[str] | None = None     # set by accucmp.cli.main.main(): the command line as given


def exit_code_for(table) -> int:
    """OK when every compared tensor passes, FINDINGS when any fails or nothing could be compared."""
    from accucmp.report.summary import result_counts

    counts = result_counts(table)
    return exit_code_for_counts(counts, len(table))


def exit_code_for_counts(counts: dict[str, int], rows: int) -> int:
    """exit_code_for, from the counts of a streamed result."""
    if counts.get("fail", 0):
        return Status.FINDINGS
    if counts.get("pass", 0) == 0 and rows:
        return Status.FINDINGS
    return Status.OK


# ---- compare ---------------------------------------------------------------
def compare(
    my_dump: Annotated[Path, typer.Option("-m", "--my-dump", help="Target dump (the run under suspicion), .h5.")],
    golden_dump: Annotated[Path, typer.Option("-g", "--golden-dump", help="Golden (reference) dump, .h5.")],
    out: Annotated[Path, typer.Option("-out", "--out", "-o", help="Output directory.")] = Path("."),
    alg: Annotated[str, typer.Option("--alg", help="'all' or comma-separated metric names.")] = "all",
    select: Annotated[Optional[str], typer.Option("--select", help="Regex on op name / module: compare only matching ops.")] = None,
    exclude: Annotated[Optional[list[str]], typer.Option("--exclude", "-x", metavar="PATTERN", help="Leave out ops by name (repeatable; the dumper's exclude= glob or regex, e.g. aten.copy_), in every check.")] = None,
    threshold: Annotated[Optional[list[str]], typer.Option("--threshold", "-t", metavar="NAME=VALUE", help="Override one verdict threshold (repeatable).")] = None,
    fmt: Annotated[str, typer.Option("--format", "-f", metavar="LIST", help="Comma-separated: csv,json,jsonl,html,xlsx (csv always; jsonl: a JSON object per row as rows are judged).")] = "csv",
    tolerance: Tolerance = None,
    summary_json: Annotated[Optional[Path], typer.Option("--summary-json", help="Also write the verdict as JSON for CI (PASS/FAIL, sentence, exit code, counts, first and worst ops); replaces the summary an earlier run wrote there.")] = None,
    jobs: Annotated[int, typer.Option("--jobs", "-j", min=0, metavar="N", help="Worker processes for reads and metrics; 0: one per core (at most 4) from 500 ops.")] = 0,
    pickle_failures: Annotated[bool, typer.Option("-p", "--dump-failures", help="Also write the failing rows to a filtered csv and their tensors (both sides) as .npy.")] = False,
    golden_fp64: Annotated[Optional[Path], typer.Option("--golden-fp64", help="fp64 golden replay of the golden dump: judge each op's error against the golden device's own error.")] = None,
    chunk_elements: Annotated[int, typer.Option("--chunk-elements", min=1, metavar="N", help="Elements read per chunk (bounds peak memory).")] = 1 << 22,
    top: Annotated[int, typer.Option("--top", min=0, metavar="N", help="How many worst/unmatched ops the summary lists.")] = 5,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No terminal summary; only the output paths.")] = False,
    scheduler: Annotated[Optional[str], typer.Option("--scheduler", help="Folders: run on this Dask cluster (tcp://host:port) instead of a local one.")] = None,
    workers: Annotated[int, typer.Option("--workers", "-w", min=0, metavar="N", help="Folders: local Dask worker processes; 0: one per core, at most one per rank pair.")] = 0,
    replica_check: Annotated[bool, typer.Option("--replica-check/--no-replica-check", help="Folders: tensors equal on every golden rank (weights, reduced grads) must be equal on every target rank.")] = True,
    force: Force = False,
    max_files: MaxFiles = MAX_FILES,
    max_bytes: MaxBytes = MAX_BYTES,
    noise_floor: Annotated[Optional[Path], typer.Option("--noise-floor", help="noise_floor.csv of `accucmp calibrate`: pass failures within --noise-factor x the model's own noise.")] = None,
    noise_factor: Annotated[float, typer.Option("--noise-factor", min=0.0, metavar="F", help="With --noise-floor: allowed multiple of the noise floor.")] = 2.0,
    align_map: AlignMapFile = None,
    batch_split: Annotated[str, typer.Option("--batch-split", metavar="auto|interleaved|contiguous", help="Run folder vs one file: the rows each rank holds.")] = "auto",
    loss_reduction: Annotated[str, typer.Option("--loss-reduction", metavar="mean|sum", help="Run folder vs one file: the loss's reduction.")] = "mean",
    bitwise: Annotated[bool, typer.Option("--bitwise", help="Determinism check of two statistics dumps: a tensor passes only when its content hash equals the golden's; names the first op whose output bits differ.")] = False,
) -> None:
    """Compare TARGET (-m) against GOLDEN (-g): a result csv in DIR and the verdict; exit 0 all pass, 1 some fail, 2 bad input.

    Two folders of per-rank dumps: every rank pair, in parallel on Dask; a folder against
    one file: every rank against that single-process reference (docs/COMPARE.md)."""
    with boundary(my_dump, golden_dump):
        formats = parse_formats(fmt)
        thresholds = with_tolerance(parse_thresholds(threshold), tolerance)
        algorithms = _metric_names(alg)
        caps = budget(max_files, max_bytes)   # a bad --max-bytes is said before minutes of compare
        if summary_json is not None:           # a taken --summary-json name too (an earlier summary: replaced)
            from accucmp.report.outputs import summary_json_force
            from dumpfile.safe_output import check_target

            check_target(summary_json, force=summary_json_force(summary_json, force))
        sharded = None
        if my_dump.is_dir() or golden_dump.is_dir():
            # a run whose ops hold DTensors against another layout: its shards put together
            # into one file first (accucmp/compare/shards.py), then compared as files
            from accucmp.compare.shards import prepare

            sharded = prepare(my_dump, golden_dump, out, selected=select is not None)
            if sharded is not None:
                for line in sharded.lines():
                    typer.echo(f"accucmp: {line}", err=True)
                my_dump, golden_dump = sharded.target, sharded.golden
        if my_dump.is_dir() and (golden_dump.is_dir() or golden_dump.is_file()):
            # a folder of ranks against another folder, or against one single-process
            # reference (docs/COMPARE.md): the same options, another callee
            if align_map is not None:
                raise UsageProblem("--align-map takes two files, not "
                                   + ("folders" if golden_dump.is_dir() else "a folder"))
            meta = {"command": _command_line()} if _command_line() else {}
            if thresholds:
                meta["threshold_overrides"] = thresholds
            common = dict(algorithms=algorithms, select=select, exclude=tuple(exclude or ()),
                          thresholds=thresholds, chunk_elements=chunk_elements, top=top, quiet=quiet,
                          scheduler=scheduler, workers=workers, formats=formats, console=_console(),
                          golden_fp64=golden_fp64, dump_failures=pickle_failures,
                          summary_json=summary_json, meta=meta, force=force)
            if golden_dump.is_dir():
                from accucmp.compare.ranks import run_folder_compare
                code = run_folder_compare(my_dump, golden_dump, out, replica_check=replica_check, **common)
            else:
                from accucmp.compare.reference_runs import run_reference_compare
                code = run_reference_compare(my_dump, golden_dump, out, batch_split=batch_split,
                                             loss=loss_reduction, **common)
            raise typer.Exit(code)
        from accucmp.report.outputs import failing_rows_of_csv, new_result_csv, write_failures, write_other_formats
        from accucmp.compare.streaming import compare_to_csv
        from accucmp.report.summary import print_summary

        for p in (my_dump, golden_dump) + ((golden_fp64,) if golden_fp64 else ()):
            require_file(p)
        csv_path = new_result_csv(out)
        jsonl_path = csv_path.with_suffix(".jsonl") if "jsonl" in formats else None
        # rows go to the csv as they are judged; only the summary's rows stay in memory
        with _compare_progress(_console(), quiet) as on_rows:
            result = compare_to_csv(str(my_dump), str(golden_dump), csv_path, algorithms=algorithms, select=select,
                                    exclude=tuple(exclude or ()),
                                    jobs=jobs, chunk_elements=chunk_elements,
                                    golden_fp64=str(golden_fp64) if golden_fp64 else None,
                                    thresholds=thresholds, top=top, force=force,
                                    adjust=_adjusters(_noise_floor_adjuster(noise_floor, noise_factor),
                                                      _bitwise_adjuster(bitwise, my_dump, golden_dump)),
                                    jsonl_path=jsonl_path, on_rows=on_rows,
                                    align_map=str(align_map) if align_map else None)
        if jsonl_path is not None and not result.rows:
            jsonl_path.unlink(missing_ok=True)
        _require_ops(result, my_dump, golden_dump, select, exclude)
        for line in sanity_lines(result.meta or {}, my_dump, golden_dump):
            typer.echo(line, err=True)
        meta = dict(result.meta or {})
        meta.setdefault("target", str(my_dump))
        meta.setdefault("golden", str(golden_dump))
        if thresholds:
            meta["threshold_overrides"] = thresholds
        if _command_line():
            meta["command"] = _command_line()
        if "html" in formats:      # the report's Run table: each dump's device, torch, mode, ...
            from accucmp.report.html import run_info

            meta["runs"] = {k: run_info(p) for k, p in (("target", my_dump), ("golden", golden_dump),
                                                          ("golden_fp64", golden_fp64)) if p is not None}
        paths = [csv_path] + ([jsonl_path] if jsonl_path else []) + write_other_formats(
            csv_path, formats, meta=meta, force=force)
        if pickle_failures:
            paths += write_failures(failing_rows_of_csv(csv_path), my_dump, golden_dump, out,
                                    stamp=paths[0].stem.split("_", 1)[1], force=force, budget=caps)
        console = _console()
        for line in sharded.findings() if sharded is not None and not quiet else ():
            console.print(line, highlight=False, soft_wrap=True)     # ranks that disagree lead the verdict
        if not quiet:
            print_summary(None, console=console, meta=meta, top=top, summary=result.summary)
        code = exit_code_for_counts(result.summary.counts, result.rows)
        if sharded is not None:
            from accucmp.compare.shards import report_lines

            lines, failed = report_lines(sharded, result.summary)
            for line in lines if not quiet else ():
                console.print(line, highlight=False, soft_wrap=True)
            code = Status.FINDINGS if failed else code
            meta["sharded"] = {"assembled": [str(a.path) for a in sharded.assembled],
                               "lines": sharded.findings() + lines}
        for p in paths[:1] + [p for p in paths[1:] if p.suffix != ".npy"]:
            console.print(f"wrote {p}", highlight=False, soft_wrap=True)
        npys = sum(1 for p in paths if p.suffix == ".npy")
        if npys:
            console.print(f"wrote {npys} .npy files to {paths[-1].parent}", soft_wrap=True)
        if summary_json is not None:
            from accucmp.report.outputs import summary_record, write_summary_json

            rec = summary_record(result.summary, code=code, meta=meta,
                                 outputs=[p for p in paths if p.suffix != ".npy"])
            if sharded is not None:
                from accucmp.compare.shards import summary_fields

                rec.update(summary_fields(sharded, meta["sharded"]["lines"], rec))
            console.print(f"wrote {write_summary_json(summary_json, rec, force=force)}", highlight=False,
                          soft_wrap=True)
    raise typer.Exit(code)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or a.samefile(b)
    except OSError:
        return False


def sanity_lines(meta: dict, my_dump: Path, golden_dump: Path) -> list[str]:
    """One stderr line each for a comparison that is probably not the one meant (docs/CLI.md,
    "Sanity lines"); they change no verdict and no exit status."""
    lines = []
    if _same_file(my_dump, golden_dump):
        lines.append(f"accucmp: note: -m and -g are the same file ({my_dump}): it passes by construction, "
                     "which proves nothing about another run")
        return lines
    t_mode, g_mode = meta.get("target_mode"), meta.get("golden_mode")
    t_world, g_world = int(meta.get("target_world_size") or 1), int(meta.get("golden_world_size") or 1)
    if t_world > 1 and g_world == 1 and "load" not in (t_mode, g_mode):
        lines.append(f"accucmp: note: {my_dump} is one rank of a {t_world}-rank run and {golden_dump} a "
                     "single-process dump: batch-sized tensors differ in shape; give the run's folder "
                     f"(-m {my_dump.parent}/) to compare each rank with its part of the reference's batch")
    paired = int(meta.get("paired_ops") or 0)
    t_ops, g_ops = int(meta.get("target_ops") or 0), int(meta.get("golden_ops") or 0)
    if g_mode == "load" and t_mode != "load":
        lines.append(f"accucmp: note: the golden (-g {golden_dump}) is a load-replay dump and the target "
                     f"(-m {my_dump}) is not: -m and -g look swapped (-m is the run under suspicion)")
    elif t_mode == "load":
        if g_ops and paired < g_ops / 2:
            lines.append(f"accucmp: note: the replay {my_dump} matched {paired} of the {g_ops} recorded ops "
                         "of the golden: fewer than half; was it replayed from this golden dump?")
    elif max(t_ops, g_ops) >= 4 and paired < max(t_ops, g_ops) / 2:
        lines.append(f"accucmp: note: only {paired} of {t_ops} target and {g_ops} golden ops pair up: "
                     "are these dumps of the same model and step?")
    return lines


def _metric_names(alg: str) -> list[str] | None:
    """--alg checked against the metric registry before any file is opened (an unknown name
    is the user's, not a failure of the engine that would otherwise meet it first)."""
    algorithms = parse_algorithms(alg)
    if algorithms is not None:
        from accucmp.compare.metrics import resolve_algorithms

        try:
            resolve_algorithms(algorithms)
        except ValueError as e:
            raise UsageProblem(f"--alg: {e}") from None
    return algorithms


@contextlib.contextmanager
def _compare_progress(console, quiet: bool):
    """A progress line (rows judged, time) while a compare runs, on a terminal only and not
    with --quiet; yields the `on_rows` callback for compare_to_csv (None: no bar)."""
    if quiet or not console.is_interactive:     # a terminal a person watches (not TTY_INTERACTIVE=0)
        yield None
        return
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("comparing: {task.completed} tensors judged"), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task("compare", total=None)
        yield lambda n: bar.advance(task, n)

def _command_line() -> str | None:
    """The accucmp command line that made this result (for the report's Run table); None
    when called other than through main() (a test's CliRunner), where argv is not ours."""
    import shlex

    return None if INVOKED_ARGS is None else "accucmp " + shlex.join(INVOKED_ARGS)

def _adjusters(*steps):
    """One adjust step made of the given ones (None: not asked for), in order."""
    steps = [s for s in steps if s is not None]
    if not steps:
        return None

    def run(table):
        for step in steps:
            table = step(table)
        return table
    return run


def _bitwise_adjuster(bitwise: bool, my_dump: Path, golden_dump: Path):
    """--bitwise: rows judged by their content hashes (accucmp/compare/bitwise.py); both dumps must
    have them, checked before any tensor is compared."""
    if not bitwise:
        return None
    from accucmp.compare.bitwise import apply_bitwise, require_hashes

    for p in (my_dump, golden_dump):
        require_file(p)
        require_hashes(str(p))
    return apply_bitwise


def _noise_floor_adjuster(noise_floor: Path | None, factor: float):
    """--noise-floor: each judged batch passes the failures within `factor` x the model's
    own noise (accucmp/compare/calibrate.py); the floor file is read once, before any tensor."""
    if noise_floor is None:
        return None
    from accucmp.compare.calibrate import apply_noise_floor, read_floor

    require_file(noise_floor)
    floor = read_floor(noise_floor)
    return lambda table: apply_noise_floor(table, floor, factor)


def _require_ops(result, my_dump: Path, golden_dump: Path, select: str | None, exclude=None) -> None:
    """Nothing compared is not a pass: a dump with no op (or a --select matching none) is bad input."""
    from dumpfile.errors import DumpFormatError

    meta = getattr(result, "meta", {}) or {}
    empty = my_dump if meta.get("target_ops", 1) == 0 else golden_dump if meta.get("golden_ops", 1) == 0 else None
    rows = result.rows if hasattr(result, "rows") else len(result.table)
    if rows and empty is None:
        return
    csv = getattr(result, "csv", None)
    if csv is not None:          # a streamed result's csv holds only a header: not a report
        Path(csv).unlink(missing_ok=True)
    if select and not exclude:
        raise DumpFormatError(f"{empty or my_dump}: no op matches --select {select!r}; nothing to compare")
    if select or exclude:
        asked = " ".join(([f"--select {select!r}"] if select else []) + [f"--exclude {x!r}" for x in exclude or ()])
        raise DumpFormatError(f"{empty or my_dump}: no op is left by {asked}; nothing to compare")
    if empty is None:
        raise DumpFormatError(f"{my_dump}: no tensor to compare with {golden_dump}")
    flt = meta.get("op_filter") or {}
    if flt.get("ops_left_out"):
        # the empty side's ops were all left out by the other dump's op_filter: that
        # filter, not the empty dump, is what the user must look at
        other, role = (golden_dump, "golden") if empty == my_dump else (my_dump, "target")
        raise DumpFormatError(f"{other}: its op_filter ({flt.get(role) or 'root attribute op_filter'}) selects "
                              f"none of the ops of {empty}; nothing to compare")
    raise DumpFormatError(f"{empty}: dump holds no op; nothing to compare")


# ---- report ----------------------------------------------------------------
def report(
    result_csv: Annotated[Path, typer.Argument(metavar="RESULT_CSV", help="A result_*.csv written by `accucmp compare`.")],
    threshold: Annotated[Optional[list[str]], typer.Option("--threshold", "-t", metavar="NAME=VALUE", help="Override one verdict threshold (repeatable).")] = None,
    fmt: Annotated[str, typer.Option("--format", "-f", metavar="LIST", help="Also write: csv,json,jsonl,html,xlsx.")] = "",
    tolerance: Tolerance = None,
    summary_json: Annotated[Optional[Path], typer.Option("--summary-json", help="Also write the verdict as JSON (as compare's).")] = None,
    out: Annotated[Optional[Path], typer.Option("-out", "--out", "-o", help="Output directory (default: next to the csv).")] = None,
    top: Annotated[int, typer.Option("--top", min=0, metavar="N", help="How many worst ops the summary lists.")] = 5,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No terminal summary.")] = False,
) -> None:
    """Re-apply verdict thresholds to a saved result (no tensors needed); exit 0/1/2 as compare."""
    with boundary(result_csv):
        thresholds = with_tolerance(parse_thresholds(threshold), tolerance)
        formats = [f for f in parse_formats(fmt) if f != "csv"] if fmt else []
        if summary_json is not None:
            from accucmp.report.outputs import summary_json_force
            from dumpfile.safe_output import check_target

            check_target(summary_json, force=summary_json_force(summary_json, False))
        from accucmp.report.outputs import read_result_csv, write_results
        from accucmp.report.summary import print_summary
        from accucmp.compare.verdict import apply_verdict

        table = read_result_csv(result_csv)
        table = apply_verdict(table, thresholds)
        meta = {"result": str(result_csv)}
        if thresholds:
            meta["threshold_overrides"] = thresholds
        console = _console()
        s = None
        if not quiet:
            s = print_summary(table, console=console, meta=meta, top=top)
        paths = []
        if formats:
            base = result_csv.stem + ("_rethreshold" if thresholds else "")
            paths = write_results(table, out or result_csv.parent, ["csv"] + formats, meta=meta, basename=base)
            for p in paths:
                console.print(f"wrote {p}", soft_wrap=True)
        code = exit_code_for(table)
        if summary_json is not None:
            from accucmp.report.outputs import summary_record, write_summary_json
            from accucmp.report.summary import summarize

            rec = summary_record(s or summarize(table, top=top), code=code, meta=meta, outputs=paths)
            console.print(f"wrote {write_summary_json(summary_json, rec)}", soft_wrap=True)
    raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    app.command("compare")(compare)
    app.command("report")(report)
