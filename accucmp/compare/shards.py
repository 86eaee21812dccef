"""Sharded tensors put back together: a run folder whose ops hold DTensors (tensor and
sequence parallel) as one dump of a single-rank-equivalent run, for compare (torch-free).

The dumper records an op on DTensors at the DTensor level, each DTensor as this rank's
local shard plus its layout (`dtensor` attribute, docs/FORMAT.md "DTensor arguments"). A
comparison with a run of another layout (one process, DDP) must see the global tensors:

    run = assemble_run("tp/", "out/tp_assembled.h5")      # -> AssembledRun
    compare_dumps(run.path, "ref.h5")

`assemble_run` pairs the ranks' ops (the same op at the same position of every rank's op
sequence: collectives keep the ranks in step, and the names are checked), and writes each
op once, op by op (memory: one op's tensors of every rank), in the project's format:
- a DTensor (input or output) becomes its global value (dumpfile.dtensor.assemble: Shard
  placed at its offset, Replicate taken once after checking the replicas are equal, Partial
  summed), with the attribute `assembled` saying which rank's shard sits where;
- a local op (no DTensor) whose tensors are equal on every rank (outside the parallel
  region, every rank holds the same activations) is written once;
- a *sharded local op*: the local ops a parallel style runs on plain shards between two
  DTensor ops (ColwiseParallel hands its output on as a local tensor: the GELU between
  fc1 and fc2 runs on each rank's columns; DTensor's redistribution all-reduces plain
  Partial shares). Recognised when one of its tensor inputs holds exactly the bytes of an
  earlier DTensor output on every rank; its tensors that differ across ranks are then
  joined as that output's layout says (Shard on the last dim: concatenated along the last
  dim; Partial(sum): summed);
- a local op whose output the next op reads as a DTensor's local shard (sequence
  parallel's Replicate-to-Shard redistribution clones each rank's chunk): joined along
  that shard's dim;
- a collective's per-rank contributions (and the buffer the op just before made for it)
  differ by design: kept as rank 0's;
- anything else that differs across ranks (a replica that should be equal and is not) is
  written as rank 0 holds it and listed in `disagreements`: a finding, never dropped.

`shard_of(...)` then says which rank's shard holds the first failing element of a
compared tensor of the assembled file (a verdict names the rank, not only the op).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from dumpfile import DumpFile, DumpWriter
from dumpfile import dtensor as DT
from dumpfile import schema as S
from dumpfile.errors import DumpError
from dumpfile.read.reader import h5_errors
from dumpfile.safe_output import output_path

from accucmp.compare.rank_files import RankFile, _dump_files, rank_key

ATTR_ASSEMBLED = "assembled"            # on a put-together tensor: JSON {placements, mesh_shape, mesh_ranks, shards}
ROOT_ASSEMBLED_FROM = "assembled_from"  # root of an assembled file: JSON {run, ranks, world_size, ...}


class ShardError(DumpError):
    """A run folder whose shards cannot be put together (ranks out of step, a layout that
    names no offset): one line, exit 2 at the CLI."""


@dataclass
class AssembledRun:
    path: Path
    run: str
    ranks: list[int]
    dtensor_ops: int = 0                 # ops holding DTensors, assembled
    replicated_ops: int = 0              # local ops equal on every rank, written once
    sharded_local_ops: list[str] = field(default_factory=list)     # "aten.gelu.default #21 in block.mlp.act"
    disagreements: list[str] = field(default_factory=list)         # replicas that differ: findings (first 50)
    n_disagreements: int = 0                                         # ... and how many in all
    collective_ops: int = 0              # collectives whose per-rank tensors differ by design, kept as rank 0's

    def line(self) -> str:
        """What was put together, in one line (printed before the verdict)."""
        n_loc = len(self.sharded_local_ops)
        shown = ", ".join(self.sharded_local_ops[:2]) + (", ..." if n_loc > 2 else "")
        local = (f", {n_loc} sharded local op(s) put together from the layout of the DTensor they read or make "
                 f"({shown})") if n_loc else ""
        if self.collective_ops:
            local += f", {self.collective_ops} collective(s) on each rank's own contribution kept as rank 0's"
        return (f"shards put together: {self.run} ({len(self.ranks)} ranks) as one run: {self.dtensor_ops} "
                f"op(s) on DTensors assembled from their layouts, {self.replicated_ops} local op(s) equal on "
                f"every rank written once{local}")


# ---- which files, which ops ------------------------------------------------
def run_rank_files(run_dir: str | os.PathLike) -> list[RankFile]:
    files = [rank_key(p) for p in _dump_files(Path(run_dir))]
    steps = sorted({f.step for f in files}, key=lambda s: -1 if s is None else s)
    if len(steps) > 1:
        raise ShardError(f"{run_dir}: holds dumps of {len(steps)} steps; shards are put together for one step "
                         "(a folder per step)")
    files.sort(key=lambda f: f.rank)
    if len({f.rank for f in files}) != len(files):
        raise ShardError(f"{run_dir}: two files claim the same rank; one file per rank")
    return files


def holds_dtensors(run_dir: str | os.PathLike) -> bool:
    """Whether the run's ops hold DTensors (tensor/sequence parallel): its rank-0 file
    records a device mesh in `parallel_layout` and some tensor carries a `dtensor` layout.
    FSDP2 alone records none: its compute ops run on all-gathered full parameters."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return False
    files = _dump_files(run_dir)
    if len(files) < 2:
        return False
    with DumpFile(files[0]) as f:
        layout = f.attrs.get(S.ROOT_PARALLEL_LAYOUT)
        try:
            meshes = DT.layout(layout).get("meshes") if layout is not None else None
        except (ValueError, TypeError, AttributeError):
            meshes = None
        if not meshes:
            return False
        with h5_errors(f.path):
            for op in f.ops():
                for rec in _flat(op):
                    if S.ATTR_DTENSOR in rec.attrs:
                        return True
    return False


