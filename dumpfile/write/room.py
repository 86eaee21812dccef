"""Room in the file for table rows, claimed before HDF5 writes them (statistics dumps).

A statistics dump writes rows into tables (the statistics table, op attributes, the
index) in batches of ~1,024 rows; HDF5 allocates their chunks and the global heap that
holds their strings and shapes as it writes them and at the next flush. Near a file-size
limit or a full disk, a batch that did not fit failed inside HDF5, the file froze at its
last flush and kept 0 ops when that came before the first flush (a 256 KB limit: 0 of the
~240 ops whose rows fit; issue 32). So when the room left is tight (TIGHT_ROOM), the
space a batch needs is claimed first (h5objects.claim_blocks: fallocate, no data
written), and when it is not there, the longest run of whole ops whose rows fit is
claimed and written, the rest dropped, and the writer stops with the claim's error: the
last flush then lists every op written (DurableFile.fail, a claim-only failure).

`rows_bytes(rows, dtype)` bounds what rows cost in the file: each row as stored, plus
each variable-length cell (string, shape) as a global heap object: a 16-byte header and
its bytes rounded up to 8. A new chunk is counted whole (HDF5 allocates chunks whole).
"""

from __future__ import annotations

import os
import resource

import numpy as np

from .h5objects import _types, stored_row_bytes, table_chunk_rows

# Room left (file-size limit, free disk) below which each batch claims its space first:
# a batch of 1,024 rows costs ~0.3 MB; more room than this and no batch can reach the end
TIGHT_ROOM = 256 << 20
# global heap: an object's header, and the collections a batch may begin (4 KiB each at
# least, some of it unused)
HEAP_OBJECT_HEADER = 16
HEAP_SLACK = 4 << 10
# what HDF5 allocates besides, for the rows' estimate: heap collections left partly used,
# chunk index nodes (measured: a file's end grew ~1.2x the estimate over the first ops)
ESTIMATE_FACTOR = 1.3

_VLEN_FIELDS: dict[np.dtype, tuple[int, ...]] = {}


def room_left(fd: int) -> int | None:
    """Bytes this file may still grow by: under the file-size limit and on the disk
    (None: not known)."""
    try:
        size = os.fstat(fd).st_size
        st = os.fstatvfs(fd)
    except OSError:
        return None
    room = st.f_bavail * st.f_frsize
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        room = min(room, max(0, limit - size))
    return room


def _vlen_fields(dtype: np.dtype) -> tuple[int, ...]:
    found = _VLEN_FIELDS.get(dtype)
    if found is None:
        found = _VLEN_FIELDS[dtype] = tuple(i for i, n in enumerate(dtype.names) if dtype[n] == object)
    return found


def _cell_bytes(v) -> int:
    if isinstance(v, str):
        n = len(v) if v.isascii() else len(v.encode("utf-8", "surrogateescape"))
    elif isinstance(v, bytes):
        n = len(v)
    elif isinstance(v, np.ndarray):
        n = v.nbytes
    elif isinstance(v, (list, tuple)):
        n = 8 * len(v)
    else:
        n = 8
    return HEAP_OBJECT_HEADER + ((n + 7) & ~7)


def heap_bytes_per_row(rows: list[tuple], dtype: np.dtype) -> list[int]:
    """Each row's variable-length cells as global heap objects."""
    fields = _vlen_fields(dtype)
    return [sum(_cell_bytes(r[i]) for i in fields) for r in rows]


def chunk_growth(ds, dtype: np.dtype, new_rows: int) -> int:
    """Bytes of the chunks a table begins when `new_rows` rows are appended to it (`ds`
    None: a table not made yet)."""
    if new_rows <= 0:
        return 0
    if ds is None:
        n, per, row = 0, table_chunk_rows(stored_row_bytes(_types(dtype)[0])), stored_row_bytes(_types(dtype)[0])
    else:
        n, per, row = ds.shape[0], ds.chunks[0], stored_row_bytes(ds.id.get_type())
    return (-(-(n + new_rows) // per) - -(-n // per)) * per * row
