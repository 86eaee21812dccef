"""Which ops a golden replay could not recompute, and why (torch-free).

Golden files (mode "golden") carry the list as the compound dataset
/_npu_dumper/not_replayed (seqid, op, reason) and the root attribute
`num_not_replayed`, so `accucmp compare` can say why a golden row is missing.
"""

from __future__ import annotations

import h5py
import numpy as np

from . import schema as S

NOT_REPLAYED_PATH = f"{S.META_GROUP}/not_replayed"
ROOT_NUM_NOT_REPLAYED = "num_not_replayed"

_STR = h5py.string_dtype("utf-8")
_DTYPE = np.dtype([("seqid", np.int64), ("op", _STR), ("reason", _STR)])


def write_not_replayed(h5: h5py.File, rows: list[tuple[str, int, str]]) -> None:
    data = np.array([(int(seqid), op, reason) for op, seqid, reason in rows], dtype=_DTYPE)
    if NOT_REPLAYED_PATH in h5:
        del h5[NOT_REPLAYED_PATH]
    h5.create_dataset(NOT_REPLAYED_PATH, data=data, dtype=_DTYPE)
    h5.attrs[ROOT_NUM_NOT_REPLAYED] = len(rows)


def read_not_replayed(h5: h5py.File) -> dict[tuple[str, int], str]:
    """(op, seqid) -> reason; empty for files that are not golden replays."""
    if NOT_REPLAYED_PATH not in h5:
        return {}
    out = {}
    for row in h5[NOT_REPLAYED_PATH][()]:
        op = row["op"].decode() if isinstance(row["op"], bytes) else str(row["op"])
        reason = row["reason"].decode() if isinstance(row["reason"], bytes) else str(row["reason"])
        out[(op, int(row["seqid"]))] = reason
    return out
