"""FSDP2's reduced gradients put together from the ranks' flat shards, for compare (torch-free).

FSDP2 records no DTensor layout (accucmp/compare/shards.py assembles those): its compute
ops run on all-gathered, whole parameters, and its reduced gradients are flat buffers that
hold a slice of every parameter of a module group. `fsdp_gradients(RUN/)` undoes that
layout over the ranks and names each gradient by the backward op that made its local
value; `fsdp_gradient_files(RUN/, REF.h5, out/)` writes them and a single-process
reference's same gradients as two small dumps to compare (docs/COMPARE.md, "Sharded
tensors (DTensor): assembled before measuring").
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dumpfile import DumpFile, DumpWriter
from dumpfile import schema as S
from dumpfile.read.reader import h5_errors

from accucmp.compare.shards import ROOT_ASSEMBLED_FROM, ShardError, digest, encode_values, rank_op_groups, run_rank_files

# FSDP2 records no DTensor layout; its reduced gradients are flat shards that hold a slice of
# every parameter of a module group: fsdp.chunk_cat lays the ranks' local gradients out as
# (world, n) (each gradient cut into `world` chunks along dim 0, padded to equal chunks),
# c10d._reduce_scatter_base_ hands row r, reduced, to rank r.
_FSDP_CHUNK_CAT = "fsdp.chunk_cat.default"
_REDUCE_SCATTER = "c10d._reduce_scatter_base_.default"
# the same layout as data for a rank's own view (reference_runs.RankView): the op laying the
# local gradients out -> its input list; the collective -> the output holding the rank's row
GRADIENT_LAYOUT_INPUTS: dict[str, str] = {_FSDP_CHUNK_CAT: "tensors"}
REDUCED_ROW_OUTPUTS: dict[str, str] = {_REDUCE_SCATTER: "result0"}


def shard_rows(shape, world: int) -> tuple[int, int, int]:
    """(rows along dim 0, rows per rank's chunk (the last ones padded), elements per row) of
    a gradient of `shape` laid out by chunk_cat over `world` ranks."""
    shape = tuple(int(d) for d in shape)
    n0 = shape[0] if shape else 1
    rest = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
    return n0, -(-n0 // world), rest


@dataclass
class ReducedGradient:
    op: str            # the backward op whose output was the local gradient (rank 0's)
    seqid: int
    module: str
    name: str          # its output's name
    value: np.ndarray  # the gradient after the reduce-scatter, put together from every rank
    occurrence: int = 0   # how many backward ops of this name ran in this module before it
    made_dtype: str = ""  # the local gradient's dtype (bfloat16 under a MixedPrecisionPolicy)

    @property
    def key(self) -> tuple:
        return gradient_key(self.module, self.op, self.occurrence, self.name)


def gradient_key(module: str, op: str, occurrence: int, name: str) -> tuple:
    """What names a gradient in any run of the model: the backward op that made it, by
    module (a wrapper's `module.` prefix dropped), op and its place among that module's
    backward ops of that name, and the output."""
    while module.startswith("module."):
        module = module[len("module."):]
    return (module, op, occurrence, name)


def fsdp_gradients(run_dir: str | os.PathLike):
    """The reduced gradients of an FSDP2 run folder, one ReducedGradient per parameter,
    each put together from the ranks' reduce-scatter outputs and named by the backward op
    that made its local gradient (the same bytes on rank 0: the op a single-process run has
    too). Yields them group by group, as the reduce-scatters ran; memory: one module
    group's gradients."""
    run_dir = os.fspath(run_dir)
    rfiles = run_rank_files(run_dir)
    world = len(rfiles)
    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(DumpFile(rf.path)) for rf in rfiles]
        made: dict[bytes, tuple] = {}          # rank 0: digest of a backward output -> (op, name, occurrence)
        seen: dict[tuple, int] = {}             # (module, op) -> backward ops so far
        pending = None                          # the chunk_cat waiting for its reduce-scatter
        for group in rank_op_groups(run_dir, files):
            op0 = group[0]
            with h5_errors(op0.file.path):
                if op0.op == _FSDP_CHUNK_CAT:
                    pending = [np.asarray(c.read()) for c in op0.inputs()["tensors"].children]
                elif op0.op == _REDUCE_SCATTER and pending is not None:
                    rows = [np.asarray(op.outputs()["result0"].read()).reshape(-1) for op in group]
                    yield from _split_reduced(pending, rows, world, made, run_dir)
                    pending = None
                elif op0.phase == S.PHASE_BACKWARD:
                    k = seen.get((op0.module, op0.op), 0)
                    seen[(op0.module, op0.op)] = k + 1
                    for name, rec in op0.outputs().items():
                        if rec.is_tensor and rec.numel:
                            made[digest(np.asarray(rec.read()))] = (op0, name, k, rec.dtype)


def _split_reduced(locals_: list[np.ndarray], rows: list[np.ndarray], world: int, made: dict, run_dir: str):
    off = 0
    for local in locals_:
        n0, per, rest = shard_rows(local.shape, world)
        chunk = per * rest
        if any(off + chunk > len(r) for r in rows):
            raise ShardError(f"{run_dir}: a reduce-scatter output holds fewer elements than the gradients "
                             "its chunk_cat laid out; cannot put them together")
        full = np.concatenate([r[off:off + chunk] for r in rows])[:n0 * rest].reshape(local.shape)
        off += chunk
        who = made.get(digest(local))
        if who is not None:
            op, name, k, dtype = who
            yield ReducedGradient(op.op, op.seqid, op.module, name, full, k, dtype)


def fsdp_gradient_files(run_dir: str | os.PathLike, reference: str | os.PathLike,
                        out_dir: str | os.PathLike) -> tuple[Path, Path, int]:
    """The reduced gradients of an FSDP2 run folder and the same gradients of a
    single-process reference dump, as two small dumps with one op per gradient in the same
    order (the backward op that made it, its output only), for compare: (target, golden,
    gradients paired). The reference's gradient of a parameter is the output of the same
    backward op (gradient_key); a gradient the reference has no such op for is left out."""
    from accucmp.report.outputs import _free_basename, timestamp

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    grads = sorted(fsdp_gradients(run_dir), key=lambda g: (g.seqid, g.name))
    with DumpFile(reference) as ref, h5_errors(os.fspath(reference)):
        seen: dict[tuple, int] = {}
        keyed: dict[tuple, Any] = {}
        for op in ref.ops():
            if op.phase != S.PHASE_BACKWARD:
                continue
            k = seen.get((op.module, op.op), 0)
            seen[(op.module, op.op)] = k + 1
            keyed[gradient_key(op.module, op.op, k, "")[:3]] = op
        pairs = []
        for g in grads:
            op = keyed.get(g.key[:3])
            rec = op.outputs().get(g.name) if op is not None else None
            # (same elements: a bias gradient is recorded as sum's (1, n) and reduced as the (n,) parameter)
            if rec is not None and rec.is_tensor and rec.numel == g.value.size:
                pairs.append((g, op, np.asarray(rec.read()).reshape(g.value.shape), rec.dtype))
    if not pairs:
        raise ShardError(f"{reference}: holds none of the backward ops that made the gradients of {run_dir}; "
                         "is it a dump of the same model's training step?")
    stem = _free_basename(out_dir, f"fsdp_gradients_{Path(run_dir).name or 'run'}_{timestamp()}", ".h5")
    target, golden = out_dir / f"{stem}.h5", out_dir / f"{stem}_reference.h5"
    # the golden keeps its own seqids while they run in the target's order, else the target's
    g_seq = [op.seqid for _, op, _, _ in pairs]
    keep = all(a < b for a, b in zip(g_seq, g_seq[1:]))
    # the gradient was computed in its local dtype (bfloat16 under a MixedPrecisionPolicy) and
    # reduced in float32: judged at the precision it was computed in (op attribute compute_dtype)
    _write_gradients(target, run_dir, [(g.op, g.seqid, g.module, g.name, g.value, g.value.dtype.name, g.made_dtype)
                                       for g, _, _, _ in pairs])
    _write_gradients(golden, reference, [(op.op, op.seqid if keep else g.seqid, op.module, g.name, v, dt, "")
                                         for g, op, v, dt in pairs])
    return target, golden, len(pairs)


def _write_gradients(path: Path, source, rows) -> None:
    from dumpfile import TensorMeta

    tmp = f"{path}.partial"
    try:
        with DumpWriter(tmp, root_attrs={S.ROOT_RANK: 0, S.ROOT_WORLD_SIZE: 1, ROOT_ASSEMBLED_FROM: json.dumps(
                {"run": os.path.abspath(source), "what": "gradients after the reduction"})}) as w:
            last = None
            for op, seqid, module, name, value, dtype, computed in rows:
                if last != (op, seqid):
                    if last is not None:
                        w.end_op()
                    grp = w.begin_op(op, seqid, phase=S.PHASE_BACKWARD, module=module,
                                     attrs={S.OP_COMPUTE_DTYPE: computed} if computed and computed != dtype else None)
                    last = (op, seqid)
                meta = TensorMeta(dtype=dtype, shape=tuple(value.shape),
                                  stride=tuple(S.contiguous_strides(tuple(value.shape))))
                w.write_tensor(grp[S.OUTPUT_GROUP], name, encode_values(value, dtype, str(path)), meta)
            if last is not None:
                w.end_op()
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.replace(tmp, path)
