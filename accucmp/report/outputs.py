"""Writing and re-reading comparison results: csv / json / html / xlsx, and `-p`'s
failing rows with their tensors as .npy (what msaccucmp's `-p 1` produced)."""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from dumpfile.errors import DumpError, DumpFormatError, DumpWriteError
from dumpfile.read.records import type_code
from dumpfile.safe_output import NameSet, OutputBudget, new_dir, output_dir, output_path


def timestamp() -> str:
    return _dt.datetime.now().strftime("%Y%m%d%H%M%S")


def _free_basename(out_dir: Path, basename: str, suffix: str = ".csv") -> str:
    """result_{stamp}; a second run within the same second gets result_{stamp}_1, never clobbers."""
    name, i = basename, 0
    while os.path.lexists(out_dir / f"{name}{suffix}"):   # a dangling link is taken too
        i += 1
        name = f"{basename}_{i}"
    return name


def _mkdir(out_dir: Path) -> Path:
    return Path(output_dir(out_dir))


def _write_format(table: pd.DataFrame, fmt: str, path: Path, *, meta: dict | None, force: bool) -> None:
    """`table` as one file of format `fmt` at `path`, created new (dumpfile.safe_output)."""
    with output_path(path, force=force) as tmp:
        if fmt == "csv":
            table.to_csv(tmp, index=False)
        elif fmt == "json":
            Path(tmp).write_text(to_json(table, meta), encoding="utf-8")
        elif fmt == "jsonl":
            with open(tmp, "w", encoding="utf-8") as fh:
                write_jsonl_rows(fh, table)
        elif fmt == "html":
            from accucmp.report.html import render_html

            Path(tmp).write_text(render_html(table, meta=meta), encoding="utf-8")
        elif fmt == "xlsx":
            table.to_excel(tmp, index=False)


def write_results(table: pd.DataFrame, out_dir: Path, formats: list[str], *, meta: dict | None = None,
                  basename: str | None = None, force: bool = False) -> list[Path]:
    """Write the table in each format; returns the paths, the csv first. Each file is
    created new (dumpfile.safe_output): an existing one is refused unless `force`."""
    out_dir = _mkdir(out_dir)
    if "xlsx" in formats:
        _require_openpyxl()
    base = _free_basename(out_dir, basename or f"result_{timestamp()}")
    return _write_formats(table, formats, lambda fmt: out_dir / f"{base}.{fmt}", out_dir, meta=meta, force=force)


def new_result_csv(out_dir: Path, basename: str | None = None) -> Path:
    """The path a streamed result csv goes to: result_{stamp}.csv in `out_dir` (created),
    never an existing file's name (as write_results)."""
    out_dir = _mkdir(out_dir)
    return out_dir / f"{_free_basename(out_dir, basename or f'result_{timestamp()}')}.csv"


def write_other_formats(csv_path: Path, formats: list[str], *, meta: dict | None = None,
                        force: bool = False) -> list[Path]:
    """json / html / xlsx of a streamed result, next to its csv under the same name. They
    are whole-table formats: the table is read back from the csv (memory grows with the
    row count here, and only when one is asked for)."""
    formats = [f for f in formats if f not in ("csv", "jsonl")]   # jsonl: streamed with the csv
    if not formats:
        return []
    if "xlsx" in formats:
        _require_openpyxl()
    table = read_result_csv(csv_path)
    for c in ("SeqId", "GoldenSeqId", "Index"):
        if c in table.columns:
            table[c] = pd.to_numeric(table[c], errors="coerce").astype("Int64")
    return _write_formats(table, formats, lambda fmt: csv_path.with_suffix(f".{fmt}"), csv_path.parent,
                          meta=meta, force=force)


def _write_formats(table: pd.DataFrame, formats, path_of, folder: Path, *, meta: dict | None,
                   force: bool) -> list[Path]:
    """Each format to `path_of(fmt)`; an OS failure is one error naming `folder`."""
    paths: list[Path] = []
    try:
        for fmt in formats:
            path = path_of(fmt)
            _write_format(table, fmt, path, meta=meta, force=force)
            paths.append(path)
    except OSError as e:
        raise DumpWriteError(f"{folder}: cannot write results ({e.strerror or e})") from e
    return paths


def failing_rows_of_csv(csv_path: Path, chunk_rows: int = 65536) -> pd.DataFrame:
    """The failing rows of a saved result, read in chunks (only they are held)."""
    parts = []
    from dumpfile.read.safety import check_regular
    check_regular(str(csv_path))        # a FIFO would block pandas' open forever
    try:
        reader = pd.read_csv(csv_path, keep_default_na=True, dtype={c: str for c in TEXT_COLUMNS},
                             chunksize=chunk_rows)
        for chunk in reader:
            parts.append(failing_rows(chunk))
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, ValueError) as e:
        raise DumpFormatError(f"{csv_path}: not a readable result csv ({type(e).__name__}: {e})") from e
    rows = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()
    if "CompareFailReason" in rows.columns:
        rows["CompareFailReason"] = rows["CompareFailReason"].astype(object).fillna("")
    return rows


