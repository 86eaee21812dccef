"""`accucmp whatif`: predict what casting each recorded tensor to a lower precision would do.

Torch-free (numpy only): the casts are re-implemented (numformats.py) as round-to-nearest-even
on float64 copies of the values, one chunk at a time (DumpFile.iter_chunks), and the tests check
them bit for bit against `tensor.to(dtype)` in torch on values built on each format's edges.

Per tensor and format we count, among the finite nonzero values:
  underflow   -> rounds to zero;
  subnormal   -> rounds to a nonzero value below the smallest normal;
  overflow    -> rounds beyond the largest finite value: inf for the IEEE-like formats,
                 saturation at +-448 for float8_e4m3fn (it has no inf; torch's cast saturates,
                 and so does its cast of +-inf, counted in `nonfinite`);
and the RMS relative rounding error over the values that neither overflow nor are non-finite
(an underflow counts as relative error 1).

MXFP8 follows the OCP Microscaling spec v1.0: blocks of 32 consecutive values along the last
dimension share a power-of-two scale X = 2^(floor(log2 amax) - 8) (E8M0, exponent clamped to
[-127, 127]); elements are x / X cast to e4m3 with saturation. A block's values "lost to the
shared scale" are its nonzero values that become zero. The dynamic range of a block is
log2(amax / smallest nonzero |x|) in binades; e4m3 spans 17.8 binades including subnormals.

The "scale" columns answer: is there one power-of-two factor 2^k for the whole tensor such
that x * 2^k neither overflows nor underflows (to zero) in the format? The largest such k is
reported (it keeps small values as far from the subnormals as possible).
"""

from __future__ import annotations

import csv
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from dumpfile import schema as S
from dumpfile.errors import DumpFormatError
from dumpfile.overwritten import holds_no_data

from accucmp.compare.rows import check_record
from accucmp.numformats import (FORMATS, MX_BLOCK, MX_ELEMENT, MX_NAMES, Format, best_scale_log2,
                                mx_scale_exponents, round_to)


# ---- statistics of one tensor --------------------------------------------------------
class _Acc:
    """Running counts of one tensor in one format (chunks are added one by one)."""

    def __init__(self):
        self.nonzero = 0        # finite nonzero values
        self.nonfinite = 0
        self.underflow = 0
        self.subnormal = 0
        self.overflow = 0
        self.sq_rel = 0.0
        self.n_rel = 0
        # mx only
        self.blocks = 0
        self.worst_block_lost = 0.0
        self.worst_block_range = 0.0

    def add(self, x: np.ndarray, r: np.ndarray, fmt: Format, clamped: np.ndarray | None = None) -> None:
        """x: the values, r: their cast; clamped (MX): which values saturated, else derived."""
        fin = np.isfinite(x)
        nz = fin & (x != 0)
        self.nonfinite += int(x.size - np.count_nonzero(fin))
        self.nonzero += int(np.count_nonzero(nz))
        xv, rv = x[nz], r[nz]
        a = np.abs(rv)
        if clamped is not None:
            over = clamped[nz]
        elif fmt.saturates:
            over = np.abs(xv) >= fmt.overflow_threshold
        else:
            over = ~np.isfinite(rv)
        self.overflow += int(np.count_nonzero(over))
        under = a == 0
        self.underflow += int(np.count_nonzero(under))
        if clamped is None:
            self.subnormal += int(np.count_nonzero((a > 0) & (a < fmt.min_normal)))
        # a saturated value is still a value (at most 1 - 448/464 off inside an MX block):
        # its error counts; an inf does not (its relative error is not a number)
        keep = np.ones_like(over) if (fmt.saturates or clamped is not None) else ~over
        with np.errstate(invalid="ignore"):
            rel = (rv[keep] - xv[keep]) / xv[keep]
        self.sq_rel += float(np.dot(rel, rel))
        self.n_rel += int(rel.size)

    @property
    def rms_rel(self) -> float:
        return math.sqrt(self.sq_rel / self.n_rel) if self.n_rel else 0.0


@dataclass
class TensorStats:
    amax: float = 0.0
    amin: float = math.inf      # smallest nonzero finite |x|
    numel: int = 0


