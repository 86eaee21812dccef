"""The result table of a comparison and the precision each row is judged at (torch-free).

PrecisionDtype starts as the least precise dtype an op touched (least_precise); for
independent runs it is then carried forward in execution order (inherit_precision),
across the batches of a streamed comparison too (PrecisionCarry).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from dumpfile import schema as S


def least_precise(dtypes) -> str:
    """The floating dtype with the largest unit roundoff, '' when none is floating."""
    best, best_u = "", -1.0
    for d in dtypes:
        u = S.UNIT_ROUNDOFF.get(d)
        if u is not None and u > best_u:
            best, best_u = d, u
    return best


def inherit_precision(table: pd.DataFrame, carry: "PrecisionCarry | None" = None) -> None:
    """Independent runs: every op works on what earlier ops computed, so a tensor carries the
    rounding error of the least precise dtype computed in before it (a bf16 model's logits
    cast to fp32 for the loss hold bf16 error, not fp32 error). PrecisionDtype becomes the
    least precise of the row's own and of every earlier row's (execution order, both runs;
    `carry` holds what earlier batches of a streamed comparison saw).
    Not for replays: there every op starts from the golden's own inputs."""
    if table.empty or "PrecisionDtype" not in table:
        return
    coarsest, coarsest_u, out = ("", -1.0, []) if carry is None else (carry.coarsest, carry.coarsest_u, [])
    # rows that carry nothing from earlier ops: an output judged by its own error on the
    # inputs it got (OwnErrorVsFp64, measured by the dumper) and an input no op of the step
    # made (MadeBy "leaf": a parameter, a buffer, the batch) keep the op's own precision
    own = _judged_on_own_terms(table)
    for d, keep in zip(table["PrecisionDtype"].tolist(), own):
        u = S.UNIT_ROUNDOFF.get(d) if isinstance(d, str) else None
        if u is not None and u > coarsest_u:
            coarsest, coarsest_u = d, u
        out.append(coarsest if u is not None and coarsest_u > u and not keep else d)
    table["PrecisionDtype"] = out
    if carry is not None:
        carry.coarsest, carry.coarsest_u = coarsest, coarsest_u


def _judged_on_own_terms(table: pd.DataFrame) -> list[bool]:
    n = len(table)
    own = (pd.to_numeric(table["OwnErrorVsFp64"], errors="coerce").notna().tolist()
           if "OwnErrorVsFp64" in table else [False] * n)
    leaf = (table["MadeBy"].astype(str).eq("leaf").tolist() if "MadeBy" in table else [False] * n)
    # an input the target rounds by a cast the op does not compute in (CastRoundedTo): judged
    # at the op's own precision, where that rounding shows (verdict.judge_row)
    cast = ([isinstance(v, str) and v != "" for v in table["CastRoundedTo"].tolist()] if "CastRoundedTo" in table
            else [False] * n)
    return [a or b or c for a, b, c in zip(own, leaf, cast)]


class PrecisionCarry:
    """inherit_precision's running state, carried from one batch to the next."""

    def __init__(self):
        self.coarsest, self.coarsest_u = "", -1.0


def to_frame(rows: list[dict[str, Any]], columns: list[str], start: int,
              carry: "PrecisionCarry | None") -> pd.DataFrame:
    """Rows (in execution order, the first being row number `start`) as the result table."""
    table = pd.DataFrame(rows, columns=columns)
    table["Index"] = np.arange(start, start + len(table), dtype=np.int64)
    if carry is not None:
        inherit_precision(table, carry)
    for c in ("SeqId", "GoldenSeqId"):
        table[c] = table[c].astype("Int64")
    return table
