"""The `accucmp` command line: a thin typer layer over plain functions.

Start-up matters (msprobe's compare CLI takes 3.5 s before doing anything), so this
module imports nothing heavy at top level: pandas, h5py, numpy, matplotlib and the
comparison engine are imported inside the commands that use them, and torch never
(only `golden`/`demo`, registered by other modules, may import it in their bodies).

Every domain error (dumpfile.errors.DumpError) and every OS/HDF5 error on a bad
file becomes one line on stderr and exit code 2 at `_boundary`, never a traceback.
Set ACCUCMP_DEBUG=1 to get the traceback of an unexpected error.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from pathlib import Path
from typing import Annotated, Iterator, Optional

import typer

from accucmp.cli.options import AlignMapFile  # noqa: E402 (--align-map)
from accucmp.cli.options import (MAX_BYTES, MAX_FILES, Force, MaxBytes, MaxFiles, Tolerance, add_version_option,
                          budget as _budget, with_tolerance)

EXIT_OK = 0
EXIT_FAIL = 1
EXIT_BAD_INPUT = 2
EXIT_BROKEN_PIPE = 141   # 128 + SIGPIPE: what a shell reports for a tool that `| head` cut off

app = typer.Typer(
    name="accucmp",
    help="Compare op-level dumps of two runs of a PyTorch model and find the op whose numerics went wrong.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
add_version_option(app, "accucmp")


class UsageProblem(Exception):
    """Bad option values (a threshold that is not NAME=VALUE, an unknown format)."""


def _one_line(msg: object) -> str:
    return " ".join(str(msg).split())


def _quiet_broken_pipe() -> None:
    """The reader of our output went away (`accucmp ls big.h5 | head`): stop without a
    word, as other Unix tools do. stdout is pointed at /dev/null so the interpreter's
    final flush of what is still buffered does not fail again and print a warning."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout is not a file descriptor (tests)
        pass


def _naming(msg: str, files: tuple) -> str:
    """An error message that names a file: prefixed with the command's input(s) when it
    names none of them (an OSError from deep inside a library names nothing)."""
    names = [str(f) for f in files if f is not None]
    if not names or any(n in msg for n in names):
        return msg
    return f"{' / '.join(names)}: {msg}"


@contextlib.contextmanager
def _boundary(*files) -> Iterator[None]:
    """Turn every expected failure into one line on stderr and exit 2. `files`: the
    command's inputs, named in a message that names none of them."""
    from dumpfile.errors import DumpError  # light: no h5py

    try:
        yield
    except typer.Exit:
        raise
    except BrokenPipeError:       # an OSError, but not bad input: nobody reads our output any more
        _quiet_broken_pipe()
        raise typer.Exit(EXIT_BROKEN_PIPE)
    except (DumpError, UsageProblem) as e:
        typer.echo(f"accucmp: error: {_one_line(e)}", err=True)
        raise typer.Exit(EXIT_BAD_INPUT)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
        # h5py raises OSError/KeyError/ValueError on damaged files; pandas raises
        # ValueError/ParserError on a damaged csv. Name the problem, no traceback.
        if os.environ.get("ACCUCMP_DEBUG"):
            raise
        typer.echo(f"accucmp: error: {_naming(f'{type(e).__name__}: {_one_line(e)}', files)}", err=True)
        raise typer.Exit(EXIT_BAD_INPUT)
    except Exception as e:  # a bug: still one line (and never a silent pass), the traceback on demand
        if os.environ.get("ACCUCMP_DEBUG"):
            raise
        typer.echo(f"accucmp: internal error: {_naming(f'{type(e).__name__}: {_one_line(e)}', files)} "
                   "(set ACCUCMP_DEBUG=1 for the traceback)", err=True)
        raise typer.Exit(EXIT_BAD_INPUT)


# ---- option parsing (plain functions, tested directly) ------------------------
def parse_thresholds(items: list[str] | None) -> dict[str, float] | None:
    """["CosineSimilarity=0.99", "RelativeEuclideanDistance=0.05,KL=1e-3"] -> dict."""
    if not items:
        return None
    out: dict[str, float] = {}
    for item in items:
        for part in item.split(","):
            part = part.strip()
            if not part:
                continue
            name, sep, value = part.partition("=")
            if not sep or not name.strip():
                raise UsageProblem(f"--threshold {part!r}: expected NAME=VALUE")
            try:
                out[name.strip()] = float(value)
            except ValueError:
                raise UsageProblem(f"--threshold {part!r}: {value!r} is not a number") from None
    return out


