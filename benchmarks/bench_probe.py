"""What the metadata probe costs (dumpfile/read/probe.py, issue 32): `npu_dumper.load` and
load-replay read a file's metadata in a watched child first.

    python benchmarks/bench_probe.py [--ops 15,1800,18000] [--repeat 3]

For dumps of N ops (tests/_cli_helpers.write_dump: an MLP step's mm/add/relu ops), side by
side in one run, each repeat alternating: the entry's own metadata reads in this process
(probe.read_metadata: open and check, index, catalog rows, every op's recorded inputs for
replay) without the probe, and the same preceded by the probe (its child's start, its reads,
the check it spares this process). Prints CPU seconds (this process and its children,
median; wall times on a shared machine say little) and the ratio. The file is in the
page cache (read once before). A file of 64 MiB or more is checked in a child without the
probe too (dumpfile.read.safety): the probe's child does that check instead.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", default="15,1800,18000", help="op counts of the dumps")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    from dumpfile.read import probe, safety
    from tests._cli_helpers import model_ops, write_dump

    os.environ.setdefault("ACCUCMP_STALL_SECONDS", "300")
    work = tempfile.mkdtemp(prefix="bench_probe_")
    print(f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    for n in (int(v) for v in a.ops.split(",")):
        layers = max(1, round(n / 6))
        path = write_dump(os.path.join(work, f"d{n}.h5"), model_ops(n_layers=layers))
        size = os.path.getsize(path)
        probe.read_metadata(path, probe.REPLAY)       # (page cache)
        for purpose in (probe.LOAD, probe.REPLAY):
            plain, probed, child = [], [], []
            for _ in range(a.repeat):
                safety._CHECKED.clear()
                c = _cpu()
                probe.read_metadata(path, purpose)
                d = _cpu()
                plain.append(d[0] - c[0] + d[1] - c[1])
                safety._CHECKED.clear()
                probe._PROBED.clear()
                c = _cpu()
                probe.probe(path, purpose)
                probe.read_metadata(path, purpose)
                d = _cpu()
                probed.append(d[0] - c[0] + d[1] - c[1])
                child.append(d[1] - c[1])
            p, q = statistics.median(plain), statistics.median(probed)
            print(f"{6 * layers:6d} ops ({size / 1e6:6.1f} MB) {purpose:6s}: entry's reads {p:6.2f} s CPU, "
                  f"with the probe {q:6.2f} s ({q / p:4.1f}x; the child {statistics.median(child):5.2f} s)")


def _cpu() -> tuple[float, float]:
    """CPU seconds of this process and of its waited-for children (a shared machine's
    wall times say little)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


if __name__ == "__main__":
    main()
