"""acl.json repair, measured side by side: the old regular-expression repair (kept here
only to measure it) against ir2tbe.acl_config.repair_json, one linear pass.

    python benchmarks/bench_acl_repair.py [--kb 4 8 16 32]

The hostile input is a value followed by N blank lines and no value after them (the
regex `\\s*\\n\\s*` backtracks over every split of the run: quadratic). Prints seconds of
each and their ratio per size; the old one is stopped past --max-old seconds.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from ir2tbe.acl_config import repair_json  # noqa: E402

_OLD_MISSING_COMMA = re.compile(r'(["\d\]}]|true|false|null)(\s*\n\s*)(?=["{\[\d-]|true|false|null)')


def old_repair(text: str) -> str:
    return _OLD_MISSING_COMMA.sub(r"\1,\2", text)


def hostile(kb: int) -> str:
    return '{"dump": {"dump_mode": "all"' + "\n" * (kb * 1024) + "}}"


def timed(fn, text: str) -> float:
    t0 = time.perf_counter()
    fn(text)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kb", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--max-old", type=float, default=60.0)
    a = ap.parse_args()
    print(f"{'size':>8} {'old regex s':>12} {'one pass s':>11} {'ratio':>8}")
    for kb in a.kb:
        text = hostile(kb)
        new = min(timed(repair_json, text) for _ in range(3))
        old = timed(old_repair, text)
        print(f"{kb:>6}KB {old:>12.3f} {new:>11.4f} {old / new:>7.0f}x", flush=True)
        if old > a.max_old:
            break
    text = hostile(2048)
    print(f"one pass on 2 MB of blank lines: {timed(repair_json, text):.3f} s")


if __name__ == "__main__":
    main()