def _flat(op) -> list:
    """Every tensor record of an op (inputs, outputs, list members), in file order."""
    out = []

    def walk(rec):
        if rec.is_list:
            for c in rec.children:
                walk(c)
        elif rec.is_tensor:
            out.append(rec)
    for io in (op.inputs(), op.outputs()):
        for rec in io.values():
            walk(rec)
    return out


def _rel(rec, op) -> str:
    return rec.path[len(op.path) + 1:]


def rank_op_groups(run_dir, files: list[DumpFile]) -> list[list]:
    """The ops of every rank that are one op of the run: same position, same name."""
    lists = [f.ops() for f in files]
    n = len(lists[0])
    for rf, ops in zip(files[1:], lists[1:]):
        if len(ops) != n:
            raise ShardError(f"{run_dir}: {rf.path} holds {len(ops)} ops and {files[0].path} {n}: the ranks did not "
                             "run the same ops; compare them rank by rank (a folder against a folder)")
    for i in range(n):
        names = {ops[i].op for ops in lists}
        if len(names) > 1:
            a, b = lists[0][i], next(ops[i] for ops in lists if ops[i].op != lists[0][i].op)
            raise ShardError(f"{run_dir}: op #{i + 1} is {a.op} (seqid {a.seqid}) on {files[0].path} and {b.op} "
                             f"(seqid {b.seqid}) on {b.file.path}: the ranks ran different ops; compare them rank "
                             "by rank")
    return [[ops[i] for ops in lists] for i in range(n)]


# ---- values ----------------------------------------------------------------
def encode_values(values: np.ndarray, dtype: str, where: str) -> np.ndarray:
    """Decoded values -> the stored array of `dtype` (schema.STORAGE_NUMPY_DTYPE)."""
    if dtype == "bfloat16":
        bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
        # round to nearest even (a Partial sum is a new value; a shard's bits come back exact)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    store = S.STORAGE_NUMPY_DTYPE.get(dtype)
    if store is None or dtype in S.RAW_BIT_DTYPES or dtype == "complex32":
        raise ShardError(f"{where}: a DTensor of dtype {dtype!r}: shards of this dtype are not put together")
    return np.asarray(values).astype(store, copy=False)


def digest(a: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(a).tobytes(), digest_size=16).digest()


def _int_list(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)


def checked_layout(attr, where: str) -> dict:
    """A `dtensor` attribute as a dict, or ShardError (one line) when it is not the
    documented shape (docs/FORMAT.md, "DTensor arguments"): a damaged or hand-edited file."""
    try:
        lay = DT.layout(attr)
    except (ValueError, TypeError, AttributeError, UnicodeDecodeError) as e:
        raise ShardError(f"{where}: its dtensor attribute is not JSON ({' '.join(str(e).split())[:80]})") from e
    ok = isinstance(lay, dict) and all(_int_list(lay.get(k)) for k in ("mesh_shape", "mesh_ranks", "coordinate",
                                                                         "global_shape"))
    ok = ok and isinstance(lay.get("placements"), list) and all(isinstance(p, str) for p in lay["placements"])
    ok = ok and len(lay["placements"]) == len(lay["mesh_shape"]) == len(lay["coordinate"])
    off = lay.get("global_offset") if ok else None
    ok = ok and (off is None or _int_list(off) and len(off) == len(lay["global_shape"]))
    if not ok:
        raise ShardError(f"{where}: its dtensor attribute is not a layout (mesh_shape, mesh_ranks, coordinate, "
                         "placements, global_shape, global_offset as docs/FORMAT.md says)")
    return lay


