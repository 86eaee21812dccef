"""One self-contained HTML page for a comparison: metrics along the op sequence
(forward and backward told apart, failing tensors and the first failure marked) as
inline SVG, the summary, and the table. No external files, scripts or fonts."""

from __future__ import annotations

import html
import io
import math
from typing import Any

import numpy as np
import pandas as pd

from .summary import describe_row, fmt_value, summarize

# Metrics plotted, with whether a log scale suits them (errors span decades).
# Severity is the verdict's measured/allowed error (dtype-aware): above 1 fails.
_PLOTTED = (("Severity", True), ("RelativeEuclideanDistance", True), ("CosineSimilarity", False),
            ("MaxAbsoluteError", True))
MAX_TABLE_ROWS = 20000
# Above this many points a series' markers are drawn as one embedded image (still
# inside the SVG, so the page stays self-contained) rather than one SVG element per
# point: 9,000 rows made a 4 MB SVG that took a second to write and to display.
RASTER_POINTS = 2000

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.4em} .counts span{margin-right:1.2em} .fail{color:#b00020;font-weight:600}
.pass{color:#1b5e20} .unmatched{color:#8a6d00} .skipped{color:#666}
table{border-collapse:collapse;font-size:12px} th,td{border:1px solid #ddd;padding:2px 6px;text-align:left}
th{background:#f3f3f3;position:sticky;top:0} tr.r-fail{background:#fde8ea} tr.r-unmatched{background:#fff7d6}
tr.first{outline:2px solid #b00020} .mono{font-family:ui-monospace,Menlo,Consolas,monospace}
#hidepass:checked ~ table tr.r-pass{display:none}
"""


def _numeric(table: pd.DataFrame, col: str) -> pd.Series:
    return pd.to_numeric(table[col], errors="coerce") if col in table.columns else pd.Series(dtype=float)


def plot_svg(table: pd.DataFrame, first: dict[str, Any] | None) -> str:
    """Inline SVG of the plotted metrics against SeqId (Index when there is no SeqId)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    metrics = [(m, log) for m, log in _PLOTTED if m in table.columns and _numeric(table, m).notna().any()]
    if not metrics:
        return "<p>No metric values to plot.</p>"
    xcol = "SeqId" if "SeqId" in table.columns and _numeric(table, "SeqId").notna().any() else "Index"
    x = _numeric(table, xcol) if xcol in table.columns else pd.Series(range(len(table)), index=table.index)
    phase = table["Phase"].fillna("").astype(str) if "Phase" in table.columns else pd.Series("", index=table.index)
    result = table["Result"].fillna("").astype(str) if "Result" in table.columns else pd.Series("", index=table.index)
    fig, axes = plt.subplots(len(metrics), 1, figsize=(11, 2.3 * len(metrics) + 0.6), sharex=True, squeeze=False)
    styles = {"forward": ("#1f77b4", "o", "forward"), "backward": ("#ff7f0e", "s", "backward")}
    for ax, (m, log) in zip(axes[:, 0], metrics):
        y = _numeric(table, m)
        if log:
            # exact agreement (0) has no place on a log axis: draw it on a floor line
            pos = y[(y > 0) & ~y.isin([math.inf])]
            floor = float(pos.min()) / 10 if len(pos) else 1e-12
            if m == "Severity":
                floor = min(floor, 0.1)  # keep the pass/fail line (1.0) above "exact"
            y = y.where(~(y <= 0), floor)
            if (y == floor).any():
                ax.axhline(floor, color="#bbbbbb", linewidth=0.6)
                ax.annotate("exact (0)", (0.005, floor), xycoords=("axes fraction", "data"), fontsize=6,
                            color="#888888", va="bottom")
            y = y.where(~y.isin([math.inf]), np.nan)
        if m == "Severity":
            ax.axhline(1.0, color="#b00020", linewidth=0.8, linestyle=":")
        for ph, (color, marker, label) in list(styles.items()) + [("", ("#7f7f7f", ".", "other"))]:
            sel = (phase == ph) if ph else ~phase.isin(list(styles))
            sel &= y.notna() & x.notna()
            if log:
                sel &= y > 0
            if sel.any():
                ax.scatter(x[sel], y[sel], s=9, c=color, marker=marker, label=label, alpha=0.75, linewidths=0,
                           rasterized=bool(sel.sum() > RASTER_POINTS))
        bad = (result == "fail") & y.notna() & x.notna() & ((y > 0) if log else True)
        if bad.any():
            ax.scatter(x[bad], y[bad], s=28, facecolors="none", edgecolors="#b00020", linewidths=1.0,
                       label="fail", rasterized=bool(bad.sum() > RASTER_POINTS))
        if log and (y > 0).any():
            ax.set_yscale("log")
        ax.set_ylabel(m, fontsize=8)
        ax.tick_params(which="both", labelsize=7)
        ax.grid(alpha=0.25)
        if first is not None:
            fx = pd.to_numeric(pd.Series([first.get(xcol)]), errors="coerce").iloc[0]
            if not math.isnan(fx):
                ax.axvline(fx, color="#b00020", linestyle="--", linewidth=1)
    if first is not None:
        axes[0, 0].set_title(f"first failure: {describe_row(first)}", fontsize=9, color="#b00020", loc="left")
    handles = {}
    for ax in axes[:, 0]:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    axes[0, 0].legend(handles.values(), handles.keys(), fontsize=7, loc="upper right", ncol=4)
    axes[-1, 0].set_xlabel(f"{xcol} (execution order)", fontsize=8)
    fig.tight_layout()
    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    plt.close(fig)
    svg = buf.getvalue()
    return svg[svg.find("<svg"):]  # drop the XML prolog/doctype: invalid inside HTML


def _cell(v: Any) -> str:
    return html.escape(fmt_value(v) if isinstance(v, float) else ("" if v is None else str(v)))


def render_html(table: pd.DataFrame, *, meta: dict | None = None, title: str = "accucmp comparison") -> str:
    s = summarize(table, top=10)
    first = s.first_failure
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
             f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>"]
    if meta:
        items = "".join(f"<li><b>{html.escape(str(k))}</b>: <span class='mono'>{html.escape(str(v))}</span></li>"
                        for k, v in meta.items() if not isinstance(v, (list, dict)) or len(str(v)) < 300)
        parts.append(f"<ul>{items}</ul>")
    counts = "".join(f"<span class='{html.escape(k)}'>{n} {html.escape(k)}</span>" for k, n in s.counts.items())
    parts.append(f"<p class='counts'><span>{s.total} tensors</span>{counts}</p>")
    if first is not None:
        parts.append(f"<p class='fail'>First failure (execution order): {html.escape(describe_row(first))}</p>")
    elif s.counts.get("pass") and not s.counts.get("fail"):
        parts.append("<p class='pass'>Every compared tensor passes.</p>")
    parts.append(plot_svg(table, first))

    shown = table
    note = ""
    if len(table) > MAX_TABLE_ROWS and "Result" in table.columns:
        keep = table["Result"] != "pass"
        shown = pd.concat([table[keep], table[~keep].head(max(0, MAX_TABLE_ROWS - int(keep.sum())))])
        shown = shown.sort_index()
        note = f"<p>Showing {len(shown)} of {len(table)} rows (every non-passing row); the csv has all.</p>"
    first_idx = first.get("Index") if first else None
    cols = list(table.columns)
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in cols)
    rows = []
    for rec in shown.to_dict(orient="records"):
        cls = f"r-{html.escape(str(rec.get('Result', '')))}"
        if first_idx is not None and rec.get("Index") == first_idx:
            cls += " first"
        rows.append(f"<tr class='{cls}'>" + "".join(f"<td>{_cell(rec.get(c))}</td>" for c in cols) + "</tr>")
    parts.append("<h2>Table</h2>" + note +
                 "<input type='checkbox' id='hidepass'><label for='hidepass'> hide passing rows</label>"
                 f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>")
    parts.append("</body></html>")
    return "".join(parts)