def _require_openpyxl() -> None:
    try:
        import openpyxl  # noqa: F401
    except ImportError:
        raise DumpWriteError("--format xlsx needs the openpyxl package (pip install 'npu-accuracy-toolkit[xlsx]'); "
                             "csv, json and html need nothing more") from None


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return None if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, (np.floating,)):
        return _jsonable(float(v))
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (np.bool_,)):
        return bool(v)
    return v


def to_json(table: pd.DataFrame, meta: dict | None) -> str:
    rows = _json_rows(table)
    fast = _indented_flat_rows(rows)
    if fast is None:
        return json.dumps({"meta": meta or {}, "rows": rows}, indent=1, default=str, allow_nan=False)
    head = json.dumps({"meta": meta or {}, "rows": []}, indent=1, default=str, allow_nan=False)
    return head[:-len("[]\n}")] + fast + "\n}"


def write_jsonl_rows(fh, table: pd.DataFrame) -> None:
    """Each row as one JSON object on its own line (JSON Lines): the csv's columns, NaN as
    null, infinities as "inf"/"-inf" (JSON has no number for them)."""
    for row in _json_rows(table):
        fh.write(json.dumps(row, default=str, allow_nan=False))
        fh.write("\n")


def op_record(row) -> dict | None:
    """One failing row as the summary JSON names it: op, seqid, phase, module, tensor, where,
    the bound it broke (why, metric, value, bound, dtype, decided_by), severity, reason."""
    from accucmp.report.headline import bound_clause, seqid_text, where_clause

    if row is None:
        return None
    path = row.get("NPUDumpPath") if isinstance(row.get("NPUDumpPath"), str) else ""
    tensor = "/".join(path.strip("/").split("/")[2:]) if path else "/".join(
        x for x in (row.get("IO"), row.get("TensorName")) if isinstance(x, str) and x)
    seq = seqid_text(row.get("SeqId"))
    rec = {"op": row.get("NPUDump"), "seqid": int(seq) if seq.isdigit() else None, "phase": row.get("Phase"),
           "module": row.get("Module"), "tensor": tensor,
           "where": where_clause(row), "why": bound_clause(row),
           "metric": row.get("DecidingMetric"), "value": row.get("DecidingValue"),
           "bound": row.get("DecidingBound"), "dtype": row.get("PrecisionDtype"),
           "decided_by": row.get("DecidedBy"), "severity": row.get("Severity"),
           "reason": row.get("FailReason")}
    return {k: _jsonable(v) for k, v in rec.items()}


def summary_record(summary, *, code: int, meta: dict | None = None, outputs=()) -> dict:
    """The verdict for a CI pipeline (`--summary-json`): PASS/FAIL, the sentence, the exit
    code, counts, and the first and worst failing ops with the bound each broke."""
    from accucmp.cli.options import package_version
    from accucmp.report.headline import verdict_sentence

    op = op_record
    meta = meta or {}
    return {
        "verdict": "PASS" if code == 0 else "FAIL",
        "sentence": verdict_sentence(summary.first_failure, summary.counts, summary.total),
        "exit_code": code,
        "tensors": summary.total,
        "counts": dict(summary.counts),
        # passing tensors that differ from the golden only by what earlier ops made
        # (independent runs judged by each op's own error: docs/COMPARE.md)
        "inherited": int(getattr(summary, "inherited", 0)),
        "first_failure": op(summary.first_failure),
        "worst": [op(r) for r in summary.worst],
        "target": meta.get("target"), "golden": meta.get("golden"),
        "thresholds": meta.get("threshold_overrides") or {},
        "outputs": [str(p) for p in outputs],
        "accucmp_version": package_version(),
    }


# --summary-json in CI (issue 35 item 8): the one output a pipeline re-writes on every run.
# A name that holds an earlier summary of ours (a regular file, not a link, whose JSON has
# these keys) is replaced without --force; anything else there (a csv, someone's notes, a
# link) is refused as every other output is, unless --force.
_SUMMARY_KEYS = ("verdict", "sentence", "exit_code", "accucmp_version")
_SUMMARY_MAX_BYTES = 16 << 20


def is_previous_summary(path: Path) -> bool:
    """Whether `path` is a summary json an earlier `--summary-json` wrote (read without
    following a link, at most 16 MB)."""
    import stat as _stat

    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not _stat.S_ISREG(st.st_mode) or st.st_size > _SUMMARY_MAX_BYTES:
            return False
        with os.fdopen(fd, "rb") as f:
            fd = -1
            record = json.loads(f.read(_SUMMARY_MAX_BYTES + 1))
    except (OSError, ValueError):
        return False
    finally:
        if fd >= 0:
            os.close(fd)
    return isinstance(record, dict) and all(k in record for k in _SUMMARY_KEYS)