def _replica_key(lay: dict) -> tuple:
    return tuple(None if p == "Replicate()" else c for p, c in zip(lay["placements"], lay["coordinate"]))


def _max_abs(a: np.ndarray, b: np.ndarray) -> float:
    if a.shape != b.shape:
        return float("inf")
    with np.errstate(all="ignore"):
        d = np.abs(a.astype(np.float64) - b.astype(np.float64)) if a.dtype.kind in "fiub" else np.abs(a - b)
    return float(np.nanmax(d)) if d.size else 0.0


def _where(op, rel: str) -> str:
    io, _, name = rel.partition("/")
    mod = op.module
    return f"{io} {name} of {op.op} #{op.seqid}" + (f" in {mod}" if mod else "")


# ---- writing -----------------------------------------------------------------
_RECENT = 1024      # DTensor outputs a rank remembers for the sharded local ops after them
# torch.distributed's op namespaces: their inputs are each rank's contribution
_COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "c10d"})


class _Assembler:
    def __init__(self, run_dir: str, files: list[DumpFile], ranks: list[int], writer: DumpWriter):
        from accucmp.extract import _Copier

        self.run, self.files, self.ranks, self.w = run_dir, files, ranks, writer
        self.copier = _Copier(files[0].h5, files[0].path, writer, str(writer.path))
        self.result = AssembledRun(Path(writer.path), run_dir, ranks)
        # per rank: digest of a recent DTensor output's local bytes -> (seqid, layout); the
        # local ops between two DTensor ops read what the last few made, so memory stays
        # bounded (_RECENT entries a rank) whatever the run's length
        self.dt_outputs: list[OrderedDict[bytes, tuple[int, dict]]] = [OrderedDict() for _ in files]
        self._pending: list[str] = []            # the last local op's differences (see _disagree)
        self._pending_outputs: set[tuple] = set()  # ... and its outputs' per-rank digests
        self._pending_local = None                 # ... and the op itself (_made_shards)

    def op(self, group: list) -> None:
        first = group[0]
        recs = [{_rel(r, op): r for r in _flat(op)} for op in group]
        dt = [rel for rel, r in recs[0].items() if S.ATTR_DTENSOR in r.attrs]
        dest = self.copier.copy_op(first.op, first.seqid, first.op, first.seqid)   # rank 0's op as it is
        grp = self.w.file[dest]
        if dt:
            self._made_shards(group, recs, dt)
            self._commit()
            self.result.dtensor_ops += 1
            for rel in dt:
                self._dtensor(group, recs, rel, grp)
            self._check_plain(group, recs, [rel for rel in recs[0] if rel not in dt])
            self._commit()
            return
        self._local(group, recs, grp)

    def finish(self) -> None:
        self._commit()

    def _disagree(self, text: str) -> None:
        """A difference between ranks, held until the next op says whether it is one: the
        buffer a collective is about to reduce (DTensor's redistribution cuts a Partial share
        into chunks and concatenates them for reduce_scatter) differs across ranks by design."""
        self._pending.append(text)

    def _commit(self) -> None:
        for text in self._pending:
            self.result.n_disagreements += 1
            if len(self.result.disagreements) < 50:
                self.result.disagreements.append(text)
        self._pending = []
        self._pending_outputs = set()
        self._pending_local = None

    def _read(self, rec) -> np.ndarray:
        return np.asarray(rec.read())

    def _dtensor(self, group, recs, rel: str, grp: h5py.Group) -> None:
        op0 = group[0]
        where = f"{self.run}: {_where(op0, rel)}"
        lay0 = checked_layout(recs[0][rel].attrs[S.ATTR_DTENSOR], f"{op0.file.path}: {recs[0][rel].path}")
        members = [i for i, r in enumerate(self.ranks) if r in lay0["mesh_ranks"]]
        parts, shards, replicas = [], [], {}
        for i in members:
            rec = recs[i].get(rel)
            if rec is None or S.ATTR_DTENSOR not in rec.attrs:
                raise ShardError(f"{where}: a DTensor on rank {self.ranks[0]} and not on rank {self.ranks[i]}")
            lay = checked_layout(rec.attrs[S.ATTR_DTENSOR], f"{rec.file.path}: {rec.path}")
            if lay["global_shape"] != lay0["global_shape"] or lay["placements"] != lay0["placements"]:
                raise ShardError(f"{where}: rank {self.ranks[i]} records global shape {lay['global_shape']} "
                                 f"{lay['placements']}, rank {self.ranks[0]} {lay0['global_shape']} "
                                 f"{lay0['placements']}: the ranks' ops are out of step")
            if lay.get("global_offset") is None:
                raise ShardError(f"{where}: placements {lay['placements']} record no global offset; "
                                 "cannot put the shards together")
            local = self._read(rec)
            parts.append((lay, local))
            shards.append({"rank": self.ranks[i], "offset": list(lay["global_offset"]),
                           "shape": list(local.shape), "coordinate": list(lay["coordinate"])})
            if "Replicate()" in lay["placements"] and not rec.uninitialized:   # (garbage differs by design)
                key = _replica_key(lay)
                if key in replicas:
                    r0, a0 = replicas[key]
                    if digest(a0) != digest(local):
                        self._disagree(
                            f"{_where(op0, rel)} ({', '.join(lay['placements'])}): rank {self.ranks[i]}'s replica "
                            f"differs from rank {r0}'s (max abs {_max_abs(local, a0):.4g})")
                else:
                    replicas[key] = (self.ranks[i], local)
            if rel.startswith(S.OUTPUT_GROUP) and local.size:
                recent = self.dt_outputs[i]
                recent[digest(local)] = (op0.seqid, lay)
                if len(recent) > _RECENT:
                    recent.popitem(last=False)
        dtype = recs[0][rel].dtype
        # a global shape the shards cannot fill (a hostile edit naming 10^12 elements): refused
        # before the global array is made
        if int(np.prod(lay0["global_shape"], dtype=np.float64)) > sum(a.size for _, a in parts):
            raise ShardError(f"{where}: global shape {lay0['global_shape']} holds more elements than its "
                             f"{len(parts)} shards together; cannot put them together")
        try:
            full = DT.assemble(parts)
        except ValueError as e:
            raise ShardError(f"{where}: {e}") from e
        self._replace(grp, rel, encode_values(full, dtype, where), recs[0][rel].attrs,
                      {"placements": lay0["placements"], "mesh_shape": lay0["mesh_shape"],
                       "mesh_ranks": lay0["mesh_ranks"], "shards": shards})

    def _check_plain(self, group, recs, rels) -> None:
        """Plain tensors of an op on DTensors (rare): every rank must hold the same."""
        for rel in rels:
            if any(rs[rel].uninitialized for rs in recs if rel in rs):
                continue                  # an empty-like op's garbage differs across ranks by design
            vals = [(r, self._read(rs[rel])) for r, rs in zip(self.ranks, recs) if rel in rs]
            self._note_differences(group[0], rel, vals)

    def _note_differences(self, op, rel, vals) -> bool:
        r0, a0 = vals[0]
        d0 = digest(a0)
        same = True
        for r, a in vals[1:]:
            if a.shape != a0.shape or digest(a) != d0:
                same = False
                self._disagree(f"{_where(op, rel)}: rank {r}'s value differs from rank {r0}'s "
                               f"(max abs {_max_abs(a, a0):.4g}), and no layout says why")
        return same

    def _local(self, group, recs, grp) -> None:
        op0 = group[0]
        rels = list(recs[0])
        if any(set(rs) != set(rels) for rs in recs[1:]):
            self._disagree(f"{op0.op} #{op0.seqid}: the ranks recorded different arguments")
            return
        # (an empty-like op's garbage differs across ranks by design: rank 0's is kept, unjudged)
        rels = [rel for rel in rels if not any(rs[rel].uninitialized for rs in recs)]
        vals = {rel: [self._read(rs[rel]) for rs in recs] for rel in rels}
        digests = {rel: tuple(digest(a) for a in vals[rel]) for rel in rels}
        collective = op0.op.split(".", 1)[0] in _COLLECTIVE_NAMESPACES
        if collective and any(digests[rel] in self._pending_outputs for rel in rels
                              if rel.startswith(S.INPUT_GROUP)):
            self._pending, self._pending_outputs = [], set()     # the op before made its buffer
        self._commit()
        differ = [rel for rel in rels if len({(d, a.shape) for d, a in zip(digests[rel], vals[rel])}) > 1]
        if not differ:
            self.result.replicated_ops += 1
            return
        self._pending_outputs = {digests[rel] for rel in differ if rel.startswith(S.OUTPUT_GROUP)}
        source = self._sharded_source(recs, vals)
        how = _join_rule(source[1]) if source is not None else None
        joinable = how is not None and all(
            len({a.shape for a in vals[rel]}) == 1 and vals[rel][0].ndim >= 1
            and (vals[rel][0].shape[-1] == source[2] if how == "last" else vals[rel][0].size == source[3])
            for rel in differ)
        if not joinable:
            if collective:
                # a collective's per-rank contributions and shards: each rank's by design (the
                # reduced result, equal on every rank, was checked above)
                self.result.collective_ops += 1
                return
            for rel in differ:
                self._note_differences(op0, rel, list(zip(self.ranks, vals[rel])))
            self._pending_local = (op0, recs, grp, vals, differ)
            return
        self._join(op0, recs, grp, vals, differ, how, source[1], f"as the output of seqid {source[0]} it reads")

    def _join(self, op0, recs, grp, vals, differ, how, lay: dict, why: str) -> None:
        """A sharded local op's per-rank tensors `differ` written as one: "last" concatenated
        along the last dim, "sum" summed, an int d concatenated along dim d."""
        for rel in differ:
            arrays = vals[rel]
            ndim = arrays[0].ndim
            if how == "sum":
                full = np.sum([a.astype(np.float64) if a.dtype.kind == "f" else a for a in arrays], axis=0)
                placements = list(lay["placements"])
                offsets = [[0] * ndim for _ in arrays]
                said = "summed over the ranks"
            else:
                d = ndim - 1 if how == "last" else how
                full = np.concatenate(arrays, axis=d)
                placements = [f"Shard({d})"]
                starts = np.cumsum([0] + [a.shape[d] for a in arrays[:-1]])
                offsets = [[0] * d + [int(o)] + [0] * (ndim - d - 1) for o in starts]
                said = f"joined along dim {d}"
            shards = [{"rank": r, "offset": off, "shape": list(a.shape), "coordinate": [k]}
                      for k, (r, a, off) in enumerate(zip(self.ranks, arrays, offsets))]
            self._replace(grp, rel, encode_values(full, recs[0][rel].dtype, f"{self.run}: {_where(op0, rel)}"),
                          recs[0][rel].attrs, {"placements": placements, "mesh_shape": [len(arrays)],
                                               "mesh_ranks": list(self.ranks), "shards": shards,
                                               "sharded_local_op": f"{said}, {why}"})
        self.result.sharded_local_ops.append(f"{op0.op} #{op0.seqid}" + (f" in {op0.module}" if op0.module else ""))

    def _made_shards(self, group, recs, dt: list[str]) -> None:
        """The local op just before this DTensor op made its input's shards (DTensor's
        Replicate-to-Shard redistribution: each rank clones its chunk of the whole tensor):
        that op is a sharded local op joined along the shard dim, not ranks that disagree."""
        held = self._pending_local
        if held is None:
            return
        op0, precs, pgrp, pvals, pdiffer = held
        for rel in dt:
            if not rel.startswith(S.INPUT_GROUP):
                continue
            lay = checked_layout(recs[0][rel].attrs[S.ATTR_DTENSOR], f"{group[0].file.path}: {recs[0][rel].path}")
            if len(lay["placements"]) != 1 or not lay["placements"][0].startswith("Shard("):
                continue
            digests = tuple(digest(self._read(rs[rel])) for rs in recs if rel in rs)
            if digests not in self._pending_outputs:
                continue
            d = int(lay["placements"][0][len("Shard("):-1])
            local = tuple(recs[0][rel].shape)
            if all(len({a.shape for a in pvals[r]}) == 1 and pvals[r][0].shape == local for r in pdiffer):
                self._pending, self._pending_outputs, self._pending_local = [], set(), None
                self._join(op0, precs, pgrp, pvals, pdiffer, d, lay,
                           f"as the input of {group[0].op} #{group[0].seqid} it makes")
                return

    def _sharded_source(self, recs, vals):
        """(seqid, layout, local last-dim size, local size) of the DTensor output whose
        local bytes an input of this op holds on every rank; None when none."""
        for rel in recs[0]:
            if not rel.startswith(S.INPUT_GROUP):
                continue
            hits = [self.dt_outputs[i].get(digest(a)) for i, a in enumerate(vals[rel])]
            if all(h is not None for h in hits) and len({h[0] for h in hits}) == 1 and vals[rel][0].ndim:
                return hits[0][0], hits[0][1], vals[rel][0].shape[-1], vals[rel][0].size
        return None

    def _replace(self, grp: h5py.Group, rel: str, data: np.ndarray, attrs: dict, shards: dict) -> None:
        """The tensor at `rel` of the op just copied becomes `data` (the global value)."""
        parent_path, _, name = rel.rpartition("/")
        parent = grp[parent_path]
        old = dict(parent[name].attrs)
        del parent[name]
        ds = parent.create_dataset(name, data=np.ascontiguousarray(data))
        for k in (S.ATTR_DTENSOR, S.ATTR_LIVE_STRIDE, S.ATTR_STORAGE_OFFSET, S.ATTR_BASE):
            old.pop(k, None)
        old[S.ATTR_TYPE] = S.TYPE_TENSOR
        old[S.ATTR_SHAPE] = np.asarray(data.shape if attrs.get(S.ATTR_DTYPE) != "complex32" else data.shape[:-1],
                                       dtype=np.int64)
        old[S.ATTR_STRIDE] = np.asarray(S.contiguous_strides(tuple(old[S.ATTR_SHAPE])), dtype=np.int64)
        old[ATTR_ASSEMBLED] = json.dumps(shards, separators=(",", ":"))
        ds.attrs.update(old)