FORMATS = ("csv", "json", "jsonl", "html", "xlsx")


def parse_formats(value: str) -> list[str]:
    names = [f.strip().lower() for f in value.split(",") if f.strip()]
    bad = [f for f in names if f not in FORMATS]
    if bad:
        raise UsageProblem(f"--format: unknown format(s) {', '.join(bad)} (choose from {', '.join(FORMATS)})")
    if "csv" not in names:
        names.insert(0, "csv")  # the csv is the result; `report` re-reads it
    return list(dict.fromkeys(names))


def parse_algorithms(value: str | None) -> list[str] | None:
    if value is None or value.strip().lower() in ("", "all"):
        return None
    return [a.strip() for a in value.split(",") if a.strip()]


def exit_code_for(table) -> int:
    """0 when every compared tensor passes, 1 when any fails or nothing could be compared."""
    from accucmp.report.summary import result_counts

    counts = result_counts(table)
    if counts.get("fail", 0):
        return EXIT_FAIL
    if counts.get("pass", 0) == 0 and len(table):
        return EXIT_FAIL
    return EXIT_OK


def _console():
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            # rich's own handling exits with 1, which here means "some tensors fail":
            # hand the error to _boundary, which exits as for any other cut-off output
            self.quiet = True
            raise BrokenPipeError

    console = _Console(stderr=False, highlight=False, soft_wrap=False)
    if console.is_terminal:
        console.fit_width = console.width      # the summary fits the window (summary.fit_width)
        return console
    # Piped output (a log, CI, `| less`): plain lines, never wrapped (rich's default is 80
    # columns) nor shortened, so commands and paths copy-paste whole. The width only sizes
    # tables, which take what their content needs.
    console = _Console(stderr=False, highlight=False, soft_wrap=True, width=_PLAIN_WIDTH)
    console.fit_width = None
    return console


_PLAIN_WIDTH = 1000