# ---- the dump walk ---------------------------------------------------------------------
# Which recorded tensors are weights: forward-op inputs by schema argument name, plus the
# input of the transposes/permutes that linear decomposes into (t(weight) feeding addmm).
WEIGHT_ARG_NAMES = frozenset({"weight", "bias"})
WEIGHT_VIEW_OPS = frozenset({"aten.t.default", "aten.permute.default", "aten.transpose.int"})
FLOAT_DTYPES = frozenset({"float32", "float64", "float16", "bfloat16", "float8_e4m3fn",
                          "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", ""})


def tensor_phase(op, io: str, name: str) -> str:
    if op.phase == "backward":
        return "gradient"
    if io == "input" and (name.split("_")[0] in WEIGHT_ARG_NAMES
                          or (op.op in WEIGHT_VIEW_OPS and name == "self")):
        return "weight"
    return "activation"


def _leaves(values: dict, prefix: str = "") -> Iterator[tuple[str, object]]:
    for name, rec in values.items():
        if rec.is_list:
            yield from _leaves({c.name: c for c in rec.children}, prefix)
        else:
            yield prefix + name, rec


COLUMNS = ("op", "seqid", "module", "phase", "io", "name", "dtype_in", "shape", "numel",
           "format", "nonzero", "nonfinite", "underflow_share", "subnormal_share",
           "overflow_share", "overflow_kind", "rms_rel_error", "amax", "amin_nonzero",
           "scale_log2", "mx_blocks", "mx_lost_share", "mx_worst_block_lost_share",
           "mx_worst_block_range_binades", "source", "overflow_share_max")
SOURCE_VALUES = "values"
SOURCE_HISTOGRAM = "log2 histogram"
# E[1/f^2] for a mantissa f spread log-uniformly over [1, 2): (1/2 - 1/8) / ln 2. The mean
# squared relative rounding error of a binade is quantum^2 / 12 times E[1/x^2].
_INV_SQ_MANTISSA = 0.375 / math.log(2)


def analyze_tensor(chunks: Iterable[np.ndarray], shape: tuple[int, ...], formats: list[str]) -> list[dict]:
    """Rows (one per format) for one tensor given as flattened C-order chunks of whole rows."""
    accs = {f: _Acc() for f in formats}
    st = TensorStats()
    last = shape[-1] if shape else 1
    for chunk in chunks:
        x = np.asarray(chunk, dtype=np.float64).reshape(-1)
        if x.size == 0:
            continue
        st.numel += x.size
        fa = np.abs(x[np.isfinite(x)])
        if fa.size:
            st.amax = max(st.amax, float(fa.max()))
            nzv = fa[fa > 0]
            if nzv.size:
                st.amin = min(st.amin, float(nzv.min()))
        for f in formats:
            if f in FORMATS:
                accs[f].add(x, round_to(x, FORMATS[f]), FORMATS[f])
            else:
                _add_mx(accs[f], x, last)
    rows = []
    for f in formats:
        a = accs[f]
        fmt = FORMATS.get(f, MX_ELEMENT)
        denom = max(a.nonzero, 1)
        k = best_scale_log2(st.amax, st.amin, fmt) if f in FORMATS else None
        row = {"format": f, "nonzero": a.nonzero, "nonfinite": a.nonfinite,
               "underflow_share": a.underflow / denom, "subnormal_share": a.subnormal / denom,
               "overflow_share": a.overflow / denom,
               "overflow_kind": "saturate" if fmt.saturates else "inf",
               "rms_rel_error": a.rms_rel, "amax": st.amax,
               "amin_nonzero": st.amin if math.isfinite(st.amin) else 0.0,
               "scale_log2": "" if k is None else k,
               "mx_blocks": "", "mx_lost_share": "", "mx_worst_block_lost_share": "",
               "mx_worst_block_range_binades": "", "source": SOURCE_VALUES,
               "overflow_share_max": a.overflow / denom}
        if f in MX_NAMES:
            row.update(mx_blocks=a.blocks, mx_lost_share=a.underflow / denom,
                       mx_worst_block_lost_share=a.worst_block_lost,
                       mx_worst_block_range_binades=a.worst_block_range)
        rows.append(row)
    return rows


