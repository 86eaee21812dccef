"""The one writer core of the dump format (torch-free).

- `writer.py`: `DumpWriter`, the in-process HDF5 writer of full dumps (op groups, hard
  links for repeated data, view entries, the index and catalog, flushes that keep the file
  openable after a kill); `h5objects.py` the HDF5 objects it makes (datasets and
  attributes through h5py's low-level API, disk-space claims, metadata-cache setting);
- `remote.py`: `RemoteDumpWriter`, the same DumpWriter run in a child process behind a
  socket (its own GIL), with the watchdog that turns a silent child into an error;
- `stats.py`: `StatsDumpWriter`, statistics-only dumps as table rows (dumpfile.stats_table).

What each tensor becomes (new data, a link to earlier data, a view entry, a statistics
row) is decided on the torch side (npu_dumper.sinks), which hands these writers the result.
"""
