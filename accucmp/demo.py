"""`accucmp demo`: the whole workflow on a sample model, on a machine with no NPU and no GPU.

1. golden: one training step of a sample model on CPU in float32, dumped.
2. target: the same step replayed from the golden dump (load mode: every op gets the
   golden inputs) under emulated Ascend numerics (npu_dumper.replay.emulation.emulate_npu:
   cube ops in float16) and, unless turned off, one planted fault (inject_fault: a
   non-cube op made 5% wrong, as a buggy device kernel would be).
3. compare + verdict: one row per tensor; float16-level differences of the emulated
   cube ops pass (the dump says they computed in float16), the planted fault fails.
4. reports: the terminal summary, result_*.csv and result_*.html.
5. IR to kernels: the first failing op (else the op with the largest error) is cut
   out of the target dump and mapped to its kernels with ir2tbe, writing CANN-layout
   kernel dumps, on the same emulated "device".

Everything here is a plain function; accucmp/cli/demo.py is the thin command.
torch is imported inside the functions (the `accucmp` CLI must start without it).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accucmp.demo_fault import FAULT_AUTO, DemoError, FaultSite, resolve_fault

DEFAULT_MODEL = "mlp"
DEFAULT_SIZE = "full"

GOLDEN_NAME = "golden_cpu_fp32.h5"
TARGET_NAME = "target_npu_emulated.h5"
WORST_OP_NAME = "worst_op.h5"
KERNELS_DIR = "kernels"


@dataclass
class DemoResult:
    model: str
    size: str
    out_dir: Path
    golden: Path
    target: Path
    fault: FaultSite | None
    table: Any = None                               # the judged comparison (pandas)
    reports: list[Path] = field(default_factory=list)
    first_failure: dict | None = None
    mapped_op: tuple[str, int] | None = None
    kernel_summary: str = ""
    kernel_map: Path | None = None
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def fault_found(self) -> bool | None:
        """Whether the first failing op is the planted one (None without a fault)."""
        if self.fault is None:
            return None
        ff = self.first_failure
        return bool(ff) and ff.get("NPUDump") == self.fault.op and (
            self.fault.seqid is None or int(ff.get("SeqId")) == self.fault.seqid)

    @property
    def only_underflow(self) -> bool:
        """Every failing op is a float16 cube op at float16's underflow edge: what emulated
        float16 without loss scaling really does to tiny gradients (see underflowing_cube_ops)."""
        failing = failing_ops(self.table)
        return bool(failing) and failing <= set(underflowing_cube_ops(self.table))

    @property
    def ok(self) -> bool:
        """The demo showed what it should: the planted fault first, or, without one, no
        failure other than float16 underflow (expected: the demo does no loss scaling)."""
        if self.fault is None:
            return self.first_failure is None or self.only_underflow
        return bool(self.fault_found)


# ---- the steps --------------------------------------------------------------------

def dump_golden(spec, size: str, seed: int, path: Path) -> int:
    """One step on CPU float32, dumped. Returns the number of ops recorded."""
    from npu_dumper import dumper

    model, inputs = spec.build(seed=seed, size=size), spec.make_inputs(seed=seed, size=size)
    with dumper(dump_path=str(path)) as d:
        spec.train_step(model, inputs)
    return d.num_ops


def replay_on_emulated_npu(spec, size: str, seed: int, golden: Path, path: Path,
                           fault: FaultSite | None, saturate: bool = False) -> int:
    """The same step replayed from `golden` with NPU numerics (and the fault) below the dumper."""
    from npu_dumper import dumper
    from npu_dumper.replay.emulation import emulate_npu, inject_fault

    model, inputs = spec.build(seed=seed, size=size), spec.make_inputs(seed=seed, size=size)
    with contextlib.ExitStack() as device:
        device.enter_context(emulate_npu(saturate=saturate))
        if fault is not None:
            device.enter_context(inject_fault(fault.op, rel=fault.rel, call=fault.call))
        with dumper(use_load=True, load_file_path=str(golden), dump_path=str(path)) as d:
            spec.train_step(model, inputs)
    return d.num_ops


def compare_and_report(target: Path, golden: Path, out_dir: Path, formats=("csv", "html")):
    """compare + verdict + reports; returns (judged table, report paths, meta)."""
    from accucmp.compare.pipeline import compare_dumps
    from accucmp.report.outputs import write_results
    from accucmp.compare.verdict import apply_verdict

    result = compare_dumps(str(target), str(golden))
    table = apply_verdict(result.table)
    meta = dict(getattr(result, "meta", {}) or {})
    meta.setdefault("target", str(target))
    meta.setdefault("golden", str(golden))
    if "html" in formats:
        from accucmp.report.html import run_info

        meta["runs"] = {"target": run_info(target), "golden": run_info(golden)}
    paths = write_results(table, out_dir, list(formats), meta=meta)
    return table, paths, meta


def op_to_map(table) -> tuple[str, int] | None:
    """The first failing op, else the op with the largest Severity; None for an empty table."""
    import pandas as pd

    from accucmp.report.findings import first_failure

    row = first_failure(table)
    if row is None:
        if table.empty or "Severity" not in table.columns:
            return None
        sev = pd.to_numeric(table["Severity"], errors="coerce")
        if sev.notna().sum() == 0:
            return None
        row = table.loc[sev.idxmax()]
    return str(row["NPUDump"]), int(row["SeqId"])


def _dump_with_inputs(target: Path, golden: Path) -> Path:
    """The dump to cut an op's inputs from: the target's own when it recorded inputs, else
    the golden it replayed (load-replay fed every matched op exactly those, by seqid)."""
    from dumpfile.read.reader import DumpFile
    from dumpfile import schema as S

    with DumpFile(target) as f:
        return target if S.INPUT_GROUP in f.recorded_io else golden


def map_to_kernels(target: Path, op: str, seqid: int, out_dir: Path, fault: FaultSite | None,
                   saturate: bool = False):
    """Cut /op/seqid/ out of the target dump and map it to kernels on the emulated device."""
    from ir2tbe.acl_config import AclConfig
    from ir2tbe.runner import run_dump_file
    from npu_dumper.replay.emulation import emulate_npu, inject_fault

    from .extract import extract_ops

    worst = out_dir / WORST_OP_NAME
    if worst.exists():
        worst.unlink()
    path = f"/{op}/{seqid}/"
    extract_ops(target, worst, [(path, path)])
    config = AclConfig(dump_path=str(out_dir / KERNELS_DIR), dump_mode="all", dump_op_switch="on")
    with contextlib.ExitStack() as device:
        device.enter_context(emulate_npu(saturate=saturate))
        if fault is not None and fault.op == op and fault.seqid in (None, seqid):
            # The mapped op is the planted one: the emulated device's kernel misbehaves
            # on it here too (it runs once, as its own single-op model).
            device.enter_context(inject_fault(fault.op, rel=fault.rel))
        return run_dump_file(worst, config)


def run_demo(model: str = DEFAULT_MODEL, out_dir: str | os.PathLike = "accucmp_demo", *,
             size: str = DEFAULT_SIZE, fault: str | None = FAULT_AUTO, seed: int = 0,
             saturate: bool = False, map_kernels: bool = True, console=None, top: int = 5,
             formats=("csv", "html")) -> DemoResult:
    """Run the demo end to end; prints to `console` (rich) when given."""
    import sample_models

    try:
        spec = sample_models.get(model)
    except KeyError as e:
        raise DemoError(f"--model {model}: {e.args[0]}") from None
    if size not in spec.sizes:
        raise DemoError(f"--size {size}: model {model} has sizes {', '.join(spec.sizes)}")
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DemoError(f"{out}: cannot create the output directory ({e.strerror or e})") from None
    say = console.print if console is not None else (lambda *a, **k: None)
    golden, target = out / GOLDEN_NAME, out / TARGET_NAME
    res = DemoResult(model, size, out, golden, target, None)
    clock = time.perf_counter

    t = clock()
    say(f"[bold]1/5[/bold] golden: one training step of [bold]{model}[/bold] ({spec.description}), "
        f"CPU float32 -> {golden}")
    n = dump_golden(spec, size, seed, golden)
    res.timings["golden"] = clock() - t
    say(f"     {n} ops recorded")

    res.fault = resolve_fault(fault, golden)
    t = clock()
    planted = f"; planted fault: {res.fault.describe()}" if res.fault else "; no planted fault"
    say(f"[bold]2/5[/bold] target: load-replay of the golden dump under emulated NPU numerics "
        f"(cube ops in float16{', saturating' if saturate else ''}){planted} -> {target}")
    n = replay_on_emulated_npu(spec, size, seed, golden, target, res.fault, saturate)
    res.timings["target"] = clock() - t
    say(f"     {n} ops recorded")

    t = clock()
    say("[bold]3/5[/bold] compare target against golden")
    table, paths, meta = compare_and_report(target, golden, out, formats)
    res.table, res.reports = table, paths
    res.timings["compare"] = clock() - t
    from accucmp.report.findings import first_failure

    ff = first_failure(table)
    res.first_failure = None if ff is None else ff.to_dict()
    if console is not None:
        from accucmp.report.summary import print_summary
        print_summary(table, console=console, meta=meta, top=top)
    say("[bold]4/5[/bold] reports: " + ", ".join(str(p) for p in paths))

    if map_kernels:
        t = clock()
        res.mapped_op = op_to_map(table)
        if res.mapped_op is None:
            say("[bold]5/5[/bold] nothing to map to kernels (no tensor compared)")
        else:
            op, seqid = res.mapped_op
            say(f"[bold]5/5[/bold] IR to kernels: {op} seqid {seqid} -> {out / KERNELS_DIR}")
            # a load-replay dump holds outputs only; the op's inputs were the golden's
            run = map_to_kernels(_dump_with_inputs(target, golden), op, seqid, out, res.fault, saturate)
            res.kernel_summary, res.kernel_map = run.summary(), Path(run.map_path)
            say("     " + res.kernel_summary.replace("\n", "\n     "))
            for o in run.mapped:
                _say_kernels(say, o.mapping)
        res.timings["kernels"] = clock() - t

    _say_conclusion(say, res)
    return res


_FP16_TINY = 2.0 ** -14
_UNDERFLOW_NEAR = 4


def failing_ops(table) -> set[tuple[str, int]]:
    """(op, seqid) of every failing op of a judged table."""
    if table is None or getattr(table, "empty", True) or "Result" not in table.columns:
        return set()
    return {(str(r.NPUDump), int(r.SeqId)) for r in table[table["Result"] == "fail"].itertuples()}


def underflowing_cube_ops(table) -> list[tuple[str, int]]:
    """Failing float16-computed ops that read a tensor whose largest golden magnitude is
    within 4x of float16's smallest normal number (so nearly all its values are float16
    subnormals or zero): gradient underflow, not a kernel bug."""
    import pandas as pd

    if table is None or table.empty or "ComputeDtype" not in table.columns:
        return []
    fp16 = table[table["ComputeDtype"].astype(str) == "float16"]
    failing = {(str(r.NPUDump), int(r.SeqId)) for r in fp16[fp16["Result"] == "fail"].itertuples()}
    absmax = pd.to_numeric(fp16["GoldenAbsMax"], errors="coerce")
    tiny = fp16[(absmax < _UNDERFLOW_NEAR * _FP16_TINY) & (absmax > 0)]
    return sorted({(str(r.NPUDump), int(r.SeqId)) for r in tiny.itertuples()} & failing, key=lambda x: x[1])


def _say_kernels(say, mapping, limit: int = 8) -> None:
    names = [k.name for k in mapping.kernels]
    shown = ", ".join(names[:limit]) + (f", ... ({len(names)} in all)" if len(names) > limit else "")
    say(f"     {mapping.ir_op} runs as: {shown}")
    if mapping.max_abs_diff is not None:
        say(f"     its kernel sequence vs the op as the device ran it: max abs diff {mapping.max_abs_diff:.3g}"
            + ("  <- the device's kernel disagrees with the op's own definition" if mapping.max_abs_diff > 0 else ""))


def _say_conclusion(say, res: DemoResult) -> None:
    total = sum(res.timings.values())
    if res.fault is not None:
        ff = res.first_failure
        where = f"{ff.get('NPUDump')} seqid {int(ff.get('SeqId'))}" if ff else "nothing"
        if res.fault_found:
            say(f"[bold green]found it:[/bold green] the first failing op is the planted fault, {where}; "
                "float16 cube ops that differ only at float16 level pass.")
        else:
            say(f"[bold red]unexpected:[/bold red] planted {res.fault.describe()}, but the first failing op is {where}.")
    elif res.first_failure is None:
        say("[bold green]all ops pass[/bold green]: emulated float16 cube ops stay within float16 error.")
    elif res.only_underflow:
        say("[bold green]clean run as expected[/bold green]: no fault found; the only failing ops are float16 "
            "underflow (below), which a clean float16 run without loss scaling really has.")
    else:
        ff = res.first_failure
        say(f"[bold yellow]first failing op:[/bold yellow] {ff.get('NPUDump')} seqid {int(ff.get('SeqId'))}")
    underflow = underflowing_cube_ops(res.table)
    if underflow:
        say(f"[bold yellow]also real:[/bold yellow] {len(underflow)} float16 cube op(s) fail reading values at "
            f"float16's underflow edge (max |value| < {_UNDERFLOW_NEAR} x {_FP16_TINY:.2g}, its smallest normal): "
            + ", ".join(f"{op} seqid {q}" for op, q in underflow[:3])
            + ". On an NPU these values underflow in float16 (what loss scaling is for).")
    say(f"done in {total:.1f} s. Next: open {res.reports[-1] if res.reports else res.out_dir}, or run yourself:")
    # the command alone on its line, never wrapped by us: it copy-pastes whole
    say(f"  accucmp compare -m {res.target} -g {res.golden}", soft_wrap=True, markup=False, highlight=False)
