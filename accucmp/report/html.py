"""One self-contained HTML page for a comparison: metrics along the op sequence (plot.py)
(forward and backward told apart, failing tensors and the first failure marked) as
inline SVG, the summary, and the table. No external files, scripts or fonts."""

from __future__ import annotations

import html
import math
from typing import Any

import pandas as pd

from accucmp.compare.op_policies import ORIGIN_ABSORBED
from accucmp.report.headline import scaled_by_tolerance
from accucmp.report.plot import plot_svg
from accucmp.report.summary import NAN_INF_ONE_SIDE, NAN_INF_SENTENCE, NOT_A_BOUND, describe_row, fmt_value, summarize

MAX_TABLE_ROWS = 20000

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:1.5em auto;max-width:1400px;
     padding:0 1em;color:#222;line-height:1.4}
h1{font-size:1.35em;margin:.2em 0} h2{font-size:1.1em;margin-top:1.6em;border-bottom:1px solid #ddd}
.verdict{padding:.8em 1em;border-radius:6px;border-left:6px solid}
.verdict.v-fail{background:#fdecee;border-color:#b00020} .verdict.v-pass{background:#eaf5ea;border-color:#1b5e20}
.verdict h1{font-weight:600;overflow-wrap:anywhere} .verdict.v-fail h1{color:#8a0018} .verdict.v-pass h1{color:#1b5e20}
.verdict p{margin:.35em 0}
.counts span{margin-right:1.2em} .fail{color:#b00020;font-weight:600}
.pass{color:#1b5e20} .unmatched{color:#8a6d00} .skipped{color:#666}
.explain{background:#fff8e1;border:1px solid #f0d98a;border-radius:6px;padding:.5em 1em;margin:.8em 0}
.explain h3{font-size:1em;margin:.3em 0} .explain p{margin:.3em 0}
table{border-collapse:collapse;font-size:12px} th,td{border:1px solid #ddd;padding:2px 6px;text-align:left;vertical-align:top}
th{background:#f3f3f3;position:sticky;top:0} tr.r-fail{background:#fde8ea} tr.r-unmatched{background:#fff7d6}
tr.first{outline:2px solid #b00020} .mono,td.mono{font-family:ui-monospace,Menlo,Consolas,monospace}
table.worst td.why{font-weight:600;color:#8a0018;white-space:nowrap} table.worst{font-size:13px}
table.worst td.mono{max-width:22em;overflow-wrap:break-word}
table.worst div.details{min-width:20em;max-width:48em;color:#444} .scroll{overflow-x:auto;max-width:100%}
table.meta th{position:static;text-align:right;white-space:nowrap} table.meta td{font-family:ui-monospace,Menlo,Consolas,monospace}
#all th{cursor:pointer;user-select:none} #all th:hover{background:#e6e6e6}
#all td.long{max-width:36em;white-space:normal}
.controls{margin:.5em 0} .controls input[type=search]{width:28em;padding:3px}
body.hidepass #all tr.r-pass{display:none}
.plot svg{max-width:100%;height:auto}
"""

# Sorting (click a header; again reverses) and filtering (text in any cell; hide passing
# rows) of the full table: plain inline JavaScript, no library, nothing fetched.
_JS = """
(function(){
var t=document.getElementById('all'); if(!t) return;
var body=t.tBodies[0], rows=Array.prototype.slice.call(body.rows), dir={};
function key(r,i){var s=r.cells[i].textContent, n=parseFloat(s);
  return (s!==''&&isFinite(Number(s)))?n:(s==='inf'?Infinity:(s==='NaN'?NaN:s.toLowerCase()));}
Array.prototype.forEach.call(t.tHead.rows[0].cells,function(th,i){
  th.title='sort'; th.addEventListener('click',function(){
    var d=dir[i]=-(dir[i]||-1);
    rows.sort(function(a,b){var x=key(a,i),y=key(b,i);
      var nx=typeof x==='number', ny=typeof y==='number';
      if(nx&&isNaN(x)) return 1; if(ny&&isNaN(y)) return -1;
      if(nx!==ny) return nx?-1:1; return x<y?-d:(x>y?d:0);});
    rows.forEach(function(r){body.appendChild(r);});});});
var q=document.getElementById('filter'), timer=null;
function apply(){var v=q.value.toLowerCase(); rows.forEach(function(r){
  r.style.display=(!v||r.textContent.toLowerCase().indexOf(v)>=0)?'':'none';});}
q.addEventListener('input',function(){clearTimeout(timer); timer=setTimeout(apply,150);});
var h=document.getElementById('hidepass');
h.addEventListener('change',function(){document.body.classList.toggle('hidepass',h.checked);});
})();
"""

# the full table's leading columns: what a reader scans first (the rest keep the csv's order)
_LEAD_COLUMNS = ("Index", "Result", "FailReason", "NPUDump", "SeqId", "Phase", "Module", "IO", "TensorName",
                 "Severity", "DecidedBy", "PrecisionDtype")
_LONG_COLUMNS = ("FailReason", "CompareFailReason", "NPUDumpPath", "GroundTruthPath", "Module")


def _cell(v: Any, text: bool = False) -> str:
    if text and (v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v))):
        return ""                   # an empty text cell (NaN from the csv), not "NaN"
    return html.escape(fmt_value(v) if isinstance(v, float) else ("" if v is None or v is pd.NA else str(v)))


def _text(v: Any) -> str:
    return v if isinstance(v, str) else ""


# ---- what a failure means, and what to try next ----------------------------------------
def explanations(table: pd.DataFrame, s) -> list[tuple[str, str]]:
    """(title, text) for each kind of finding present: underflow, overflow / NaN-Inf, amplified
    rounding, absorbed updates, cancellation, ill-conditioned results, and failures inherited from an earlier op."""
    out: list[tuple[str, str]] = []
    if "Result" not in table.columns or not s.counts.get("fail"):
        return out
    failed = table[table["Result"] == "fail"]
    reasons = failed["FailReason"].fillna("").astype(str) if "FailReason" in failed.columns else pd.Series(dtype=str)
    n_under = int(reasons.str.contains("underflow", regex=False).sum())
    if n_under:
        out.append(("Underflow", f"{n_under} failing tensor(s) hold values near or below the smallest normal "
                    "number of their precision (float16: 6.1e-05): they lose digits or become zero there. "
                    "This is what low-precision training does to small gradients, not necessarily a kernel "
                    "bug. Try next: loss scaling (a dynamic scaler such as torch.amp.GradScaler, or a static "
                    "scale 2^k) so gradients stay in float16's normal range; or bfloat16, which has float32's "
                    "exponent range; or keep this op in float32."))
    nonfinite = pd.to_numeric(failed.get("NonFiniteMismatch", pd.Series(dtype=float)), errors="coerce").fillna(0)
    n_over = int((nonfinite > 0).sum()) + int(reasons.str.contains("overflow", case=False, regex=False).sum())
    if n_over:
        out.append(("Overflow / NaN-Inf", f"{n_over} failing tensor(s) are NaN or Inf on one side only. In "
                    "float16 anything above 65504 becomes Inf (and Inf - Inf, 0 x Inf become NaN). Try next: a "
                    "smaller loss scale (or a dynamic scaler that backs off on Inf), bfloat16, or float32 for "
                    "the op that first overflows (the first failure below); check its inputs' max |x| in the "
                    "csv (GoldenAbsMax)."))
    n_amp = int(reasons.str.startswith("amplified rounding").sum())
    if n_amp:
        out.append(("Amplified rounding", f"{n_amp} failing tensor(s) come from an op that computed right on its "
                    "inputs, which agree with the golden's to their rounding, but whose result moves far more "
                    "than its inputs do (cos/sin of large arguments such as rotary angles at long positions, log "
                    "near 1, the difference of near-equal values): the precision cannot carry this computation. "
                    "Try next: compute that op and the values it reads in float32 (Llama computes its rotary "
                    "angles in float32 for this reason)."))
    n_abs = int((failed["Origin"] == ORIGIN_ABSORBED).sum()) if "Origin" in failed.columns else 0
    if n_abs:
        out.append(("Absorbed updates", f"{n_abs} failing tensor(s) are state (parameters, optimizer moments) that "
                    "an in-place update changes by less than half the spacing of their dtype, so rounding keeps "
                    "the old value: the golden learns, the target does not, step after step, although every "
                    "value stays within rounding of the golden's (AdamW's weight decay and an Adam step on a "
                    "LayerNorm weight of 1.0 in bfloat16). Try next: keep parameters and optimizer state in "
                    "float32 (autocast, or master weights), or an optimizer that rounds stochastically or "
                    "carries the rounding error (Kahan summation)."))
    n_cancel = int(reasons.str.contains("error >= 100%", regex=False).sum())
    if n_cancel:
        out.append(("Cancellation", f"{n_cancel} failing tensor(s) have an error of 100% or more against a more "
                    "precise golden. A result that is a small difference of large terms (e.g. a bias gradient "
                    "followed by a normalisation, 0 in exact arithmetic) is rounding noise at low precision. "
                    "Try next: compare with --golden-fp64 (accucmp golden) to tell noise from a fault."))
    n_ill = int(table["FailReason"].fillna("").astype(str).str.startswith("ill-conditioned").sum()) \
        if "FailReason" in table.columns else 0
    if n_ill:
        out.append(("Ill-conditioned (not judged)", f"{n_ill} tensor(s) were skipped: the fp64 golden shows "
                    "the golden device itself has no correct digit there, so no verdict is possible."))
    later = failed
    if s.first_failure is not None and "SeqId" in failed.columns:
        fs = pd.to_numeric(pd.Series([s.first_failure.get("SeqId")]), errors="coerce").iloc[0]
        later = failed[pd.to_numeric(failed["SeqId"], errors="coerce") > fs]
    ops_later = later.drop_duplicates(subset=[c for c in ("NPUDump", "SeqId") if c in later.columns])
    if len(ops_later):
        caused = ""
        if "Origin" in later.columns:          # the verdict's caused-here / inherited flag
            kinds = later["Origin"].fillna("").astype(str).value_counts()
            parts = [f"{n} {k}" for k, n in kinds.items() if k]
            caused = f" (their failing tensors by Origin: {', '.join(parts)})" if parts else ""
        out.append(("Inherited", f"{len(ops_later)} op(s) after the first failing one fail too{caused}. An error "
                    "flows forward into every op that reads the result (and backward through the gradients), "
                    "so later failures are often inherited from the first. Try next: look at the first failure; "
                    "`accucmp extract --from-report` copies the failing ops for a replay of each on its own."))
    return out


def _explain_html(items: list[tuple[str, str]]) -> str:
    if not items:
        return ""
    body = "".join(f"<h3>{html.escape(t)}</h3><p>{html.escape(x)}</p>" for t, x in items)
    return f"<section class='explain'>{body}</section>"


# ---- the worst ops: reason first -----------------------------------------------------------
def _worst_html(s) -> str:
    from accucmp.report.headline import bound_clause

    if not s.worst:
        return ""
    head = ("Why it fails (threshold that decided)", "Op", "SeqId", "Phase", "Module", "Tensor", "Precision",
            "x allowed", "Details")
    rows = []
    for r in s.worst:
        path = _text(r.get("NPUDumpPath"))
        sev = pd.to_numeric(pd.Series([r.get("Severity")]), errors="coerce").iloc[0]
        knob = _text(r.get("DecidedBy"))
        why = html.escape(bound_clause(r)) + (f"<br><small class='mono'>{html.escape(knob)}</small>"
                                              if knob and knob != "CompareStatus" else "")
        cells = [("why", why)] + [(c, _breakable(v) if c == "mono" else html.escape(v)) for c, v in (
            ("mono", _text(r.get("NPUDump"))), ("", _seqid(r)), ("", _text(r.get("Phase"))),
            ("mono", _text(r.get("Module"))), ("mono", "/".join(path.strip("/").split("/")[2:])),
            ("", _text(r.get("PrecisionDtype"))), ("", "" if pd.isna(sev) else f"{sev:.3g}"))]
        cells.append(("long", f"<div class='details'>{html.escape(_text(r.get('FailReason')))}</div>"))
        rows.append("<tr>" + "".join(f"<td class='{c}'>{v}</td>" for c, v in cells) + "</tr>")
    return ("<h2>Worst failing ops</h2><p>One row per op, its worst tensor; <i>x allowed</i> is the measured "
            "error over the error its precision allows (above 1 fails).</p><div class='scroll'><table class='worst'>"
            "<thead><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr></thead><tbody>" + "".join(rows)
            + "</tbody></table></div>")


def _breakable(name: str) -> str:
    """A dotted name or path, escaped, that may wrap after each '.', '/' or '_' (<wbr>), so
    a long module path takes a few lines in its cell rather than pushing the table wide."""
    out = html.escape(name)
    for ch in (".", "/", "_"):
        out = out.replace(ch, ch + "<wbr>")
    return out


def _seqid(r: dict) -> str:
    from accucmp.report.headline import seqid_text

    return seqid_text(r.get("SeqId")) or seqid_text(r.get("GoldenSeqId"))


# ---- run metadata as a table ------------------------------------------------------------------
_RUN_FIELDS = (("file", "file"), ("device", "device"), ("torch", "torch_version"), ("mode", "mode"),
               ("dump mode", "dump_mode"), ("compute dtype", "compute_dtype"), ("rank", "rank"),
               ("world size", "world_size"), ("step", "step"), ("ops", "num_ops"), ("created", "created"),
               ("closed cleanly", "complete"), ("replayed", "load_file"), ("format", "format_version"))
_META_LABELS = {"command": "accucmp command", "target": "target", "golden": "golden", "golden_fp64": "fp64 golden",
                "pairing": "ops paired by", "target_ops": "target ops", "golden_ops": "golden ops",
                "paired_ops": "ops paired", "unmatched_target_ops": "target ops unpaired",
                "unmatched_golden_ops": "golden ops unpaired", "threshold_overrides": "thresholds given",
                "algorithms": "metrics", "compared_io": "compared", "select": "--select", "rows": "rows",
                "result": "result csv"}


def _fmt_meta(v: Any) -> str:
    if isinstance(v, dict):
        return "; ".join(f"{k}={_fmt_meta(x)}" for k, x in v.items() if x not in (None, "", [], {}))
    if isinstance(v, (list, tuple)):
        return ", ".join(_fmt_meta(x) for x in v)
    return fmt_value(v) if isinstance(v, float) else str(v)


def _dtype_counts(table: pd.DataFrame, col: str) -> str:
    if col not in table.columns:
        return ""
    vc = table[col].dropna().astype(str)
    vc = vc[vc != ""].value_counts()
    return ", ".join(f"{k} ({n})" for k, n in vc.items())


def _meta_html(table: pd.DataFrame, meta: dict | None) -> str:
    meta = dict(meta or {})
    runs = meta.pop("runs", None) or {}
    out = ["<h2>Run</h2>"]
    sides = [k for k in ("target", "golden", "golden_fp64") if isinstance(runs.get(k), dict)]
    dtypes = {"target": _dtype_counts(table, "DataType"), "golden": _dtype_counts(table, "GoldenDataType")}
    if sides:
        head = "".join(f"<th style='text-align:left'>{html.escape(k.replace('_', ' '))}</th>" for k in sides)
        rows = []
        for label, key in _RUN_FIELDS:
            vals = [runs[k].get(key) for k in sides]
            if all(v in (None, "") for v in vals):
                continue
            rows.append(f"<tr><th>{html.escape(label)}</th>"
                        + "".join(f"<td>{html.escape(_fmt_meta(v) if v is not None else '')}</td>" for v in vals)
                        + "</tr>")
        rows.append("<tr><th>tensor dtypes</th>" + "".join(f"<td>{html.escape(dtypes.get(k, ''))}</td>"
                                                           for k in sides) + "</tr>")
        out.append(f"<table class='meta'><thead><tr><th></th>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>")
    items = []
    prec = _dtype_counts(table, "PrecisionDtype")
    if prec:
        items.append(("precision judged at", prec))
    if not sides:
        for side, col in (("target dtypes", "DataType"), ("golden dtypes", "GoldenDataType")):
            if _dtype_counts(table, col):
                items.append((side, _dtype_counts(table, col)))
    for k, v in meta.items():
        if v in (None, "", [], {}) or k in ("warnings", "notes", "op_filter", "target_mode", "golden_mode"):
            continue
        text = _fmt_meta(v)
        if len(text) > 2000:
            text = text[:2000] + " …"
        items.append((_META_LABELS.get(k, k.replace("_", " ")), text))
    for k in ("warnings", "notes"):
        for v in meta.get(k) or ():
            items.append((k[:-1], str(v)))
    if items:
        out.append("<table class='meta' style='margin-top:.8em'><tbody>" + "".join(
            f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(v)}</td></tr>" for k, v in items)
            + "</tbody></table>")
    return "".join(out)


def run_info(path) -> dict[str, Any]:
    """The root attributes of a dump that describe its run (device, torch, mode, ...), for
    the report's Run table; {} when the file cannot be read (the report still gets written)."""
    from dumpfile import DumpFile
    from dumpfile.errors import DumpError

    try:
        with DumpFile(str(path)) as f:
            attrs = dict(f.attrs)
    except (DumpError, OSError, ValueError, KeyError):
        return {}
    info: dict[str, Any] = {"file": str(path)}
    for _, key in _RUN_FIELDS[1:]:
        v = attrs.get(key)
        if v is None:
            continue
        if isinstance(v, bytes):
            v = v.decode("utf-8", "replace")
        elif hasattr(v, "item") and getattr(v, "size", 2) == 1:
            v = v.item()
        info[key] = v if isinstance(v, (str, int, float, bool)) else str(v)
    return info


# ---- the page -----------------------------------------------------------------------------------
def render_html(table: pd.DataFrame, *, meta: dict | None = None, title: str = "accucmp comparison") -> str:
    from accucmp.report.headline import verdict_sentence

    s = summarize(table, top=10)
    first = s.first_failure
    sentence = verdict_sentence(first, s.counts, s.total)
    kind = "v-fail" if sentence.startswith("FAIL") else "v-pass"
    parts = [page_head(title), f"<header class='verdict {kind}'><h1>{html.escape(sentence)}</h1>"]
    counts = "".join(f"<span class='{html.escape(k)}'>{n} {html.escape(k)}</span>" for k, n in s.counts.items())
    parts.append(f"<p class='counts'><span>{s.total} tensors</span>{counts}</p>")
    if first is not None:
        parts.append(f"<p class='mono'>First failure (execution order): {html.escape(describe_row(first))}</p>")
        if _text(first.get("DecidedBy")) in NOT_A_BOUND:
            parts.append("<p>Decided by what the run does, not a bound: the target run departs from the golden "
                         "run here (docs/COMPARE.md, &ldquo;Departures&rdquo;).</p>")
        elif _text(first.get("DecidedBy")) == NAN_INF_ONE_SIDE:
            parts.append(f"<p>Decided by {html.escape(NAN_INF_SENTENCE)}.</p>")
        elif _text(first.get("DecidedBy")) and _text(first.get("DecidedBy")) != "CompareStatus":
            knob = _text(first.get("DecidedBy"))
            parts.append(f"<p>Decided by the threshold <span class='mono'>{html.escape(knob)}</span>: "
                         f"change it with <span class='mono'>-t {html.escape(knob)}=VALUE</span>" +
                         (", or every dtype bound at once with <span class='mono'>--tolerance F</span>.</p>"
                          if scaled_by_tolerance(knob) else ".</p>"))
    elif s.counts.get("pass") and not s.counts.get("fail"):
        parts.append("<p class='pass'>Every compared tensor passes.</p>")
    parts.append("</header>")
    parts += report_sections(table, s, meta)
    parts.append(PAGE_END)
    return "".join(parts)


def page_head(title: str) -> str:
    """The page's start, up to and including <body>: title, viewport, the inline style."""
    return (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            "<meta name='viewport' content='width=device-width, initial-scale=1'>"
            f"<style>{_CSS}</style></head><body>")


PAGE_END = f"<script>{_JS}</script></body></html>"


def report_sections(table: pd.DataFrame, s, meta: dict | None) -> list[str]:
    """The report of one compared pair below its verdict header: what the findings mean, the
    worst ops, the plot along the op sequence, the run table and every row (the folder
    report shows these for its leading rank: accucmp/report/folder.py)."""
    first = s.first_failure
    parts = []
    parts.append(_explain_html(explanations(table, s)))
    parts.append(_worst_html(s))
    parts.append("<h2>Along the op sequence</h2><div class='plot'>" + plot_svg(table, first) + "</div>")
    parts.append(_meta_html(table, meta))

    shown = table
    note = ""
    if len(table) > MAX_TABLE_ROWS and "Result" in table.columns:
        keep = table["Result"] != "pass"
        shown = pd.concat([table[keep], table[~keep].head(max(0, MAX_TABLE_ROWS - int(keep.sum())))])
        shown = shown.sort_index()
        note = f"<p>Showing {len(shown)} of {len(table)} rows (every non-passing row); the csv has all.</p>"
    first_idx = first.get("Index") if first else None
    cols = [c for c in _LEAD_COLUMNS if c in table.columns] + [c for c in table.columns if c not in _LEAD_COLUMNS]
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in cols)
    td = {c: ("<td class='long'>" if c in _LONG_COLUMNS else "<td>") for c in cols}
    from accucmp.report.outputs import TEXT_COLUMNS

    text_cols = set(TEXT_COLUMNS) | {c for c in cols if table[c].dtype == object}
    rows = []
    for rec in shown.to_dict(orient="records"):
        cls = f"r-{html.escape(str(rec.get('Result', '')))}"
        if first_idx is not None and rec.get("Index") == first_idx:
            cls += " first"
        rows.append(f"<tr class='{cls}'>" + "".join(f"{td[c]}{_cell(rec.get(c), c in text_cols)}</td>"
                                                     for c in cols) + "</tr>")
    parts.append("<h2>All tensors</h2>" + note +
                 "<div class='controls'><input type='search' id='filter' placeholder='filter: op, module, "
                 "result, reason…' aria-label='filter rows'> <label><input type='checkbox' id='hidepass'> hide "
                 "passing rows</label> <span style='color:#666'>(click a column header to sort)</span></div>"
                 f"<div class='scroll'><table id='all'><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}"
                 "</tbody></table></div>")
    return parts
