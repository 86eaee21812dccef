"""`accucmp bisect`: the smallest set of ops or module subtrees whose upcast fixes the loss.

Protocol with the user's script (docs/WHATIF.md), kept tiny on purpose:
  - the tool sets NPU_DUMPER_UPCAST to a JSON object {"ops": [...], "modules": [...],
    "dtype": "float32"}; the script wraps its step in `npu_dumper.upcast_from_env()`;
  - the script prints `loss=<float>`; the LAST such line of its stdout is the loss (the
    first number after `loss=` on it: `step 3 loss=2.31074309  (1.11s)` reads 2.31074309);
  - a non-zero exit, or no `loss=` line, is a failed run: bisect stops with one line naming
    the command, the upcast set and the script's last stderr line.

Search (adaptive group testing, as delta debugging does for a monotone test): with every
suspect upcast the loss must be within tolerance (else nothing to find). A set S known to
suffice together with the already-kept set F is split in halves A, B; if F+A suffices recurse
into A, else if F+B suffices recurse into B, else both halves hold a needed suspect: find the
needed part of A with B kept, then that of B with it. One culprit among n takes about
2*log2(n) runs instead of n. Runs are cached by their suspect set (in memory and in
DIR/bisect_cache.json, keyed by command and set), so a rerun after an interruption is cheap.

Never imports torch: the script runs in subprocesses.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

ENV_VAR = "NPU_DUMPER_UPCAST"   # npu_dumper.upcast.ENV_VAR (not imported: that module needs torch)
# `loss=` and the first number after it, anywhere on a line (a log line often carries a
# step count before it and a time after it)
_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?|[-+]?(?:inf|nan)\b"
LOSS_ON_LINE = re.compile(r"\bloss\s*=\s*(" + _NUMBER + ")", re.IGNORECASE)


class BisectError(Exception):
    """The script failed, printed no loss, or the suspects cannot explain the difference."""


@dataclass
class Suspect:
    kind: str    # "op" or "module"
    name: str

    def __str__(self) -> str:
        return f"{self.kind} {self.name}"


@dataclass
class BisectResult:
    culprits: list[Suspect]
    golden: float
    baseline: float          # loss with nothing upcast
    fixed: float             # loss with the culprits upcast
    runs: int                # script runs actually made (cache hits excluded)
    evaluations: int         # set evaluations (cache hits included)
    suspects: int
    log: list[str] = field(default_factory=list)


def find_loss(text: str) -> tuple[float, int, str] | None:
    """The loss of `text`: the first number after `loss=` on the last line that has one,
    with that line's number (1-based) and text; None when no line has one."""
    for n, line in reversed(list(enumerate(text.splitlines(), 1))):
        m = LOSS_ON_LINE.search(line)
        if m is not None:
            return float(m.group(1)), n, line.strip()
    return None


def parse_loss(stdout: str) -> float | None:
    found = find_loss(stdout)
    return None if found is None else found[0]


def read_golden(value: str, say: Callable[[str], None] | None = None) -> float:
    """--golden-loss: a number, or a file whose last `loss=` line (or sole number) is it;
    `say` is told which line of the file was read."""
    try:
        return float(value)
    except ValueError:
        pass
    p = Path(value)
    if not p.is_file():
        raise BisectError(f"--golden-loss {value!r}: neither a number nor a file")
    text = p.read_text(errors="replace")
    found = find_loss(text)
    if found is None:
        try:
            loss = float(text.strip())
        except ValueError:
            raise BisectError(f"{p}: no line with 'loss=<number>' and not a number") from None
        where = "its only content"
    else:
        loss, n, line = found
        where = f"line {n}: {line[:120]}"
    if say is not None:
        say(f"golden loss {loss:.9g} read from {p} ({where})")
    return loss