def analyze_histogram(hist: np.ndarray, amax: float, nonfinite: int, formats: list[str]) -> list[dict]:
    """Rows (one per plain format) for one tensor of a statistics dump from its histogram of
    floor(log2|x|) (int64 pairs [e, count, ...], npu_dumper.capture.tensor_hist) and its largest
    magnitude. What a histogram can tell (docs/WHATIF.md, "Statistics-only dumps"):

    underflow   exact but for values exactly at the rounding tie 2^k (k = the exponent of half
                the smallest subnormal), which round to zero and are counted as not;
    subnormal   an upper bound: the values of the subnormal binades, including the top sliver
                of the last one that rounds up to the smallest normal;
    overflow    exact when the tensor's max |x| is below the format's overflow threshold (then
                0) or every value of the threshold's binade overflows; otherwise a range:
                `overflow_share` counts the binades above, `overflow_share_max` includes the
                threshold's binade;
    rms_rel_error  an estimate: per binade, quantum^2/12 x E[1/x^2] with mantissas spread
                log-uniformly; an underflow counts 1, an overflow to inf is left out, a
                saturated value counts 1 - max/|x| at its binade's middle.
    MXFP8 needs the values of each 32-block: not predicted from a histogram (no row)."""
    e = np.asarray(hist[0::2], dtype=np.int64)
    n = np.asarray(hist[1::2], dtype=np.int64)
    nonzero = int(n.sum())
    amin = math.ldexp(1.0, int(e.min())) if nonzero else math.inf
    rows = []
    for f in formats:
        fmt = FORMATS.get(f)
        if fmt is None:
            continue
        k_zero = fmt.emin - fmt.man_bits - 1          # half the smallest subnormal
        thr = fmt.overflow_threshold
        e_thr = math.frexp(thr)[1] - 1
        under = int(n[e < k_zero].sum())
        sub = int(n[(e >= k_zero) & (e < fmt.emin)].sum())
        over_lo = int(n[e > e_thr].sum())
        over_hi = int(n[e >= e_thr].sum())
        if amax < thr:
            over_lo = over_hi = 0
        elif over_lo == 0 and over_hi > 0:
            over_lo = 1                               # the maximum itself overflows
        keep = (e >= k_zero) & (e <= e_thr)
        ke, kn = e[keep], n[keep].astype(np.float64)
        q_exp = np.maximum(ke, fmt.emin) - fmt.man_bits
        rel2 = np.minimum(np.ldexp(1.0, 2 * (q_exp - ke)) * _INV_SQ_MANTISSA / 12.0, 1.0)
        sq = float(np.dot(rel2, kn)) + under
        n_rel = float(kn.sum()) + under
        if fmt.saturates:
            # a saturated value is still a value (as in analyze_tensor): error 1 - max/|x|,
            # |x| taken at its binade's geometric middle 2^e * sqrt(2)
            above = e > e_thr
            if above.any():
                rel = 1.0 - fmt.max_finite / (np.ldexp(1.0, e[above]) * math.sqrt(2.0))
                sq += float(np.dot(rel * rel, n[above]))
                n_rel += float(n[above].sum())
        denom = max(nonzero, 1)
        k = best_scale_log2(amax, amin, fmt)
        rows.append({"format": f, "nonzero": nonzero, "nonfinite": nonfinite,
                     "underflow_share": under / denom, "subnormal_share": sub / denom,
                     "overflow_share": over_lo / denom,
                     "overflow_kind": "saturate" if fmt.saturates else "inf",
                     "rms_rel_error": math.sqrt(sq / n_rel) if n_rel else 0.0,
                     "amax": amax, "amin_nonzero": amin if math.isfinite(amin) else 0.0,
                     "scale_log2": "" if k is None else k,
                     "mx_blocks": "", "mx_lost_share": "", "mx_worst_block_lost_share": "",
                     "mx_worst_block_range_binades": "", "source": SOURCE_HISTOGRAM,
                     "overflow_share_max": over_hi / denom})
    return rows


