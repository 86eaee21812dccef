"""`accucmp ls`: the ops of a dump in seqid order with phase, module, shapes, dtypes
and (with --stats) value statistics. Reads data only when statistics are asked for,
and then in chunks, so listing a large dump stays cheap.

~505 lines: the three sources of an op's lines (statistics table columns, catalog rows,
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
from dumpfile.printable import printable
from dumpfile.read import catalog as catalog_mod, light
from dumpfile.read.reader import _attr_str, ending_text, h5_errors


@dataclass
class TensorLine:
    side: str          # "in" / "out"
    name: str          # argument name, "self" or "tensors/tensors_0"
    kind: str          # "Tensor", "Tensor(view)", "Tensor(stats)", or a value's type name
    dtype: str = ""
    shape: tuple[int, ...] | None = None
    value: str = ""    # non-tensor values, short
    stats: dict[str, float] = field(default_factory=dict)
    # describe_value(line, True), made beforehand where it is cheaper by columns (a
    # statistics table); not part of what the line is
    described: str | None = field(default=None, compare=False, repr=False)


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
                "ending": ending_text(f),
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
    r"""A field of the listing: a tab or newline inside a name (a module registered as
    "a\tb") would split the row, an escape sequence or carriage return in a name would act
    on the terminal; each is written as its escape (\t, \n, \x1b: dumpfile.printable)."""
    return printable(text)


def _raised(op) -> str:
    v = op.attrs.get(S.OP_RAISED)
    return str(v) if v else ""


def _outputs_text(ln: OpLine, stats: bool, sep: str, each=lambda text: text) -> str:
    """The outputs' descriptions joined by `sep`, each passed through `each`."""
    text = sep.join(each(describe_value(v, stats)) for v in ln.values if v.side == "out")
    return text or (each(f"raised {ln.raised}") if ln.raised else "")


_LISTING_FIELDS = ("seqid", "io", "name", "Type", "dtype", "shape", "uninitialized", "value")