def _join_rule(lay: dict) -> str | None:
    """How a local op's per-rank tensors that hold a DTensor output's local values join
    (1-d meshes): "last" (Shard on the last dim: concatenated), "sum" (Partial(sum)); None:
    not joined."""
    placements = lay.get("placements") or []
    if len(placements) != 1:
        return None
    if placements[0] == "Partial(sum)":
        return "sum"
    if placements[0] == f"Shard({len(lay['global_shape']) - 1})":
        return "last"
    return None


def assemble_run(run_dir: str | os.PathLike, out_path: str | os.PathLike) -> AssembledRun:
    """Write the run of folder `run_dir` (one dump per rank, one step) as one dump at
    `out_path` whose tensors are the global values (module docstring). ShardError (one
    line) when the ranks' ops cannot be paired or a layout cannot be put together."""
    run_dir, out_path = os.fspath(run_dir), os.fspath(out_path)
    rfiles = run_rank_files(run_dir)
    if len(rfiles) < 2:
        raise ShardError(f"{run_dir}: {len(rfiles)} dump file(s); shards are put together from 2 or more ranks")
    # written to a temporary file beside out_path and renamed when complete: never through a
    # link, never over a file, removed on failure or Ctrl-C (dumpfile.safe_output)
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(output_path(out_path))
        files = [stack.enter_context(DumpFile(rf.path)) for rf in rfiles]
        ranks = [rf.rank for rf in rfiles]
        root = {k: v for k, v in files[0].attrs.items()
                if k not in (S.ROOT_FORMAT, S.ROOT_FORMAT_VERSION, S.ROOT_COMPLETE, S.ROOT_NUM_OPS, S.ROOT_MODE)}
        root[S.ROOT_RANK] = 0
        root[S.ROOT_WORLD_SIZE] = 1
        with DumpWriter(tmp, mode=files[0].mode, root_attrs=root) as w:
            asm = _Assembler(run_dir, files, ranks, w)
            for group in rank_op_groups(run_dir, files):
                with h5_errors(group[0].file.path):
                    asm.op(group)
            asm.finish()
            w.file.attrs[ROOT_ASSEMBLED_FROM] = json.dumps(
                {"run": os.path.abspath(run_dir), "ranks": ranks, "files": [f.path for f in files],
                 "world_size": rfiles[0].world_size, "parallel_layout": _text(files[0].attrs.get(
                     S.ROOT_PARALLEL_LAYOUT)), "sharded_local_ops": asm.result.sharded_local_ops,
                 "disagreements": asm.result.disagreements}, separators=(",", ":"))
    asm.result.path = Path(out_path)
    return asm.result