# ---- compare ---------------------------------------------------------------
@app.command()
def compare(
    my_dump: Annotated[Path, typer.Option("-m", "--my-dump", help="Target dump (the run under suspicion), .h5.")],
    golden_dump: Annotated[Path, typer.Option("-g", "--golden-dump", help="Golden (reference) dump, .h5.")],
    out: Annotated[Path, typer.Option("-out", "--out", "-o", help="Output directory.")] = Path("."),
    alg: Annotated[str, typer.Option("--alg", help="'all' or comma-separated metric names.")] = "all",
    select: Annotated[Optional[str], typer.Option("--select", help="Regex on op name / module: compare only matching ops.")] = None,
    threshold: Annotated[Optional[list[str]], typer.Option("--threshold", "-t", help="Override a verdict threshold: NAME=VALUE (repeatable).")] = None,
    fmt: Annotated[str, typer.Option("--format", "-f", help="Comma-separated: csv,json,jsonl,html,xlsx (csv always; jsonl: one JSON object per row, written as rows are judged).")] = "csv",
    tolerance: Tolerance = None,
    summary_json: Annotated[Optional[Path], typer.Option("--summary-json", help="Also write the verdict (PASS/FAIL, the sentence, exit code, counts, first and worst failing ops) as JSON for CI.")] = None,
    jobs: Annotated[int, typer.Option("--jobs", "-j", min=0, help="Worker processes for tensor reads and metrics; 0: one per core (at most 4) when there are 500+ ops.")] = 0,
    pickle_failures: Annotated[bool, typer.Option("-p", "--dump-failures", help="Also write the failing rows to a filtered csv and their tensors (both sides) as .npy.")] = False,
    golden_fp64: Annotated[Optional[Path], typer.Option("--golden-fp64", help="fp64 golden replay of the golden dump: judge each op's error against the golden device's own error.")] = None,
    chunk_elements: Annotated[int, typer.Option("--chunk-elements", min=1, help="Elements read per chunk (bounds peak memory).")] = 1 << 22,
    top: Annotated[int, typer.Option("--top", min=0, help="How many worst/unmatched ops the summary lists.")] = 5,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No terminal summary; only the output paths.")] = False,
    scheduler: Annotated[Optional[str], typer.Option("--scheduler", help="Folders: run on this Dask cluster (tcp://host:port) instead of a local one.")] = None,
    workers: Annotated[int, typer.Option("--workers", "-w", min=0, help="Folders: local Dask worker processes; 0: one per core, at most one per rank pair.")] = 0,
    replica_check: Annotated[bool, typer.Option("--replica-check/--no-replica-check", help="Folders: check that tensors the golden run holds equal on every rank (DDP weights, reduced grads) are equal across the target's ranks too.")] = True,
    force: Force = False,
    max_files: MaxFiles = MAX_FILES,
    max_bytes: MaxBytes = MAX_BYTES,
    noise_floor: Annotated[Optional[Path], typer.Option("--noise-floor", help="noise_floor.csv of `accucmp calibrate`: pass failures within --noise-factor x the model's own noise.")] = None,
    noise_factor: Annotated[float, typer.Option("--noise-factor", min=0.0, help="With --noise-floor: allowed multiple of the noise floor.")] = 2.0,
    align_map: AlignMapFile = None,
    bitwise: Annotated[bool, typer.Option("--bitwise", help="Determinism check of two statistics dumps: a tensor passes only when its content hash (its bits) equals the golden's; names the first op whose output bits differ and whether its inputs already did.")] = False,
) -> None:
    """Compare TARGET (-m) against GOLDEN (-g); write DIR/result_{time}.csv; exit 0 all pass, 1 some fail, 2 bad input.

    Given two folders of per-rank dumps, pairs their files by rank (and step) and compares
    every pair in parallel on Dask (docs/COMPARE.md, "Comparing runs of many ranks")."""
    with _boundary(my_dump, golden_dump):
        formats = parse_formats(fmt)
        thresholds = with_tolerance(parse_thresholds(threshold), tolerance)
        algorithms = parse_algorithms(alg)
        caps = _budget(max_files, max_bytes)   # a bad --max-bytes is said before minutes of compare
        if summary_json is not None:           # a taken --summary-json name too
            from dumpfile.safe_output import check_target

            check_target(summary_json, force=force)
        if my_dump.is_dir() and golden_dump.is_dir():
            from accucmp.compare.ranks import run_folder_compare

            if align_map is not None:
                raise UsageProblem("--align-map takes two files, not folders")
            if summary_json is not None:
                raise UsageProblem("--summary-json takes two files; folders write their summary json "
                                   "next to the per-rank csvs")
            code = run_folder_compare(my_dump, golden_dump, out, algorithms=algorithms, select=select,
                                      thresholds=thresholds, chunk_elements=chunk_elements, top=top,
                                      quiet=quiet, scheduler=scheduler, workers=workers,
                                      replica_check=replica_check, formats=formats,
                                      console=_console(), golden_fp64=golden_fp64,
                                      dump_failures=pickle_failures)
            raise typer.Exit(code)
        from accucmp.report.outputs import failing_rows_of_csv, new_result_csv, write_failures, write_other_formats
        from accucmp.compare.streaming import compare_to_csv
        from accucmp.report.summary import print_summary

        for p in (my_dump, golden_dump) + ((golden_fp64,) if golden_fp64 else ()):
            _require_file(p)
        csv_path = new_result_csv(out)
        jsonl_path = csv_path.with_suffix(".jsonl") if "jsonl" in formats else None
        # rows go to the csv as they are judged; only the summary's rows stay in memory
        with _compare_progress(_console(), quiet) as on_rows:
            result = compare_to_csv(str(my_dump), str(golden_dump), csv_path, algorithms=algorithms, select=select,
                                    jobs=jobs, chunk_elements=chunk_elements,
                                    golden_fp64=str(golden_fp64) if golden_fp64 else None,
                                    thresholds=thresholds, top=top, force=force,
                                    adjust=_adjusters(_noise_floor_adjuster(noise_floor, noise_factor),
                                                      _bitwise_adjuster(bitwise, my_dump, golden_dump)),
                                    jsonl_path=jsonl_path, on_rows=on_rows,
                                    align_map=str(align_map) if align_map else None)
        if jsonl_path is not None and not result.rows:
            jsonl_path.unlink(missing_ok=True)
        _require_ops(result, my_dump, golden_dump, select)
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
        if not quiet:
            print_summary(None, console=console, meta=meta, top=top, summary=result.summary)
        for p in paths[:1] + [p for p in paths[1:] if p.suffix != ".npy"]:
            console.print(f"wrote {p}", highlight=False, soft_wrap=True)
        npys = sum(1 for p in paths if p.suffix == ".npy")
        if npys:
            console.print(f"wrote {npys} .npy files to {paths[-1].parent}", soft_wrap=True)
        code = exit_code_for_counts(result.summary.counts, result.rows)
        if summary_json is not None:
            from accucmp.report.outputs import summary_record, write_summary_json

            rec = summary_record(result.summary, code=code, meta=meta,
                                 outputs=[p for p in paths if p.suffix != ".npy"])
            console.print(f"wrote {write_summary_json(summary_json, rec, force=force)}", highlight=False,
                          soft_wrap=True)
    raise typer.Exit(code)


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


