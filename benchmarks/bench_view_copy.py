"""Byte cost of keeping `h5copy -s /op/seqid/` of one op group self-contained.

Format 1.5: a view (Type 40) whose base lives in another op's group names a hard link to
that base in its own op group (`/{op}/{seqid}/_base|...`, dumpfile.write.writer._local_base), so
h5copy of the group carries the base. For each sample model (one training step), dumps
it side by side with the links (default) and without (the 1.4 behaviour: `base` names
the other group), writer="thread" so the switch applies in this process; prints file
sizes, the ratio and the number of cross-group views.

    python benchmarks/bench_view_copy.py [--sizes tiny,full]

Measured alternative (not kept): storing such views' values in their own group cost
+39% (mlp full) to +101% (transformer full) in bytes.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import sample_models
from dumpfile.write.writer import DumpWriter
from npu_dumper import dumper

_LOCAL = DumpWriter._local_base


def dump_size(spec, size: str, path: str, links: bool) -> tuple[int, int]:
    DumpWriter._local_base = _LOCAL if links else (lambda self, parent, base_path: base_path)
    try:
        model, inputs = spec.build(seed=0, size=size), spec.make_inputs(seed=0, size=size)
        with dumper(dump_path=path, writer="thread") as d:
            spec.train_step(model, inputs)
    finally:
        DumpWriter._local_base = _LOCAL
    return os.path.getsize(path), d.summary.get("views", 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="tiny,full")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        print(f"{'model':<12} {'size':<5} {'no links':>12} {'base links':>13} {'ratio':>7} {'views':>6}")
        for size in args.sizes.split(","):
            for name in sample_models.names():
                spec = sample_models.get(name)
                if size not in spec.sizes:
                    continue
                p = os.path.join(tmp, f"{name}.h5")
                plain, _ = dump_size(spec, size, p, False)
                linked, nv = dump_size(spec, size, p, True)
                print(f"{name:<12} {size:<5} {plain:>12,d} {linked:>13,d} {linked / plain:>7.4f} {nv:>6d}")


if __name__ == "__main__":
    main()
