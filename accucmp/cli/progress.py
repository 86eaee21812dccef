"""Progress bars for the commands that can take more than a second (ls --stats, extract,
convert; compare and golden have their own): rich, on stderr, only when a person watches
(stdout and stderr both an interactive terminal) and never with --quiet, so logs, pipes
and CI output hold only the results."""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator


def watched() -> bool:
    """A person watches: stdout and stderr are an interactive terminal."""
    from rich.console import Console

    try:
        return sys.stdout.isatty() and Console(file=sys.stderr).is_interactive
    except (AttributeError, ValueError):     # a replaced or closed stream
        return False


@contextlib.contextmanager
def progress_bar(label: str, total: int | None, *, quiet: bool = False) -> Iterator[Callable[[int], None] | None]:
    """Yields `advance(n=1)`, or None when no bar is shown (callers skip the call)."""
    if quiet or not watched() or (total is not None and total <= 1):
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=Console(file=sys.stderr), transient=True) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n=1: bar.advance(task, n)