_INVOKED_ARGS: list[str] | None = None     # set by main(): the command line as given


def _command_line() -> str | None:
    """The accucmp command line that made this result (for the report's Run table); None
    when called other than through main() (a test's CliRunner), where argv is not ours."""
    import shlex

    return None if _INVOKED_ARGS is None else "accucmp " + shlex.join(_INVOKED_ARGS)


def exit_code_for_counts(counts: dict[str, int], rows: int) -> int:
    """exit_code_for, from the counts of a streamed result."""
    if counts.get("fail", 0):
        return EXIT_FAIL
    if counts.get("pass", 0) == 0 and rows:
        return EXIT_FAIL
    return EXIT_OK


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
        _require_file(p)
        require_hashes(str(p))
    return apply_bitwise


def _noise_floor_adjuster(noise_floor: Path | None, factor: float):
    """--noise-floor: each judged batch passes the failures within `factor` x the model's
    own noise (accucmp/compare/calibrate.py); the floor file is read once, before any tensor."""
    if noise_floor is None:
        return None
    from accucmp.compare.calibrate import apply_noise_floor, read_floor

    _require_file(noise_floor)
    floor = read_floor(noise_floor)
    return lambda table: apply_noise_floor(table, floor, factor)


def _require_ops(result, my_dump: Path, golden_dump: Path, select: str | None) -> None:
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
    if select:
        raise DumpFormatError(f"{empty or my_dump}: no op matches --select {select!r}; nothing to compare")
    if empty is None:
        raise DumpFormatError(f"{my_dump}: no tensor to compare with {golden_dump}")
    raise DumpFormatError(f"{empty}: dump holds no op; nothing to compare")


def _require_file(p: Path) -> None:
    from dumpfile.errors import DumpFormatError

    if not p.exists():
        raise DumpFormatError(f"{p}: no such file")
    if p.is_dir():
        raise DumpFormatError(f"{p}: is a directory, not a dump file")


# ---- report ----------------------------------------------------------------
@app.command()
def report(
    result_csv: Annotated[Path, typer.Argument(help="A result_*.csv written by `accucmp compare`.")],
    threshold: Annotated[Optional[list[str]], typer.Option("--threshold", "-t", help="NAME=VALUE (repeatable).")] = None,
    fmt: Annotated[str, typer.Option("--format", "-f", help="Also write: csv,json,jsonl,html,xlsx.")] = "",
    tolerance: Tolerance = None,
    summary_json: Annotated[Optional[Path], typer.Option("--summary-json", help="Also write the verdict as JSON (as compare).")] = None,
    out: Annotated[Optional[Path], typer.Option("-out", "--out", "-o", help="Output directory (default: next to the csv).")] = None,
    top: Annotated[int, typer.Option("--top", min=0)] = 5,
    quiet: Annotated[bool, typer.Option("--quiet", "-q")] = False,
) -> None:
    """Re-apply verdict thresholds to a saved result (no tensors needed); exit 0/1/2 as compare."""
    with _boundary(result_csv):
        thresholds = with_tolerance(parse_thresholds(threshold), tolerance)
        formats = [f for f in parse_formats(fmt) if f != "csv"] if fmt else []
        if summary_json is not None:
            from dumpfile.safe_output import check_target

            check_target(summary_json)
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