def _text(v) -> str | None:
    return v.decode() if isinstance(v, bytes) else (None if v is None else str(v))


# ---- which rank ----------------------------------------------------------------
# an element fails when |target - golden| exceeds this share of max |golden| (per dtype):
# a coarse cut that finds the first element a shard got wrong, not a verdict threshold
_FIRST_FAIL_REL = {"float64": 1e-9, "float32": 1e-5, "float16": 1e-3, "bfloat16": 1e-2}


def shard_of(target_path: str, target_ds: str, golden_path: str, golden_ds: str) -> str | None:
    """Which rank's shard holds the first failing element (C order) of tensor `target_ds`
    of an assembled file, against `golden_ds`: one line, or None when the tensor was not
    put together from shards or no element fails."""
    with DumpFile(target_path) as tf, DumpFile(golden_path) as gf:
        with h5_errors(target_path):
            obj = tf.h5.get(target_ds)
            if obj is None or ATTR_ASSEMBLED not in obj.attrs:
                return None
            info = json.loads(_text(obj.attrs[ATTR_ASSEMBLED]))
            dtype = _text(obj.attrs.get(S.ATTR_DTYPE)) or "float32"
            t = np.asarray(tf._record(target_ds, target_ds.rsplit("/", 1)[-1]).read(), dtype=np.float64)
        with h5_errors(golden_path):
            g = np.asarray(gf._record(golden_ds, golden_ds.rsplit("/", 1)[-1]).read(), dtype=np.float64)
    if t.shape != g.shape:
        return None
    with np.errstate(all="ignore"):
        err = np.abs(t - g)
        scale = np.nanmax(np.abs(g)) if g.size else 0.0
    bad = np.flatnonzero(~(err <= _FIRST_FAIL_REL.get(dtype, 1e-5) * (scale or 1.0)))
    if not bad.size:
        return None
    idx = tuple(int(i) for i in np.unravel_index(int(bad[0]), t.shape))
    if any(p.startswith("Partial") for p in info["placements"]):
        return (f"element {list(idx)} is a sum of every rank's share ({', '.join(info['placements'])}): "
                "no one shard holds it")
    holders = [s for s in info["shards"]
               if all(o <= i < o + n for i, o, n in zip(idx, s["offset"], s["shape"]))]
    if not holders:
        return None
    ranges = ", ".join(f"{o}:{o + n}" for o, n in zip(holders[0]["offset"], holders[0]["shape"]))
    replicated = len(holders) > 1
    who = " and ".join(f"rank {s['rank']}" for s in holders)
    wrong = _wrong_shards(err, g, info, dtype)
    return (f"first failing element {list(idx)} lies in {who}'s shard ([{ranges}] of {list(t.shape)}, "
            f"{', '.join(info['placements'])}{', replicated' if replicated else ''}); shards off: "
            f"{', '.join(f'rank {r}' for r in wrong) or 'none'}")


