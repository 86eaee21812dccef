"""`accucmp compare -m RUN_B/ -g RUN_A/`: two runs of N ranks, every rank pair compared in
parallel on Dask distributed, one merged answer.

* Pairing (rank_files.py, `rank_key`, the one place the naming rule lives): a file's rank
  and step come from its root attributes, else from its name; files pair on (rank, step).
* Each pair is one Dask task (rank_tasks.pair_task: streaming.compare_to_csv on a worker): its rows go to a
  per-rank csv as they are judged, and the task returns only its summary (counts, first
  failure, worst ops), so neither the workers nor this process hold rows.
* Replica checks (rank_tasks.replica_task, one task per rank other than the lowest): tensors that the golden run
  holds bit-for-bit equal on rank r and on the lowest rank (DDP weights, reduced
  gradients) must be equal across those ranks of the target run too; tensors that are
  not are reported per rank, earliest first. Data-dependent tensors (activations of
  different micro-batches) differ in the golden run as well and so are not checked.
* Scheduling is Dask's: a LocalCluster of worker processes by default, or an existing
  cluster (`--scheduler tcp://host:port`, workers must see the dumps and the output
  folder at the same paths). Dask is imported only here, so comparing two files does
  not load it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from dumpfile.errors import DumpFormatError

from accucmp.compare.rank_files import RankPair, pair_folders
from accucmp.compare.rank_tasks import pair_task, replica_task


@dataclass
class RunsResult:
    pairs: list[dict[str, Any]]               # per rank pair: key, files, pair_task's dict
    unpaired: list[tuple[str, str]]
    replicas: list[dict[str, Any]]
    earliest: dict[str, Any] | None           # the earliest failing op over all ranks
    diverge_first: list[int]                  # ranks whose first failure is the earliest
    paths: list[Path]
    workers: int
    seconds: float
    plan: str | None = None                   # what is paired how (a run against one reference)

    @property
    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in self.pairs:
            for k, v in (p.get("counts") or {}).items():
                out[k] = out.get(k, 0) + v
        return out

    @property
    def errors(self) -> list[str]:
        return ([f"{p['target']}: {p['error']}" for p in self.pairs if p.get("error")]
                + [f"replica check {r['label']}: {r['error']}" for r in self.replicas if r.get("error")])

    @property
    def exit_code(self) -> int:
        """0 / 1 / 2, decided with the sentence (accucmp/report/folder.py: they always agree)."""
        from accucmp.report.folder import folder_verdict

        return folder_verdict(self)[0]

    @property
    def sentence(self) -> str:
        """The verdict sentence over all ranks: FAIL exactly when exit_code is not 0."""
        from accucmp.report.folder import folder_verdict

        return folder_verdict(self)[1]


def _failure_key(p: dict[str, Any]) -> tuple:
    ff = p.get("first_failure") or {}
    seq = ff.get("SeqId")
    return (-1 if p["step"] is None else p["step"], math.inf if seq is None else seq, p["rank"])


def _client(scheduler: str | None, workers: int, n_tasks: int):
    """A Dask client: to `scheduler`, or to a LocalCluster of worker processes (one
    thread each: HDF5 serialises reads within a process, so processes are the parallelism)."""
    from dask.distributed import Client, LocalCluster

    if scheduler:
        try:
            return Client(scheduler, timeout="30s"), None
        except (OSError, TimeoutError) as e:
            raise DumpFormatError(f"--scheduler {scheduler}: cannot connect ({' '.join(str(e).split())})") from e
    if workers <= 0:
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:
            cores = os.cpu_count() or 1
        workers = max(1, min(cores, n_tasks))
    cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                           dashboard_address=":0", silence_logs=logging.CRITICAL)
    return Client(cluster), cluster


def compare_runs(target_dir, golden_dir, out_dir, *, algorithms=None, select: str | None = None,
                 thresholds: Mapping[str, float] | None = None, chunk_elements: int = 1 << 22,
                 top: int = 5, scheduler: str | None = None, workers: int = 0,
                 replica_check: bool = True, golden_fp64=None, progress=None,
                 basename: str | None = None, exclude=()) -> RunsResult:
    """Pair the ranks of two run folders and compare every pair on Dask; the merged result.
    `progress`: an object with start(n_pairs), rows(n), pair_done() (the CLI's bar)."""
    from accucmp.report.outputs import _free_basename, _mkdir, timestamp
    from accucmp.compare.verdict import thresholds_with

    t_start = time.perf_counter()
    thresholds_with(thresholds)                 # bad thresholds fail before a cluster starts
    if golden_fp64 is not None:
        raise DumpFormatError("--golden-fp64 takes one file; it is not supported with folders")
    for d, role in ((target_dir, "target"), (golden_dir, "golden")):
        if not Path(d).is_dir():
            raise DumpFormatError(f"{d}: {role} folder does not exist")
    pairing = pair_folders(target_dir, golden_dir)
    from accucmp.compare.reference_runs import check_world_sizes

    check_world_sizes(pairing.pairs, target_dir, golden_dir)
    if not pairing.pairs:
        why = "; ".join(f"{p}: {r}" for p, r in pairing.unpaired[:3]) or "no .h5 files"
        raise DumpFormatError(f"{target_dir} and {golden_dir}: no rank pairs to compare ({why})")
    out_dir = _mkdir(Path(out_dir))
    base = basename or _free_basename(out_dir, f"result_{timestamp()}", suffix="_ranks.csv")
    exclude = tuple(exclude or ())
    options = dict(algorithms=algorithms, select=select, chunk_elements=chunk_elements,
                   thresholds=dict(thresholds) if thresholds else None, top=top, exclude=exclude)

    # replica checks: per step, each rank against the lowest rank present in both runs
    replica_specs = []
    if replica_check:
        by_step: dict[int, list[RankPair]] = {}
        for p in pairing.pairs:
            by_step.setdefault(p.key[1], []).append(p)
        for step, ps in sorted(by_step.items()):
            ps.sort(key=lambda p: p.key[0])
            ref = ps[0]
            for p in ps[1:]:
                replica_specs.append((ref, p))

    client, cluster = _client(scheduler, workers, len(pairing.pairs) + len(replica_specs))
    queue_name = f"accucmp-rows-{uuid.uuid4().hex}" if progress is not None else None
    try:
        n_workers = len(client.scheduler_info().get("workers", {})) or workers
        queue = None
        if queue_name:
            from distributed import Queue

            queue = Queue(queue_name, client=client)
            progress.start(len(pairing.pairs) + len(replica_specs))
        futures = {}
        for p in pairing.pairs:
            csv = out_dir / f"{base}_rank{p.key[0]}{'' if p.target.step is None else f'_step{p.target.step}'}.csv"
            fut = client.submit(pair_task, p.target.path, p.golden.path, str(csv), options, queue_name,
                                key=f"accucmp-pair-{p.key[0]}-{p.key[1]}-{uuid.uuid4().hex[:8]}", pure=False)
            futures[fut] = ("pair", p)
        for ref, p in replica_specs:
            fut = client.submit(replica_task, ref.golden.path, p.golden.path, ref.target.path, p.target.path,
                                chunk_elements=chunk_elements, select=select, exclude=exclude,
                                key=f"accucmp-replica-{p.key[0]}-{p.key[1]}-{uuid.uuid4().hex[:8]}", pure=False)
            futures[fut] = ("replica", (ref, p))
        pair_results, replicas = _gather(client, futures, progress, queue)
    finally:
        client.close()
        if cluster is not None:
            cluster.close()

    pair_results.sort(key=lambda r: (r["rank"], -1 if r["step"] is None else r["step"]))
    replicas.sort(key=lambda r: (-1 if r["step"] is None else r["step"], r["rank"]))
    failing = [r for r in pair_results if r.get("first_failure")]
    earliest, first_ranks = None, []
    if failing:
        best = min(failing, key=_failure_key)
        k = _failure_key(best)[:2]
        first_ranks = sorted(r["rank"] for r in failing if _failure_key(r)[:2] == k)
        earliest = dict(best["first_failure"], rank=best["rank"], step=best["step"])
    result = RunsResult(pair_results, pairing.unpaired, replicas, earliest, first_ranks, [],
                        n_workers, time.perf_counter() - t_start)
    result.paths = _write_merged(result, out_dir, base, target_dir, golden_dir)
    return result


def _gather(client, futures, progress, queue):
    """Results as tasks finish; the row counts workers send go to the progress bar meanwhile."""
    pair_results, replicas = [], []
    remaining = list(futures)
    while remaining:
        done = [f for f in remaining if f.done()]
        if not done:
            time.sleep(0.2)
        for fut in done:
            remaining.remove(fut)
            kind, what = futures[fut]
            res = fut.result()
            if kind == "pair":
                p = what
                pair_results.append(dict(res, rank=p.key[0], step=p.target.step, target=p.target.path,
                                         golden=p.golden.path, rank_from=p.target.source))
            else:
                ref, p = what
                replicas.append(dict(res, rank=p.key[0], ref_rank=ref.key[0], step=p.target.step,
                                     label=f"{p.label()} vs rank {ref.key[0]}"))
            if progress is not None:
                progress.pair_done()
        if queue is not None:
            _drain(queue, progress)
    return pair_results, replicas


def _drain(queue, progress) -> None:
    try:
        while queue.qsize():
            for n in queue.get(batch=True):
                progress.rows(int(n))
    except Exception:  # noqa: BLE001 - progress only
        pass


def _plain(v):
    """JSON-safe: NaN -> null, infinities -> "inf"/"-inf" (as outputs.to_json)."""
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return v


def _write_merged(r: RunsResult, out_dir: Path, base: str, target_dir, golden_dir) -> list[Path]:
    """{base}_ranks.csv (one row per rank pair) and {base}_summary.json (the merged answer)."""
    import csv

    from dumpfile.safe_output import open_output

    ranks_csv = out_dir / f"{base}_ranks.csv"
    cols = ["Rank", "Step", "Rows", "Pass", "Fail", "Unmatched", "Skipped", "FirstFailureOp",
            "FirstFailureSeqId", "FirstFailureTensor", "ReplicaChecked", "ReplicaDiffer", "Seconds",
            "Target", "Golden", "ResultCsv", "Error"]
    rep = {(x["rank"], x["step"]): x for x in r.replicas}
    with open_output(ranks_csv, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(cols)
        for p in r.pairs:
            c = p.get("counts") or {}
            ff = p.get("first_failure") or {}
            x = rep.get((p["rank"], p["step"]), {})
            w.writerow([p["rank"], "" if p["step"] is None else p["step"], p.get("rows", ""),
                        c.get("pass", 0), c.get("fail", 0), c.get("unmatched", 0), c.get("skipped", 0),
                        ff.get("NPUDump", ""), "" if ff.get("SeqId") is None else ff["SeqId"],
                        "/".join(x for x in (ff.get("IO") or "", ff.get("TensorName") or "") if x),
                        x.get("checked", ""), x.get("differ", ""), f"{p.get('seconds', 0):.2f}",
                        p["target"], p["golden"], p.get("csv", ""), p.get("error") or ""])
    summary = {
        "verdict": "PASS" if r.exit_code == 0 else "FAIL", "sentence": r.sentence, "exit_code": r.exit_code,
        "target": str(target_dir), "golden": str(golden_dir), "counts": r.counts,
        "earliest_failure": r.earliest, "diverge_first": r.diverge_first,
        "ranks": r.pairs, "replica_checks": r.replicas,
        "unpaired": [{"path": p, "reason": why} for p, why in r.unpaired],
        "workers": r.workers, "seconds": r.seconds,
    }
    js = out_dir / f"{base}_summary.json"
    with open_output(js, "w", encoding="utf-8") as fh:
        fh.write(json.dumps(_plain(summary), indent=1, default=str, allow_nan=False) + "\n")
    return [ranks_csv, js]


# ---- the command line's part -------------------------------------------------------------
class _Bar:
    """rich progress: tasks (rank pairs and replica checks) done, rows written."""

    def __init__(self, console):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.p = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                          TimeElapsedColumn(), console=console, transient=True)
        self.pairs = self.rows_id = None

    def start(self, n: int) -> None:
        self.p.start()
        self.pairs = self.p.add_task("rank pairs", total=n)
        self.rows_id = self.p.add_task("rows", total=None)

    def rows(self, n: int) -> None:
        self.p.advance(self.rows_id, n)

    def pair_done(self) -> None:
        self.p.advance(self.pairs, 1)

    def stop(self) -> None:
        self.p.stop()


def run_folder_compare(target_dir, golden_dir, out_dir, *, console, quiet: bool = False,
                       formats=("csv",), dump_failures: bool = False, compare=None, summary_json=None,
                       meta: dict | None = None, force: bool = False, **kw) -> int:
    """`accucmp compare` given two folders: compare, print the merged answer, write the
    asked outputs (`--format html`: one report over the ranks; `--summary-json`), exit code.
    `compare`: what makes the RunsResult (compare_runs; reference_runs.compare_with_reference
    for a folder against one single-process dump)."""
    from accucmp.report.summary import describe_row, fmt_value

    extra = [f for f in formats if f not in ("csv", "html")]
    if extra:
        raise DumpFormatError(f"--format {','.join(extra)}: folders write csv (per rank), html (one report over "
                              "the ranks) and a summary json")
    if dump_failures:
        raise DumpFormatError("-p/--dump-failures takes two files; with folders, run it on one rank's pair")
    bar = _Bar(console) if console.is_terminal and not quiet else None
    try:
        r = (compare or compare_runs)(target_dir, golden_dir, out_dir, progress=bar, **kw)
    finally:
        if bar is not None:
            bar.stop()
    counts = r.counts
    rows = sum(p.get("rows") or 0 for p in r.pairs)
    if not rows and not r.errors and (kw.get("select") or kw.get("exclude")):
        # nothing compared is not a pass (as for two files: bad input, one line)
        asked = " ".join(([f"--select {kw['select']!r}"] if kw.get("select") else [])
                         + [f"--exclude {x!r}" for x in kw.get("exclude") or ()])
        raise DumpFormatError(f"{target_dir}: no op is left by {asked} on any rank; nothing to compare")
    code = r.exit_code
    if "html" in formats:
        from accucmp.report.folder import write_folder_html

        r.paths.append(write_folder_html(r, Path(r.paths[0]).with_name(Path(r.paths[0]).name.replace(
            "_ranks.csv", ".html")), meta=meta, force=force))
    if not quiet:
        from rich.table import Table

        # the verdict sentence first, as for two files; the rank says where too
        head = r.sentence
        console.print(head, style="bold red" if head.startswith("FAIL") else "bold green", markup=False,
                      highlight=False, soft_wrap=not console.is_terminal)
        parts = [f"{len(r.pairs)} rank pair(s)", f"{rows} tensors"] + [
            f"{counts[k]} {k}" for k in ("pass", "fail", "unmatched", "skipped") if counts.get(k)]
        console.print("[bold]accucmp[/bold]: " + ", ".join(parts) + f" ({r.workers} Dask worker(s), "
                      f"{r.seconds:.1f} s)", soft_wrap=True)
        t = Table(title="per rank", title_justify="left")
        for c in ("Rank", "Step", "Rows", "Pass", "Fail", "Unmatched", "First failure", "Replicas"):
            t.add_column(c, overflow="fold")
        rep = {(x["rank"], x["step"]): x for x in r.replicas}
        for p in r.pairs:
            c = p.get("counts") or {}
            ff = p.get("first_failure")
            x = rep.get((p["rank"], p["step"]))
            rtext = "" if x is None or x.get("error") else (
                f"{x['differ']} of {x['checked']} differ" if x.get("golden_equal") else "nothing replicated")
            t.add_row(str(p["rank"]), "" if p["step"] is None else str(p["step"]),
                      str(p.get("rows", "")), str(c.get("pass", 0)), str(c.get("fail", 0)),
                      str(c.get("unmatched", 0)),
                      "error: " + p["error"] if p.get("error") else (describe_row(ff) if ff else ""), rtext)
        console.print(t)
        if r.earliest:
            e = r.earliest
            where = f"rank {e['rank']}" + ("" if e["step"] is None else f" step {e['step']}")
            console.print(f"[bold red]earliest failure[/bold red] over all ranks (step, then seqid): "
                          f"{where}: {describe_row(e)}", soft_wrap=True)
            if e.get("FailReason"):
                console.print(f"  why: {e['FailReason']}", soft_wrap=True, markup=False)
            console.print(f"  diverge first: rank(s) {', '.join(map(str, r.diverge_first))}", soft_wrap=True)
        elif code == 0:
            console.print("[green]every compared tensor passes on every rank[/green]")
        for x in r.replicas:
            if x.get("differ"):
                console.print(f"[bold red]replica check[/bold red] {x['label']}: {x['differ']} of {x['checked']} "
                              "tensor(s) the golden run holds equal across these ranks differ in the target run",
                              soft_wrap=True)
                for f in x.get("first") or []:
                    console.print(f"  {describe_row(f)} MaxAbsoluteError={fmt_value(f.get('MaxAbsoluteError'))}",
                                  soft_wrap=True, markup=False)
        for path, why in r.unpaired:
            console.print(f"  unpaired: {path}: {why}", soft_wrap=True, markup=False, highlight=False)
    for e in r.errors:
        print(f"accucmp: error: {' '.join(e.split())}", file=sys.stderr)
    for p in r.paths:
        console.print(f"wrote {p}", highlight=False, soft_wrap=True)
    console.print(f"wrote {len([p for p in r.pairs if p.get('csv')])} per-rank result csv(s) to {Path(out_dir)}",
                  highlight=False, soft_wrap=True)
    if summary_json is not None:
        from accucmp.report.folder import folder_summary_record
        from accucmp.report.outputs import write_summary_json

        rec = folder_summary_record(r, meta=dict(meta or {}, target=str(target_dir), golden=str(golden_dir)),
                                    outputs=r.paths + [p["csv"] for p in r.pairs if p.get("csv")],
                                    top=kw.get("top", 5))
        console.print(f"wrote {write_summary_json(Path(summary_json), rec, force=force)}", highlight=False,
                      soft_wrap=True)
    return code
