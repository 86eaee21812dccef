"""Every command's `--help` reads whole at 80 columns (issue 35 item 1): no option name or
help text cut (`--dump-failur…`, `csv,json,json…`, a command list ending in `...`), no
flag shown as taking a value (`--help -h <bool>`), no word split at a hyphen, no line
wider than the terminal. The layout is dumpfile/cli_help.py's, shared by accucmp and
ir2tbe."""

from __future__ import annotations

import re

import pytest
import typer
from typer.testing import CliRunner

WIDTH = 80


def _apps():
    from accucmp.cli.main import app as accucmp_app
    from ir2tbe.cli import app as ir2tbe_app

    return {"accucmp": accucmp_app, "ir2tbe": ir2tbe_app}


def _help_pages():
    pages = []
    for prog, app in _apps().items():
        group = typer.main.get_command(app)
        pages.append((prog, app, []))
        pages += [(prog, app, [name]) for name in sorted(group.commands)]
    return pages


def _help(app, prog, args) -> str:
    result = CliRunner().invoke(app, args + ["--help"], prog_name=prog, terminal_width=WIDTH,
                                env={"COLUMNS": str(WIDTH)})
    assert result.exit_code == 0, result.output
    return result.output


def test_every_command_has_a_help_page():
    names = {(prog, tuple(args)) for prog, _, args in _help_pages()}
    for command in ("compare", "report", "ls", "extract", "export", "convert", "golden", "demo",
                    "whatif", "bisect", "calibrate"):
        assert ("accucmp", (command,)) in names
    assert ("ir2tbe", ("run",)) in names and ("ir2tbe", ("map",)) in names


@pytest.mark.parametrize("prog,app,args", _help_pages(), ids=lambda v: " ".join(v) if isinstance(v, list) else v if isinstance(v, str) else "")
def test_help_reads_whole_at_80_columns(prog, app, args):
    text = _help(app, prog, args)
    lines = text.splitlines()
    assert max(map(len, lines)) <= WIDTH, text
    assert "…" not in text, text                                  # rich's cut names and help
    assert not any(c in text for c in "╭│╰"), text                 # no panels with narrow columns
    assert "<bool>" not in text and "<list[" not in text and "range>" not in text, text
    cut = [ln for ln in lines if ln.rstrip().endswith("...") and not ln.startswith("Usage:")]
    assert not cut, cut                                           # click's cut command list
    split = [ln for ln in lines if re.search(r"[A-Za-z]-$", ln.rstrip())]
    assert not split, split                                       # `--noise-` / `floor`
    assert len(lines) <= 80, f"{len(lines)} lines"                 # compare's was 209


def test_flags_read_as_flags_and_command_list_is_whole():
    from accucmp.cli.main import app

    compare = _help(app, "accucmp", ["compare"])
    assert re.search(r"^  -p, --dump-failures +Also write", compare, re.M), compare
    assert re.search(r"^  -h, --help +Show this message", compare, re.M), compare
    assert re.search(r"^  --replica-check / --no-replica-check$", compare, re.M), compare
    top = _help(app, "accucmp", [])
    # the whole first paragraph of each command, wrapped under its name
    assert "1 some fail, 2 bad input." in " ".join(top.split()), top