def _wrong_shards(err: np.ndarray, g: np.ndarray, info: dict, dtype: str) -> list[int]:
    scale = float(np.nanmax(np.abs(g))) if g.size else 0.0
    out = []
    for s in info["shards"]:
        idx = tuple(slice(o, o + n) for o, n in zip(s["offset"], s["shape"]))
        e = err[idx]
        if e.size and not bool((e <= _FIRST_FAIL_REL.get(dtype, 1e-5) * (scale or 1.0)).all()):
            out.append(s["rank"])
    return out


# ---- what compare does with a sharded run ------------------------------------------
@dataclass
class ShardedCompare:
    """The two sides compare runs as single files once a sharded run folder is put together."""
    target: Path
    golden: Path
    assembled: list[AssembledRun]

    def lines(self) -> list[str]:
        return [a.line() for a in self.assembled]

    def findings(self) -> list[str]:
        """Ranks that disagree where their values must be equal (replicas, local ops outside
        the parallel region): one FAIL line per put-together run, naming the first (in
        execution order) and the count. It leads the verdict: ops after it that read the
        ranks' values mix a right and a wrong rank once put together."""
        out = []
        for a in self.assembled:
            if a.disagreements:
                more = a.n_disagreements - 1
                out.append(f"FAIL: {a.run}: the ranks disagree where they must be equal: {a.disagreements[0]}"
                           + (f" (and {more} more tensor(s) after it)" if more else "")
                           + "; the assembled run holds rank 0's copy, and ops on shards after it mix the ranks")
        return out