def _table_lines(f: DumpFile, stats: bool) -> dict[int, list[TensorLine]] | None:
    """Every op's lines of a statistics table file by seqid, from the table's columns: the
    fields shown read once (stats_table.read_fields), names and dtypes decoded once per
    distinct value, each op's lines a slice of one list of lines in (seqid, inputs first,
    row) order, and with `stats` the statistics' text (`describe_value`) formatted a column
    at a time (numpy) instead of per value (`ls --stats` of 50k ops, 150k tensors: 5.6-6.4 s
    -> 3.4-3.6 s CPU on the loaded 2-core VM, README).
    The same lines as the per-op records give (lists flattened as `_flatten` does,
    statistics as stored). None: read per op (a value row that does not decode)."""
    import dumpfile.stats_table as T

    fields = _LISTING_FIELDS + (S.STATS_FIELDS if stats else ())
    rows = T.read_fields(f.h5, fields, complete=f.complete)
    if not len(rows):
        return {}
    # inputs before outputs within an op, each in row order (lexsort is stable)
    rows = rows[np.lexsort((rows["io"] != T.IO_INPUT, rows["seqid"]))]
    seqids, codes = rows["seqid"], rows["Type"]
    names = _decoded(rows["name"])
    dtypes = _decoded(rows["dtype"])
    sides = np.where(rows["io"] == T.IO_INPUT, "in", "out").tolist()
    codes_l = codes.tolist()
    is_tensor = codes == S.TYPE_TENSOR_STATS
    shapes = _shape_tuples(rows["shape"], is_tensor)
    suffix = None
    if stats:
        with_stats = is_tensor & ~rows["uninitialized"].astype(bool)
        suffix = _stats_suffixes(rows, with_stats)
        stats_of: list = [None] * len(rows)
        stored = np.column_stack([rows[k][with_stats].astype(np.float64) for k in S.STATS_FIELDS])
        for i, values_ in zip(np.flatnonzero(with_stats).tolist(), stored.tolist()):
            stats_of[i] = dict(zip(S.STATS_FIELDS, values_))
    values = rows["value"]
    shown: dict[tuple, str] = {}            # (Type, stored value text) -> shown value
    # lines shared by rows that show the same (a model's ops repeat a few hundred); a
    # tensor's with its text without statistics
    same_tensor: dict[tuple, tuple[TensorLine, str]] = {}
    same_value: dict[tuple, TensorLine] = {}
    lines: list[TensorLine | None] = []
    type_names = S.TYPE_NAMES
    for i, (side, name, code) in enumerate(zip(sides, names, codes_l)):
        if code in S.LIST_TYPES:
            lines.append(None)               # a holder: its children are the lines
            continue
        if code == S.TYPE_TENSOR_STATS:
            key = (side, name, code, dtypes[i], shapes[i])
            hit = same_tensor.get(key)
            if hit is None:
                line = TensorLine(side, name, type_names.get(code, "Tensor"), dtypes[i], shapes[i])
                hit = same_tensor[key] = (line, describe_value(line, False))
            line = hit[0]
            if suffix is not None and suffix[i] is not None:
                # its own line: the statistics are this row's
                line = TensorLine(side, name, line.kind, line.dtype, line.shape,
                                  stats=stats_of[i], described=hit[1] + suffix[i])
            lines.append(line)
            continue
        key = (side, name, code, values[i])
        line = same_value.get(key)
        if line is None:
            vkey = (code, values[i])
            value = shown.get(vkey)
            if value is None:
                try:
                    value = shown[vkey] = _short(T.decode_value(code, _attr_str(vkey[1])))
                except ValueError:
                    return None
            line = same_value[key] = TensorLine(side, name, type_names.get(code, str(code)), value=value)
        lines.append(line)
    out: dict[int, list[TensorLine]] = {}
    starts = np.flatnonzero(np.diff(seqids)) + 1
    bounds = zip(np.concatenate(([0], starts)).tolist(), np.append(starts, len(seqids)).tolist())
    has_lists = bool(np.isin(codes, S.LIST_TYPES).any())
    for q, (a, b) in zip(seqids[np.concatenate(([0], starts))].tolist(), bounds):
        op_lines = lines[a:b]
        if has_lists and None in op_lines:
            op_lines = [line for side in ("in", "out")
                        for line in _table_flatten([(names[j], lines[j]) for j in range(a, b)
                                                    if sides[j] == side])]
        out[q] = op_lines
    return out


def _decoded(column: np.ndarray) -> list[str]:
    """A column of stored strings as str, each distinct value decoded once."""
    items = column.tolist()
    text = {v: _attr_str(v) for v in set(items)}
    return list(map(text.__getitem__, items))


def _shape_tuples(column: np.ndarray, wanted: np.ndarray) -> list[tuple | None]:
    """The shape of each row whose `wanted` is set (a tuple, one object per distinct
    shape), None for the others."""
    out: list[tuple | None] = [None] * len(column)
    shape_of: dict[bytes, tuple] = {}
    idx = np.flatnonzero(wanted).tolist()
    stored = column[idx].tolist()
    # h5py gives each row's shape as a 1-d array of the column's base type (int64 as the
    # writer makes it): its bytes are the key; anything else is converted first
    first = stored[0] if stored else None
    if type(first) is np.ndarray and first.dtype == np.int64 and first.ndim == 1:
        keys = list(map(np.ndarray.tobytes, stored))
    else:
        stored = [np.asarray(a, dtype=np.int64).reshape(-1) for a in stored]
        keys = [a.tobytes() for a in stored]
    for i, key, a in zip(idx, keys, stored):
        shape = shape_of.get(key)
        if shape is None:
            shape = shape_of[key] = tuple(np.asarray(a, dtype=np.int64).reshape(-1).tolist())
        out[i] = shape
    return out


def _whole(a: np.ndarray) -> np.ndarray:
    """Where `_fmt` writes the value as an int (NaN, Inf: not whole)."""
    return (np.abs(a) < 1e15) & (a == np.trunc(a))


