"""`--version` for every command line of the project (accucmp, ir2tbe): the installed
distribution's version. Here, at the bottom layer, so that ir2tbe's CLI need not import
accucmp (which imports ir2tbe). Torch-free; typer only."""

from __future__ import annotations

from typing import Annotated

import typer

DISTRIBUTION = "npu-accuracy-toolkit"


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:      # run from a source tree that was never installed
        return "unknown (not installed)"


def _show_version(ctx: typer.Context, value: bool) -> None:
    if value:
        typer.echo(f"{ctx.find_root().info_name} {package_version()}")
        raise typer.Exit(0)


def _version_callback(version: Annotated[bool, typer.Option(
        "--version", callback=_show_version, is_eager=True, help="Show the version and exit.")] = False) -> None:
    """(the app's own options: --version)"""


def add_version_option(app: typer.Typer, prog: str) -> None:
    """`PROG --version` prints 'PROG VERSION' and exits 0, before any command runs (PROG:
    the program name the app is run under)."""
    app.callback()(_version_callback)
