"""Names from a dump are text from outside: an op, module or argument name (or a file
name) holding ANSI escape sequences, a carriage return, a newline or rich markup reaches
the terminal only as escapes (dumpfile.printable), in `ls` (plain and rich table),
compare's summary and one-line error messages; the HTML report escapes its own way."""

from __future__ import annotations

import io
import pytest
from typer.testing import CliRunner

from accucmp.cli.main import app
from dumpfile.printable import printable

from ._cli_helpers import Op, model_ops, perturbed, write_dump

runner = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"})

# a colour, a reset, rich markup and a hyperlink, a carriage return that would overwrite
# the line, a forged line, an OSC that sets the window title (ended by BEL), a C1 CSI,
# a right-to-left override, HTML
INJ = ("\x1b[31mRED\x1b[0m[bold red]x[/][link=http://evil.example]L[/link]\rOVER\nforged line"
       "\x1b]0;TITLE\x07\x9b2J\u202eevil<script>alert(1)</script>")
UNSAFE = ("\x1b", "\r", "\x07", "\x9b", "\u202e")


def _hostile_ops():
    ops = []
    for o in model_ops(n_layers=1):
        o.module += INJ
        if o.seqid == 1:
            o.op = "aten.mm" + INJ.replace("/", "|")
            o.inputs = {k + INJ.replace("/", "|"): v for k, v in o.inputs.items()}
        ops.append(Op(o.op, o.seqid, o.inputs, o.outputs, o.phase, o.module, o.dtype))
    return ops


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    d = tmp_path_factory.mktemp("names")
    ops = _hostile_ops()
    golden = write_dump(d / "golden.h5", ops)
    faulty = write_dump(d / "faulty.h5", perturbed(ops, 1, 0.5))
    return d, golden, faulty


def _no_unsafe(text: str, where: str) -> None:
    for c in UNSAFE:
        assert c not in text, (where, c, text[:500])


def test_printable_escapes_what_a_terminal_acts_on():
    assert printable("a\x1b[31mb\rc\nd\te\x07\x7f\x9b\u202e\udcff") == \
        "a\\x1b[31mb\\rc\\nd\\te\\x07\\x7f\\x9b\\u202e\\udcff"
    assert printable("aten.mm.default layers.0 µ 中文") == "aten.mm.default layers.0 µ 中文"


def test_ls_plain_and_rich_print_no_control_character(dumps):
    from rich.console import Console

    from accucmp.listing import list_ops, render

    _, golden, _ = dumps
    r = runner.invoke(app, ["ls", golden, "--plain"])
    assert r.exit_code == 0, r.output
    _no_unsafe(r.output, "ls --plain")
    lines = r.output.splitlines()
    assert len(lines) == 2 + 5          # header, column names, one line per op: none forged
    assert "aten.mm\\x1b[31mRED\\x1b[0m[bold red]x[|]" in lines[2] and "\\rOVER\\nforged line" in lines[2]
    # the rich table on a terminal: markup shown as text, escapes as escapes
    rows, info = list_ops(golden)
    buf = io.StringIO()
    render(rows, info, console=Console(file=buf, force_terminal=True, width=400, color_system=None),
           plain=False, stats=False)
    out = buf.getvalue()
    _no_unsafe(out, "ls table")
    # (a long name is broken over lines after its dots: each column's cells read back joined)
    columns: dict[int, str] = {}
    for row in out.splitlines():
        for i, cell in enumerate(row.split("│")):
            columns[i] = columns.get(i, "") + cell.strip()
    flat = "\n".join(columns.values())
    assert "[bold red]x[/][link=http://evil.example]L[/link]" in flat and "\\x1b]0;TITLE\\x07" in flat


def test_compare_summary_and_html_report(dumps):
    d, golden, faulty = dumps
    out = d / "cmp"
    r = runner.invoke(app, ["compare", "-m", faulty, "-g", golden, "-o", str(out), "-f", "csv,html"])
    assert r.exit_code == 1, r.output
    _no_unsafe(r.output, "compare summary")
    assert "first failure (execution order): aten.mm\\x1b[31mRED" in r.output
    html = next(out.glob("*.html")).read_text(encoding="utf-8")
    assert "<script>alert" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    # the csv keeps the names as stored (data, not a terminal)
    csv = next(out.glob("result_*.csv")).read_text(encoding="utf-8")
    assert "aten.mm\x1b[31mRED" in csv


def test_an_error_naming_a_hostile_file_name_is_one_printable_line(dumps):
    """(a newline in a message is a space: one_line cannot tell the file name's from
    the library's own)"""
    d, golden, _ = dumps
    bad = d / "bad\nname\x1b[2J.h5"
    bad.write_bytes(b"\x1b[31m not hdf5 \r\n" * 8)
    for args in (["ls", str(bad)], ["compare", "-m", str(bad), "-g", golden, "-o", str(d / "c2")]):
        r = runner.invoke(app, args)
        assert r.exit_code == 2, r.output
        _no_unsafe(r.output, args[0])
        assert len(r.output.strip().splitlines()) == 1 and "bad name\\x1b[2J.h5" in r.output, r.output
