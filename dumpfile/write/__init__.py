"""The one writer core of the dump format (torch-free).

- `writer.py`: `DumpWriter`, the in-process HDF5 writer of full dumps (op groups, hard
  links for repeated data, view entries, the index); its concerns around it:
  `catalog.py` (the catalog rows next to the index), `durability.py` (its base class:
  flushes that keep the file openable after a kill, disk space claimed before a flush,
  a failed write freezing the file at its last flush, the close), `h5objects.py` (the
  HDF5 objects it makes: datasets and attributes through h5py's low-level API,
  disk-space claims, metadata-cache setting);
- `remote.py`: `RemoteDumpWriter`, the caller's end of the same DumpWriter run in a child
  process behind a socket (its own GIL), the protocol and the watchdog that turns a
  silent child into an error; `remote_child.py` the child's serving loop;
- `stats.py`: `StatsDumpWriter`, statistics-only dumps as table rows (dumpfile.stats_table).

What each tensor becomes (new data, a link to earlier data, a view entry, a statistics
row) is decided on the torch side, once for every writer (npu_dumper.sinks.plan), which
hands these writers the result.
"""
