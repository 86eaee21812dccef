"""The HTML report's figure: the plotted metrics along the op sequence (forward and
backward told apart, failing tensors and the first failure marked) as inline SVG, drawn
with matplotlib (imported only when a report is made).
"""

from __future__ import annotations

import io
import math
from typing import Any

import numpy as np
import pandas as pd

from accucmp.report.headline import middle_ellipsis
from accucmp.report.summary import describe_row


# Metrics plotted, with whether a log scale suits them (errors span decades).
# Severity is the verdict's measured/allowed error (dtype-aware): above 1 fails.
_PLOTTED = (("Severity", True), ("RelativeEuclideanDistance", True), ("CosineSimilarity", False),
            ("MaxAbsoluteError", True))


# Above this many points a series' markers are drawn as one embedded image (still
# inside the SVG, so the page stays self-contained) rather than one SVG element per
# point: 9,000 rows made a 4 MB SVG that took a second to write and to display.
RASTER_POINTS = 2000


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
        elif not log:
            # cosine near 1: plain values, not an offset label such as "1e-6+9.9999e-1"
            ax.ticklabel_format(axis="y", useOffset=False)
        ax.set_ylabel(m, fontsize=8)
        ax.tick_params(which="both", labelsize=7)
        ax.grid(alpha=0.25)
        if first is not None:
            fx = pd.to_numeric(pd.Series([first.get(xcol)]), errors="coerce").iloc[0]
            if not math.isnan(fx):
                ax.axvline(fx, color="#b00020", linestyle="--", linewidth=1)
    if first is not None:
        # parse_math=False: a module or op name holding "$...$" is text, not a formula
        # (matplotlib's mathtext raised on "mod$x^$y", losing the whole report)
        # a long op name or module path would run off the figure: shorten it in the middle
        # control characters in a name (no glyph: a warning per character on stderr) as escapes
        from dumpfile.printable import printable
        axes[0, 0].set_title(middle_ellipsis(printable(f"first failure: {describe_row(first)}"), 150), fontsize=9,
                             color="#b00020", loc="left", parse_math=False)
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
