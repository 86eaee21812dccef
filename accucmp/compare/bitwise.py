"""`accucmp compare --bitwise`: judge two statistics dumps by bit identity (content hashes).

Statistics dumps of format 1.7+ hold an XXH3-64 hash of every tensor's bytes
(npu_dumper.capture.tensor_hash). Two runs on the same device and dtype (a determinism check) agree
bit for bit exactly where the hashes agree, so here a row passes when its hashes are equal
and fails when they differ, whatever the statistics' tolerances would say. An output row
whose op's input rows all agree is where the difference arises ("caused here"); a
differing input was already different before the op (an earlier op, or the data fed in).

Applied to each judged batch (the `adjust` step of streaming.compare_to_csv), after the
verdict, so it is re-runnable like every verdict. Torch-free.
"""

from __future__ import annotations

import math

import pandas as pd

from dumpfile import schema as S
from dumpfile.errors import DumpError
from dumpfile.read.reader import DumpFile

CAUSED_HERE = "output bits differ from the golden's, its inputs are bit-identical: the difference arises here"
OUTPUT_INHERITED = "output bits differ from the golden's (content hash); its inputs already differ"
INPUT_DIFFERS = "input bits differ from the golden's (content hash): from an earlier op or the data fed in"
NO_HASH = "no content hash on one side: judged by its statistics"


class BitwiseError(DumpError):
    """A dump that --bitwise cannot judge (no content hashes)."""


def require_hashes(path: str) -> None:
    """`path` must be a statistics dump with content hashes (format 1.7+)."""
    with DumpFile(path) as f:
        if not f.stats_only or not f.attrs.get(S.ROOT_CONTENT_HASH):
            raise BitwiseError(f"{path}: --bitwise needs a statistics dump with content hashes "
                               f"(npu_dumper.dumper(stats_only=True), format 1.7 or later)")


def _is(v, want: bool) -> bool:
    if v is None or (isinstance(v, float) and math.isnan(v)) or v is pd.NA:
        return False
    if isinstance(v, str):
        return v.strip().lower() == str(want).lower()
    return bool(v) is want


def _decided_by_hash(out: pd.DataFrame, idx) -> None:
    """The verdict's Deciding* columns (when present) say the hashes decided: the summary's
    sentence then quotes the FailReason."""
    for col, value in (("DecidedBy", "BitIdentical"), ("DecidingMetric", ""),
                       ("DecidingValue", math.nan), ("DecidingBound", math.nan)):
        if col in out.columns:
            out.at[idx, col] = value


def apply_bitwise(table: pd.DataFrame) -> pd.DataFrame:
    """Result/FailReason/Severity of a judged batch by bit identity (see the module docstring)."""
    if "BitIdentical" not in table.columns or table.empty:
        return table
    out = table.copy()
    keys = [c for c in ("NPUDump", "SeqId") if c in out.columns]
    inputs_differ: set = set()
    for idx, row in out.iterrows():
        if str(row.get("IO", "")) == "input" and _is(row["BitIdentical"], False):
            inputs_differ.add(tuple(row[k] for k in keys))
    for idx, row in out.iterrows():
        same, differs = _is(row["BitIdentical"], True), _is(row["BitIdentical"], False)
        if same:
            out.at[idx, "Result"] = "pass"
            out.at[idx, "FailReason"] = ""
            _decided_by_hash(out, idx)
        elif differs:
            if str(row.get("IO", "")) == "input":
                reason = INPUT_DIFFERS
            elif tuple(row[k] for k in keys) in inputs_differ:
                reason = OUTPUT_INHERITED
            else:
                reason = CAUSED_HERE
            out.at[idx, "Result"] = "fail"
            out.at[idx, "FailReason"] = reason
            if "Severity" in out.columns:
                out.at[idx, "Severity"] = math.inf
            _decided_by_hash(out, idx)
        elif row.get("CompareStatus") == "stats" and str(row.get("Result")) != "skipped":
            prev = str(row.get("FailReason") or "")
            out.at[idx, "FailReason"] = f"{prev}; {NO_HASH}" if prev else NO_HASH
    return out
