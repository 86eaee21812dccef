"""How every command's `--help` is laid out (accucmp and ir2tbe): click's plain layout, not
typer's rich panels, which at 80 columns cut option names and help text in their narrow
columns and show a flag as `<bool>` as if it took a value. The command list shows each
command's whole first paragraph, wrapped, where click would cut it with `...`.
tests/test_cli_help.py reads every command's help at 80 columns. Light: typer only."""

from __future__ import annotations

import inspect

import typer
from typer.core import TyperGroup


def first_paragraph(text: str | None) -> str:
    """A command's help up to its first blank line, as one line (the formatter wraps it)."""
    if not text:
        return ""
    return " ".join(inspect.cleandoc(text).partition("\f")[0].split("\n\n")[0].split())


class WholeHelpGroup(TyperGroup):
    """The command list with each command's whole first paragraph."""

    def format_commands(self, ctx, formatter) -> None:
        rows = []
        for name in self.list_commands(ctx):
            cmd = self.get_command(ctx, name)
            if cmd is not None and not cmd.hidden:
                rows.append((name, cmd.short_help or first_paragraph(cmd.help)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


# typer.Typer's settings for the layout above
HELP_SETTINGS = {"cls": WholeHelpGroup, "rich_markup_mode": None}
