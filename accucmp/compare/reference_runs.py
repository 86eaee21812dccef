"""`accucmp compare -m RUN/ -g REF.h5`: every rank of a data-parallel run against ONE
single-process reference dump (torch-free).

What is paired how (docs/COMPARE.md, "A run against a single-process reference"):

* Layouts (`describe_layout`): the ranks' root attributes `world_size` and
  `parallel_layout` (wrappers and device meshes) and the reference's. Data parallel (DDP,
  FSDP2 on a 1-D mesh, or no wrapper) compares; tensor parallel and other meshes, a
  reference that is itself a rank of a run, ranks of different world sizes are one line
  (UncomparableRuns, exit 2), never a size-mismatch verdict.
* The batch split (`find_batch_split`): the first forward op reading a tensor no op made
  (the batch) whose shape is the reference's with one dimension divided by the world size;
  which rows of the reference's batch rank 0 holds says interleaved (DistributedSampler's
  default: rank, rank + W, ...) or contiguous, unless `--batch-split` states it.
* Per rank (`RankView`, given to the pipeline: pipeline.stream_compare(view=...)), each
  tensor of the rank by what the rank holds of the reference's:
  - a batch slice (shape = reference's with one dimension divided by the world size,
    batch-major): compared with those rows of the reference's tensor (`BatchSlice` reads
    them in bounded pieces); a gradient (made by a backward op) times the loss
    normalisation (a mean loss over the rank's part: world size / 1 for a sum loss);
  - the same shape, not depending on the batch (weights, buffers): compared whole;
  - the same shape and depending on the batch (the loss, per-rank gradients before the
    all-reduce: partial sums over the rank's rows): status `partial`, never a failure;
  - the gradient a parallel wrapper copies back after its all-reduce (DDP's reducer
    copying the averaged bucket into .grad): compared with the reference's full-batch
    gradient from the op that made it there;
  - ops that exist only because of the parallelism (collectives, FSDP's copy-in/out,
    DDP's bucket copies, their buffers): status `parallelism`, taken out before the op
    streams are aligned, so they neither disturb the pairing nor count as departures;
  - FSDP2's reduce-scattered gradients: the rank's row of the reduce-scatter holds a dim-0
    chunk of every parameter's averaged gradient of a module group, laid out by
    fsdp.chunk_cat (fsdp_gradients.shard_rows); each parameter's chunk (`FlatRange`, one at
    a time) against those rows of the reference's full-batch gradient from the backward op
    that made the local gradient (a row per parameter, MatchedBy `after reduce-scatter`);
    copies of that buffer: status `sharded`.
  Which tensor depends on the batch, and which op made it, comes from the dump's links
  (the catalog's `obj`/`base` entries of a dump written with dedup, the default).
* Folder: one Dask task per rank (rank_tasks.pair_task with the view's options), merged as
  ranks.py merges a folder compare; the replica check does not apply (one reference).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from dumpfile import schema as S
from dumpfile.errors import DumpFormatError
from dumpfile.read.catalog import linked_tensor, row_entries
from dumpfile.read.light import LightValue

from accucmp.compare.fsdp_gradients import GRADIENT_LAYOUT_INPUTS, REDUCED_ROW_OUTPUTS

SPLITS = ("auto", "interleaved", "contiguous")
LOSS_REDUCTIONS = ("mean", "sum")


class UncomparableRuns(DumpFormatError):
    """A run and a reference that cannot be compared tensor by tensor (one line, exit 2)."""


# ---- what exists only because of the parallelism: policy as data --------------------------
# op namespaces whose ops are communication or a parallel wrapper's own bookkeeping
PARALLELISM_NAMESPACES: dict[str, str] = {
    "c10d": "collective",
    "_c10d_functional": "collective",
    "c10d_functional": "collective",
    "_dtensor": "DTensor redistribution",
    "fsdp": "FSDP copy-in/copy-out",
}
# autograd nodes whose ops, writing into a preallocated out= buffer, are a wrapper's hooks:
# DDP's reducer copies each gradient into its bucket from the AccumulateGrad hook
BUCKET_HOOK_NODES: dict[str, str] = {
    "torch::autograd::AccumulateGrad": "DDP reducer: a gradient copied into its all-reduce bucket",
}
# ops that normalise with statistics over the batch they are given (training-mode BatchNorm):
# on a rank, over its part of the batch, so their outputs are not the reference's rows, and
# nor is anything computed from them: by design (plain BatchNorm under DDP; SyncBatchNorm
# normalises over the whole batch), never a finding. Keyed by op packet (op_policies.packet).
# the inputs such an op updates in place from those statistics (running mean and variance):
# read later, they hold this rank's update
RUNNING_STATISTICS = ("running_mean", "running_var")
BATCH_STATISTICS_OPS: dict[str, str] = {
    "aten.native_batch_norm": "BatchNorm",
    "aten._native_batch_norm_legit": "BatchNorm",
    "aten._native_batch_norm_legit_functional": "BatchNorm",
    "aten._native_batch_norm_legit_no_stats": "BatchNorm",
    "aten.cudnn_batch_norm": "BatchNorm",
    "aten.miopen_batch_norm": "BatchNorm",
    "aten._batch_norm_with_update": "BatchNorm",
    "aten.batch_norm_stats": "BatchNorm",
}
# wrappers (root attribute parallel_layout) under which ranks hold a part of the batch
DATA_PARALLEL_WRAPPERS: dict[str, str] = {"ddp": "DDP", "fsdp2": "FSDP2"}


def _namespace(op: str) -> str:
    return op.split(".", 1)[0]


# ---- layouts --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    world_size: int
    wrappers: tuple[str, ...]
    meshes: tuple[dict, ...]

    def name(self) -> str:
        names = [DATA_PARALLEL_WRAPPERS.get(w, w) for w in self.wrappers]
        return "+".join(names) if names else ("tensor-parallel" if self.meshes else "data-parallel")


def read_layout(path: str) -> Layout:
    from dumpfile.read.reader import DumpFile

    with DumpFile(path) as f:
        a = f.attrs
        world = int(a.get(S.ROOT_WORLD_SIZE, 1) or 1)
        raw = a.get(S.ROOT_PARALLEL_LAYOUT)
    wrappers, meshes = (), ()
    if raw is not None:
        try:
            d = json.loads(raw.decode() if isinstance(raw, bytes) else str(raw))
            wrappers = tuple(sorted(str(w) for w in d.get("wrappers", [])))
            meshes = tuple(m for m in d.get("meshes", []) if isinstance(m, dict))
        except (ValueError, AttributeError, TypeError) as e:
            raise DumpFormatError(f"{path}: root attribute parallel_layout is not the JSON docs/FORMAT.md "
                                  f"describes ({e})") from e
    return Layout(world, wrappers, meshes)


def describe_layout(targets: list, golden: str) -> Layout:
    """The run's layout (rank_files.RankFile list, one per rank) checked against a
    single-process reference: the layout, or UncomparableRuns naming why not."""
    g = read_layout(golden)
    if g.world_size > 1:
        raise UncomparableRuns(f"{golden}: a rank of a {g.world_size}-rank run, not a single-process reference "
                               "(give the run's folder as -g to compare rank with rank)")
    layouts = {rf.path: read_layout(rf.path) for rf in targets}
    worlds = {lay.world_size for lay in layouts.values()}
    if len(worlds) > 1:
        raise UncomparableRuns("ranks of different runs in one folder: world sizes "
                               + ", ".join(str(w) for w in sorted(worlds)))
    lay = next(iter(layouts.values()))
    if lay.world_size <= 1:
        raise UncomparableRuns(f"{targets[0].path}: world_size 1: not a rank of a distributed run "
                               "(compare two files as usual)")
    if any(x != lay for x in layouts.values()):
        raise UncomparableRuns("the ranks record different parallel layouts: "
                               + "; ".join(sorted({_layout_text(x) for x in layouts.values()})))
    for mesh in lay.meshes:
        shape = list(mesh.get("mesh_shape") or [])
        names = list(mesh.get("mesh_dim_names") or [])
        if "fsdp2" not in lay.wrappers or len(shape) != 1:
            raise UncomparableRuns(
                f"{lay.name()} run ({_layout_text(lay)}) vs a single-process reference: its tensors are "
                f"shards on a device mesh {shape}{' ' + str(names) if names else ''}, and compare does not "
                "assemble shards against a reference yet; compare rank with rank of a run of the same layout")
    return lay


def _layout_text(lay: Layout) -> str:
    meshes = ", ".join(f"mesh {m.get('mesh_shape')}" + (f" {m.get('mesh_dim_names')}" if m.get("mesh_dim_names")
                                                       else "") for m in lay.meshes)
    return f"world size {lay.world_size}, wrappers {list(lay.wrappers) or 'none'}" + (f", {meshes}" if meshes else "")


def check_world_sizes(pairs, target_dir, golden_dir) -> None:
    """Two run folders compare rank with rank only when their world sizes agree (rank r of
    a 2-rank run holds half the batch, of a 4-rank run a quarter): else one line."""
    t = {p.target.world_size for p in pairs if p.target.world_size}
    g = {p.golden.world_size for p in pairs if p.golden.world_size}
    if t and g and t != g:
        raise UncomparableRuns(f"{target_dir} (world size {', '.join(map(str, sorted(t)))}) and {golden_dir} (world "
                               f"size {', '.join(map(str, sorted(g)))}): runs of different world sizes do not compare "
                               "rank with rank; compare each with a single-process reference (-g FILE)")


# ---- catalog links: which op made a tensor ----------------------------------------------------
def _entries(f, op) -> tuple[list[dict], list[dict]]:
    """(inputs, outputs) catalog entries of one op: name `n`, shape, links `obj`/`base`."""
    return row_entries(f, op) or ([], [])


def _link(entry: dict) -> tuple[int, str, str] | None:
    """(seqid, io, name) of the tensor an entry is (its `obj` link) or a view of (its
    `base`); None when the entry is the tensor's first appearance and no view."""
    linked = linked_tensor(entry)
    return None if linked is None else linked[1:]