def suspects_from_compare(csv_path: str | os.PathLike, by: str = "op") -> list[Suspect]:
    """The failing ops (or their modules) of a compare result csv, in first-failure order."""
    with open(csv_path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    if rows and ("Result" not in rows[0] or "NPUDump" not in rows[0]):
        raise BisectError(f"{csv_path}: not a compare result csv (no Result/NPUDump columns)")
    out: dict[str, None] = {}
    for r in rows:
        if r.get("Result") != "fail":
            continue
        name = r["NPUDump"] if by == "op" else (r.get("Module") or "")
        if name:
            out.setdefault(name)
    if not out:
        raise BisectError(f"{csv_path}: no failing {'op' if by == 'op' else 'module'} to bisect")
    return [Suspect(by, n) for n in out]


def spec_for(suspects: Sequence[Suspect], dtype: str) -> str:
    return json.dumps({"ops": sorted(s.name for s in suspects if s.kind == "op"),
                       "modules": sorted(s.name for s in suspects if s.kind == "module"),
                       "dtype": dtype}, sort_keys=True)


def _names(suspects: Sequence[Suspect], most: int = 4) -> str:
    if not suspects:
        return ""
    names = [s.name for s in suspects[:most]]
    return " (" + ", ".join(names) + (", ..." if len(suspects) > most else "") + ")"


class ScriptRunner:
    """Runs the command with NPU_DUMPER_UPCAST set; caches the loss per upcast set."""

    def __init__(self, command: str, dtype: str = "float32", cache_path: Path | None = None,
                 timeout: float | None = None, progress: Callable[[str], None] | None = None):
        self.command = command
        self.dtype = dtype
        self.cache_path = cache_path
        self.timeout = timeout
        self.progress = progress or (lambda s: None)
        self.runs = 0
        self.evaluations = 0
        self.cache: dict[str, float] = {}
        if cache_path is not None and cache_path.is_file():
            try:
                self.cache = json.loads(cache_path.read_text()).get(command, {})
            except (json.JSONDecodeError, AttributeError):
                self.cache = {}

    def loss(self, suspects: Sequence[Suspect]) -> float:
        spec = spec_for(suspects, self.dtype)
        self.evaluations += 1
        if spec in self.cache:
            self.progress(f"  (cached) upcast {len(suspects)} suspect(s){_names(suspects)}: loss={self.cache[spec]:.9g}")
            return self.cache[spec]
        env = dict(os.environ, **{ENV_VAR: spec if suspects else ""})
        try:
            p = subprocess.run(self.command, shell=True, env=env, capture_output=True, text=True,
                               timeout=self.timeout)
        except subprocess.TimeoutExpired:
            raise BisectError(f"run {self.command!r} with {ENV_VAR}={spec} timed out after {self.timeout}s") from None
        self.runs += 1
        last_err = next((ln for ln in reversed(p.stderr.splitlines()) if ln.strip()), "")
        if p.returncode != 0:
            raise BisectError(f"run {self.command!r} with {ENV_VAR}={spec} failed with exit code "
                              f"{p.returncode}: {last_err or '(no stderr)'}")
        loss = parse_loss(p.stdout)
        if loss is None:
            raise BisectError(f"run {self.command!r} printed no 'loss=<float>' line "
                              f"(with {ENV_VAR}={spec})")
        self.progress(f"  run {self.runs}: upcast {len(suspects)} suspect(s){_names(suspects)}: loss={loss:.9g}")
        self.cache[spec] = loss
        self._save()
        return loss

    def _save(self) -> None:
        if self.cache_path is None:
            return
        try:
            data = json.loads(self.cache_path.read_text()) if self.cache_path.is_file() else {}
        except json.JSONDecodeError:
            data = {}
        data[self.command] = self.cache
        self.cache_path.parent.mkdir(parents=True, exist_ok=True)
        self.cache_path.write_text(json.dumps(data, indent=1, sort_keys=True))


def within(loss: float, golden: float, rtol: float, atol: float) -> bool:
    return math.isfinite(loss) and abs(loss - golden) <= atol + rtol * abs(golden)


def bisect(runner: ScriptRunner, suspects: list[Suspect], golden: float, rtol: float = 1e-3,
           atol: float = 0.0, progress: Callable[[str], None] | None = None) -> BisectResult:
    say = progress or (lambda s: None)
    if not suspects:
        raise BisectError("no suspects to bisect")

    def ok(s: Sequence[Suspect]) -> bool:
        return within(runner.loss(list(s)), golden, rtol, atol)

    say(f"golden loss {golden:.9g}, tolerance {atol:g} + {rtol:g}*|golden|; {len(suspects)} suspect(s)")
    baseline = runner.loss([])
    if within(baseline, golden, rtol, atol):
        say("the loss is already within tolerance with nothing upcast")
        return BisectResult([], golden, baseline, baseline, runner.runs, runner.evaluations, len(suspects))
    if not ok(suspects):
        raise BisectError(f"upcasting all {len(suspects)} suspect(s) gives loss {runner.loss(suspects):.9g}, "
                          f"still outside tolerance of golden {golden:.9g}: the cause is not among them")

    def find(cands: list[Suspect], kept: list[Suspect]) -> list[Suspect]:
        if len(cands) == 1:
            return cands
        half = len(cands) // 2
        a, b = cands[:half], cands[half:]
        if ok(kept + a):
            return find(a, kept)
        if ok(kept + b):
            return find(b, kept)
        need_a = find(a, kept + b)
        return need_a + find(b, kept + need_a)

    culprits = find(list(suspects), [])
    fixed = runner.loss(culprits)
    return BisectResult(culprits, golden, baseline, fixed, runner.runs, runner.evaluations, len(suspects))


def split_names(values: Sequence[str] | None) -> list[str]:
    return [n.strip() for v in (values or []) for n in v.split(",") if n.strip()]


def command_line(cmd: str) -> str:
    """The --run text as given; a bare script path runs with this Python."""
    if cmd.endswith(".py") and " " not in cmd.strip():
        return f"{shlex.quote(sys.executable)} {shlex.quote(cmd)}"
    return cmd
