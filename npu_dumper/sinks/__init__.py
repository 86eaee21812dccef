"""Hand-off from the model's thread to a dump writer (dumpfile.write).

The dispatch mode (npu_dumper.mode) calls one protocol, `submit(OpJob)` / `close()` /
`failed`, implemented by:

- `thread.py`: `WriterThread`, a background thread writing through an in-process DumpWriter;
  it owns the one dedup step (which capture is new data, a link, a view) and the faults
  (failed writes, interrupts, the flush bound);
- `process.py`: `ProcessWriter`, the same thread feeding a writer child process
  (dumpfile.write.remote.RemoteDumpWriter);
- `stats.py`: `StatsWriterThread`, statistics-only dumps (table rows, no tensor data);
- `worker_threads.py`: the pooled threads these run on.
"""
