"""One comparison streamed to its result csv: rows are compared, judged and written a
batch at a time, and only what the summary shows is kept (SummaryBuilder), so the
memory of `accucmp compare` does not grow with the number of rows.

Before this, the whole result was held several times over: the row dicts, the table
made of them, the verdict's copy of the table and its per-row dicts (~4.5 KB per row,
1.37 GB at 300k rows). Used by `accucmp compare` for one pair of files and by
rank_compare for each rank pair (on a Dask worker).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from accucmp.report.summary import Summary, SummaryBuilder


@dataclass
class StreamedResult:
    csv: Path
    summary: Summary
    meta: dict[str, Any]
    rows: int


def compare_to_csv(target: str, golden: str, csv_path: Path, *, algorithms=None, select: str | None = None,
                   jobs: int = 1, chunk_elements: int = 1 << 22, golden_fp64: str | None = None,
                   thresholds: Mapping[str, float] | None = None, top: int = 5,
                   on_rows: Callable[[int], None] | None = None,
                   observe: Callable[[Any], None] | None = None,
                   batch_rows: int = 4096, force: bool = False,
                   adjust: Callable[[Any], Any] | None = None,
                   jsonl_path: Path | None = None, align_map: str | None = None, view=None,
                   exclude=()) -> StreamedResult:
    """Compare `target` against `golden`, judge each row (verdict.judge, per batch of
    whole ops) and write the result table to `csv_path` as it comes. `on_rows(n)` is told
    of every n rows written (progress); `observe(batch)` sees every judged batch;
    `adjust(batch)`, when given, may change a judged batch before it is written.
    `jsonl_path`: also write every row as one JSON object per line, as it is judged
    (`--format jsonl`: a CI job or `jq` reads rows while a long compare runs)."""
    import contextlib

    from dumpfile.safe_output import open_output

    from accucmp.compare.pipeline import stream_compare
    from accucmp.compare.verdict import judge, thresholds_with

    thresholds_with(thresholds)          # a bad threshold fails before any tensor is read
    csv_path = Path(csv_path)
    rows = 0
    builder = SummaryBuilder(top)
    with stream_compare(target, golden, algorithms=algorithms, select=select, jobs=jobs,
                        chunk_elements=chunk_elements, golden_fp64=golden_fp64,
                        batch_rows=batch_rows, align_map=align_map, view=view,
                        exclude=exclude) as stream:
        # a temporary file renamed into place at the end (dumpfile.safe_output): never
        # written through a link, never over an existing file unless `force`
        with open_output(csv_path, "w", force=force, encoding="utf-8", newline="") as fh, \
                (open_output(jsonl_path, "w", force=force, encoding="utf-8") if jsonl_path is not None
                 else contextlib.nullcontext()) as jh:
            for measured in stream.batches:
                judged = judge(measured, thresholds).table
                if adjust is not None:      # e.g. --noise-floor (accucmp/compare/calibrate.py)
                    judged = adjust(judged)
                judged.to_csv(fh, index=False, header=rows == 0)
                if jh is not None:
                    from accucmp.report.outputs import write_jsonl_rows

                    write_jsonl_rows(jh, judged)
                rows += len(judged)
                builder.add(judged)
                if observe is not None:
                    observe(judged)
                if on_rows is not None and len(judged):
                    on_rows(len(judged))
        meta = dict(stream.meta)
    meta["rows"] = rows
    return StreamedResult(csv_path, builder.result(), meta, rows)


class Throttle:
    """Calls `fn(total)` with what was added, at most every `interval` seconds (and at flush)."""

    def __init__(self, fn: Callable[[int], None], interval: float = 0.5):
        self.fn, self.interval = fn, interval
        self.pending, self.last = 0, 0.0

    def __call__(self, n: int) -> None:
        self.pending += n
        now = time.monotonic()
        if now - self.last >= self.interval:
            self.flush(now)

    def flush(self, now: float | None = None) -> None:
        if self.pending:
            self.fn(self.pending)
            self.pending = 0
        self.last = time.monotonic() if now is None else now
