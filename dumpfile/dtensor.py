"""Reassemble a DTensor's global value from the local shards that the ranks recorded.

Torch-free (numpy), for compare: each rank's record of a DTensor argument holds its local
shard and the `dtensor` attribute (docs/FORMAT.md, "DTensor arguments"):

    parts = [(rec.attrs["dtensor"], rec.read()) for rec in records_of_every_rank]
    full = assemble(parts)        # the global tensor, comparable with a one-rank run

Shard placements put each shard at its `global_offset`; Replicate takes the ranks at
coordinate 0 of that mesh dimension; Partial(sum) sums the ranks' shares.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from dumpfile import jsontext


def layout(attr: Any) -> dict:
    """The `dtensor` attribute (str or bytes) as a dict."""
    if isinstance(attr, bytes):
        attr = attr.decode()
    return jsontext.loads(attr) if isinstance(attr, str) else dict(attr)


def assemble(parts: Iterable[tuple[Any, np.ndarray]]) -> np.ndarray:
    """Global value from (dtensor attribute, local array) of every rank of the mesh.
    ValueError (one line) when the parts do not make one tensor."""
    parts = [(layout(a), np.asarray(x)) for a, x in parts]
    if not parts:
        raise ValueError("no shards to assemble")
    first = parts[0][0]
    shape = tuple(first["global_shape"])
    n_ranks = len(first["mesh_ranks"])
    if len(parts) != n_ranks:
        raise ValueError(f"{len(parts)} shards for a mesh of {n_ranks} ranks")
    out = None
    for lay, local in parts:
        if tuple(lay["global_shape"]) != shape or lay["placements"] != first["placements"]:
            raise ValueError("shards disagree on the global shape or the placements")
        offset = lay.get("global_offset")
        if offset is None:
            raise ValueError(f"placements {lay['placements']} give no global offset")
        coord = lay["coordinate"]
        # one copy of replicated data: the ranks at coordinate 0 of every Replicate dimension
        if any(p == "Replicate()" and c != 0 for p, c in zip(lay["placements"], coord)):
            continue
        if out is None:
            acc = np.float64 if local.dtype.kind == "f" else (np.complex128 if local.dtype.kind == "c" else local.dtype)
            out = np.zeros(shape, dtype=acc)
        idx = tuple(slice(o, o + n) for o, n in zip(offset, local.shape))
        out[idx] += local
    return out.astype(parts[0][1].dtype, copy=False)