def _fmt_column(a: np.ndarray) -> list[str]:
    """`_fmt` of every value of a float column, the same text."""
    a = np.asarray(a, dtype=np.float64)
    out = np.empty(len(a), dtype=object)
    whole = _whole(a)
    out[whole] = list(map(str, a[whole].astype(np.int64).tolist()))
    out[~whole] = list(map("{:.4g}".format, a[~whole].tolist()))       # (NaN: "nan", as _fmt)
    return out.tolist()


def _stats_suffixes(rows: np.ndarray, wanted: np.ndarray) -> list[str | None]:
    """`_stats_text` of each row whose `wanted` is set, formatted by columns; None for the others."""
    idx = np.flatnonzero(wanted)
    shown = [rows[k][idx].astype(np.float64) for k in ("min", "max", "mean")]
    # rows with no whole number among the three (most): one format call for the three
    fractional = ~(_whole(shown[0]) | _whole(shown[1]) | _whole(shown[2]))
    text = np.empty(len(idx), dtype=object)
    text[fractional] = list(map(" min={:.4g} max={:.4g} mean={:.4g}".format,
                                *(a[fractional].tolist() for a in shown)))
    text[~fractional] = list(map(" min={} max={} mean={}".format, *(_fmt_column(a[~fractional]) for a in shown)))
    text = text.tolist()
    for field_, label in (("nan_count", " nan="), ("inf_count", " inf=")):
        col = rows[field_][idx]
        some = np.flatnonzero(col != 0)                       # (NaN counts as some, as `if`)
        for j, count in zip(some.tolist(), _fmt_column(col[some])):
            text[j] += label + count
    out: list[str | None] = [None] * len(rows)
    for i, t in zip(idx.tolist(), text):
        out[i] = t
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
    if with_stats and v.described is not None:
        return v.described
    if v.shape is None:
        return f"{v.name}={v.value}"
    text = f"{v.name}: {v.dtype or '?'}{list(v.shape)}"
    if v.kind == "Tensor(view)":
        text += " view"
    if with_stats and v.stats:
        text += _stats_text(v.stats)
    return text


def _stats_text(s: dict) -> str:
    text = f" min={_fmt(s.get('min', math.nan))} max={_fmt(s.get('max', math.nan))} mean={_fmt(s.get('mean', math.nan))}"
    if s.get("nan_count"):
        text += f" nan={_fmt(s['nan_count'])}"
    if s.get("inf_count"):
        text += f" inf={_fmt(s['inf_count'])}"
    return text