def _is_tensor(entry: dict) -> bool:
    return isinstance(entry.get("shape"), list) and entry.get("T") in S.TENSOR_TYPES


def _shape(entry: dict) -> tuple[int, ...]:
    return tuple(int(s) for s in entry.get("shape") or ())


def slice_dim(t_shape, g_shape, world: int) -> int | None:
    """The dimension along which `t_shape` is 1/world of `g_shape` (all others equal)."""
    if len(t_shape) != len(g_shape) or not t_shape:
        return None
    diff = [d for d, (a, b) in enumerate(zip(t_shape, g_shape)) if a != b]
    if len(diff) == 1 and t_shape[diff[0]] * world == g_shape[diff[0]]:
        return diff[0]
    return None


# ---- the batch split --------------------------------------------------------------------------
@dataclass(frozen=True)
class BatchSplit:
    kind: str                      # "interleaved" or "contiguous"
    batch: int                     # rows of the reference's batch
    found: str                     # where it was found ("aten.embedding.default #1 indices") or "stated"

    def rows(self, rank: int, world: int) -> list[int]:
        if self.kind == "interleaved":
            return list(range(rank, self.batch, world))
        per = self.batch // world
        return list(range(rank * per, (rank + 1) * per))


_MAX_BATCH_ELEMENTS = 1 << 24


def _rows_of(x: np.ndarray, dim: int) -> list[bytes]:
    x = np.ascontiguousarray(np.moveaxis(x, dim, 0))
    return [x[i].tobytes() for i in range(x.shape[0])]


def find_batch_split(target: str, golden: str, world: int, rank: int, stated: str = "auto") -> BatchSplit:
    """The batch input of `target` (a rank file) against the reference's: how many rows
    the reference's batch has and which of them the rank holds (interleaved/contiguous)."""
    from accucmp.compare.pipeline import _open
    from accucmp.compare.pairing import match_ops
    from accucmp.compare.rows import op_tensors

    tf, gf = _open(target, "target"), _open(golden, "golden")
    try:
        if not tf.attrs.get("dedup", False) or tf.catalog is None:
            raise UncomparableRuns(f"{target}: written without links (dedup off or no catalog): compare cannot tell "
                                   "which tensors depend on the batch")
        keep = [o for o in tf.ops() if _namespace(o.op) not in PARALLELISM_NAMESPACES]
        m = match_ops(tf, gf, keep, gf.ops(), repair_shapes=False)
        _check_same_model(tf, gf, m.pairs, world)
        for pair in m.pairs:
            t, g = pair.target, pair.golden
            if t is None or g is None or t.phase != S.PHASE_FORWARD:
                continue
            ins, _ = _entries(tf, t)
            g_ins = {e["n"]: e for e in _entries(gf, g)[0] if _is_tensor(e)}
            for e in ins:
                ge = g_ins.get(e["n"])
                if not _is_tensor(e) or ge is None or _link(e) is not None:
                    continue
                dim = slice_dim(_shape(e), _shape(ge), world)
                if dim is None:
                    continue
                batch = _shape(ge)[dim]
                where = f"{t.op} #{t.seqid} {e['n']}"
                if batch % world:
                    raise UncomparableRuns(f"{target}: the batch ({where}: {batch} rows in the reference) does not "
                                           f"split evenly over {world} ranks")
                if stated != "auto":
                    return BatchSplit(stated, batch, f"stated; batch {where}")
                if _shape(e)[dim] * max(1, math.prod(_shape(e))) > _MAX_BATCH_ELEMENTS:
                    raise UncomparableRuns(f"{target}: the batch ({where}) is too large to find the split from; "
                                           "state it with --batch-split")
                t_rows = _rows_of(np.asarray(op_tensors(t).inputs[e["n"]].read()), dim)
                g_rows = _rows_of(np.asarray(op_tensors(g).inputs[e["n"]].read()), dim)
                for kind in ("interleaved", "contiguous"):
                    split = BatchSplit(kind, batch, where)
                    if [g_rows[j] for j in split.rows(rank, world)] == t_rows:
                        return split
                held = [j for j, r in enumerate(g_rows) if r in set(t_rows)]
                raise UncomparableRuns(f"{target}: rank {rank}'s batch ({where}) holds rows {held[:8]} of the "
                                       f"reference's {batch}: neither interleaved nor contiguous (state "
                                       "--batch-split to compare anyway, or check the reference's batch)")
        raise UncomparableRuns(f"{target} vs {golden}: no input of a forward op is the reference's batch split "
                               f"{world} ways (a different model or batch?)")
    finally:
        tf.close()
        gf.close()


