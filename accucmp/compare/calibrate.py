"""`accucmp calibrate`: a per-tensor noise floor from two golden runs, and its use in compare.

Two golden runs that differ only by something harmless (a seeded perturbation of the input at
the last bit, or two non-deterministic runs of the same step) show how far the model's own
tensors move without any bug. `calibrate` compares them (the second against the first, with
the usual compare engine) and writes DIR/noise_floor.csv: per golden tensor path, its
RelativeEuclideanDistance and MaxAbsoluteError between the two runs.

`accucmp compare ... --noise-floor noise_floor.csv [--noise-factor F]` then passes a failing
tensor when both its metrics are at most F times that tensor's noise floor (F = 2 by default):
its error is what the model does by itself. The floor is keyed by the golden dump's tensor
path (GroundTruthPath), so give compare the same golden dump (-g) that calibrate got as -g.
A floor of 0 (bit-identical runs) never excuses anything.
"""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path

FLOOR_METRICS = ("RelativeEuclideanDistance", "MaxAbsoluteError")
KEY = "GroundTruthPath"
NOISE_REASON = "within noise floor"


def calibrate(golden: str | os.PathLike, second: str | os.PathLike, out_dir: str | os.PathLike,
              jobs: int = 1) -> tuple[Path, int]:
    from accucmp.compare.pipeline import compare_dumps

    res = compare_dumps(str(second), str(golden), algorithms=list(FLOOR_METRICS), jobs=jobs)
    table = res.table
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "noise_floor.csv"
    n = 0
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["NPUDump", "SeqId", KEY, *FLOOR_METRICS])
        for row in table.to_dict("records"):
            vals = [_num(row.get(m)) for m in FLOOR_METRICS]
            if not row.get(KEY) or any(math.isnan(v) for v in vals):
                continue
            w.writerow([row.get("NPUDump", ""), row.get("SeqId", ""), row[KEY], *(f"{v:.9g}" for v in vals)])
            n += 1
    return path, n


def _num(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def read_floor(path: str | os.PathLike) -> dict[str, tuple[float, ...]]:
    from dumpfile.errors import DumpFormatError

    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    if rows and not all(c in rows[0] for c in (KEY, *FLOOR_METRICS)):
        raise DumpFormatError(f"{path}: not a noise_floor.csv written by `accucmp calibrate` "
                              f"(needs columns {KEY}, {', '.join(FLOOR_METRICS)})")
    return {r[KEY]: tuple(_num(r[m]) for m in FLOOR_METRICS) for r in rows}


def apply_noise_floor(table, floor: dict[str, tuple[float, ...]], factor: float = 2.0):
    """Failing rows within `factor` x their noise floor become pass (FailReason says why)."""
    table = table.copy()
    if "Result" not in table.columns or KEY not in table.columns:
        return table
    excused = 0
    for idx, row in table[table["Result"] == "fail"].iterrows():
        fl = floor.get(str(row[KEY]))
        if not fl:
            continue
        vals = [_num(row.get(m)) for m in FLOOR_METRICS]
        if all(f > 0 and not math.isnan(v) and v <= factor * f for v, f in zip(vals, fl)):
            table.at[idx, "Result"] = "pass"
            if "FailReason" in table.columns:
                table.at[idx, "FailReason"] = (f"{NOISE_REASON}: RED {vals[0]:.3g} <= {factor:g} x {fl[0]:.3g}")
            excused += 1
    table.attrs["noise_floor_excused"] = excused
    return table
