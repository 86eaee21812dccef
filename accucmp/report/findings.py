"""What a judged comparison table points at first: the first failure (the earliest op that
caused its error), the worst failing ops, the unmatched ops (torch-free). The terminal
summary, the reports and the demo read these; a table without a verdict is judged first
with the default thresholds.
"""

from __future__ import annotations

import math

import pandas as pd

from dumpfile.departures import is_by_design_op

from accucmp.compare.departures import STATUS_UNPAIRED_OP

from accucmp.compare.op_policies import (ORIGIN_ABSORBED, ORIGIN_AMPLIFIED, ORIGIN_CAUSED, ORIGIN_DEPARTURE, ORIGIN_OVERFLOW,
                                         ORIGIN_UNDERFLOW)
from accucmp.compare.verdict import RESULT_FAIL, RESULT_UNMATCHED, apply_verdict


def _execution_order(table: pd.DataFrame) -> pd.DataFrame:
    # Index is assigned in execution order by compare_dumps; SeqId is the fallback
    for key in ("Index", "SeqId"):
        if key in table.columns:
            k = pd.to_numeric(table[key], errors="coerce")
            return table.assign(__k=k).sort_values("__k", kind="stable", na_position="last").drop(columns="__k")
    return table


def _rows(table: pd.DataFrame, result: str) -> pd.DataFrame:
    """The rows whose Result is `result`, the table judged first when it has no verdict."""
    if "Result" not in table.columns:
        table = apply_verdict(table)
    return table[table["Result"] == result]


def first_failure(table: pd.DataFrame) -> pd.Series | None:
    """The first failing row in execution order whose op caused its error (Origin "caused
    here") or where the run departs from its recording (Origin "departs": an op inserted or
    missing, a changed argument, a differing parameter); the first failing row when there
    is none. None when nothing fails."""
    failed = _rows(table, RESULT_FAIL)
    if failed.empty:
        return None
    first = _first_failure_of(failed)
    return lead(first, _execution_order(failed).iloc[0], first_unpaired(table))


def first_unpaired(table: pd.DataFrame) -> pd.Series | None:
    """The first op only one of two independent runs has (compare/departures.py), if any."""
    if "CompareStatus" not in table.columns:
        return None
    un = table[table["CompareStatus"] == STATUS_UNPAIRED_OP]
    return None if un.empty else _execution_order(un).iloc[0]


def _index(row) -> float:
    try:
        return float(row.get("Index"))
    except (TypeError, ValueError):
        return float("inf")


def lead(first, first_failing, unpaired):
    """What the headline names: the first failure (first_failure's rule), or an op only one
    run has that comes before the first failing row when that row is not an op's own error
    (its inputs already differ: what the extra or missing op changed)."""
    if unpaired is None or first_failing is None:
        return first
    if str(first_failing.get("Origin") or "") == ORIGIN_CAUSED:
        return first
    return unpaired if _index(unpaired) < _index(first_failing) else first


def _first_failure_of(failed: pd.DataFrame) -> pd.Series | None:
    if "Origin" in failed.columns:
        # the earliest op whose inputs still agree but whose output does not: later failures
        # (and earlier ones that only carry a difference in from outside) inherit from it
        # (an output whose golden values exceed its dtype's range overflows there: where the
        # difference starts as well; so does one that amplifies its inputs' rounding, and an
        # update of state whose dtype rounds it away)
        caused = failed[failed["Origin"].isin((ORIGIN_CAUSED, ORIGIN_DEPARTURE, ORIGIN_OVERFLOW, ORIGIN_AMPLIFIED,
                                               ORIGIN_ABSORBED))]
        if not caused.empty:
            return _execution_order(caused).iloc[0]
        # none: an op whose inputs agree and whose output sits at its dtype's underflow edge
        # is still where the difference starts; inherited rows got theirs from elsewhere
        under = failed[failed["Origin"] == ORIGIN_UNDERFLOW]
        if not under.empty:
            return _execution_order(under).iloc[0]
    return _execution_order(failed).iloc[0]


def worst_ops(table: pd.DataFrame, n: int = 10) -> pd.DataFrame:
    """Failing ops (one row each: its worst tensor), largest Severity first."""
    failed = _rows(table, RESULT_FAIL)
    if failed.empty:
        return failed
    key = ["NPUDump", "SeqId"] if "SeqId" in failed.columns else ["NPUDump"]
    sev = pd.to_numeric(failed["Severity"], errors="coerce").fillna(0.0)
    worst = failed.assign(__s=sev).sort_values("__s", ascending=False, kind="stable")
    worst = worst.drop_duplicates(subset=key, keep="first")
    return worst.drop(columns="__s").head(n)


def unmatched_ops(table: pd.DataFrame) -> pd.DataFrame:
    """One row per unmatched op (either side), in execution order, the ops a precision or
    device change adds by design (dtype casts, copies: dumpfile.departures.BY_DESIGN_OPS)
    after the others: an inserted multiply must not hide behind autocast's casts."""
    un = _rows(table, RESULT_UNMATCHED)
    un = _execution_order(un.drop_duplicates(subset=[c for c in ("NPUDump", "SeqId", "GoldenSeqId")
                                                     if c in un.columns]))
    if un.empty or "NPUDump" not in un.columns:
        return un
    by_design = un["NPUDump"].astype(str).map(is_by_design_op)
    return pd.concat([un[~by_design], un[by_design]])


def by_module(rows: list[dict]) -> list[tuple[str, list[dict]]]:
    """Rows grouped by module, the modules in the order their first row comes."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        m = r.get("Module")
        groups.setdefault(m if isinstance(m, str) and m else "(top level)", []).append(r)
    return list(groups.items())


def loss_scale_of(rows: list[dict]) -> int | None:
    """2**k (k >= 4) when the failing backward tensors among `rows` (the worst failing ops)
    are all 2**k times the golden's: relative distance 2**k - 1 and standard deviations
    2**k apart, within 1%. What a loss scale (torch.amp.GradScaler) does to every gradient
    of a run whose golden has none; None otherwise (a note for the reader, never a verdict)."""
    scales = set()
    for r in rows:
        if str(r.get("Phase", "")) != "backward":
            continue
        try:
            red = float(r.get("RelativeEuclideanDistance"))
            ratio = float(r.get("TargetStd")) / float(r.get("GoldenStd"))
        except (TypeError, ValueError, ZeroDivisionError):
            return None
        if not (math.isfinite(red) and math.isfinite(ratio)) or red < 15:
            return None
        k = round(math.log2(red + 1))
        if not 4 <= k <= 40 or abs((red + 1) / 2 ** k - 1) > 0.01 or abs(ratio / 2 ** k - 1) > 0.01:
            return None
        scales.add(k)
    return 2 ** scales.pop() if len(scales) == 1 else None
