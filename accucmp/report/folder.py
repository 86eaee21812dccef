"""The merged answer of a folder compare (`accucmp compare -m RUN_B/ -g RUN_A/`, compared
by accucmp/compare/ranks.py): its verdict sentence and exit status, decided once here so
the terminal, the summary JSON and the HTML report say the same thing and the sentence
never says PASS when the status is 1; the `--summary-json` record (the two-file record's
keys, so one client reads both, plus per-rank results); and the per-rank part of the HTML
report (accucmp/report/html.py renders the page).

Light: no pandas at import, no Dask, no torch.
"""

from __future__ import annotations

import math
from typing import Any

from dumpfile.cli_boundary import Status


def _where(rank: int, step) -> str:
    return f"rank {rank}" + ("" if step is None else f" step {step}")


def _rows(r) -> int:
    return sum(p.get("rows") or 0 for p in r.pairs)


def replica_failures(r) -> list[dict[str, Any]]:
    """The replica checks that found a tensor the golden holds equal across ranks and the
    target does not, in (step, rank) order."""
    return [x for x in r.replicas if x.get("differ") and not x.get("error")]


def folder_verdict(r) -> tuple[int, str]:
    """(exit status, verdict sentence) of a folder compare: 2 when a pair or a replica check
    could not be run; else 1 when any tensor fails or a replica check finds a difference,
    or when nothing could be compared; else 0. The sentence is FAIL exactly when the status
    is not 0, and names what decided it."""
    from accucmp.report.headline import verdict_sentence, where_clause

    counts, rows = r.counts, _rows(r)
    if r.errors:
        first = r.errors[0]
        more = f" (and {len(r.errors) - 1} more)" if len(r.errors) > 1 else ""
        return Status.BAD_INPUT, f"FAIL: {len(r.errors)} rank check(s) could not be run: {first}{more}"
    if r.earliest is not None and counts.get("fail", 0):
        e = r.earliest
        head = verdict_sentence(e, counts, rows)
        return Status.FINDINGS, head.replace(" is ", f" is on {_where(e['rank'], e.get('step'))}: ", 1)
    bad = replica_failures(r)
    if bad:
        x = bad[0]
        f = (x.get("first") or [{}])[0]
        tensor = "/".join(t for t in (f.get("IO") or "", f.get("TensorName") or "") if t)
        what = where_clause(f) + (f" {tensor}" if tensor else "")
        more = f"; {len(bad) - 1} more rank(s) differ" if len(bad) > 1 else ""
        return Status.FINDINGS, (f"FAIL: replica check: {_where(x['rank'], x.get('step'))} differs from rank "
                                 f"{x['ref_rank']} in {x['differ']} of {x['checked']} tensor(s) the golden run "
                                 f"holds equal across them; first {what}{more}")
    head = verdict_sentence(None, counts, rows)
    if not head.startswith("PASS"):
        return Status.FINDINGS, head
    if not rows:            # no rank pair held a row (every op left out): nothing compared
        return Status.FINDINGS, "FAIL: no tensor could be compared on any rank"
    checked = sum(x.get("checked") or 0 for x in r.replicas)
    return Status.OK, head + f" on {len(r.pairs)} rank pair(s)" + (
        f"; replicas equal ({checked} tensor(s) checked)" if checked else "")


def rank_verdict(p: dict[str, Any], replica: dict[str, Any] | None) -> tuple[str, str]:
    """(PASS/FAIL, sentence) of one rank pair, its replica check included."""
    from accucmp.report.headline import verdict_sentence

    if p.get("error"):
        return "FAIL", f"FAIL: not compared: {p['error']}"
    counts = p.get("counts") or {}
    head = verdict_sentence(p.get("first_failure"), counts, p.get("rows") or 0)
    if head.startswith("PASS") and replica and replica.get("differ"):
        head = (f"FAIL: replica check: {replica['differ']} of {replica['checked']} tensor(s) differ from "
                f"rank {replica['ref_rank']}")
    if head.startswith("PASS") and not p.get("rows"):
        head = "FAIL: no tensor compared"
    return ("PASS" if head.startswith("PASS") else "FAIL"), head


def _failure_order(p: dict[str, Any]) -> tuple:
    ff = p.get("first_failure") or {}
    seq = ff.get("SeqId")
    return (-1 if p.get("step") is None else p["step"], math.inf if seq is None else seq, p["rank"])


def ranks_leading(r) -> list[dict[str, Any]]:
    """The rank pairs in the order a reader wants them: the ranks that diverge first, then the
    other failing ones by their first failure (step, seqid), then the rest by rank."""
    lead = set(r.diverge_first)

    def key(p):
        first = p["rank"] in lead and p.get("first_failure") is not None
        failing = p.get("first_failure") is not None or bool(p.get("error"))
        return (0 if first else 1 if failing else 2,) + _failure_order(p)
    return sorted(r.pairs, key=key)