def _add_mx(acc: _Acc, x: np.ndarray, last: int) -> None:
    """Blocks of 32 along the last dim; a row whose length is not a multiple of 32 gets a
    zero-padded last block (padding adds no nonzero values and cannot raise amax)."""
    rows = x.reshape(-1, last)
    pad = (-last) % MX_BLOCK
    if pad:
        rows = np.pad(rows, ((0, 0), (0, pad)))
    blocks = rows.reshape(-1, MX_BLOCK)
    scale = np.ldexp(1.0, mx_scale_exponents(blocks))[:, None]
    scaled = blocks / scale
    q = round_to(scaled, MX_ELEMENT) * scale
    acc.blocks += blocks.shape[0]
    fin = np.isfinite(blocks)
    nz = fin & (blocks != 0)
    lost = nz & (q == 0)
    n_nz = nz.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        share = np.where(n_nz > 0, lost.sum(axis=1) / np.maximum(n_nz, 1), 0.0)
        a = np.where(nz, np.abs(blocks), np.nan)
        has = n_nz > 0
        if has.any():
            rng = np.log2(np.nanmax(a[has], axis=1) / np.nanmin(a[has], axis=1))
            acc.worst_block_range = max(acc.worst_block_range, float(rng.max()))
    if share.size:
        acc.worst_block_lost = max(acc.worst_block_lost, float(share.max()))
    # counts as for a plain format; "overflow" = clamped at the element's 448
    xs = blocks.reshape(-1)
    qs = q.reshape(-1)
    with np.errstate(invalid="ignore"):
        clamped = (np.abs(scaled) >= MX_ELEMENT.overflow_threshold).reshape(-1)
    acc.add(xs, qs, MX_ELEMENT, clamped)
    # subnormal relative to the block's scale: the element itself is an e4m3 subnormal
    qe = np.abs(round_to(scaled, MX_ELEMENT))
    acc.subnormal += int(np.count_nonzero(nz & (qe > 0) & (qe < MX_ELEMENT.min_normal)))


def iter_tensors(dump, skipped: list | None = None):
    """(op, io, name, record) for every recorded floating tensor with data. Uninitialised
    memory (an empty-like op's output, the buffer dropout's bernoulli_ overwrites: attribute
    `uninitialized`, or by the op's nature in dumps older than that attribute) holds whatever
    the allocator left, no value of the run: left out, and listed in `skipped` as
    (op, seqid, io, name) when a list is given."""
    for op in dump.ops():
        for io, values in (("input", op.inputs), ("output", op.outputs)):
            for name, rec in _leaves(values()):
                if not rec.is_tensor:
                    continue
                if rec.uninitialized or holds_no_data(op.op, io, name):
                    if skipped is not None:
                        skipped.append((op.op, op.seqid, io, name))
                    continue
                if rec.dtype not in FLOAT_DTYPES:
                    continue
                yield op, io, name, rec


def run_whatif(dump_path: str | os.PathLike, formats: list[str], out_dir: str | os.PathLike,
               select: str | None = None, chunk_elements: int = 1 << 22,
               skipped: list | None = None) -> tuple[Path, list[dict]]:
    import re

    from dumpfile.read.reader import DumpFile

    pattern = re.compile(select) if select else None
    out_dir = Path(out_dir)
    rows: list[dict] = []
    with DumpFile(dump_path) as dump:
        if dump.stats_only and not dump.attrs.get(S.ROOT_STATS_HISTOGRAM):
            raise DumpFormatError(
                f"{dump_path}: a statistics-only dump without log2 histograms holds no distribution of "
                "magnitudes; dump with stats_only=True, stats_histogram=True (or a full dump)")
        if dump.stats_only and all(f in MX_NAMES for f in formats):
            raise DumpFormatError(f"{dump_path}: mxfp8 needs the values of each 32-value block; "
                                  "a statistics dump's histograms cannot predict it (use a full dump)")
        for op, io, name, rec in iter_tensors(dump, skipped):
            if pattern and not (pattern.search(op.op) or pattern.search(op.module or "")):
                continue
            base = {"op": op.op, "seqid": op.seqid, "module": op.module, "phase": tensor_phase(op, io, name),
                    "io": io, "name": name, "dtype_in": rec.dtype, "shape": "x".join(map(str, rec.shape)),
                    "numel": rec.numel}
            if rec.is_stats:
                st = rec.stats()
                hist = rec.attrs.get(S.STATS_HIST_FIELD)
                if hist is None:
                    continue
                amax = max(abs(st["min"]), abs(st["max"])) if st["numel"] > st["nan_count"] + st["inf_count"] else 0.0
                for r in analyze_histogram(hist, amax, int(st["nan_count"] + st["inf_count"]), formats):
                    rows.append(base | r)
                continue
            # the shape attribute checked against the stored data, as compare does: a shape
            # that lies made the block reshape of the stored values an internal error
            shape, _ = check_record(rec)
            for r in analyze_tensor(rec.iter_chunks(chunk_elements), shape, formats):
                rows.append(base | r)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"whatif_{time.strftime('%Y%m%d%H%M%S')}.csv"
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})
    return path, rows