def summary_json_force(path: Path | None, force: bool) -> bool:
    """The --force to write the summary json with: the user's, or True over an earlier summary."""
    return force or (path is not None and is_previous_summary(Path(path)))


def write_summary_json(path: Path, record: dict, *, force: bool = False) -> Path:
    """Write the summary json: new, or replacing an earlier summary (is_previous_summary;
    the name is replaced, never written through), or anything with `force`."""
    path = Path(path)
    force = summary_json_force(path, force)
    try:
        with output_path(path, force=force) as tmp:
            Path(tmp).write_text(json.dumps(record, indent=1, default=str, allow_nan=False) + "\n",
                                 encoding="utf-8")
    except OSError as e:
        raise DumpWriteError(f"{path}: cannot write the summary json ({e.strerror or e})") from e
    return path


def _json_rows(table: pd.DataFrame) -> list[dict]:
    """[{column: _jsonable(value)}] per row, as from to_dict(orient="records"), column by column."""
    cols = []
    for name in table.columns:
        col = table[name]
        vals = col.tolist()
        if isinstance(col.dtype, np.dtype) and col.dtype.kind == "f":   # numpy floats: only NaN/inf to map
            vals = [v if v == v and v not in (math.inf, -math.inf) else _jsonable(v) for v in vals]
        else:                                  # to_dict turns pandas' NA into None
            vals = [None if v is pd.NA else _jsonable(v) for v in vals]
        cols.append(vals)
    names = list(table.columns)
    return [dict(zip(names, r)) for r in zip(*cols)] if names else [{} for _ in range(len(table))]


def _indented_flat_rows(rows: list[dict]) -> str | None:
    """json.dumps(rows, indent=1) as nested at depth 1, text for text, for rows of scalars.

    json's C encoder runs only without indent (the pure-Python one took 1.2 s for 9,000
    rows), so encode compactly with separators that JSON text never contains raw (control
    characters are escaped inside strings), then put the indentation in. None: use json.dumps.
    """
    if not rows or any(not r or any(isinstance(v, (list, tuple, dict)) for v in r.values()) for r in rows):
        return None
    compact = json.dumps(rows, separators=("\x00", "\x01"), default=str, allow_nan=False)
    body = compact[2:-2]                       # inside the outer "[{" ... "}]"
    rows_text = (r.replace("\x00", ",\n   ").replace("\x01", ": ") for r in body.split("}\x00{"))
    return "[\n  {\n   " + "\n  },\n  {\n   ".join(rows_text) + "\n  }\n ]"


TEXT_COLUMNS = ("NPUDump", "NPUDumpPath", "GroundTruthPath", "DataType", "Shape", "CompareFailReason",
                "Phase", "Module", "GoldenDataType", "GoldenShape", "GoldenOp", "IO", "TensorName",
                "PrecisionDtype", "ComputeDtype", "CompareStatus", "MatchedBy", "Result", "FailReason",
                "DecidedBy", "DecidingMetric")


def read_result_csv(path: Path) -> pd.DataFrame:
    """A saved result; checks it is one (has the columns a verdict needs)."""
    from dumpfile.read.safety import open_regular

    path = Path(path)
    try:
        # text columns stay text: module paths of nn.Sequential children ("0", "3", "1.10")
        # and tensor names would otherwise come back as numbers (and "1.10" as 1.1)
        with open_regular(str(path)) as f:        # a directory or FIFO is refused (a FIFO would hang the read)
            table = pd.read_csv(f, keep_default_na=True, dtype={c: str for c in TEXT_COLUMNS})
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, ValueError) as e:
        raise DumpFormatError(f"{path}: not a readable result csv ({type(e).__name__}: {e})") from e
    missing = [c for c in ("NPUDump", "NPUDumpPath", "GroundTruthPath") if c not in table.columns]
    if missing:
        raise DumpFormatError(f"{path}: not an accucmp result csv (missing column(s) {', '.join(missing)})")
    if table.empty:     # a header alone judges nothing: not a pass
        raise DumpFormatError(f"{path}: result csv has a header but no rows; nothing to judge")
    # seqids and row numbers are whole numbers or empty (a golden-only row has no SeqId): a
    # row shifted by extra fields, or a SeqId of "abc", reached int() in the verdict (exit 3)
    for c in ("SeqId", "GoldenSeqId", "Index"):
        if c in table.columns:
            num = pd.to_numeric(table[c], errors="coerce")
            bad = (num.isna() & table[c].notna()) | (num.notna() & (num % 1 != 0))
            if bad.any():
                i = int(bad.to_numpy().nonzero()[0][0])
                raise DumpFormatError(f"{path}: row {i + 1}: column {c} holds {str(table[c].iloc[i])[:40]!r}, not a "
                                      "whole number; not an accucmp result csv (edited?)")
    if "CompareFailReason" in table.columns:
        table["CompareFailReason"] = table["CompareFailReason"].astype(object).fillna("")
    return table