def per_rank(r) -> list[dict[str, Any]]:
    """One plain record per rank pair (leading order): rank, step, verdict, sentence, counts,
    first failing op and module, its replica check, files."""
    from accucmp.report.outputs import op_record

    rep = {(x["rank"], x["step"]): x for x in r.replicas}
    out = []
    for p in ranks_leading(r):
        x = rep.get((p["rank"], p["step"]))
        verdict, sentence = rank_verdict(p, x)
        ff = p.get("first_failure")
        out.append({
            "rank": p["rank"], "step": p["step"], "verdict": verdict, "sentence": sentence,
            "tensors": p.get("rows") or 0, "counts": dict(p.get("counts") or {}),
            "first_failure": op_record(ff) if ff else None,
            "diverges_first": p["rank"] in r.diverge_first and ff is not None,
            "replica": None if x is None else {
                "ref_rank": x.get("ref_rank"), "golden_equal": x.get("golden_equal"),
                "checked": x.get("checked"), "differ": x.get("differ"), "error": x.get("error"),
                "first": [op_record(f) for f in x.get("first") or []]},
            "target": p.get("target"), "golden": p.get("golden"), "csv": p.get("csv"),
            "error": p.get("error"),
        })
    return out


def merged_worst(r, top: int) -> list[dict[str, Any]]:
    """The worst failing ops over every rank (by Severity, measured over allowed error), each
    with its rank and step."""
    from accucmp.report.headline import as_float

    rows = [dict(w, rank=p["rank"], step=p["step"]) for p in r.pairs for w in (p.get("worst") or []) if w]
    rows.sort(key=lambda w: -as_float(w.get("Severity")) if not math.isnan(as_float(w.get("Severity"))) else math.inf)
    return rows[:top]


def folder_summary_record(r, *, meta: dict | None = None, outputs=(), top: int = 5) -> dict[str, Any]:
    """The `--summary-json` record of a folder compare: the two-file record's keys (verdict,
    sentence, exit_code, tensors, counts, inherited, first_failure, worst, target, golden,
    thresholds, outputs, accucmp_version) with first_failure and worst naming their rank
    and step, plus `kind` "folders", `ranks` (per_rank), `diverge_first`, `replica_checks`
    `unpaired` and `plan` (the line saying what is paired how; None for rank vs rank)."""
    from accucmp.report.outputs import op_record, summary_record
    from accucmp.report.summary import Summary

    code, sentence = folder_verdict(r)
    worst = merged_worst(r, top)
    s = Summary(counts=r.counts, total=_rows(r), first_failure=r.earliest, worst=worst,
                inherited=sum(int(p.get("inherited") or 0) for p in r.pairs))
    rec = summary_record(s, code=code, meta=meta, outputs=outputs)
    rec["sentence"] = sentence
    if r.earliest is not None:
        rec["first_failure"] = dict(rec["first_failure"] or {}, rank=r.earliest["rank"], step=r.earliest.get("step"))
    rec["worst"] = [dict(op_record(w), rank=w["rank"], step=w["step"]) for w in worst]
    rec.update({
        "kind": "folders",
        # what is paired how (a run against a single-process reference: reference_runs' line)
        "plan": getattr(r, "plan", None),
        "ranks": per_rank(r),
        "diverge_first": list(r.diverge_first),
        "replica_checks": [{"rank": x["rank"], "ref_rank": x.get("ref_rank"), "step": x.get("step"),
                            "golden_equal": x.get("golden_equal"), "checked": x.get("checked"),
                            "differ": x.get("differ"), "error": x.get("error"),
                            "first": [op_record(f) for f in x.get("first") or []]} for x in r.replicas],
        "unpaired": [{"path": p, "reason": why} for p, why in r.unpaired],
    })
    return rec


# ---- the HTML report: ranks as a dimension ----------------------------------------------
def _cell(v) -> str:
    import html

    return html.escape("" if v is None else str(v))


def _ranks_table(r) -> str:
    """One row per rank pair, leading order; the diverge-first ranks marked."""
    import html
    from pathlib import Path

    from accucmp.report.headline import bound_clause, where_clause

    head = ("Rank", "Step", "Verdict", "Tensors", "Pass", "Fail", "Unmatched", "First failure", "Why",
            "Replica check", "Result csv")
    rows = []
    for rec, p in zip(per_rank(r), ranks_leading(r)):
        c = rec["counts"]
        ff = p.get("first_failure")
        x = rec["replica"]
        rep = "" if x is None else ("error: " + str(x["error"]) if x.get("error") else
                                    f"{x['differ']} of {x['checked']} differ from rank {x['ref_rank']}"
                                    if x.get("golden_equal") else "nothing replicated")
        cls = "r-fail" if rec["verdict"] == "FAIL" else "r-pass"
        if rec["diverges_first"]:
            cls += " first"
        mark = " (diverges first)" if rec["diverges_first"] else ""
        cells = [f"{rec['rank']}{mark}", rec["step"], rec["verdict"], rec["tensors"], c.get("pass", 0),
                 c.get("fail", 0), c.get("unmatched", 0),
                 ("not compared: " + str(rec["error"])) if rec["error"] else (where_clause(ff) if ff else ""),
                 bound_clause(ff) if ff else "", rep, Path(rec["csv"]).name if rec["csv"] else ""]
        rows.append(f"<tr class='{cls}'>" + "".join(f"<td>{_cell(v)}</td>" for v in cells) + "</tr>")
    return ("<h2>Ranks</h2><p>One row per rank pair, the rank(s) that diverge first (earliest failing op, "
            "by step then seqid) leading; each rank's rows are in its result csv.</p>"
            "<div class='scroll'><table class='ranks'><thead><tr>"
            + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr></thead><tbody>" + "".join(rows)
            + "</tbody></table></div>")