def render(lines: list[OpLine], info: dict[str, Any], *, console, plain: bool, stats: bool) -> None:
    header = (f"{info['path']}: {info['ops']} ops, mode {info['mode']}"
              + ("" if info["complete"] else ", " + (info.get("ending") or "INCOMPLETE"))
              + (", statistics only" if info["stats_only"] else ""))
    if info["shown"] != info["ops"]:
        header += f"; showing {info['shown']}"
    if plain:
        out = [printable(header), "seqid\top\tphase\tmodule\tinputs\toutputs"]
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

    if stats:
        console.print(_stats_table(lines, escape(printable(header)), width=console.width))
        return
    from accucmp.report.fit import wrap_name

    # the op and module columns get fixed widths and their names are broken after dots and
    # underscores, never inside a word; the values fold as rich lays them out
    seqid_w = max([5] + [len(str(ln.seqid)) for ln in lines])
    phase_w = max([5] + [len(printable(ln.phase)) for ln in lines])
    rest = max(40, console.width - seqid_w - phase_w - 19)     # 7 rules, 12 of padding
    op_w, module_w = max(12, rest * 25 // 100), max(13, rest * 27 // 100)

    def names(text: str, wrap, width: int) -> str:
        return escape("\n".join(wrap(printable(text), width))) if text else ""

    t = Table(title=escape(printable(header)), title_justify="left")
    for col in ("seqid", "op", "phase", "module", "inputs", "outputs"):
        width = {"op": op_w, "module": module_w}.get(col)
        t.add_column(col, overflow="fold", justify="right" if col == "seqid" else "left",
                     width=width, no_wrap=width is not None)
    for ln in lines:
        # each value on a line of its own: the newlines joining them are ours, the text
        # of each value is made printable
        t.add_row(str(ln.seqid), names(ln.op, wrap_name, op_w), escape(printable(ln.phase)),
                  names(ln.module, wrap_name, module_w),
                  escape("\n".join(printable(describe_value(v, stats)) for v in ln.values if v.side == "in")),
                  escape(_outputs_text(ln, stats, "\n", printable)))
    console.print(t)


def _stats_table(lines: list[OpLine], title: str, width: int = 80):
    """`ls --stats` on a terminal: a row per tensor, its statistics in columns of their
    own that never wrap, so a number is never folded inside its digits (80 columns fit
    op, tensor and min/max/mean); the seqid and op on its first row, its module path and
    phase on the rows below, a rule between ops. Names are fitted, never folded mid-word
    (accucmp/report/fit.py): an op name too long for its column loses `aten.`/`.default`
    first, a module path breaks after its dots, a tensor's text at its spaces. NaN and Inf
    counts get a column only where some tensor has them."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    from accucmp.report.fit import short_op, wrap_dotted, wrap_prose

    counts = any(v.stats.get("nan_count") or v.stats.get("inf_count")
                 for ln in lines for v in ln.values)
    numbers = ("min", "max", "mean") + (("nan/inf",) if counts else ())
    blank = [""] * len(numbers)
    # the rows' text first: the number columns take what their widest cell needs, the two
    # name columns share the rest
    per_op = []
    for ln in lines:
        rows = []
        for v in ln.values:
            name = printable(v.name if v.side == "in" else f"→ {v.name}")
            s = v.stats
            if v.shape is None:
                rows.append([f"{name}={printable(v.value)}", *blank])
                continue
            # (the shape without spaces: a line breaks between name and shape, not inside)
            text = f"{name}: {printable(v.dtype or '?')}[{','.join(map(str, v.shape))}]"
            if not s:
                rows.append([text, *blank])
            else:
                found = s.get("nan_count") or s.get("inf_count")
                rows.append([text,
                             *(_fmt(s.get(k, math.nan)) for k in ("min", "max", "mean")),
                             *((f"{_fmt(s.get('nan_count', 0))}/{_fmt(s.get('inf_count', 0))}"
                                if found else "",) if counts else ())])
        if ln.raised:
            rows.append([printable(f"→ raised {ln.raised}"), *blank])
        per_op.append(rows)
    number_w = [max([len(h)] + [len(r[1 + i]) for rows in per_op for r in rows]) for i, h in enumerate(numbers)]
    # SIMPLE_HEAD: a space at each edge and between columns, one of padding on each inner side
    ncols = 2 + len(numbers)
    names_w = max(24, width - sum(number_w) - (3 * ncols - 1))
    op_w = max(12, names_w // 2)
    tensor_w = max(12, names_w - op_w)
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1),
              pad_edge=False)
    t.add_column("seqid op", width=op_w, no_wrap=True, overflow="ellipsis")
    t.add_column("tensor", width=tensor_w, no_wrap=True, overflow="ellipsis")
    for name in numbers:
        t.add_column(name, justify="right", no_wrap=True)
    for ln, rows in zip(lines, per_op):
        # (names from the file are made printable: escapes, not terminal controls)
        seqid = str(ln.seqid)
        op_cells = [escape(f"{seqid} {short_op(printable(ln.op), op_w - len(seqid) - 1)}")]
        where = wrap_dotted(printable(ln.module), op_w) if ln.module else []
        if ln.phase:
            if where and len(where[-1]) + 1 + len(ln.phase) <= op_w:
                where[-1] += " " + printable(ln.phase)
            else:
                where.append(printable(ln.phase))
        op_cells += [f"[dim]{escape(w)}[/dim]" for w in where]
        while len(rows) < len(op_cells):
            rows.append(["", *blank])
        for i, cells in enumerate(rows):
            text = "\n".join(wrap_prose(cells[0], tensor_w))
            t.add_row(op_cells[i] if i < len(op_cells) else "", escape(text), *cells[1:],
                      end_section=i == len(rows) - 1)
    return t