# ---- ls --------------------------------------------------------------------
@app.command("ls")
def ls_command(
    dump: Annotated[Path, typer.Argument(help="A dump file (.h5).")],
    select: Annotated[Optional[str], typer.Option("--select", help="Regex on op name / module.")] = None,
    stats: Annotated[bool, typer.Option("--stats", help="Show min/max/mean/NaN/Inf of each tensor (reads the data).")] = False,
    limit: Annotated[Optional[int], typer.Option("--limit", "-n", min=0, help="Show at most N ops.")] = None,
    plain: Annotated[bool, typer.Option("--plain", help="Plain text even on a terminal.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
) -> None:
    """List the ops of a dump in execution (seqid) order: phase, module, shapes, dtypes."""
    with _boundary(dump):
        from accucmp.listing import list_ops, render
        from accucmp.cli.progress import progress_bar

        _require_file(dump)
        # only --stats reads tensor data (a listing without it is instant)
        rows, info = list_ops(dump, select=select, stats=stats, limit=limit,
                              progress=lambda n: progress_bar("reading ops", n, quiet=quiet or not stats))
        render(rows, info, console=_console(), plain=plain or not sys.stdout.isatty(), stats=stats)


# ---- extract ---------------------------------------------------------------
@app.command()
def extract(
    input_file: Annotated[Path, typer.Option("-i", "--input", help="Dump to copy ops from.")],
    output_file: Annotated[Path, typer.Option("-o", "--output", help="Dump to write (appended to when it exists).")],
    source: Annotated[Optional[list[str]], typer.Option("-s", "--source", help="/op/seqid/ to copy (repeatable; /op/ copies every call of op).")] = None,
    dest: Annotated[Optional[list[str]], typer.Option("-d", "--dest", help="/op/seqid/ to write it as (repeatable, pairs with -s; default: the same path).")] = None,
    from_report: Annotated[Optional[Path], typer.Option("--from-report", help="Copy every failing op of this result csv.")] = None,
    threshold: Annotated[Optional[list[str]], typer.Option("--threshold", "-t", help="With --from-report: re-judge with NAME=VALUE first.")] = None,
    pv: Annotated[bool, typer.Option("-p", "-v", "-pv", hidden=True, help="Accepted for h5copy compatibility.")] = False,
    max_bytes: MaxBytes = MAX_BYTES,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
) -> None:
    """Copy ops into a small dump (the h5copy workflow) that works as a load file for replay."""
    with _boundary(input_file):
        from accucmp.extract import extract_ops, ops_from_report

        _require_file(input_file)
        pairs = _pair_paths(source or [], dest or [])
        if from_report is not None:
            _require_file(from_report)
            pairs += [(p, p) for p in ops_from_report(from_report, input_file, parse_thresholds(threshold))]
        if not pairs:
            raise UsageProblem("nothing to copy: give -s /op/seqid/ or --from-report result.csv")
        from accucmp.cli.progress import progress_bar

        written = extract_ops(input_file, output_file, pairs, budget=_budget(max_bytes=max_bytes),
                              progress=lambda n: progress_bar("copying ops", n, quiet=quiet))
        typer.echo(f"copied {len(written)} op(s) to {output_file}")
        for path in written:
            typer.echo(f"  {path}")


def _pair_paths(sources: list[str], dests: list[str]) -> list[tuple[str, str]]:
    if dests and len(dests) != len(sources):
        raise UsageProblem(f"-d given {len(dests)} time(s) for {len(sources)} -s: give one -d per -s or none")
    return list(zip(sources, dests or sources))


# ---- other modules' commands --------------------------------------------------
@app.command("export")
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
    with _boundary():
        from accucmp.report.export import ExportError, run_export

        if device_type not in ("keep", "npu", "cpu", "cuda"):
            raise UsageProblem(f"--device-type {device_type!r}: use keep, npu, cpu or cuda")
        try:
            counts = run_export(str(input), str(output), layout, device_type=device_type, force=force)
        except ExportError as e:
            typer.echo(f"accucmp: error: {_one_line(e)}", err=True)
            raise typer.Exit(EXIT_BAD_INPUT)
        skipped = (f"; {counts['skipped_tensors']} tensors with no {layout} form left out"
                   if counts["skipped_tensors"] else "")
        typer.echo(f"wrote {output} ({layout}): {counts['ops']} ops, {counts['tensors']} tensors{skipped}")


_PLUGIN_MODULES = ("accucmp.cli.convert", "accucmp.cli.golden", "accucmp.cli.demo", "accucmp.cli.whatif")


def _register_plugins(target: typer.Typer) -> None:
    for name in _PLUGIN_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:  # the module itself is not written (yet); anything else is a bug
                continue
            raise
        module.register(target)


_register_plugins(app)


# ---- entry point -------------------------------------------------------------
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
    global _INVOKED_ARGS
    _INVOKED_ARGS = list(sys.argv[1:] if argv is None else argv)
    args = normalize_argv(_INVOKED_ARGS)
    app(args=args, prog_name="accucmp")


if __name__ == "__main__":  # pragma: no cover
    main()