def _replica_html(r) -> str:
    import html

    from accucmp.report.headline import where_clause

    bad = replica_failures(r)
    if not bad:
        return ""
    items = []
    for x in bad:
        firsts = "; ".join(where_clause(f) + " " + "/".join(t for t in (f.get("IO") or "", f.get("TensorName") or "")
                                                             if t) for f in x.get("first") or [])
        items.append(f"<li>{_cell(x.get('label') or x['rank'])}: {x['differ']} of {x['checked']} tensor(s) the "
                     f"golden run holds equal across these ranks differ in the target run: "
                     f"<span class='mono'>{html.escape(firsts)}</span></li>")
    return "<h2>Replica checks</h2><ul>" + "".join(items) + "</ul>"


def render_folder_html(r, lead_table, *, meta: dict | None = None, lead: dict | None = None) -> str:
    """One page for a folder compare: the verdict over all ranks, the ranks table (the
    diverge-first rank leading), the replica checks, then the full report of the leading
    rank pair (`lead_table`: its result rows; None when it has none)."""
    import html

    from accucmp.report.html import PAGE_END, page_head, report_sections
    from accucmp.report.summary import summarize

    code, sentence = folder_verdict(r)
    kind = "v-fail" if code else "v-pass"
    counts = r.counts
    parts = [page_head("accucmp comparison of two runs"), f"<header class='verdict {kind}'><h1>{html.escape(sentence)}</h1>"]
    parts.append(f"<p class='counts'><span>{len(r.pairs)} rank pair(s)</span><span>{_rows(r)} tensors</span>"
                 + "".join(f"<span class='{html.escape(k)}'>{n} {html.escape(k)}</span>" for k, n in counts.items())
                 + "</p>")
    if getattr(r, "plan", None):
        parts.append(f"<p class='plan'>{html.escape(r.plan)}</p>")
    if r.diverge_first:
        parts.append(f"<p>Diverge first: rank(s) {', '.join(map(str, r.diverge_first))}</p>")
    parts.append("</header>")
    parts.append(_ranks_table(r))
    parts.append(_replica_html(r))
    if r.unpaired:
        parts.append("<h2>Unpaired files</h2><ul>" + "".join(f"<li class='mono'>{_cell(p)}: {_cell(why)}</li>"
                                                            for p, why in r.unpaired) + "</ul>")
    if lead is not None and lead_table is not None:
        s = summarize(lead_table, top=10)
        label = "diverges first" if lead["rank"] in r.diverge_first and lead.get("first_failure") else "leading"
        step = "" if lead.get("step") is None else f" step {lead['step']}"
        parts.append(f"<h2>Rank {lead['rank']}{step} ({label}): its report</h2>"
                     f"<p class='mono'>{_cell(lead.get('target'))} vs {_cell(lead.get('golden'))}</p>")
        run_meta = dict(meta or {})
        run_meta.update(target=lead.get("target"), golden=lead.get("golden"))
        parts += report_sections(lead_table, s, run_meta)
    parts.append(PAGE_END)
    return "".join(parts)


def write_folder_html(r, path, *, meta: dict | None = None, force: bool = False):
    """The folder report at `path` (created new: dumpfile.safe_output). Only the leading rank
    pair's rows are read back from its csv (memory as a two-file --format html)."""
    from pathlib import Path

    import pandas as pd

    from accucmp.report.outputs import read_result_csv
    from dumpfile.errors import DumpWriteError
    from dumpfile.safe_output import output_path

    ordered = [p for p in ranks_leading(r) if p.get("csv") and not p.get("error") and p.get("rows")]
    lead = ordered[0] if ordered else None
    table = None
    if lead is not None:
        table = read_result_csv(Path(lead["csv"]))
        for c in ("SeqId", "GoldenSeqId", "Index"):
            if c in table.columns:
                table[c] = pd.to_numeric(table[c], errors="coerce").astype("Int64")
    path = Path(path)
    try:
        with output_path(path, force=force) as tmp:
            Path(tmp).write_text(render_folder_html(r, table, meta=meta, lead=lead), encoding="utf-8")
    except OSError as e:
        raise DumpWriteError(f"{path.parent}: cannot write results ({e.strerror or e})") from e
    return path