def _check_same_model(tf, gf, pairs, world: int) -> None:
    """The tensors no op made (parameters, buffers, the batch) of the rank's forward ops have
    the reference's shapes, or its batch split `world` ways: else the reference is of
    another model (a size mismatch on every row would say so less clearly)."""
    odd, seen, first = 0, 0, ""
    for pair in pairs:
        t, g = pair.target, pair.golden
        if t is None or g is None or t.phase != S.PHASE_FORWARD:
            continue
        g_ins = {e["n"]: e for e in _entries(gf, g)[0] if _is_tensor(e)}
        for e in _entries(tf, t)[0]:
            ge = g_ins.get(e["n"])
            if not _is_tensor(e) or ge is None or _link(e) is not None:
                continue
            seen += 1
            a, b = _shape(e), _shape(ge)
            if a != b and slice_dim(a, b, world) is None:
                odd += 1
                first = first or (f"{t.op} #{t.seqid}" + (f" in {t.module}" if t.module else "")
                                  + f" {e['n']} {list(a)} vs {list(b)}")
    if odd:
        raise UncomparableRuns(f"{gf.path} is not a reference of the model of {tf.path}: {odd} of {seen} inputs no "
                               f"op made (parameters, the batch) have other shapes, first {first}")


def _whole(part) -> np.ndarray:
    """A sliced view's whole value, read through its own chunks (the slice's shape)."""
    parts = list(part.iter_chunks(1 << 22))
    x = np.concatenate(parts) if parts else np.zeros(0, dtype=np.asarray(part.source.read()).dtype)
    return x.reshape(part.attrs[S.ATTR_SHAPE])


