"""What the hostile-file check costs at open (dumpfile.read.safety), side by side in one run.

    python benchmarks/bench_safety.py [--ops 50000] [--keep DIR]

Writes (once, reused with --keep) a full dump of N small ops (bench_ls.write_full: 4
datasets and 3 groups per op), then, each in a fresh process, warm:
1. the whole-file walk (check_file) in this process vs in a child process
   (ACCUCMP_SAFETY_CHILD_BYTES=0 / a huge value): seconds, and the resident memory the
   caller keeps after it (VmRSS after the check minus before; the child's is given back);
2. the listing check (check_listing: the op groups' level and the metadata datasets, what
   `accucmp ls` from the catalog reads) vs the whole walk: seconds, ratio;
3. `accucmp ls --plain` as a process (what users wait for; goal < 1 s for 50k ops).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

_CHILD = """
import json, os, sys, time
sys.path.insert(0, %(root)r)
import h5py
from dumpfile.read import safety
def rss():
    for ln in open("/proc/self/status"):
        if ln.startswith("VmRSS:"):
            return int(ln.split()[1]) / 1024
path, how = sys.argv[1], sys.argv[2]
h5 = h5py.File(path, "r")
before = rss()
t0 = time.perf_counter()
if how == "listing":
    assert safety.check_listing(h5, path)
else:
    safety.check_file(h5, path)
print(json.dumps({"seconds": time.perf_counter() - t0, "kept_mb": rss() - before}))
"""


def run(path: str, how: str, child_bytes: str) -> dict:
    env = dict(os.environ, ACCUCMP_SAFETY_CHILD_BYTES=child_bytes)
    p = subprocess.run([sys.executable, "-c", _CHILD % {"root": ROOT}, path, how], capture_output=True,
                       text=True, env=env)
    if p.returncode:
        raise SystemExit(f"child failed: {p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", type=int, default=50000)
    ap.add_argument("--keep", help="directory to keep (and reuse) the dump in")
    a = ap.parse_args()
    d = a.keep or tempfile.mkdtemp(prefix="bench_safety_")
    os.makedirs(d, exist_ok=True)
    try:
        import bench_ls
        path = os.path.join(d, f"full_{a.ops}.h5")
        if not os.path.exists(path):
            bench_ls.write_full(path, a.ops, 0)
        size = os.path.getsize(path)
        print(f"{a.ops} ops, {size / 1e6:.0f} MB; machine: {os.cpu_count()} cores, "
              f"load average {os.getloadavg()[0]:.2f}")
        here = run(path, "full", str(1 << 62))
        child = run(path, "full", "0")
        listing = run(path, "listing", "0")
        print(f"  whole walk in this process: {here['seconds']:.2f} s, keeps {here['kept_mb']:.0f} MB resident")
        print(f"  whole walk in a child:      {child['seconds']:.2f} s, keeps {child['kept_mb']:.0f} MB resident "
              f"(time {child['seconds'] / here['seconds']:.2f}x of in-process)")
        print(f"  listing check:              {listing['seconds']:.2f} s "
              f"({here['seconds'] / listing['seconds']:.0f}x less than the whole walk)")
        cmd = [sys.executable, "-m", "accucmp.cli", "ls", "--plain", path]
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        subprocess.run(cmd, capture_output=True, env=env)            # warm
        t0 = time.perf_counter()
        subprocess.run(cmd, capture_output=True, env=env, check=True)
        print(f"  accucmp ls --plain as a process: {time.perf_counter() - t0:.2f} s (goal < 1 s at 50k ops); "
              f"load average now {os.getloadavg()[0]:.2f}")
    finally:
        if not a.keep:
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
