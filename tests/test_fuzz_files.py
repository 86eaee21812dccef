"""The seeded subset of the file fuzzer (benchmarks/fuzz_files.py, issue 32): real dumps of
every kind mutated (bytes and HDF5 objects), every command and API run on them in a child
under an address-space limit. None may end in an internal error, a traceback, a hang, a
multi-line refusal, a kill, or a compare that passes where the unmutated pair fails.
The per-pair time limit is only a hang guard (600 s); ~60 pairs, ~1-2 minutes of CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAIRS = 60
SEED = 32


def test_the_seeded_fuzz_subset_finds_nothing(tmp_path):
    out_json = tmp_path / "fuzz.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "fuzz_files.py"), "--pairs", str(PAIRS),
                        "--seed", str(SEED), "--timeout", "600", "--keep", str(tmp_path / "work"),
                        "--json", str(out_json)], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=ROOT), timeout=3 * 3600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out_json.read_text())
    assert res["pairs"] == PAIRS
    bad = {k: v for k, v in res["counts"].items()
           if k in ("exit3", "traceback", "hang", "changed_verdict", "refusal_multiline", "killed")}
    assert not bad, (bad, {k: v[:5] for k, v in res["examples"].items()})
    # the mutants reached the commands: some were refused, some read as they are
    assert res["counts"].get("refusal", 0) > 0 and res["counts"].get("ok", 0) > 0, res["counts"]