def _layout_of(run_dir: Path) -> tuple[str, ...]:
    """The first rank file's (world_size, parallel_layout wrappers) as words, for messages."""
    files = _dump_files(run_dir)
    if not files:
        return ()
    with DumpFile(files[0]) as f:
        try:
            lay = DT.layout(f.attrs.get(S.ROOT_PARALLEL_LAYOUT) or "{}")
        except (ValueError, TypeError, AttributeError):
            lay = {}
    return tuple(lay.get("wrappers") or ())


def _layout_signature(run_dir: Path, first: int = 64) -> tuple:
    """What says two sharded runs are of one layout: rank 0's `parallel_layout` and the
    placements and global shapes of its first `first` DTensors (the same mesh sharded
    another way, Colwise where the other is Rowwise, pairs no shard with its like)."""
    files = _dump_files(run_dir)
    sig = []
    with DumpFile(files[0]) as f, h5_errors(str(files[0])):
        for op in f.ops():
            for rec in _flat(op):
                a = rec.attrs.get(S.ATTR_DTENSOR)
                if a is not None:
                    lay = checked_layout(a, f"{f.path}: {rec.path}")
                    sig.append((op.op, _rel(rec, op), tuple(lay["placements"]), tuple(lay["global_shape"]),
                                tuple(lay["mesh_shape"])))
            if len(sig) >= first:
                break
        return (_text(f.attrs.get(S.ROOT_PARALLEL_LAYOUT)) or "", tuple(sig[:first]))


_WRAPPER_WORDS = {"fsdp2": "FSDP2", "ddp": "DDP"}


def _refuse_flat_shards_against_replicas(target: Path, golden: Path) -> None:
    """FSDP2 against a run that keeps whole parameters (DDP): one line, no compare.

    FSDP2 records no DTensor layout (its compute ops run on all-gathered, whole
    parameters), and its parameters and reduced gradients live in flat buffers that
    concatenate every parameter's shard of a module (fsdp.all_gather_copy_in, chunk_cat,
    reduce_scatter): rank by rank such a buffer meets the other run's per-parameter
    gradient copies and bucket views, which is how `size mismatch (4272) vs (64,32)` and
    a false replica desync came about. The compute ops do pair: the line says how."""
    t_w, g_w = set(_layout_of(target)), set(_layout_of(golden))
    if ("fsdp2" in t_w) == ("fsdp2" in g_w):
        return
    fsdp, other = (target, golden) if "fsdp2" in t_w else (golden, target)
    other_w = ", ".join(_WRAPPER_WORDS.get(w, w) for w in sorted(g_w if fsdp is target else t_w)) or "unwrapped"
    raise ShardError(f"{fsdp} (FSDP2: parameters and reduced gradients sharded in flat buffers that hold "
                     f"several parameters each, no DTensor layout recorded) and {other} ({other_w}: whole "
                     "parameters on every rank) differ in layout: their gradients after the reduction pair no "
                     "tensor with its like; compare each with a single-process reference dump (-g REF.h5), or "
                     "the forward and backward compute ops rank by rank with --select on the model's modules")


