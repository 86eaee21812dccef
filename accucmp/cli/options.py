"""Options shared by the commands that write files (--force, --max-files, --max-bytes),
declared once so every command spells and documents them the same way (docs/CLI.md,
"Outputs"), and the parsers of option values several commands take (--threshold, --format,
--alg). Light: typer only; the output rules themselves live in dumpfile.safe_output."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from accucmp.cli.boundary import UsageProblem
from dumpfile.safe_output import DEFAULT_MAX_BYTES, DEFAULT_MAX_FILES, OutputBudget, format_size, parse_size

Force = Annotated[bool, typer.Option(
    "--force", help="Replace output files that exist (default: refuse). A link at an output "
                    "name is replaced, never written through.")]
MaxFiles = Annotated[int, typer.Option(
    "--max-files", min=1, metavar="N", help="Write at most this many files.")]
MaxBytes = Annotated[str, typer.Option(
    "--max-bytes", metavar="SIZE", help="Write at most this many bytes, e.g. 500M, 64G.")]


# the defaults as the signatures spell them
MAX_FILES = DEFAULT_MAX_FILES
MAX_BYTES = format_size(DEFAULT_MAX_BYTES)


def budget(max_files: int = DEFAULT_MAX_FILES, max_bytes: str | int = DEFAULT_MAX_BYTES) -> OutputBudget:
    return OutputBudget(max_files=max_files, max_bytes=parse_size(max_bytes))


# ---- option values (plain functions, tested directly) ---------------------------
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


# ---- the verdict's one tolerance knob (issue 22) ---------------------------------
Tolerance = Annotated[Optional[float], typer.Option(
    "--tolerance", metavar="F", help="Scale every dtype-derived bound: 2 allows twice the default "
                        "error, 0.5 half.")]


def with_tolerance(thresholds: dict[str, float] | None, tolerance: float | None) -> dict[str, float] | None:
    """--tolerance F as the verdict threshold Tolerance=F (checked there: positive, finite)."""
    if tolerance is None:
        return thresholds
    return {**(thresholds or {}), "Tolerance": tolerance}


# ---- --version: in dumpfile.version, shared with ir2tbe (which sits below accucmp) ----
from dumpfile.version import DISTRIBUTION, add_version_option, package_version  # noqa: E402,F401


# ---- aligning different op streams (issue 20 item 4, accucmp/compare/align.py) ------
AlignMapFile = Annotated[Optional[Path], typer.Option(
    "--align-map", help="Override file for aligning ops the two runs compute differently: "
                        "'module TARGET = GOLDEN' / 'op A+B = C+D+E' lines, or the same as JSON "
                        "(docs/COMPARE.md, \"Aligning different op streams\").")]
