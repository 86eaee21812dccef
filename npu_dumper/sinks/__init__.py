"""Hand-off from the model's thread to a dump writer (dumpfile.write).

The dispatch mode (npu_dumper.capture.mode) calls one protocol, `submit(OpJob)` / `close()` /
`failed` (protocol.py), implemented by:

- `thread.py`: `WriterThread`, background threads writing through an in-process DumpWriter:
  the queue and its back-pressure, the data thread that moves large tensors' bytes, and
  every fault (failed writes, a lost writer process, interrupts) in one place (`_fail`);
- `process.py`: `ProcessWriter`, the same pipeline whose last step sends op records to a
  writer child process (dumpfile.write.remote.RemoteDumpWriter);
- `stats.py`: `StatsWriterThread`, the same pipeline writing statistics rows;
- `plan.py`: `StoragePlan`, the one planning step all three run: what each captured
  tensor becomes (new data, a hard link, a view entry; statistics computed or repeated),
  with the dedup maps and their invalidation;
- `worker_threads.py`: the pooled threads these run on.
"""