def badness(row: dict) -> float:
    """One number to sort by: values lost (overflow + underflow + MX block loss) dominate
    rounding error."""
    lost = row["overflow_share"] + row["underflow_share"]
    return lost * 1e3 + row["subnormal_share"] * 10 + row["rms_rel_error"]


def summarize(rows: list[dict], formats: list[str], top: int = 5) -> list[str]:
    """Plain lines: per format, the worst tensors and the module paths with most values lost."""
    lines = []
    for f in formats:
        fr = [r for r in rows if r["format"] == f]
        if not fr:
            continue
        tot = sum(r["nonzero"] for r in fr) or 1
        uf = sum(r["underflow_share"] * r["nonzero"] for r in fr) / tot
        of = sum(r["overflow_share"] * r["nonzero"] for r in fr) / tot
        by_phase = {}
        for r in fr:
            p = by_phase.setdefault(r["phase"], [0, 0.0])
            p[0] += r["nonzero"]
            p[1] += (r["underflow_share"] + r["overflow_share"]) * r["nonzero"]
        ph = ", ".join(f"{k} {v[1] / max(v[0], 1):.2%}" for k, v in sorted(by_phase.items()))
        over_word = "saturated" if FORMATS.get(f, MX_ELEMENT).saturates else "overflow"
        lines.append(f"{f}: {len(fr)} tensors, underflow {uf:.3%}, {over_word} {of:.3%} of nonzero values; "
                     f"underflow+{over_word} by phase: {ph}")
        shown: set = set()
        for r in sorted(fr, key=badness, reverse=True):
            if badness(r) == 0 or len(shown) >= top:
                break
            # an op's output is usually the next op's input: show each tensor once
            sig = (r["phase"], r["amax"], r["amin_nonzero"], r["nonzero"], r["rms_rel_error"])
            if sig in shown:
                continue
            shown.add(sig)
            extra = (f", worst block lost {float(r['mx_worst_block_lost_share']):.1%}, range "
                     f"{float(r['mx_worst_block_range_binades']):.1f} binades" if f in MX_NAMES else
                     f", scale 2^{r['scale_log2']}" if r["scale_log2"] != "" else ", no single scale fits")
            lines.append(f"  {r['op']}/{r['seqid']} {r['io']} {r['name']} [{r['phase']}] "
                         f"module={r['module'] or '-'}: underflow {r['underflow_share']:.2%}, "
                         f"subnormal {r['subnormal_share']:.2%}, {over_word} {r['overflow_share']:.2%}, "
                         f"rms rel {r['rms_rel_error']:.2e}{extra}")
        mods = {}
        for r in fr:
            m = mods.setdefault((r["module"] or "-", r["phase"]), [0, 0.0])
            m[0] += r["nonzero"]
            m[1] += (r["underflow_share"] + r["overflow_share"]) * r["nonzero"]
        worst = sorted(((v[1] / max(v[0], 1), k) for k, v in mods.items() if v[1] > 0), reverse=True)[:top]
        if worst:
            lines.append("  modules losing most values: " + "; ".join(
                f"{m} [{p}] {s:.2%}" for s, (m, p) in worst))
    return lines
