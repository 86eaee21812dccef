"""The terminal summary of a comparison: counts, the first failing op in execution
order, the worst ops and the unmatched ones.

`summarize(table)` is a plain function returning data (tested); `print_summary`
renders it with rich. The first failure is what users act on: errors propagate
forward and backward, so the earliest failing op in seqid order is the suspect,
not the one with the largest error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from accucmp.report import findings
from dumpfile.departures import is_by_design_op
from accucmp.report.fit import middle_ellipsis, short_module, short_op, short_place, wrap_prose
from accucmp.report.headline import as_float, scaled_by_tolerance

# DecidedBy values that are no threshold but what the run does (accucmp/compare/verdict.py: an op
# inserted, missing or fed another input; other arguments; other random draws): the summary and
# the HTML report say so instead of offering `-t NAME=VALUE`
NOT_A_BOUND = frozenset({"Departure", "ArgsDiffer", "RandomDraws"})
# DecidedBy values that are a finding no threshold changes, said as such (not as a -t knob)
NAN_INF_ONE_SIDE = "NonFiniteMismatch"
NAN_INF_SENTENCE = ("NaN/Inf on one side only: a finite value against a NaN or Inf fails whatever the "
                    "thresholds (its Origin says where it came from)")

RESULTS = ("pass", "fail", "unmatched", "skipped")

# The column that ranks failing ops, best first: the verdict's Severity, else (a table
# judged elsewhere) a metric where larger is worse.
_SEVERITY_COLUMNS = ("Severity", "Score", "ErrorUnits", "ErrorRatio", "RelativeEuclideanDistance",
                     "MaxRelativeError", "MeanRelativeError", "MaxAbsoluteError")
_WORST_COLUMNS = ("Severity", "ErrorUlps", "CosineSimilarity", "RelativeEuclideanDistance", "MaxAbsoluteError")
_SHORT = {"CosineSimilarity": "Cosine", "RelativeEuclideanDistance": "RelEuclid", "MaxAbsoluteError": "MaxAbsErr",
          "MaxRelativeError": "MaxRelErr", "ErrorUlps": "Err(u)"}
_SHOW_METRICS = ("CosineSimilarity", "RelativeEuclideanDistance", "MaxAbsoluteError", "MaxRelativeError")


@dataclass
class Summary:
    counts: dict[str, int]
    total: int
    first_failure: dict[str, Any] | None
    worst: list[dict[str, Any]] = field(default_factory=list)
    worst_by: str | None = None
    unmatched: list[dict[str, Any]] = field(default_factory=list)
    # set by SummaryBuilder (a streamed result: no table to look these up in)
    columns: list[str] = field(default_factory=list)
    ill_conditioned: int = 0
    # rows that pass although they differ from the golden: earlier ops made the difference
    # (verdict: Origin "inherited" on a passing row; independent runs judged by own error)
    inherited: int = 0


def inherited_count(table: pd.DataFrame) -> int:
    if "Origin" not in table.columns or "Result" not in table.columns or table.empty:
        return 0
    return int(((table["Result"] == "pass") & (table["Origin"].astype(str) == "inherited")).sum())


def result_counts(table: pd.DataFrame) -> dict[str, int]:
    if "Result" not in table.columns:
        return {}
    vc = table["Result"].fillna("").astype(str).value_counts()
    return {str(k): int(v) for k, v in vc.items()}


def _order(table: pd.DataFrame) -> pd.DataFrame:
    keys = [c for c in ("SeqId", "Index") if c in table.columns]
    if not keys:
        return table
    tmp = table.assign(**{f"__{k}": pd.to_numeric(table[k], errors="coerce") for k in keys})
    return tmp.sort_values([f"__{k}" for k in keys], kind="stable", na_position="last").drop(
        columns=[f"__{k}" for k in keys])


def _first_failure(table: pd.DataFrame) -> dict[str, Any] | None:
    row = findings.first_failure(table)
    return None if row is None else row.to_dict()


def summarize(table: pd.DataFrame, top: int = 5) -> Summary:
    counts = result_counts(table)
    failed = table[table["Result"] == "fail"] if "Result" in table.columns else table.iloc[0:0]
    worst_by = next((c for c in _SEVERITY_COLUMNS if c in table.columns
                     and pd.to_numeric(failed[c], errors="coerce").notna().any()), None)
    if "Severity" in table.columns:
        worst = findings.worst_ops(table, max(top, 1))  # one row per op, its worst tensor
        worst_by = "Severity"
    elif worst_by is not None and not failed.empty:
        key = pd.to_numeric(failed[worst_by], errors="coerce")
        worst = failed.assign(__k=key).sort_values("__k", ascending=False, na_position="last",
                                                   kind="stable").drop(columns="__k")
    else:
        worst = _order(failed)
    if "Result" not in table.columns:
        unmatched = table.iloc[0:0]
    else:
        unmatched = findings.unmatched_ops(table)  # one row per op
    return Summary(
        counts=counts, total=len(table),
        first_failure=_first_failure(table) if counts.get("fail") else None,
        worst=[r for r in worst.head(top).to_dict(orient="records")],
        worst_by=worst_by,
        unmatched=[r for r in unmatched.head(top).to_dict(orient="records")],
        inherited=inherited_count(table),
    )


class SummaryBuilder:
    """summarize() over a result that comes in batches (execution order, whole ops each,
    verdict applied), holding only what the summary shows: counts, the first failure, the
    `top` worst failing ops and the first `top` unmatched ones. Memory does not grow with
    the number of rows."""

    def __init__(self, top: int = 5):
        self.top = top
        self.counts: dict[str, int] = {}
        self.total = 0
        self.first_failure: dict[str, Any] | None = None
        self.worst = None                 # DataFrame of candidates, at most `top` ops
        self.worst_by: str | None = None
        self.unmatched: list[dict[str, Any]] = []
        self.unmatched_by_design: list[dict[str, Any]] = []
        self.first_unpaired: dict[str, Any] | None = None     # an op only one run has (findings.lead)
        self.first_failing: dict[str, Any] | None = None
        self.columns: list[str] = []
        self.ill_conditioned = 0
        self.inherited = 0

    def add(self, part: pd.DataFrame) -> None:
        if not self.columns:
            self.columns = list(part.columns)
        self.total += len(part)
        if part.empty or "Result" not in part.columns:
            return
        for k, v in result_counts(part).items():
            self.counts[k] = self.counts.get(k, 0) + v
        if "FailReason" in part.columns:
            self.ill_conditioned += int(part["FailReason"].astype(str).str.startswith("ill-conditioned").sum())
        self.inherited += inherited_count(part)
        if not (part["Result"] == "fail").any() and len(self.unmatched) >= self.top \
                and not (part["Result"] == "unmatched").any():
            return
        if self.first_unpaired is None and self.first_failing is None and "CompareStatus" in part.columns:
            fu = findings.first_unpaired(part)
            if fu is not None:
                self.first_unpaired = fu.to_dict()
        s = summarize(part, top=max(self.top, 1))
        if s.first_failure is not None and self.first_failure is None:
            self.first_failure = s.first_failure      # batches come in execution order
            failed = part[part["Result"] == "fail"]
            self.first_failing = findings._execution_order(failed).iloc[0].to_dict()
        # ops a run has by design (casts) only fill what the others leave (findings.unmatched_ops)
        for r in s.unmatched:
            if is_by_design_op(str(r.get("NPUDump", ""))):
                if len(self.unmatched_by_design) < self.top:
                    self.unmatched_by_design.append(r)
            elif len(self.unmatched) < self.top:
                self.unmatched.append(r)
        if s.worst:
            self.worst_by = self.worst_by or s.worst_by
            cand = pd.DataFrame(s.worst)
            self.worst = cand if self.worst is None else pd.concat([self.worst, cand], ignore_index=True)
            if self.worst_by in self.worst.columns:
                key = pd.to_numeric(self.worst[self.worst_by], errors="coerce")
                self.worst = self.worst.assign(__k=key).sort_values(
                    "__k", ascending=False, na_position="last", kind="stable").drop(columns="__k")
            self.worst = self.worst.head(max(self.top, 1))

    def result(self) -> Summary:
        worst = [] if self.worst is None else self.worst.head(self.top).to_dict(orient="records")
        first = findings.lead(self.first_failure, self.first_failing, self.first_unpaired)
        return Summary(counts=dict(self.counts), total=self.total, first_failure=first,
                       worst=worst, worst_by=self.worst_by,
                       unmatched=(self.unmatched + self.unmatched_by_design)[:self.top],
                       columns=list(self.columns), ill_conditioned=self.ill_conditioned,
                       inherited=self.inherited)


def fmt_value(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        if math.isnan(v):
            return "NaN"
        if v == 0 or 1e-3 <= abs(v) < 1e5:
            return f"{v:.6g}"
        return f"{v:.3e}"
    return str(v)


def _seqid(row: dict[str, Any], key: str = "SeqId") -> str:
    v = row.get(key)
    if isinstance(v, float) and not math.isnan(v) and v.is_integer():
        return str(int(v))
    if v is None or (isinstance(v, float) and math.isnan(v)) or v == "":
        return ""
    return fmt_value(v)


def _text(row: dict[str, Any], key: str) -> str:
    v = row.get(key)
    return v if isinstance(v, str) else ""  # empty cells come back as NaN from a csv


def describe_row(row: dict[str, Any]) -> str:
    """'aten.mm.default seqid 12 (backward, layers.3) output result' in one line."""
    def text_of(key: str) -> str:
        return _text(row, key)

    path = text_of("NPUDumpPath") or text_of("GroundTruthPath")
    op = text_of("NPUDump") or (path.strip("/").split("/")[0] if path else "?")
    where = ", ".join(x for x in (text_of("Phase"), text_of("Module")) if x)
    tensor = "/".join(path.strip("/").split("/")[2:]) if path.count("/") >= 3 else path
    seqid = _seqid(row)
    if not seqid and _seqid(row, "GoldenSeqId"):     # a golden-only op: the target has no seqid
        text = f"{op} golden seqid {_seqid(row, 'GoldenSeqId')}"
    else:
        text = f"{op} seqid {seqid}"
    if where:
        text += f" ({where})"
    if tensor:
        text += f" {tensor}"
    return text


def fit_width(console) -> int | None:
    """Columns the summary must fit: the terminal's; None off a terminal (lines are neither
    shortened nor wrapped, for logs and `| less`: accucmp.cli.progress.console sets fit_width).
    A console made elsewhere (a test's, the demo's) is fitted to its width."""
    if console is None:
        return 80
    if hasattr(console, "fit_width"):
        return console.fit_width
    return console.width


def _say(console, text: str, style: str | None = None, *, wrap: bool = True) -> None:
    """One line of prose: on a terminal wrapped to its width at spaces, continuation lines
    indented, never between a number and its unit (accucmp/report/fit.py); never wrapped off
    it. Names from the dumps in it are made printable (dumpfile.printable: no escape
    sequence reaches the terminal)."""
    from dumpfile.printable import printable

    text = printable(text)
    width = fit_width(console) if wrap and console.is_terminal else None
    for line in wrap_prose(text, width):
        console.print(line, style=style, markup=False, highlight=False, soft_wrap=True,
                      emoji=False)     # ("file.py:1234:" is no :emoji: code)


def headline_text(s: Summary, width: int | None) -> str:
    """The verdict sentence. Where `width` is known, an op name or module path longer than
    half of it is shortened where it says least (accucmp/report/fit.py: an op name loses
    `aten.` and `.default` first, a module path keeps its end; the csv keeps the full
    names); the rest of the sentence wraps at spaces on a terminal."""
    from accucmp.report.headline import source_place, verdict_sentence

    ff = s.first_failure
    if ff is None and s.inherited and s.counts.get("pass", 0) and not s.counts.get("fail", 0):
        # independent runs: the rows that differ from the golden by what earlier ops made
        return (verdict_sentence(None, s.counts, s.total) +
                f"; {s.inherited} of them differ from the golden by inherited rounding only "
                "(each op within its own error on its own inputs)")
    if width is None or ff is None:
        return verdict_sentence(ff, s.counts, s.total)
    row = dict(ff)
    for key, shorten in (("Module", short_module), ("NPUDump", short_op)):
        v = row.get(key)
        if isinstance(v, str) and len(v) > width // 2:
            row[key] = shorten(v, width // 2)
    place = source_place(row.get("Source"))
    if len(place) > width // 3:     # (the file's name and line; the csv keeps the full line)
        row["Source"] = short_place(place, width // 3)
    return verdict_sentence(row, s.counts, s.total)


_PHASE = {"forward": "fwd", "backward": "bwd", "optimizer": "opt"}


def worst_lines(rows: list[dict[str, Any]], width: int | None) -> list[str]:
    """The worst failing ops as plain aligned lines that fit `width` (None: no limit): op
    names, module paths and tensor names are shortened where they say least (an op name
    loses `aten.`/`.default` first, a module path keeps its end), never broken across
    lines. The deciding bound ('why') ends each line, or goes on a line of its own below
    the op when the window is too narrow for both."""
    from accucmp.report.headline import bound_clause

    head = ("seqid", "op", "phase", "module", "tensor", "x allowed")
    body, whys = [], []
    for r in rows:
        path = _text(r, "NPUDumpPath")
        sev = as_float(r.get("Severity"))
        body.append((_seqid(r), _text(r, "NPUDump"), _PHASE.get(_text(r, "Phase"), _text(r, "Phase")),
                     _text(r, "Module"), "/".join(path.strip("/").split("/")[2:]),
                     "" if math.isnan(sev) else f"{sev:.3g}"))
        whys.append(bound_clause(r))
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    why_w = max([3] + [len(w) for w in whys])
    total = sum(widths) + 2 * len(widths)
    inline = width is None or total + 2 + why_w <= width
    if width is not None and total > width:
        # shrink the names until the line fits: long module paths first, then op names,
        # then tensor names, each down to a floor where both ends still say something
        over = total - width
        for i, least in ((3, 18), (1, 22), (4, 13), (3, 12), (1, 16), (4, 8)):
            cut = min(over, max(0, widths[i] - least))
            widths[i] -= cut
            over -= cut
    right = {0, 5}
    shorten = {1: short_op, 3: short_module}

    def line(cells) -> str:
        out = []
        for i, c in enumerate(cells):
            c = shorten.get(i, middle_ellipsis)(c, widths[i])
            out.append(c.rjust(widths[i]) if i in right else c.ljust(widths[i]))
        return "  " + "  ".join(out)
    if inline:
        return [(line(head) + "  why").rstrip()] + [(line(b) + "  " + w).rstrip() for b, w in zip(body, whys)]
    indent = " " * (4 + widths[0])
    out = [line(head).rstrip()]
    for b, w in zip(body, whys):
        out.append(line(b).rstrip())
        out += [indent + w] if width is None else wrap_prose(indent + w, width, indent=len(indent))
    return out


def print_summary(table: pd.DataFrame | None, *, console=None, meta: dict | None = None, top: int = 5,
                  summary: Summary | None = None) -> Summary:
    """Print the summary of `table`, or a `summary` already made (a streamed result: then
    `table` may be None). The first line is the verdict sentence (accucmp/report/headline.py)."""
    from rich.console import Console

    console = console or Console()
    width = fit_width(console)
    s = summary if summary is not None else summarize(table, top=top)
    if table is None:
        table = pd.DataFrame(columns=s.columns)
    head = headline_text(s, width)
    _say(console, head, "bold red" if head.startswith("FAIL") else "bold green")
    parts = [f"{s.total} tensors"] + [f"{s.counts[r]} {r}" for r in RESULTS if s.counts.get(r)]
    parts += [f"{n} {r}" for r, n in s.counts.items() if r not in RESULTS]
    _say(console, "accucmp: " + ", ".join(parts))
    for w in (meta or {}).get("warnings") or ():
        _say(console, f"  warning: {w}")
    for n in (meta or {}).get("notes") or ():
        _say(console, f"  note: {n}")
    flt = (meta or {}).get("op_filter") or {}
    for side in ("target", "golden"):
        if flt.get(side):
            _say(console, f"  note: the {side} dump was filtered ({flt[side]}); the other side's ops were "
                          f"passed through the same selection ({flt.get('ops_left_out', 0)} op(s) left out)")

    n_noise = s.ill_conditioned if summary is not None else (
        int(table["FailReason"].astype(str).str.startswith("ill-conditioned").sum())
        if "FailReason" in table.columns and len(table) else 0)
    if n_noise:
        _say(console, f"  note: {n_noise} tensor(s) not judged: ill-conditioned at the target's "
                      "precision (sums that cancel: rounding alone leaves them no correct digit there, "
                      "by the fp64 golden, the op's own error or the replay's rounding of their terms); "
                      "FailReason in the result says which")

    if s.first_failure is not None:
        ff = s.first_failure
        origin = " (caused here: its inputs still agree)" if _text(ff, "Origin") == "caused here" else ""
        _say(console, f"first failure (execution order): {describe_row(ff)}{origin}")
        metrics = [f"{m}={fmt_value(ff.get(m))}" for m in _SHOW_METRICS if m in ff]
        if metrics and all(as_float(ff.get(m)) != as_float(ff.get(m)) for m in _SHOW_METRICS if m in ff):
            metrics = []            # (an op inserted or missing, an argument: nothing measured)
        if metrics:
            _say(console, "  " + "  ".join(metrics))
        if _text(ff, "Source"):
            _say(console, f"  source: {_text(ff, 'Source')}")
        for label, key in (("why", "FailReason"), ("note", "CompareFailReason")):
            if _text(ff, key) and not (key == "CompareFailReason" and (_text(ff, key) in _text(ff, "FailReason")
                                                                      or _text(ff, "Origin") == "departs")):
                _say(console, f"  {label}: {_text(ff, key)}")
        if _text(ff, "DecidedBy") in NOT_A_BOUND:
            _say(console, "  decided by: what the run does, not a bound: the target run departs from the golden "
                          "run here (docs/COMPARE.md, \"Departures\")")
        elif _text(ff, "DecidedBy") == NAN_INF_ONE_SIDE:
            _say(console, f"  decided by: {NAN_INF_SENTENCE}")
        elif _text(ff, "DecidedBy") and _text(ff, "DecidedBy") != "CompareStatus":
            knob = _text(ff, "DecidedBy")
            _say(console, f"  decided by: {knob} (change it with -t {knob}=VALUE" +
                 (", or every dtype bound at once with --tolerance F)" if scaled_by_tolerance(knob) else ")"))
    elif s.counts.get("fail", 0) == 0 and s.counts.get("pass", 0):
        _say(console, "every compared tensor passes", "green")
    if s.counts.get("pass", 0) == 0 and s.counts.get("fail", 0) == 0 and s.total:
        _say(console, "no tensor could be compared: see CompareFailReason in the result", "yellow")

    if s.worst and top:
        by = "measured/allowed error" if s.worst_by == "Severity" else (s.worst_by or "seqid")
        _say(console, f"worst failing ops (by {by}):", "bold")
        for ln in worst_lines(s.worst, width):
            _say(console, ln, wrap=False)
        scale = findings.loss_scale_of(s.worst)
        if scale is not None:
            _say(console, f"  note: these backward tensors are {scale} (2^{scale.bit_length() - 1}) times the golden's, "
                          "what a loss scale does: the dumper recognises torch.amp.GradScaler (docs/COMPARE.md, "
                          "\"Loss scaling\"); for another scaler, dump the step with it off or at scale 1 to "
                          "compare its gradients")
    if s.unmatched and top:
        n = s.counts.get("unmatched", 0)
        _say(console, f"unmatched ({n}; first {len(s.unmatched)}, casts last), by module:", "yellow")
        for module, rows in findings.by_module(s.unmatched):
            _say(console, f"  {module}:")
            for r in rows:
                reason = _text(r, "CompareFailReason")
                _say(console, f"    {describe_row(r)}: {reason}")
    return s
