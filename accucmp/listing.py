"""`accucmp ls`: the ops of a dump in seqid order with phase, module, shapes, dtypes
and (with --stats) value statistics. Reads data only when statistics are asked for,
and then in chunks, so listing a large dump stays cheap.

~415 lines: the three sources of an op's lines (statistics table columns, catalog rows,
the groups) each need their own fast path to reach the same lines, and they are
kept side by side so that they stay equal (tests compare them).
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dumpfile import DumpFile
from dumpfile import schema as S
from dumpfile.read import catalog as catalog_mod, light
from dumpfile.read.reader import _attr_str, h5_errors


@dataclass
class TensorLine:
    side: str          # "in" / "out"
    name: str          # argument name, "self" or "tensors/tensors_0"
    kind: str          # "Tensor", "Tensor(view)", "Tensor(stats)", or a value's type name
    dtype: str = ""
    shape: tuple[int, ...] | None = None
    value: str = ""    # non-tensor values, short
    stats: dict[str, float] = field(default_factory=dict)


@dataclass
class OpLine:
    seqid: int
    op: str
    phase: str
    module: str
    values: list[TensorLine]
    raised: str = ""              # the op raised this (it has inputs, no outputs)


def _short(v: Any, limit: int = 40) -> str:
    s = repr(v) if not isinstance(v, str) else v
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _flatten(side: str, recs: dict, prefix: str = "") -> list:
    out = []
    for name, rec in recs.items():
        label = f"{prefix}{name}"
        if rec.is_list or rec.children:
            out += _flatten(side, {c.name: c for c in rec.children}, prefix=f"{label}/")
        else:
            out.append((side, label, rec))
    return out


def tensor_stats(rec, chunk_elements: int = 1 << 22) -> dict[str, float]:
    """min / max / mean / nan / inf over finite values, streamed (stats dumps: stored stats)."""
    if rec.is_stats:
        stored = rec.stats()         # the statistics only (not the 1.7 content hash)
        return {k: stored[k] for k in S.STATS_FIELDS if k in stored}
    n = nan = inf = 0
    lo, hi, total = math.inf, -math.inf, 0.0
    for chunk in rec.iter_chunks(chunk_elements):
        a = np.asarray(chunk)
        if a.dtype == bool:
            a = a.astype(np.int8)
        if np.iscomplexobj(a):
            a = np.abs(a)
        a = a.astype(np.float64, copy=False)
        n += a.size
        isn = np.isnan(a)
        isi = np.isinf(a)
        nan += int(isn.sum())
        inf += int(isi.sum())
        fin = a[~(isn | isi)]
        if fin.size:
            lo, hi = min(lo, float(fin.min())), max(hi, float(fin.max()))
            total += float(fin.sum())
    finite = n - nan - inf
    return {"min": lo if finite else math.nan, "max": hi if finite else math.nan,
            "mean": total / finite if finite else math.nan, "nan_count": nan, "inf_count": inf,
            "numel": n}


def list_ops(path: Path, *, select: str | None = None, stats: bool = False,
             limit: int | None = None, progress=None) -> tuple[list[OpLine], dict[str, Any]]:
    """The ops of a dump. `progress(total)`, when given, is a context manager yielding
    advance() (or None), called once per op walked (accucmp/cli/progress.py)."""
    pattern = re.compile(select) if select else None
    # one file: any HDF5 failure below is this file's (the light walk reads it directly)
    # without --stats the catalog is all it reads: the whole-file check only if it must
    # read further (dumpfile.read.safety.check_listing)
    with DumpFile(path, check="full" if stats else "listing") as f, h5_errors(f.path), \
            (progress(len(f)) if progress is not None else contextlib.nullcontext()) as advance:
        info = {"path": str(path), "mode": f.mode, "ops": len(f), "complete": f.complete,
                "stats_only": f.stats_only, "device": f.attrs.get(S.ROOT_DEVICE, "")}
        lines: list[OpLine] = []
        # names, dtypes, shapes and values of every op from the catalog, read once (format
        # 1.2+), instead of walking each op's groups (~0.3 ms an op)
        catalog = None if (stats or f.is_table) else _catalog_rows(f)
        lines_seen: dict = {}          # one TensorLine per distinct entry (ops repeat them)
        by_text: dict = {}             # an op's lines by its row without placement (ops repeat them)
        # a statistics table: every op's lines from the table's columns, read once
        table = _table_lines(f, stats) if f.is_table else None
        for op in f.ops():
            if advance is not None:
                advance()
            if pattern and not (pattern.search(op.op) or pattern.search(op.module or "")):
                continue
            if limit is not None and len(lines) >= limit:
                break
            if not stats and not f.is_table:   # table (stats 1.1) files: values from the rows below
                vals = None
                if catalog is not None:
                    text = catalog.get(op.index_row)
                    vals = by_text.get(text) if text else None
                    if vals is None and text:
                        vals = _catalog_values(catalog_mod.parse_row(text), lines_seen)
                        if vals is not None and len(by_text) < _MAX_DISTINCT_ROWS:
                            by_text[text] = vals
                if vals is None:
                    f.check_all()
                    vals = _light_values(f, op.path)
                # (only an op with no outputs can have raised: no attribute read per op; the
                # lines are inputs then outputs, so the last says whether there are outputs)
                raised = "" if vals and vals[-1].side == "out" else _raised(op)
                lines.append(OpLine(op.seqid, op.op, op.phase or "", op.module or "", vals, raised))
                continue
            vals = table.get(op.seqid) if table is not None else None
            if vals is not None:
                raised = "" if vals and vals[-1].side == "out" else _raised(op)
                lines.append(OpLine(op.seqid, op.op, op.phase or "", op.module or "", vals, raised))
                continue
            if not f.is_table:
                f.check_all()
            vals = []
            for side, label, rec in _flatten("in", op.inputs()) + _flatten("out", op.outputs()):
                if rec.is_tensor:
                    line = TensorLine(side, label, S.TYPE_NAMES.get(rec.type, "Tensor"), rec.dtype, rec.shape)
                    if stats and not rec.uninitialized:
                        line.stats = tensor_stats(rec)
                else:
                    line = TensorLine(side, label, S.TYPE_NAMES.get(rec.type, str(rec.type)),
                                      value=_short(rec.read()))
                vals.append(line)
            raised = "" if vals and vals[-1].side == "out" else _raised(op)
            lines.append(OpLine(op.seqid, op.op, op.phase or "", op.module or "", vals, raised))
        info["shown"] = len(lines)
    return lines, info


def _cell(text: str) -> str:
    r"""A field of the tab-separated listing: a tab or newline inside a name (a module
    registered as "a\tb") would split the row; written as the two characters \t, \n."""
    return text.replace("\t", "\\t").replace("\n", "\\n")


def _raised(op) -> str:
    v = op.attrs.get(S.OP_RAISED)
    return str(v) if v else ""


def _outputs_text(ln: OpLine, stats: bool, sep: str) -> str:
    text = sep.join(describe_value(v, stats) for v in ln.values if v.side == "out")
    return text or (f"raised {ln.raised}" if ln.raised else "")


def _table_lines(f: DumpFile, stats: bool) -> dict[int, list[TensorLine]] | None:
    """Every op's lines of a statistics table file by seqid, from the table's columns (a
    field read per numpy row costs ~1 us, and DumpFile._table_values builds full records
    per op: 8 s for 50k ops); the same lines as the per-op records give (lists flattened
    as `_flatten` does, statistics as stored). None: read per op (a value row that does
    not decode)."""
    import dumpfile.stats_table as T

    tab = f._table
    rows = tab.rows[tab._order]          # grouped by seqid, written order within an op
    if not len(rows):
        return {}
    cols = {k: rows[k].tolist() for k in ("seqid", "io", "name", "Type", "dtype", "value",
                                          "uninitialized")}
    shapes = rows["shape"]
    st = [rows[k].tolist() for k in S.STATS_FIELDS] if stats else None
    text: dict[Any, str] = {}
    shown: dict[tuple, str] = {}            # (Type, stored value text) -> shown value
    shape_of: dict[bytes, tuple] = {}
    same: dict[tuple, TensorLine] = {}      # lines shared by rows that show the same
    out: dict[int, list[TensorLine]] = {}
    per_op: dict[int, tuple[list, list]] = {}
    for i, (q, io, name, code) in enumerate(zip(cols["seqid"], cols["io"], cols["name"], cols["Type"])):
        name = text[name] if name in text else text.setdefault(name, _attr_str(name))
        ins, outs = per_op.setdefault(q, ([], []))
        entries = ins if io == T.IO_INPUT else outs
        if code in S.LIST_TYPES:
            entries.append((name, None))     # a holder: its children are the lines
            continue
        if code == S.TYPE_TENSOR_STATS:
            dt = cols["dtype"][i]
            if st is None:
                # without --stats a line is its row's name, dtype and shape: one line per
                # distinct row, shared (a model's ops repeat a few hundred)
                raw = shapes[i]
                lkey = (io, name, code, dt, raw.dtype.str, raw.tobytes()) if isinstance(raw, np.ndarray) else None
                line = same.get(lkey) if lkey is not None else None
                if line is not None:
                    entries.append((name, line))
                    continue
            else:
                lkey = None
            sa = np.asarray(shapes[i], dtype=np.int64).reshape(-1)
            key = sa.tobytes()
            shape = shape_of.get(key)
            if shape is None:
                shape = shape_of[key] = tuple(sa.tolist())
            line = TensorLine("in" if io == T.IO_INPUT else "out", name,
                              S.TYPE_NAMES.get(code, "Tensor"),
                              text[dt] if dt in text else text.setdefault(dt, _attr_str(dt)), shape)
            if st is not None and not cols["uninitialized"][i]:
                line.stats = {k: float(c[i]) for k, c in zip(S.STATS_FIELDS, st)}
            if lkey is not None:
                same[lkey] = line
        else:
            key = (code, cols["value"][i])
            lkey = (io, name, key)
            line = same.get(lkey)
            if line is None:
                value = shown.get(key)
                if value is None:
                    try:
                        value = shown[key] = _short(T.decode_value(code, _attr_str(key[1])))
                    except ValueError:
                        return None
                line = same[lkey] = TensorLine("in" if io == T.IO_INPUT else "out", name,
                                               S.TYPE_NAMES.get(code, str(code)), value=value)
        entries.append((name, line))
    for q, (ins, outs) in per_op.items():
        out[q] = _table_flatten(ins) + _table_flatten(outs)
    return out


def _table_flatten(entries: list) -> list[TensorLine]:
    """Lines in the order `_flatten` gives the records _table_values builds: a row whose
    name's parent ("tensors" of "tensors/tensors_0") is a list row earlier in the op goes
    under that list, in row order; the rest in row order."""
    lines = [line for _, line in entries]
    for line in lines:
        if line is None:
            break
    else:                              # no list row in the op (the usual case): row order
        return lines
    children: dict[str, list] = {}
    top = []
    for name, line in entries:
        parent = name.rpartition("/")[0]
        if parent and parent in children:
            children[parent].append((name, line))
        else:
            top.append((name, line))
        if line is None:
            children[name] = []
    out: list[TensorLine] = []

    def walk(items):
        for name, line in items:
            if line is None:
                walk(children[name])
            else:
                out.append(line)
    walk(top)
    return out


def _catalog_rows(f: DumpFile):
    """The catalog's rows by index row, placement left out (dumpfile.read.catalog).
    Only names, Types, dtypes, shapes and values are taken from it: they stay true when a
    tool rewrites the file (its offsets may not, and are not used here)."""
    return catalog_mod.described_rows(f)


# Distinct catalog rows whose lines are kept (parsed once): a model's ops repeat a few
# hundred patterns; a bound for files where every row differs.
_MAX_DISTINCT_ROWS = 1 << 16


_TENSOR_TYPES, _TYPE_NAMES, _DTYPE, _SHAPE = S.TENSOR_TYPES, S.TYPE_NAMES, S.ATTR_DTYPE, S.ATTR_SHAPE


def _catalog_values(d: Any, seen: dict) -> list[TensorLine] | None:
    """What _light_values reads from an op's groups, from its parsed catalog row; None when
    the row does not describe the op (empty, malformed, or an entry lacking what is shown).
    Lines are shared through `seen` between ops with the same entry."""
    if not d:
        return None
    try:
        out: list[TensorLine] = []
        for side, key in (("in", S.CAT_INPUTS), ("out", S.CAT_OUTPUTS)):
            for e in d[key]:
                if S.CAT_LENGTH in e:        # a list: its children follow as entries
                    continue
                code, name = e[S.CAT_TYPE], e[S.CAT_NAME]
                if code in _TENSOR_TYPES:
                    dtype, shape = e[_DTYPE], e[_SHAPE]
                    key_ = (side, name, code, dtype, tuple(shape) if type(shape) is list else None)
                    line = seen.get(key_)
                    if line is None:
                        if type(dtype) is not str or type(name) is not str or type(shape) is not list \
                                or not all(type(x) is int for x in shape):
                            return None
                        line = seen[key_] = TensorLine(side, name, _TYPE_NAMES.get(code, "Tensor"), dtype,
                                                       key_[4])
                    out.append(line)
                elif S.CAT_VALUE in e:
                    v = e[S.CAT_VALUE]
                    try:
                        key_ = (side, name, code, type(v), v)
                        line = seen.get(key_)
                    except TypeError:        # lists: not hashable
                        key_, line = None, None
                    if line is None:
                        line = TensorLine(side, str(name), S.TYPE_NAMES.get(code, str(code)), value=_short(v))
                        if key_ is not None:
                            seen[key_] = line
                    out.append(line)
                else:                        # (complex, NaN: only in the file)
                    return None
        return out
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def _light_values(f: DumpFile, op_path: str) -> list[TensorLine]:
    """Names, kinds, dtypes, shapes and values of an op from its groups, through the light
    walk (dumpfile.read.light: only the attributes shown are read)."""
    out: list[TensorLine] = []
    for side, sub in (("in", S.INPUT_GROUP), ("out", S.OUTPUT_GROUP)):
        recs = light.walk_group(f, f"{op_path}/{sub}", values=True)
        for _, label, rec in _flatten(side, recs):
            if rec.is_tensor:
                out.append(TensorLine(side, label, S.TYPE_NAMES.get(rec.type, "Tensor"),
                                      rec.dtype or _stored_dtype(f, rec), rec.shape))
            else:
                out.append(TensorLine(side, label, S.TYPE_NAMES.get(rec.type, str(rec.type)),
                                      value=_short(rec.read())))
    return out


def _stored_dtype(f: DumpFile, rec) -> str:
    try:
        return str(f.h5[rec.path].dtype)
    except (KeyError, TypeError, AttributeError):
        return ""


def _fmt(v: float) -> str:
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    if isinstance(v, (int, np.integer)) or (isinstance(v, float) and v.is_integer() and abs(v) < 1e15):
        return str(int(v))
    return f"{v:.4g}"


def describe_value(v: TensorLine, with_stats: bool) -> str:
    if v.shape is None:
        return f"{v.name}={v.value}"
    text = f"{v.name}: {v.dtype or '?'}{list(v.shape)}"
    if v.kind == "Tensor(view)":
        text += " view"
    if with_stats and v.stats:
        s = v.stats
        text += f" min={_fmt(s.get('min', math.nan))} max={_fmt(s.get('max', math.nan))} mean={_fmt(s.get('mean', math.nan))}"
        if s.get("nan_count"):
            text += f" nan={_fmt(s['nan_count'])}"
        if s.get("inf_count"):
            text += f" inf={_fmt(s['inf_count'])}"
    return text


def render(lines: list[OpLine], info: dict[str, Any], *, console, plain: bool, stats: bool) -> None:
    header = (f"{info['path']}: {info['ops']} ops, mode {info['mode']}"
              + ("" if info["complete"] else ", INCOMPLETE (writer did not close cleanly)")
              + (", statistics only" if info["stats_only"] else ""))
    if info["shown"] != info["ops"]:
        header += f"; showing {info['shown']}"
    if plain:
        out = [header, "seqid\top\tphase\tmodule\tinputs\toutputs"]
        # lines read from the catalog are shared between ops (listing._catalog_values):
        # each described once; an op's cells are cached by the identity of its lines
        cells: dict[tuple, str] = {}
        for ln in lines:
            key = tuple(map(id, ln.values))
            text = cells.get(key) if not ln.raised else None
            if text is None:
                ins = "; ".join(describe_value(v, stats) for v in ln.values if v.side == "in")
                outs = _outputs_text(ln, stats, "; ")
                text = _cell(ins) + "\t" + _cell(outs)
                if not ln.raised:
                    cells[key] = text
            out.append("\t".join((str(ln.seqid), _cell(ln.op), _cell(ln.phase), _cell(ln.module), text)))
        # print, not rich: rich expands tabs, and plain output is for cut/awk/grep
        print("\n".join(out))
        return
    from rich.markup import escape
    from rich.table import Table

    t = Table(title=escape(header), title_justify="left")
    for col in ("seqid", "op", "phase", "module", "inputs", "outputs"):
        t.add_column(col, overflow="fold", justify="right" if col == "seqid" else "left")
    for ln in lines:
        t.add_row(str(ln.seqid), escape(ln.op), ln.phase, escape(ln.module),
                  escape("\n".join(describe_value(v, stats) for v in ln.values if v.side == "in")),
                  escape(_outputs_text(ln, stats, "\n")))
    console.print(t)
