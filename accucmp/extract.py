"""`accucmp extract`: copy chosen ops into a small dump, the `h5copy -pv -i IN -o OUT
-s /op/seqid/ -d /op/seqid/` workflow, done so the result is a valid load file.

What plain h5copy gets wrong and this does not:
- Type-40 views hold an object reference to a dataset that is usually in another op
  (not copied); each view is materialised into a plain tensor (exact stored bits).
- The copy gets the root attributes of its source and an index of every op, so
  readers and load-replay see all of them (a file built with h5copy has none).
- Appending never overwrites: an op path already in OUT is refused with a message.
- OUT is rebuilt in a temporary file and swapped in only when complete, so a failed
  extract leaves OUT as it was.
- OUT, when it exists, must be a tensor dump (a full dump or an earlier extract): a
  statistics-only dump or an HDF5 file that is not a dump is refused, not mixed with.
- OUT must be a regular file or absent: a symbolic link or special file at OUT is
  refused (never read or written through); the result replaces the name OUT itself.
- The bytes copied (each tensor's declared size; a view counts the elements it
  covers) are checked against a cap (--max-bytes) before anything is copied.
Every attribute of op groups, input/output groups and values is preserved; hard
links between values inside the copied ops stay hard links (stored once).
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from pathlib import Path
from typing import Iterable

import h5py
import numpy as np

from dumpfile import DumpFile, DumpWriter, view_of
from dumpfile import schema as S
from dumpfile.errors import DumpError, DumpFormatError, DumpWriteError, raised_by_h5py
from dumpfile.printable import printable
from dumpfile.safe_output import IN_PROGRESS, WRITTEN, OutputBudget
from dumpfile.read.h5util import view_base
from dumpfile.read.reader import (H5_ERRORS, corrupt_dump_error, decode_raw, h5_errors, h5_message, members,
                                  type_code)

# root attributes the writer owns; everything else is carried over
_WRITER_ROOT_ATTRS = {S.ROOT_FORMAT, S.ROOT_FORMAT_VERSION, S.ROOT_COMPLETE, S.ROOT_NUM_OPS, S.ROOT_MODE}
_WRITER_OP_ATTRS = {S.OP_SEQID, S.OP_NAME, S.OP_PHASE, S.OP_MODULE, S.OP_GRAD_FN}
ROOT_EXTRACTED_FROM = "extracted_from"


class ExtractError(DumpError):
    """An extract request that cannot be done (unknown op, path already in OUT)."""


def _s(v) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else ("" if v is None else str(v))


def parse_op_path(path: str) -> tuple[str, int | None]:
    """'/op/seqid/' , 'op/seqid', '/op/seqid/output' -> (op, seqid); '/op/' -> (op, None)."""
    parts = [p for p in path.strip().split("/") if p]
    if not parts or parts[0] == S.META_GROUP:
        raise ExtractError(f"{path!r}: expected /op/seqid/")
    if len(parts) == 1:
        return parts[0], None
    if not S.is_seqid_name(parts[1]):
        raise ExtractError(f"{path!r}: seqid {parts[1]!r} is not a number (expected /op/seqid/)")
    if len(parts) > 2 and parts[2] not in (S.INPUT_GROUP, S.OUTPUT_GROUP):
        raise ExtractError(f"{path!r}: expected /op/seqid/ (copying a part of an op is not supported)")
    return parts[0], int(parts[1])


def list_op_groups(h5: h5py.File) -> list[tuple[str, int]]:
    """Every /op/seqid group, found by walking (files appended to by h5copy lack index rows)."""
    found = []
    for name, obj in members(h5):     # (an op skipped here would be dropped from OUT)
        if name == S.META_GROUP or not isinstance(obj, h5py.Group):
            continue
        found += [(name, int(k)) for k in obj.keys() if S.is_seqid_name(k)]
    return sorted(found, key=lambda t: (t[1], t[0]))


def _resolve(src_h5: h5py.File, in_path: str, pairs: Iterable[tuple[str, str]]) -> list[tuple[str, int, str, int]]:
    """(src, dst) paths -> [(src_op, src_seq, dst_op, dst_seq)] with every source checked."""
    jobs = []
    for src, dst in pairs:
        sop, sseq = parse_op_path(src)
        dop, dseq = parse_op_path(dst)
        if sop not in src_h5 or not isinstance(src_h5[sop], h5py.Group):
            raise ExtractError(f"{in_path}: no op /{sop}/ in this dump")
        if sseq is None:
            if dseq is not None:
                raise ExtractError(f"-s {src!r} names every call of {sop}; -d must name an op too, not a seqid")
            seqs = sorted(int(k) for k in src_h5[sop].keys() if S.is_seqid_name(k))
            jobs += [(sop, q, dop, q) for q in seqs]
            continue
        if str(sseq) not in src_h5[sop]:
            have = sorted(int(k) for k in src_h5[sop].keys() if S.is_seqid_name(k))
            hint = f" (it has seqids {', '.join(map(str, have[:8]))}{', ...' if len(have) > 8 else ''})" if have else ""
            raise ExtractError(f"{in_path}: no op group /{sop}/{sseq}/{hint}")
        jobs.append((sop, sseq, dop, sseq if dseq is None else dseq))
    return jobs


# HDF5 messages of a failed write (the temporary OUT), not of damage in the file read
_WRITE_FAILURE = re.compile(r"writ(e|ing)|no space left|disk quota", re.IGNORECASE)


class _Copier:
    """Copies op groups from one open file into a DumpWriter, keeping hard links."""

    def __init__(self, src: h5py.File, src_path: str, writer: DumpWriter, out_path: str):
        self.src, self.src_path, self.w = src, src_path, writer
        self.out_path = out_path             # what the user named OUT (the writer's is a temp file)
        self.copied: dict[object, str] = {}  # source object id -> destination path
        self._open: set = set()              # ids of the source groups being copied (the path)

    @contextlib.contextmanager
    def _errors(self):
        """An HDF5 failure while copying names the file it is about: OUT when a write
        failed, else the file being read (damaged)."""
        try:
            yield
        except H5_ERRORS as e:
            if not raised_by_h5py(e):
                raise
            if _WRITE_FAILURE.search(str(e)):
                raise DumpWriteError(f"{self.out_path}: write failed ({h5_message(e)})") from e
            raise corrupt_dump_error(self.src_path, e) from e

    def copy_op(self, sop: str, sseq: int, dop: str, dseq: int) -> str:
        with self._errors():
            return self._copy_op(sop, sseq, dop, dseq)

    def _copy_op(self, sop: str, sseq: int, dop: str, dseq: int) -> str:
        grp = self.src[f"/{sop}/{sseq}"]
        attrs = {k: grp.attrs[k] for k in grp.attrs.keys()}
        op_name = _s(attrs.get(S.OP_NAME)) if dop == sop and S.OP_NAME in attrs else dop
        g = self.w.begin_op(dop, dseq, phase=_s(attrs.get(S.OP_PHASE, "")), module=_s(attrs.get(S.OP_MODULE, "")),
                            grad_fn=_s(attrs.get(S.OP_GRAD_FN, "")),
                            attrs={k: v for k, v in attrs.items() if k not in _WRITER_OP_ATTRS})
        g.attrs[S.OP_NAME] = op_name
        self._open = {grp.id}
        for name, child in members(grp):
            if isinstance(child, h5py.Group) and name in (S.INPUT_GROUP, S.OUTPUT_GROUP):
                dst = g[name]
                dst.attrs.update({k: child.attrs[k] for k in child.attrs.keys()})
                for cname, cobj in members(child):
                    self.copy_node(cobj, dst, cname)
            else:
                self.copy_node(child, g, name)
        self.w.end_op()
        return f"/{dop}/{dseq}/"

    def copy_node(self, obj, parent: h5py.Group, name: str) -> None:
        key = obj.id
        if key in self.copied:
            parent[name] = self.w.file[self.copied[key]]
            return
        if isinstance(obj, h5py.Group):
            if key in self._open:
                # a soft link to a group being copied (its own ancestor): copying it would
                # recurse for ever (RecursionError, an internal error)
                raise DumpFormatError(f"{self.src_path}: {printable(obj.name)}: a soft link back to a group "
                                      "that contains it (a cycle); refused")
            self._open.add(key)
            g = parent.create_group(name)
            g.attrs.update({k: obj.attrs[k] for k in obj.attrs.keys()})
            for cname, cobj in members(obj):
                self.copy_node(cobj, g, cname)
            self._open.discard(key)
        elif type_code(obj.attrs.get(S.ATTR_TYPE, S.TYPE_TENSOR), f"{self.src_path}: {obj.name}") \
                == S.TYPE_TENSOR_VIEW:
            self._materialise(obj, parent, name)
        else:
            self.src.copy(obj, parent, name=name, expand_soft=True)
        self.copied[key] = f"{parent.name}/{name}"

    def _materialise(self, obj: h5py.Dataset, parent: h5py.Group, name: str) -> None:
        where = f"{self.src_path}: {obj.name}"
        attrs = {k: obj.attrs[k] for k in obj.attrs.keys()}
        base = view_base(self.src, self.src_path, obj, attrs.get(S.ATTR_BASE))
        base_path = _s(attrs.get(S.ATTR_BASE, ""))
        dtype = _s(base.attrs.get(S.ATTR_DTYPE, "")) or str(base.dtype)
        raw = base[()]
        if dtype == "complex32":  # stored as (..., 2) float16 pairs: rebuild on complex values
            raw = decode_raw(raw, dtype)
        shape = tuple(int(x) for x in np.asarray(attrs.get(S.ATTR_SHAPE, ())).reshape(-1))
        data = view_of(raw, np.asarray(S.live_stride(base.attrs), dtype=np.int64),
                       S.storage_offset(base.attrs, f"{self.src_path}: {base.name}"), shape,
                       np.asarray(S.live_stride(attrs), dtype=np.int64),
                       S.storage_offset(attrs, where), where=where)
        if dtype == "complex32":
            data = np.stack([data.real, data.imag], axis=-1).astype(np.float16)
        ds = parent.create_dataset(name, data=np.ascontiguousarray(data))
        attrs.pop(S.ATTR_BASE, None)
        attrs[S.ATTR_TYPE] = S.TYPE_TENSOR
        attrs["materialized_view_of"] = base_path or base.name
        ds.attrs.update(attrs)


def _root_attrs(h5: h5py.File) -> tuple[str, dict]:
    attrs = {k: h5.attrs[k] for k in h5.attrs.keys()}
    mode = _s(attrs.get(S.ROOT_MODE, S.MODE_DUMP))
    return (mode if mode in S.MODES else S.MODE_DUMP), {k: v for k, v in attrs.items() if k not in _WRITER_ROOT_ATTRS}


def _out_dir(output_path: str) -> str:
    """The directory OUT goes in, checked before anything is read: the temporary file
    is made there, and its name must not be what the user sees. OUT itself must be a
    regular file or absent: appending reads it, so a link would be read through."""
    out_dir = os.path.dirname(os.path.abspath(output_path))
    shown = os.path.dirname(output_path) or "."
    if not os.path.exists(out_dir):
        raise DumpWriteError(f"{output_path}: directory {shown} does not exist")
    if not os.path.isdir(out_dir):
        raise DumpWriteError(f"{output_path}: {shown} is not a directory")
    if os.path.islink(output_path):
        raise DumpWriteError(f"{output_path}: is a symbolic link; refusing to read or write through it "
                             "(choose another -o)")
    if os.path.exists(output_path) and not os.path.isfile(output_path):
        raise DumpWriteError(f"{output_path}: is not a regular file; choose another -o")
    return out_dir


def _declared_bytes(h5: h5py.File, sop: str, sseq: int) -> int:
    """What copying /sop/sseq writes, from dataset metadata alone (nothing is read)."""
    total = 0

    def visit(_name, obj):
        nonlocal total
        if not isinstance(obj, h5py.Dataset):
            return
        if type_code(obj.attrs.get(S.ATTR_TYPE, S.TYPE_TENSOR), f"{obj.file.filename}: {obj.name}") \
                == S.TYPE_TENSOR_VIEW:
            try:
                n = 1
                for d in np.asarray(obj.attrs.get(S.ATTR_SHAPE, ())).reshape(-1):
                    n *= max(int(d), 0)
            except (TypeError, ValueError, OverflowError):   # NaN or text: the copy will refuse it
                n = 0
            total += n * 16   # widest element a view can have
        else:
            total += int(obj.size or 0) * obj.dtype.itemsize   # (a null dataspace: size None)

    h5[f"/{sop}/{sseq}"].visititems(visit)
    return total


def _open_output(output_path: str, src: DumpFile) -> DumpFile:
    """An existing OUT that ops can be appended to: a dump of the same kind as the input.
    OUT is rebuilt from its op groups, so anything else would lose data or mix kinds."""
    old = DumpFile(output_path)   # require_dump: an HDF5 file that is not a dump is refused
    if old.is_table:              # its ops live in tables, not groups: the rebuild would drop them
        old.close()
        raise ExtractError(f"{output_path}: is a statistics-only dump (format 1.1 table); "
                           "extract cannot append to it: choose another -o")
    if old.stats_only != src.stats_only:
        kind = "statistics-only" if old.stats_only else "tensor"
        old.close()
        raise ExtractError(f"{output_path}: is a {kind} dump and {src.path} is not; refusing to mix "
                           "statistics and tensors in one file: choose another -o")
    return old


def extract_ops(input_path: str | os.PathLike, output_path: str | os.PathLike,
                pairs: list[tuple[str, str]], *, budget: OutputBudget | None = None,
                progress=None) -> list[str]:
    """Copy ops (src, dst path pairs) from INPUT into OUTPUT (appending); returns the dst paths.
    `budget` caps the bytes copied (checked from metadata before the copy). `progress(total)`,
    when given, is a context manager yielding advance() (or None), entered for the copy."""
    input_path, output_path = os.fspath(input_path), os.fspath(output_path)
    if os.path.abspath(input_path) == os.path.abspath(output_path):
        raise ExtractError(f"{output_path}: output is the input file; choose another -o")
    out_dir = _out_dir(output_path)
    with DumpFile(input_path) as src:  # validates: exists, HDF5, a dump
        if src.is_table:
            raise ExtractError(f"{input_path}: a statistics-only dump (format 1.1 table) has no op groups "
                               "to copy, and no tensor values to replay; extract works on tensor dumps")
        with h5_errors(input_path):
            jobs = _resolve(src.h5, input_path, pairs)
            planned = sum(_declared_bytes(src.h5, sop, sseq) for sop, sseq, _, _ in jobs)
        (budget or OutputBudget()).charge(output_path, planned, files=1)
        old = _open_output(output_path, src) if os.path.exists(output_path) else None
        try:
            with h5_errors(output_path):
                existing = list_op_groups(old.h5) if old else []
            taken = {(o, q) for o, q in existing}
            for sop, sseq, dop, dseq in jobs:
                if (dop, dseq) in taken:
                    raise ExtractError(f"{output_path}: /{dop}/{dseq}/ already exists; refusing to overwrite it "
                                       "(remove it, or write it elsewhere with -d /op/seqid/)")
                taken.add((dop, dseq))
            root_from = old if old and old.h5.attrs.get(S.ROOT_FORMAT) is not None else src
            with h5_errors(root_from.path):
                mode, root = _root_attrs(root_from.h5)
            sources = [s for s in _s(root.get(ROOT_EXTRACTED_FROM, "")).split(";") if s]
            if os.path.abspath(input_path) not in sources:
                sources.append(os.path.abspath(input_path))
            root[ROOT_EXTRACTED_FROM] = ";".join(sources)
            try:
                fd, tmp = tempfile.mkstemp(prefix=".accucmp_extract_", suffix=".h5", dir=out_dir)
            except OSError as e:
                raise DumpWriteError(f"{output_path}: cannot write in {os.path.dirname(output_path) or '.'} "
                                     f"({e.strerror or e})") from e
            os.close(fd)
            IN_PROGRESS.add(tmp)          # (a Ctrl-C removes it: dumpfile.interrupts)
            try:
                with DumpWriter(tmp, mode=mode, root_attrs=root) as w:
                    if old:
                        keep = _Copier(old.h5, output_path, w, output_path)
                        for o, q in existing:
                            keep.copy_op(o, q, o, q)
                    copier = _Copier(src.h5, input_path, w, output_path)
                    with (progress(len(jobs)) if progress is not None else contextlib.nullcontext()) as advance:
                        written = []
                        for job in jobs:
                            written.append(copier.copy_op(*job))
                            if advance is not None:
                                advance()
            except BaseException as e:
                os.unlink(tmp)
                if isinstance(e, DumpWriteError):   # the writer names the temporary file
                    raise DumpWriteError(str(e).replace(tmp, output_path)) from e
                raise
        finally:
            if old:
                old.close()
    try:
        os.replace(tmp, output_path)
    except OSError as e:
        os.unlink(tmp)
        raise DumpWriteError(f"{output_path}: cannot replace it ({e.strerror or e})") from e
    finally:
        IN_PROGRESS.discard(tmp)
    WRITTEN.append(os.fspath(output_path))
    return written


def ops_from_report(result_csv: str | os.PathLike, input_path: str | os.PathLike,
                    thresholds: dict[str, float] | None = None) -> list[str]:
    """/op/seqid/ of every failing row of a result csv that is in INPUT (NPU side first)."""
    from accucmp.report.outputs import read_result_csv

    table = read_result_csv(Path(result_csv))
    if thresholds or "Result" not in table.columns:
        from accucmp.compare.verdict import apply_verdict

        table = apply_verdict(table, thresholds)
    failed = table[table["Result"] == "fail"]
    if failed.empty:
        raise ExtractError(f"{result_csv}: no failing rows, nothing to extract")
    out: list[str] = []
    with DumpFile(input_path) as f:
        for _, row in failed.iterrows():
            cands = []
            for col in ("NPUDumpPath", "GroundTruthPath"):
                p = row.get(col)
                if isinstance(p, str) and p.count("/") >= 2:
                    parts = [x for x in p.split("/") if x]
                    cands.append(f"/{parts[0]}/{parts[1]}/")
            hit = next((c for c in cands if c.strip("/") in f.h5), None)
            if hit is None:
                raise ExtractError(f"{input_path}: failing row {row.get('Index', '?')} "
                                   f"({' or '.join(cands) or 'no path'}) is not in this dump; "
                                   "pass the target (-m) or golden (-g) dump the result was made from")
            if hit not in out:
                out.append(hit)
    return sorted(out, key=lambda p: int(p.strip("/").split("/")[1]))