# ---- -p: failing rows and their tensors --------------------------------------
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


_MAX_NAME = 160   # bytes of a file name made from a tensor path (most filesystems allow 255)


def _safe(path: str) -> str:
    name = _UNSAFE.sub("_", path.strip("/").replace("/", ".")) or "value"
    if len(name) > _MAX_NAME:     # keep both ends readable; the hash keeps long names distinct
        import hashlib

        digest = hashlib.sha1(name.encode("utf-8", "surrogatepass")).hexdigest()[:10]
        name = f"{name[:70]}~{digest}~{name[-70:]}"
    return name


def failing_rows(table: pd.DataFrame) -> pd.DataFrame:
    if "Result" not in table.columns:
        return table.iloc[0:0]
    return table[table["Result"] == "fail"]


def write_failures(table: pd.DataFrame, target: Path, golden: Path, out_dir: Path, *, stamp: str,
                   force: bool = False, budget: OutputBudget | None = None) -> list[Path]:
    """The failing rows as result_{stamp}_failed.csv and, per row, both tensors as .npy under
    failed_{stamp}/ named `{Index}.{npu|golden}.{op.seqid.output.name}.npy`.

    failed_{stamp}/ is always a new folder (never one, or a link, already there); every
    .npy counts against `budget` (files and bytes) before it is written."""
    from dumpfile import DumpFile

    budget = budget or OutputBudget()
    out_dir = _mkdir(out_dir)
    rows = failing_rows(table)
    csv_path = out_dir / f"result_{stamp}_failed.csv"
    with output_path(csv_path, force=force) as tmp:
        rows.to_csv(tmp, index=False)
    paths = [csv_path]
    if rows.empty:
        return paths
    # two tensors per failing row at most: refuse before writing any of them
    budget.check(out_dir / f"failed_{stamp}", 0, files=2 * len(rows))
    npy_dir = Path(new_dir(out_dir, f"failed_{stamp}"))
    names = NameSet()
    with DumpFile(target) as t, DumpFile(golden) as g:
        for _, row in rows.iterrows():
            idx = row.get("Index", "")
            for side, f, col in (("npu", t, "NPUDumpPath"), ("golden", g, "GroundTruthPath")):
                p = row.get(col)
                if not isinstance(p, str) or not p or p not in f.h5:
                    continue
                name = f"{idx}.{side}.{_safe(p)}"
                try:
                    arr = read_tensor_at(f, p, before_read=lambda rec, n=name: budget.check(
                        npy_dir / f"{n}.npy", _declared_nbytes(rec)))    # not read at all past the cap
                except DumpFormatError:
                    continue        # stored as no numbers: its row says the tensor is unreadable
                if arr is None:
                    continue
                path = npy_dir / (names.unique(name) + ".npy")
                budget.charge(path, int(arr.nbytes) + 128)   # + the .npy header
                with output_path(path) as tmp:               # a new folder: nothing to force
                    np.save(tmp, arr)
                paths.append(path)
    return paths


def _declared_nbytes(rec) -> int:
    """The bytes a tensor declares (shape x stored item size), from metadata alone."""
    from dumpfile import schema as S

    try:
        itemsize = np.dtype(S.STORAGE_NUMPY_DTYPE.get(rec.dtype, "float32")).itemsize
        return rec.numel * itemsize
    except (TypeError, ValueError, OverflowError, DumpError):   # the read names the damage
        return 0


def read_tensor_at(f, path: str, before_read=None) -> np.ndarray | None:
    """The decoded tensor stored at `path` of an open DumpFile (None for a non-tensor).
    `before_read(record)` runs before its values are read (a cap check)."""
    from dumpfile import ValueRecord
    from dumpfile import schema as S

    from dumpfile.read.reader import h5_errors

    with h5_errors(f.path, path):
        obj = f.h5[path]
        if not hasattr(obj, "dtype"):
            return None
        attrs = dict(obj.attrs)
    rec = ValueRecord(f, path, path.rsplit("/", 1)[-1],
                      type_code(attrs.get(S.ATTR_TYPE, S.TYPE_TENSOR), f"{f.path}: {path}"), attrs)
    if rec.type not in (S.TYPE_TENSOR, S.TYPE_TENSOR_VIEW):
        return None
    if before_read is not None:
        before_read(rec)
    try:
        return np.asarray(rec.read())
    except DumpError:
        raise
    except (OSError, ValueError, KeyError) as e:
        raise DumpFormatError(f"{f.path}: cannot read {path}: {e}") from e