def prepare(target: Path, golden: Path, out_dir: Path, *, selected: bool = False) -> ShardedCompare | None:
    """What `accucmp compare -m TARGET -g GOLDEN` compares when a side is a run folder
    whose ops hold DTensors: None when neither is (or both are runs of the same layout:
    rank against rank, shard against shard, as folders compare today); else the sides as
    single files, each sharded run put together in `out_dir`. ShardError (one line) for a
    pairing that no file-by-file compare answers (FSDP2 against DDP: unless `selected`,
    the user's --select choosing the ops to pair rank by rank)."""
    t_dir, g_dir = target.is_dir(), golden.is_dir()
    if not (t_dir or g_dir):
        return None
    t_sh, g_sh = t_dir and holds_dtensors(target), g_dir and holds_dtensors(golden)
    if not (t_sh or g_sh):
        if t_dir and g_dir and not selected:
            _refuse_flat_shards_against_replicas(target, golden)
        return None
    if t_sh and g_sh and _layout_signature(target) == _layout_signature(golden):
        return None                       # same layout: rank r against rank r, shards against shards
    other, other_dir = (golden, g_dir) if t_sh and not g_sh else (target, t_dir) if g_sh and not t_sh else (None, False)
    if other is not None and other_dir:
        n = len(_dump_files(other))
        if n != 1:
            wrappers = ", ".join(_layout_of(other)) or "no DTensors"
            sharded = target if t_sh else golden
            raise ShardError(f"{sharded}: holds DTensors (tensor parallel: every rank sees the whole batch) and "
                             f"{other} is a run of {n} ranks without them ({wrappers}: each rank its own part of "
                             "the batch); these layouts pair no tensor with its like: compare each run with a "
                             "single-process reference dump (-g REF.h5)")
    out_dir.mkdir(parents=True, exist_ok=True)
    from accucmp.report.outputs import _free_basename, timestamp

    assembled = []

    def side(path: Path, sharded: bool, is_dir: bool) -> Path:
        if sharded:
            name = _free_basename(out_dir, f"assembled_{path.name or 'run'}_{timestamp()}", ".h5")
            run = assemble_run(path, out_dir / f"{name}.h5")
            assembled.append(run)
            return run.path
        return _dump_files(path)[0] if is_dir else path

    return ShardedCompare(side(target, t_sh, t_dir), side(golden, g_sh, g_dir), assembled)


def report_lines(sharded: ShardedCompare, summary) -> tuple[list[str], bool]:
    """Lines after the verdict of a compare of put-together runs: the replicas that differ
    (FAIL each), and which rank's shard holds the first failing element of the first
    failure. (lines, whether they are findings)."""
    lines = []
    ff = getattr(summary, "first_failure", None) or {}
    t_ds, g_ds = ff.get("NPUDumpPath"), ff.get("GroundTruthPath")
    if isinstance(t_ds, str) and isinstance(g_ds, str) and t_ds and g_ds:
        said = None
        with contextlib.suppress(DumpError, KeyError, ValueError, TypeError):
            said = shard_of(str(sharded.target), t_ds, str(sharded.golden), g_ds)
        if said is None and sharded.golden in [a.path for a in sharded.assembled]:
            with contextlib.suppress(DumpError, KeyError, ValueError, TypeError):
                said = shard_of(str(sharded.golden), g_ds, str(sharded.target), t_ds)
        if said:
            what = f"{ff.get('IO', '')} {ff.get('TensorName', '')} of {ff.get('NPUDump', '')} #{ff.get('SeqId', '')}"
            mod = ff.get("Module")
            lines.append(f"  shard: {what.strip()}" + (f" in {mod}" if isinstance(mod, str) and mod else "")
                         + f": {said}")
    return lines, bool(sharded.findings())


def summary_fields(sharded: ShardedCompare, lines: list[str], record: dict) -> dict:
    """What --summary-json adds for put-together runs: the assembled files and the lines
    (ranks that disagree, which rank's shard); ranks that disagree make the verdict FAIL
    and lead its sentence, as on the terminal."""
    out = {"sharded": {"assembled": [str(a.path) for a in sharded.assembled], "lines": lines}}
    findings = sharded.findings()
    if findings:
        out["verdict"] = "FAIL"
        out["sentence"] = findings[0]
    return out