# ---- a reference tensor's batch slice, read in bounded pieces -------------------------------------
@dataclass
class BatchSlice(LightValue):
    """The rows `rows` (sorted, of `batch`) of a reference tensor along dimension `dim`,
    times `scale`: what one rank holds of it. Seen flat, the reference is (outer, batch,
    block) with `block` = shape[dim] / batch x the sizes after `dim` (batch-major), so the
    rank's elements, in C order, are the reference's stream filtered by row: read in the
    reference's own chunks, never the whole tensor at once for a large one."""

    source: Any = None
    dim: int = 0
    rows: tuple[int, ...] = ()
    batch: int = 1
    scale: float = 1.0

    @classmethod
    def of(cls, rec, dim: int, rows, batch: int, scale: float) -> "BatchSlice":
        shape = list(rec.shape)
        shape[dim] = shape[dim] // batch * len(rows)
        attrs = dict(rec.attrs)
        attrs[S.ATTR_SHAPE] = tuple(shape)
        return cls(rec.file, rec.path, rec.name, rec.type, attrs, source=rec, dim=dim,
                   rows=tuple(sorted(rows)), batch=batch, scale=scale)

    @property
    def stored_size(self) -> int:
        return math.prod(self.attrs[S.ATTR_SHAPE])

    @property
    def uninitialized(self) -> bool:
        return self.source.uninitialized

    def _block(self) -> int:
        shape = tuple(self.source.shape)
        return shape[self.dim] // self.batch * math.prod(shape[self.dim + 1:])

    def _keep(self, start: int, n: int) -> np.ndarray:
        pos = np.arange(start, start + n, dtype=np.int64)
        return np.isin((pos // self._block()) % self.batch, np.asarray(self.rows, dtype=np.int64))

    def _scaled(self, x: np.ndarray) -> np.ndarray:
        if self.scale != 1.0 and x.dtype.kind in "fc":
            return (x * x.dtype.type(self.scale)).astype(x.dtype, copy=False)
        return x

    def read(self):
        # in the reference's pieces: the whole reference is world size x this
        return _whole(self)

    def iter_chunks(self, chunk_elements: int = 1 << 22) -> Iterator[np.ndarray]:
        src = self.source
        pieces = (src.iter_chunks_into(chunk_elements) if isinstance(src, LightValue) and src.fast
                  and src.stored_shape else src.iter_chunks(chunk_elements))
        start = 0
        for piece in pieces:
            piece = np.asarray(piece).reshape(-1)
            keep = self._keep(start, piece.size)
            start += piece.size
            if keep.any():
                yield self._scaled(piece[keep])


@dataclass
class FlatRange(LightValue):
    """Elements [start, stop) of a tensor seen flat (C order), as `shape`, times `scale`:
    one parameter's part of a rank's reduce-scattered buffer, or the rows of the
    reference's full-batch gradient that part holds. Read in the source's own chunks."""

    source: Any = None
    start: int = 0
    stop: int = 0
    scale: float = 1.0

    @classmethod
    def of(cls, rec, start: int, stop: int, shape, scale: float = 1.0) -> "FlatRange":
        attrs = dict(rec.attrs)
        attrs[S.ATTR_SHAPE] = tuple(int(s) for s in shape)
        return cls(rec.file, rec.path, rec.name, rec.type, attrs, source=rec, start=int(start), stop=int(stop),
                   scale=scale)

    @property
    def stored_size(self) -> int:
        return self.stop - self.start

    @property
    def uninitialized(self) -> bool:
        return self.source.uninitialized

    def read(self):
        return _whole(self)

    def iter_chunks(self, chunk_elements: int = 1 << 22) -> Iterator[np.ndarray]:
        src = self.source
        if isinstance(src, LightValue) and src.fast and src.stored_shape:
            shape = tuple(int(d) for d in src.stored_shape)
            per_row = math.prod(shape[1:]) if len(shape) > 1 else 1
            if per_row <= chunk_elements and math.prod(shape) == self.source.numel:
                # only the rows of dim 0 that hold the range, in slabs of about chunk_elements:
                # one parameter of a reduce-scatter row costs its own size, not the row's
                yield from self._rows(src, shape, per_row, chunk_elements)
                return
        pieces = (src.iter_chunks_into(chunk_elements) if isinstance(src, LightValue) and src.fast
                  and src.stored_shape else src.iter_chunks(chunk_elements))
        pos = 0
        for piece in pieces:
            piece = np.asarray(piece).reshape(-1)
            lo, hi = max(self.start, pos), min(self.stop, pos + piece.size)
            pos += piece.size
            if lo < hi:
                # a copy: a source read into a reused buffer overwrites the piece at the next read
                x = piece[lo - (pos - piece.size):hi - (pos - piece.size)].copy()
                if self.scale != 1.0 and x.dtype.kind in "fc":
                    x = (x * x.dtype.type(self.scale)).astype(x.dtype, copy=False)
                yield x
            if pos >= self.stop:
                break

    def _rows(self, src, shape: tuple, per_row: int, chunk_elements: int) -> Iterator[np.ndarray]:
        from h5py import h5s

        from dumpfile.read.h5util import h5_errors
        from dumpfile.read.values import decode_raw

        first, end = self.start // per_row, -(-self.stop // per_row)
        step = max(1, chunk_elements // per_row)
        with h5_errors(src.file.path, src.path):
            dsid = src._dataset()
            fspace = dsid.get_space()
        for r in range(first, end, step):
            n = min(step, end - r)
            count = (n,) + shape[1:]
            buf = np.empty(count, dtype=src.stored_dtype)
            with h5_errors(src.file.path, src.path):
                fspace.select_hyperslab((r,) + (0,) * (len(shape) - 1), count)
                dsid.read(h5s.create_simple(count), fspace, buf)
            x = decode_raw(buf, src.dtype, f"{src.file.path}: {src.path}").reshape(-1)
            lo, hi = max(self.start - r * per_row, 0), min(self.stop - r * per_row, x.size)
            x = x[lo:hi]
            if self.scale != 1.0 and x.dtype.kind in "fc":
                x = (x * x.dtype.type(self.scale)).astype(x.dtype, copy=False)
            yield x


# ---- one rank against the reference --------------------------------------------------------------
# tensor flags: depends on the batch, a gradient, parallelism, computed from statistics over
# the rank's part of the batch (BATCH_STATISTICS_OPS)
_BATCH, _GRAD, _PAR, _RANK_STATS = 1, 2, 4, 8


@dataclass
class RankView:
    """How one rank's tensors are paired with the reference's (see the module doc). Made
    from plain options (sent to a Dask worker), then bound to the open files and op pairs
    by the pipeline: `parallel_ops` before the op streams are aligned, `bind` after,
    `adjust` per op pair's tasks."""

    rank: int
    world: int
    rows: tuple[int, ...]
    batch: int
    grad_scale: float                   # reference gradient x this = the rank's (mean loss: world)
    wrappers: tuple[str, ...] = ()
    # what is kept per rank, a few bytes per op (not per tensor: 10^6 rows stay cheap):
    out_flags: dict = field(default_factory=dict, repr=False)     # seqid -> flags of its outputs (non-zero)
    batch_leaves: set = field(default_factory=set, repr=False)    # (seqid, input) no op made, batch-sliced
    made_by: dict = field(default_factory=dict, repr=False)       # seqid -> {input: (seqid, output)}: views
    partner: dict = field(default_factory=dict, repr=False)       # target seqid -> golden OpRecord
    par_reason: dict = field(default_factory=dict, repr=False)    # seqid -> why it is parallelism
    # FSDP2: reduce-scatter seqid -> the local gradients its row holds a chunk of, in layout
    # order: ((seqid, output) that made it or None, shape, dtype) each
    reduced: dict = field(default_factory=dict, repr=False)
    stats_op: dict = field(default_factory=dict, repr=False)     # "first": the first BATCH_STATISTICS op
    stats_updates: set = field(default_factory=set, repr=False)  # links of the running statistics they update
    _tf: Any = field(default=None, repr=False)

    @classmethod
    def from_options(cls, o: dict) -> "RankView":
        return cls(int(o["rank"]), int(o["world"]), tuple(o["rows"]), int(o["batch"]), float(o["grad_scale"]),
                   tuple(o.get("wrappers") or ()))

    # -- before pairing: the ops only the parallel run has
    def parallel_ops(self, tf, ops: list) -> tuple[list, list]:
        """(ops to pair, parallelism ops) of the rank's file. On the way, which op made
        the inputs that later links may name (views, the parallelism ops' inputs)."""
        self._tf = tf
        keep, par = [], []
        consumers: dict[int, list[int]] = {}
        allocations, packs = set(), set()
        laid_out = None                      # FSDP2: the local gradients a chunk_cat laid out
        for op in ops:
            ins, _ = _entries(tf, op)
            if op.op in GRADIENT_LAYOUT_INPUTS:
                laid_out = self._laid_out(ins, GRADIENT_LAYOUT_INPUTS[op.op])
            elif op.op in REDUCED_ROW_OUTPUTS and laid_out is not None:
                self.reduced[op.seqid] = laid_out
                laid_out = None
            why = PARALLELISM_NAMESPACES.get(_namespace(op.op), "")
            hook = BUCKET_HOOK_NODES.get(getattr(op, "grad_fn", "") or "")
            if not why and hook and any(e["n"] == "out" and e.get("uninitialized") for e in ins):
                why = hook
            made_here = {}
            for e in ins:
                ln = _link(e)
                if ln is None:
                    continue
                consumers.setdefault(ln[0], []).append(op.seqid)
                made = self._made(ln)
                if made is not None:
                    made_here[e["n"]] = (made, bool(e.get("base")))
                if not why and ln[0] in self.par_reason and _copy_like(op.op):
                    why = f"copy out of a {self.par_reason[ln[0]].split(':')[0]}'s buffer"
            if why:
                self.par_reason[op.seqid] = why
            kept = {n: m for n, (m, view) in made_here.items() if view or why}
            if kept:
                self.made_by[op.seqid] = kept
            if not any(_is_tensor(e) for e in ins):
                allocations.add(op.seqid)
            elif op.phase == S.PHASE_FORWARD and not any(_link(e) for e in ins if _is_tensor(e)):
                packs.add(op.seqid)
        # allocations, and ops reading only tensors no op made (parameters, buffers), whose
        # outputs only parallelism ops use: a wrapper's buffers (DDP packs the buffers it
        # broadcasts with a cat)
        for seq in allocations | packs:
            users = consumers.get(seq)
            if seq not in self.par_reason and users and all(u in self.par_reason for u in users):
                self.par_reason[seq] = "a buffer of the parallel wrapper"
        for op in ops:
            (par if op.seqid in self.par_reason else keep).append(op)
        return keep, par

    def _laid_out(self, ins: list[dict], name: str) -> list[tuple]:
        """The tensors of the input list `name` in order: (what made it, shape, dtype)."""
        items = [e for e in ins if e["n"].startswith(name + "/") and _is_tensor(e)]
        items.sort(key=lambda e: int(e["n"].rsplit("_", 1)[-1]) if e["n"].rsplit("_", 1)[-1].isdigit() else 0)
        out = []
        for e in items:
            ln = _link(e)
            out.append((self._made(ln) if ln is not None else None, _shape(e), str(e.get("dtype") or "")))
        return out

    def _made(self, ln) -> tuple[int, str] | None:
        """The (seqid, output) a link names: an output itself, or what made a linked input."""
        if ln[1] == S.OUTPUT_GROUP:
            return (ln[0], ln[2])
        return self.made_by.get(ln[0], {}).get(ln[2])

    def _input_flags(self, seq: int, entry: dict) -> int:
        ln = _link(entry)
        if ln is None:
            if entry["n"] in RUNNING_STATISTICS and self.stats_updates and seq > self.stats_op.get("seqid", seq):
                # updated in place by an earlier BatchNorm (its new bytes carry no link)
                return _BATCH | _RANK_STATS
            return _BATCH if (seq, entry["n"]) in self.batch_leaves else 0
        if ln in self.stats_updates:
            return _BATCH | _RANK_STATS         # a buffer BatchNorm updated from this rank's rows
        made = self._made(ln)
        if made is not None:
            return self.out_flags.get(made[0], 0)
        return _BATCH if (ln[0], ln[2]) in self.batch_leaves else 0

    # -- after pairing: which tensors depend on the batch
    def bind(self, gf, pairs) -> None:
        """After the pairing: the golden partner of each op, the flags of every op's
        outputs (depends on the batch, made in backward), and the allocations only the rank
        made (no tensor input, outputs uninitialized: a wrapper's buffers) as parallelism."""
        first_backward = True
        for p in sorted((p for p in pairs if p.target is not None), key=lambda p: p.target.seqid):
            t = p.target
            ins, outs = _entries(self._tf, t)
            if p.golden is None:
                if outs and not any(_is_tensor(e) for e in ins) and all(e.get("uninitialized") for e in outs):
                    self.par_reason[t.seqid] = "an allocation only the parallel run made (a wrapper's buffer)"
                elif (_copy_like(t.op) and (t.seqid - 1 in self.par_reason or t.seqid + 1 in self.par_reason)
                      and all(_link(e)[0] in self.par_reason for e in ins if _is_tensor(e) and _link(e))):
                    # a wrapper's copy next to its collectives, reading nothing but what the
                    # parallelism ops read or made (or what carries no link): DDP's buffer
                    # broadcast copying a 0-d num_batches_tracked back, FSDP2 (mixed precision)
                    # casting its flat shards into the all-gather's inputs
                    self.par_reason[t.seqid] = "a copy next to a collective, only the parallel run has"
                g_ins = {}
            else:
                self.partner[t.seqid] = p.golden
                g_ins = {e["n"]: e for e in _entries(gf, p.golden)[0] if _is_tensor(e)}
            dep = 0
            # a gradient (scaled as the loss's normalisation): a backward op's output that
            # reads a gradient, or the first backward op's (the loss's: its seed is made
            # outside the recorded ops), or one reading a tensor no recorded op made (the
            # engine's). Not every backward op's: GELU's backward computes x^2 of the saved
            # activation, a batch slice with no loss scale in it.
            grad = t.phase == S.PHASE_BACKWARD and first_backward and p.golden is not None
            for e in ins:
                if not _is_tensor(e):
                    continue
                if _link(e) is None:
                    ge = g_ins.get(e["n"])
                    if ge is not None and slice_dim(_shape(e), _shape(ge), self.world) is not None:
                        self.batch_leaves.add((t.seqid, e["n"]))
                    elif t.phase == S.PHASE_BACKWARD:
                        grad = True
                f = self._input_flags(t.seqid, e)
                dep |= f & (_BATCH | _RANK_STATS)
                grad = grad or (t.phase == S.PHASE_BACKWARD and bool(f & _GRAD))
            if t.phase == S.PHASE_BACKWARD and p.golden is not None:     # (a wrapper's allocation is not it)
                first_backward = False
            if dep & _BATCH and _packet(t.op) in BATCH_STATISTICS_OPS:
                dep |= _RANK_STATS
                for e in ins:                   # the running statistics it updates: by their first appearance
                    if e["n"] in RUNNING_STATISTICS and _is_tensor(e):
                        self.stats_updates.add(_link(e) or (t.seqid, S.INPUT_GROUP, e["n"]))
                self.stats_op.setdefault("seqid", t.seqid)
                self.stats_op.setdefault("first", f"{BATCH_STATISTICS_OPS[_packet(t.op)]} {t.op} #{t.seqid}"
                                         + (f" in {t.module}" if t.module else ""))
            flags = dep | (_GRAD if grad else 0)
            if flags:
                self.out_flags[t.seqid] = flags

    def flags_of(self, t_op, io: str, name: str, inputs: dict) -> int:
        if io == S.OUTPUT_GROUP:
            return self.out_flags.get(t_op.seqid, 0)
        e = inputs.get(name)
        return self._input_flags(t_op.seqid, e) if e is not None else 0

    def is_parallel(self, pair) -> bool:
        return pair.golden is None and pair.target is not None and pair.target.seqid in self.par_reason

    # -- per op pair: the reference's part for each of the rank's tensors
    def _batch_sliced_shape(self, tv, gv) -> bool:
        """A shape argument (a view's or reshape's size) that differs from the reference's
        only in the one entry standing for the batch, by the rank's share of its rows:
        [2, 4, 4] against [4, 4, 4] on one of 2 ranks, [8, 16] against [16, 16] flattened."""
        if not (isinstance(tv, list) and isinstance(gv, list)) or len(tv) != len(gv):
            return False
        diff = [i for i, (a, b) in enumerate(zip(tv, gv)) if a != b]
        if len(diff) != 1:
            return False
        a, b = tv[diff[0]], gv[diff[0]]
        return (isinstance(a, int) and isinstance(b, int) and not isinstance(a, bool) and a > 0 and b > 0
                and a * self.batch == b * len(self.rows))

    def _args_beyond_the_batch(self, t_op, g_op) -> str:
        """args_differ of the two ops, a batch-sliced shape argument not counted: the rank
        runs the reference's ops on its part of the batch (an eps, a dim stays a finding)."""
        from accucmp.compare.rows import args_differ, op_tensors

        t, g = op_tensors(t_op).scalar_args, op_tensors(g_op).scalar_args
        if t is None or g is None:
            return ""
        t = {k: (g[k] if k in g and self._batch_sliced_shape(v, g[k]) else v) for k, v in t.items()}
        return args_differ(t, g)

    def adjust(self, pair, tasks: list) -> list:
        from accucmp.compare.rows import STATUS_PARALLELISM, STATUS_PARTIAL, STATUS_SHARDED, Task

        t_op = pair.target
        if t_op is None:
            return tasks
        why = self.par_reason.get(t_op.seqid)
        inputs = {e["n"]: e for e in _entries(self._tf, t_op)[0]} if why is None else {}
        if pair.golden is not None and any(t.row.get("ArgsDiffer") for t in tasks):
            still = self._args_beyond_the_batch(t_op, pair.golden)
            for t in tasks:
                if t.row.get("ArgsDiffer"):
                    t.row["ArgsDiffer"] = still
        out = []
        for task in tasks:
            row = task.row
            io, name = row.get("IO"), row.get("TensorName")
            if why is not None:
                if io == S.OUTPUT_GROUP and t_op.seqid in self.reduced and name == REDUCED_ROW_OUTPUTS.get(t_op.op):
                    out.extend(self._after_reduce_scatter(t_op, task))
                    continue
                grad = self._after_all_reduce(t_op, task) if io == S.OUTPUT_GROUP else None
                if grad is not None:
                    out.append(grad)
                    continue
                row["CompareStatus"] = STATUS_SHARDED if self._sharded(t_op, task) else STATUS_PARALLELISM
                row["CompareFailReason"] = (f"{why}: a copy of the reduce-scattered gradients (compared per "
                                            "parameter at the reduce-scatter)"
                                            if row["CompareStatus"] == STATUS_SHARDED else
                                            f"{why}: exists only because of the parallelism; not compared")
                row["MatchedBy"] = "parallelism"
                out.append(Task(row, task.target, None))
                continue
            t, g = task.target, task.golden
            if t is None or g is None:
                out.append(task)
                continue
            flags = self.flags_of(t_op, io, name, inputs)
            if io == S.INPUT_GROUP and row.get("MadeBy") == "op" and self._wrapper_made(inputs.get(name), flags):
                # a parameter the wrapper gathered (FSDP2's all-gather copy-out writes the
                # unsharded parameters in place: the dumper knows an op made it, the catalog
                # links no compared op): judged here as a parameter is, not passed as inherited
                row["MadeBy"] = "leaf"
            if flags & _RANK_STATS and flags & _BATCH and not row.get("ArgsDiffer"):
                # (an op whose arguments differ from the reference's, an eps, stays a finding)
                row["CompareStatus"] = STATUS_PARTIAL
                row["CompareFailReason"] = (f"computed from statistics over this rank's part of the batch "
                                            f"({self.stats_op.get('first', 'BatchNorm')} normalises over the "
                                            "rows it is given; SyncBatchNorm would use the whole batch's): "
                                            "differs from the reference by design, not compared")
                out.append(task)
                continue
            try:
                t_shape, g_shape = tuple(t.shape), tuple(g.shape)
            except (DumpFormatError, ValueError, TypeError, KeyError, OSError):
                out.append(task)            # an unreadable shape: the comparer reports it (corrupt)
                continue
            dim = slice_dim(t_shape, g_shape, self.world)
            if dim is not None and g_shape[dim] % self.batch == 0:
                if g.is_stats:
                    row["CompareStatus"] = STATUS_PARTIAL
                    row["CompareFailReason"] = "statistics-only reference: a batch slice needs its tensor"
                    out.append(task)
                    continue
                scale = self.grad_scale if (flags & _GRAD) else 1.0
                part = BatchSlice.of(g, dim, self.rows, self.batch, scale)
                row["ReferencePart"] = (f"rows {_rows_text(self.rows)} of {self.batch} (dim {dim})"
                                        + (f" x{scale:g} (gradient of a mean loss over this rank's rows)"
                                           if scale != 1.0 else ""))
                out.append(Task(row, t, part, task.fp64, scale=task.scale))
                continue
            if t_shape == g_shape and flags & _BATCH:
                row["CompareStatus"] = STATUS_PARTIAL
                row["CompareFailReason"] = ("depends on this rank's part of the batch and has the reference's "
                                            "shape (a reduction over the batch: a loss, a gradient before the "
                                            "all-reduce): a partial sum, not comparable one-to-one")
                out.append(task)
                continue
            out.append(task)
        return out

    def _wrapper_made(self, entry: dict | None, flags: int) -> bool:
        """Whether this input, made by an op, was made by no compared op: a parallelism op
        made it (directly or through views), or it carries no link and does not depend on
        the batch (written in place by a wrapper's copy-out)."""
        if entry is None:
            return False
        ln = _link(entry)
        if ln is None:
            return not flags & _BATCH
        made = self._made(ln)
        return (made[0] if made is not None else ln[0]) in self.par_reason

    def _producer_output(self, t_op, name: str):
        """The golden record of what the op that made the target op's input `name` made."""
        made = self.made_by.get(t_op.seqid, {}).get(name)
        if made is None:
            return None, None
        g_op = self.partner.get(made[0])
        if g_op is None:
            return None, None
        from accucmp.compare.rows import op_tensors

        return g_op, op_tensors(g_op).outputs.get(made[1])

    def _after_all_reduce(self, t_op, task):
        """DDP's reducer copying the all-reduced bucket into .grad: the copy's result against
        the reference's gradient from the op that made that .grad."""
        from accucmp.compare.rows import Task, dtype_of, safe_shape

        t = task.target
        if t is None or not _copy_like(t_op.op):
            return None
        src = self.made_by.get(t_op.seqid, {}).get("src")
        if src is None or src[0] not in self.par_reason:
            return None
        g_op, g = self._producer_output(t_op, task.row.get("TensorName"))
        if g is None or not g.is_tensor or g.numel != t.numel:
            return None
        row = task.row
        made = self.made_by[t_op.seqid][row.get("TensorName")]
        row.update({"GroundTruthPath": g.path, "GoldenDataType": dtype_of(g), "GoldenShape": safe_shape(g),
                    "GoldenSeqId": g_op.seqid, "GoldenOp": g_op.op, "CompareStatus": "", "CompareFailReason": "",
                    "MatchedBy": "after all-reduce", "Module": g_op.module or row.get("Module"),
                    "ReferencePart": f"the full-batch gradient {g_op.op} #{g_op.seqid} {made[1]} (the rank's "
                                     f"#{made[0]} after the all-reduce)"
                                     + (f" x{self.reduced_scale:g}" if self.reduced_scale != 1.0 else "")})
        if self.reduced_scale != 1.0:       # a sum loss: the averaged gradient is the full one / world
            g = FlatRange.of(g, 0, g.numel, tuple(g.shape), self.reduced_scale)
        self._mark_rank_stats(row, made[0])
        return Task(row, t, g, scale=_loss_scale(row, t_op, g_op, made[1]))

    def _mark_rank_stats(self, row: dict, made_seq) -> None:
        """A reduced gradient whose local parts were computed from per-rank batch statistics
        (BatchNorm under DDP/FSDP): their average is not the full-batch gradient, by design."""
        if made_seq is not None and self.out_flags.get(made_seq, 0) & _RANK_STATS:
            from accucmp.compare.rows import STATUS_PARTIAL

            row["CompareStatus"] = STATUS_PARTIAL
            row["CompareFailReason"] = (f"the average of gradients computed from statistics over each rank's part "
                                        f"of the batch ({self.stats_op.get('first', 'BatchNorm')}): not the "
                                        "full-batch gradient, by design; not compared")

    @property
    def reduced_scale(self) -> float:
        """Reference gradient x this = a gradient averaged over the ranks (a mean loss: 1; a
        sum loss: each rank's sum over its rows, averaged: 1 / world)."""
        return self.grad_scale / self.world

    def _after_reduce_scatter(self, t_op, task) -> list:
        """FSDP2's reduce-scattered row of this rank, one task per parameter: its chunk of
        the parameter's averaged gradient (dim-0 rows rank x chunk, chunk_cat's layout)
        against those rows of the reference's full-batch gradient, from the backward op that
        made the local gradient. One parameter's part is read at a time (FlatRange)."""
        from accucmp.compare.fsdp_gradients import shard_rows
        from accucmp.compare.rows import STATUS_PARALLELISM, Task, dtype_of, op_tensors, shape_str

        t = task.target
        base = dict(task.row, MatchedBy="after reduce-scatter", CompareStatus="", CompareFailReason="")
        try:
            have = t.numel if t is not None else 0
        except (DumpFormatError, ValueError, TypeError, KeyError, OSError):
            return [task]                    # an unreadable record: the comparer reports it
        out, off = [], 0
        for k, (made, shape, dtype) in enumerate(self.reduced[t_op.seqid]):
            n0, per, rest = shard_rows(shape, self.world)
            lo, hi = min(self.rank * per, n0), min((self.rank + 1) * per, n0)
            start, n = off, (hi - lo) * rest
            off += per * rest
            if n == 0:                       # this rank's chunk is padding only
                continue
            row = dict(base, TensorName=f"{task.row.get('TensorName')}[{start}:{start + n}]")
            part_shape = (hi - lo,) + tuple(shape[1:])
            g_op = self.partner.get(made[0]) if made is not None else None
            g = op_tensors(g_op).outputs.get(made[1]) if g_op is not None else None
            if t is None or start + n > have or g is None or not g.is_tensor or g.numel != n0 * rest:
                why = ("its row holds fewer elements than the gradients laid out" if t is not None and
                       start + n > have else "no reference gradient from the op that made this one")
                row.update(CompareStatus=STATUS_PARALLELISM, MatchedBy="parallelism",
                           CompareFailReason=f"{self.par_reason.get(t_op.seqid)}: parameter {k}'s shard: {why}")
                out.append(Task(row, t, None))
                continue
            mine = FlatRange.of(t, start, start + n, part_shape)
            ref = FlatRange.of(g, lo * rest, hi * rest, part_shape, self.reduced_scale)
            computed = dtype if dtype and dtype != dtype_of(t) else row.get("ComputeDtype")
            row.update({"Shape": shape_str(part_shape), "GoldenShape": shape_str(part_shape),
                        "GroundTruthPath": g.path, "GoldenDataType": dtype_of(g), "GoldenSeqId": g_op.seqid,
                        "GoldenOp": g_op.op, "Module": g_op.module or row.get("Module"), "ComputeDtype": computed,
                        "ReferencePart": f"rows {lo}:{hi} of {n0} (dim 0) of the full-batch gradient {g_op.op} "
                                         f"#{g_op.seqid} {made[1]}"
                                         + (f" x{self.reduced_scale:g}" if self.reduced_scale != 1.0 else "")
                                         + f" (this rank's shard of the gradient its #{made[0]} made, "
                                           "after the reduce-scatter)"})
            self._mark_rank_stats(row, made[0])
            out.append(Task(row, mine, ref, scale=_loss_scale(row, t_op, g_op, made[1])))
        return out

    def _sharded(self, t_op, task) -> bool:
        t = task.target
        if t is None or not _copy_like(t_op.op) or task.row.get("IO") != S.OUTPUT_GROUP:
            return False
        # a copy to or from a collective's buffer under FSDP2: the reduce-scattered gradient shard
        return "fsdp2" in self.wrappers and any(
            made[0] in self.par_reason for made in self.made_by.get(t_op.seqid, {}).values())


def _packet(op: str) -> str:
    from accucmp.compare.op_policies import packet

    return packet(op)


def _copy_like(op: str) -> bool:
    from accucmp.compare.op_policies import BY_DESIGN_UNPAIRED, packet

    return packet(op) in BY_DESIGN_UNPAIRED


def _rows_text(rows) -> str:
    rows = list(rows)
    return ",".join(map(str, rows[:6])) + (",..." if len(rows) > 6 else "")


# ---- the folder against one reference, on Dask -------------------------------------------------------
def _pairs_line(lay: Layout, split: BatchSplit, n_ranks: int, golden: str, loss: str) -> str:
    grads = ("gradients after the all-reduce with the full-batch gradients" if "ddp" in lay.wrappers else
             "reduce-scattered gradients per parameter with the full-batch gradients' rows each rank holds"
             if "fsdp2" in lay.wrappers else
             "per-rank gradients as partial sums")
    return (f"comparing {n_ranks} {lay.name()} rank(s) (world size {lay.world_size}) with the 1-process reference "
            f"{golden}: activations by batch slice ({split.kind}, {split.batch} rows; {split.found}), "
            f"batch gradients x{lay.world_size if loss == 'mean' else 1} ({loss} loss), {grads}; "
            "parallelism ops listed, not compared")


def plan(target_dir, golden: str, *, batch_split: str = "auto", loss: str = "mean"):
    """(rank files, layout, split, the one line) of a folder against a reference."""
    from accucmp.compare.rank_files import _keyed

    if batch_split not in SPLITS:
        raise DumpFormatError(f"--batch-split {batch_split!r}: one of {', '.join(SPLITS)}")
    if loss not in LOSS_REDUCTIONS:
        raise DumpFormatError(f"--loss-reduction {loss!r}: one of {', '.join(LOSS_REDUCTIONS)}")
    unpaired: list = []
    files = sorted(_keyed(Path(target_dir), "target", unpaired).values(), key=lambda rf: rf.key)
    if not files:
        why = "; ".join(f"{p}: {r}" for p, r in unpaired[:3]) or "no .h5 files"
        raise DumpFormatError(f"{target_dir}: no rank dumps to compare ({why})")
    lay = describe_layout(files, golden)
    first = files[0]
    split = find_batch_split(first.path, golden, lay.world_size, first.rank, batch_split)
    return files, unpaired, lay, split, _pairs_line(lay, split, len(files), golden, loss)


def compare_with_reference(target_dir, golden, out_dir, *, batch_split: str = "auto", loss: str = "mean",
                           algorithms=None, select: str | None = None, thresholds=None,
                           chunk_elements: int = 1 << 22, top: int = 5, scheduler: str | None = None,
                           workers: int = 0, golden_fp64=None, progress=None,
                           basename: str | None = None, on_plan=None, exclude=(), replica_check: bool = True):
    """Every rank of `target_dir` against the single-process dump `golden`, one Dask task a
    rank; the merged result (ranks.RunsResult). `on_plan(line)` is told what is paired how
    before any tensor is read."""
    import uuid

    from accucmp.compare import ranks
    from accucmp.compare.rank_tasks import pair_task
    from accucmp.compare.verdict import thresholds_with
    from accucmp.report.outputs import _free_basename, _mkdir, timestamp

    t_start = time.perf_counter()
    thresholds_with(thresholds)
    if golden_fp64 is not None:
        raise DumpFormatError("--golden-fp64 takes one file; it is not supported with folders")
    files, unpaired, lay, split, line = plan(target_dir, str(golden), batch_split=batch_split, loss=loss)
    if on_plan is not None:
        on_plan(line)
    out_dir = _mkdir(Path(out_dir))
    base = basename or _free_basename(out_dir, f"result_{timestamp()}", suffix="_ranks.csv")
    scale = float(lay.world_size) if loss == "mean" else 1.0
    client, cluster = ranks._client(scheduler, workers, len(files))
    try:
        n_workers = len(client.scheduler_info().get("workers", {})) or workers
        if progress is not None:
            progress.start(len(files))
        futures = {}
        for rf in files:
            view = {"rank": rf.rank, "world": lay.world_size, "rows": split.rows(rf.rank, lay.world_size),
                    "batch": split.batch, "grad_scale": scale, "wrappers": list(lay.wrappers)}
            options = dict(algorithms=algorithms, select=select, chunk_elements=chunk_elements,
                           thresholds=dict(thresholds) if thresholds else None, top=top, view=view,
                           exclude=tuple(exclude or ()))
            csv = out_dir / f"{base}_rank{rf.rank}{'' if rf.step is None else f'_step{rf.step}'}.csv"
            fut = client.submit(pair_task, rf.path, str(golden), str(csv), options, None,
                                key=f"accucmp-ref-{rf.rank}-{uuid.uuid4().hex[:8]}", pure=False)
            futures[fut] = ("pair", _RefPair(rf, golden))
        pair_results, _ = ranks._gather(client, futures, progress, None)
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
    pair_results.sort(key=lambda r: (r["rank"], -1 if r["step"] is None else r["step"]))
    failing = [r for r in pair_results if r.get("first_failure")]
    earliest, first_ranks = None, []
    if failing:
        best = min(failing, key=ranks._failure_key)
        k = ranks._failure_key(best)[:2]
        first_ranks = sorted(r["rank"] for r in failing if ranks._failure_key(r)[:2] == k)
        earliest = dict(best["first_failure"], rank=best["rank"], step=best["step"])
    result = ranks.RunsResult(pair_results, unpaired, [], earliest, first_ranks, [], n_workers,
                              time.perf_counter() - t_start)
    result.paths = ranks._write_merged(result, out_dir, base, target_dir, golden)
    result.plan = line
    return result


def run_reference_compare(target_dir, golden, out_dir, *, console, quiet: bool = False,
                          batch_split: str = "auto", loss: str = "mean", **kw) -> int:
    """`accucmp compare -m RUN/ -g REF.h5`: the line saying what is paired how, then the
    folder compare's merged answer (ranks.run_folder_compare); the exit code."""
    import functools

    from accucmp.compare.ranks import run_folder_compare

    def say(line: str) -> None:
        if not quiet:
            console.print(line, markup=False, highlight=False, soft_wrap=True)

    compare = functools.partial(compare_with_reference, batch_split=batch_split, loss=loss, on_plan=say)
    return run_folder_compare(target_dir, golden, out_dir, console=console, quiet=quiet, compare=compare, **kw)


@dataclass
class _RefPair:
    """ranks._gather's view of one rank's task: the rank file against the reference."""

    target: Any
    golden_path: str

    @property
    def key(self):
        return self.target.key

    @property
    def golden(self):
        return _Named(str(self.golden_path))


@dataclass
class _Named:
    path: str


def _loss_scale(row: dict, t_op, g_op, g_name: str) -> float:
    """The loss scale a rank's reduced gradient (the row's tensor of `t_op`) carries over the
    reference's gradient (output `g_name` of `g_op`): a rank that trains with a GradScaler
    against a reference without one (docs/COMPARE.md, "Loss scaling"). Sets LossScale."""
    from accucmp.compare.rows import tensor_scale

    scale = tensor_scale(t_op, str(row.get("IO")), str(row.get("TensorName")).split("[", 1)[0]) \
        / tensor_scale(g_op, "output", g_name)
    if scale != 1.0:
        row["LossScale"] = scale
    return scale
