"""The `ir2tbe` command line: map framework ops of a dump to their kernels.

    ir2tbe run output.h5 --acl-config acl.json [--device cpu|cuda]
    ir2tbe map gelu -i output.h5

A thin typer layer over ir2tbe.runner / ir2tbe.kernels. Every failure leaves through
the one boundary accucmp shares (dumpfile/cli_boundary.py): bad input one line and exit
2, a bug of ours exit 3 with its traceback in a log file (README, "Exit codes").
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Annotated, Optional

import typer

from dumpfile.cli_boundary import boundary, fail, new_app, require_file

PROG = "ir2tbe"

app = new_app(PROG, "Map framework (IR) ops recorded in a dump to the kernels they run, with a kernel-level dump.")


@app.command("run")
def run_command(
    dump: Annotated[Path, typer.Argument(metavar="DUMP", help="Dump (or extracted ops) to replay, e.g. output.h5.")],
    acl_config: Annotated[Path, typer.Option("--acl-config", "-c", help="acl.json to follow.")] = Path("acl.json"),
    device: Annotated[str, typer.Option("--device", help="Device to run the kernels on (cpu, cuda, cuda:1).")] = "cpu",
    dump_path: Annotated[Optional[str], typer.Option(
        "--dump-path", help="Override acl.json's dump_path.")] = None,
    op: Annotated[Optional[list[str]], typer.Option(
        "--op", metavar="OP", help="Only these ops (name, short name or glob); repeatable.")] = None,
) -> None:
    """Replay each op of DUMP from its recorded inputs and dump every kernel it runs (CANN layout)."""
    with boundary(dump, prog=PROG):
        require_file(dump)
        _run(dump, acl_config, device, dump_path, op)


def _run(dump, acl_config, device, dump_path, op) -> None:
    from .acl_config import AclConfigWarning, check_acl_dump_env, load_acl_config

    check_acl_dump_env()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", AclConfigWarning)
        config = load_acl_config(acl_config)
    for w in caught:
        typer.echo(f"ir2tbe: warning: {w.message}", err=True)
    if not config.enabled:
        typer.echo(f"ir2tbe: warning: {acl_config}: dump_op_switch is \"off\": kernels run but no dumps "
                   "are written (set it to \"on\")", err=True)
    _check_device(device)
    from .runner import run_dump_file

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = run_dump_file(dump, config, device=device, dump_path=dump_path, ops=op)
    typer.echo(result.summary())
    if not result.ops:
        raise fail(PROG, f"{dump}: no op to map" + (f" matching {', '.join(op)}" if op else ""))
    if not result.mapped:
        # never exit 0 having mapped nothing: the usual cause is an op copied with h5copy on
        # its own whose input is a view of a tensor stored in an op that was not copied
        why = "; ".join(f"{o.op} {o.seqid}: {o.why_not}" for o in result.skipped[:3])
        raise fail(PROG, f"{dump}: mapped 0 of {len(result.ops)} op(s) ({why})")


@app.command("map")
def map_command(
    op: Annotated[str, typer.Argument(metavar="OP", help="Op name: aten.gelu.default, aten.gelu, gelu or a glob.")],
    dump: Annotated[Path, typer.Option("-i", "--input", help="Dump to take the op's recorded inputs from.")],
    device: Annotated[str, typer.Option("--device", help="Device to run on.")] = "cpu",
    seqid: Annotated[Optional[int], typer.Option("--seqid", help="Which call (default: the first).")] = None,
) -> None:
    """List the kernels an op runs, with shapes, using one of its recorded calls (nothing is written)."""
    with boundary(dump, prog=PROG):
        require_file(dump)
        _map(op, dump, device, seqid)


def _map(op, dump, device, seqid) -> None:
    from dumpfile.read.reader import DumpFile
    from npu_dumper.replay.recorded import load_call

    from .kernels import lower_to_kernels
    from .runner import op_matches

    with DumpFile(dump) as df:
        recs = [r for r in df.ops() if op_matches(r.op, [op]) and (seqid is None or r.seqid == seqid)]
        if not recs:
            raise fail(PROG, f"{dump}: no recorded call of {op}" + (f" with seqid {seqid}" if seqid else ""))
        rec = recs[0]
        _check_device(device)
        call = load_call(rec, device=device, allow_random=True)
        if not call.ok:
            raise fail(PROG, f"{dump}: {rec.op} {rec.seqid}: {call.why_not}")
        try:
            mapping = lower_to_kernels(call.func, call.args, call.kwargs)
        except Exception as e:  # noqa: BLE001 - the op cannot run on these inputs here (as `run` says)
            # (a file whose input records a dtype the op has no kernel for, gelu on complex32:
            # the fuzzer's seed 29 made one, and map ended with an internal error)
            raise fail(PROG, f"{dump}: {rec.op} {rec.seqid}: failed to run on {device}: {type(e).__name__}: "
                             f"{' '.join(str(e).split())}") from None
    typer.echo(f"{rec.op} (seqid {rec.seqid}) -> {len(mapping.kernels)} kernel(s); "
               f"decomposed vs native max abs diff: {mapping.max_abs_diff}")
    for k in mapping.kernels:
        ins = ", ".join(f"{tuple(t.shape)}:{str(t.dtype).replace('torch.', '')}" for t in k.inputs)
        outs = ", ".join(f"{tuple(t.shape)}:{str(t.dtype).replace('torch.', '')}" for t in k.outputs)
        via = f"  via {' > '.join(k.decomposed_from)}" if k.decomposed_from else ""
        typer.echo(f"{k.order:4d}  {k.name:<32} [{ins}] -> [{outs}]{via}")
    for n in mapping.device_kernels:
        typer.echo(f"      device kernel: {n}")
    for n in mapping.notes:
        typer.echo(f"      note: {n}")


def _check_device(device: str) -> None:
    """A --device this machine cannot run on is the user's choice (exit 2), said before any
    op runs; torch raises RuntimeError for a bad name, AssertionError for CUDA missing."""
    import torch

    try:
        torch.empty(0, device=torch.device(device))
    except (RuntimeError, AssertionError) as e:
        raise fail(PROG, f"--device {device!r}: {e}") from None


def main(argv: list[str] | None = None) -> None:
    import sys

    from dumpfile import cli_boundary, interrupts

    if argv is None and not interrupts.installed():       # the program: Ctrl-C is one line, exit 130
        interrupts.install(PROG)
    cli_boundary.command_args = list(sys.argv[1:] if argv is None else argv)
    try:
        with boundary(prog=PROG):      # typer's own parsing, an import that fails
            app(args=argv, prog_name="ir2tbe")
    except typer.Exit as e:
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()
