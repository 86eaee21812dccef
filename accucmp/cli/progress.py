"""Terminal output: the console results are printed on (`console()`), and progress bars
for the commands that can take more than a second (ls --stats, extract, convert; compare
and golden have their own): rich, on stderr, only when a person watches
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


_PLAIN_WIDTH = 1000


def console():
    """The console commands print results on (stdout). On a terminal the summary fits the
    window (summary.fit_width); piped (a log, CI, `| less`) lines are plain and never wrapped
    (rich's default is 80 columns) nor shortened, so commands and paths copy-paste whole."""
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            # rich's own handling exits with 1, which here means "some tensors fail":
            # hand the error to the boundary, which exits as for any other cut-off output
            self.quiet = True
            raise BrokenPipeError

    out = _Console(stderr=False, highlight=False, soft_wrap=False)
    if out.is_terminal:
        out.fit_width = out.width
        return out
    # the width only sizes tables, which take what their content needs
    out = _Console(stderr=False, highlight=False, soft_wrap=True, width=_PLAIN_WIDTH)
    out.fit_width = None
    return out
