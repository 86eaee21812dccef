"""Where a contiguous dataset's bytes lie, from its object header read with one `pread`:
the per-tensor offset check of a compare (dumpfile.read.catalog) without opening the dataset.

Opening a dataset through HDF5 (H5Oopen: type, space, layout, fill value, filters, its
chunk cache) costs ~55-95 us on the 2-core VM when its metadata is not cached yet, as in
a compare that visits each dataset once; the name's link lookup alone ~15 us. The
storage place is the header's layout message: read here from the header the name links
to now, so a name whose dataset was deleted and written again (its old bytes left at the
old offset) gives the new dataset's place, as HDF5 would.

Only what this reader can be sure of is answered: version-1 object headers (h5py's
default, libver "earliest") with the layout message (version 3 or 4) in the header's
first block, 8-byte addresses and lengths, no user block. Anything else gives None, and
the caller asks HDF5 (dumpfile.h5direct.stored_at). Format: the HDF5 File Format
Specification, "Version 1 Data Object Header Prefix" and "The Data Layout Message".
"""

from __future__ import annotations

import os
import struct

_PREFIX = struct.Struct("<BBHII")       # version, reserved, messages, reference count, header size
_MESSAGE = struct.Struct("<HHB3x")     # type, size, flags
_PLACE = struct.Struct("<QQ")           # contiguous: address, size
_LAYOUT = 0x0008                       # (a header holds one; continuations skipped)
_CONTIGUOUS = 1
_UNDEFINED = (1 << 64) - 1
_SHARED = 0x02
_FIRST_READ = 512
_MAX_HEADER = 1 << 16


def contiguous_place(fd: int, header_address: int) -> tuple[int, int] | None:
    """(file offset, size in bytes) of the contiguous dataset whose object header is at
    `header_address` (a hard link's address); None when this reader cannot tell (another
    header version or layout, a layout message not in the first block, a short read)."""
    try:
        b = os.pread(fd, _FIRST_READ, header_address)
        if len(b) < 16:
            return None
        version, _, n_messages, _, size = _PREFIX.unpack_from(b, 0)
        if version != 1 or size > _MAX_HEADER:
            return None
        end = 16 + size                     # (the 12-byte prefix is padded to 8 bytes)
        if end > len(b):
            b = os.pread(fd, end, header_address)
            if len(b) < end:
                return None
    except (OSError, OverflowError, ValueError):
        return None
    p = 16
    for _ in range(n_messages):
        if p + 8 > end:
            return None
        kind, length, flags = _MESSAGE.unpack_from(b, p)
        data = p + 8
        if data + length > end:
            return None
        if kind == _LAYOUT:
            if flags & _SHARED or length < 18 or b[data] not in (3, 4) or b[data + 1] != _CONTIGUOUS:
                return None
            address, nbytes = _PLACE.unpack_from(b, data + 2)
            return None if address == _UNDEFINED else (address, nbytes)   # (no storage yet)
        p = data + length
    return None                             # (not in the first block: the rest is elsewhere)
