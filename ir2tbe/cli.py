"""The `ir2tbe` command line: map framework ops of a dump to their kernels.

    ir2tbe run output.h5 --acl-config acl.json [--device cpu|cuda]
    ir2tbe map gelu -i output.h5

A thin typer layer over ir2tbe.runner / ir2tbe.kernels. Domain errors become one
line on stderr and exit code 2.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path
from typing import Annotated, Iterator, Optional

import typer

EXIT_BAD_INPUT = 2

app = typer.Typer(
    name="ir2tbe",
    help="Map framework (IR) ops recorded in a dump to the kernels they run, with a kernel-level dump.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

from dumpfile.version import add_version_option  # noqa: E402  (light: typer only)

add_version_option(app, "ir2tbe")


def _fail(msg: object) -> None:
    typer.echo(f"ir2tbe: error: {' '.join(str(msg).split())}", err=True)
    raise typer.Exit(EXIT_BAD_INPUT)


@contextlib.contextmanager
def _boundary(where: Path) -> Iterator[None]:
    """Any failure on a bad file: one line that names it, exit 2, no traceback
    (IR2TBE_DEBUG=1 re-raises the unexpected ones)."""
    from dumpfile.errors import DumpError

    try:
        yield
    except typer.Exit:
        raise
    except DumpError as e:
        _fail(e)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, RecursionError, MemoryError) as e:
        if os.environ.get("IR2TBE_DEBUG"):
            raise
        msg = f"{type(e).__name__}: {e}"
        _fail(msg if str(where) in msg else f"{where}: {msg}")


@app.command("run")
def run_command(
    dump: Annotated[Path, typer.Argument(help="Dump (or extracted ops) to replay, e.g. output.h5.")],
    acl_config: Annotated[Path, typer.Option("--acl-config", "-c", help="acl.json to follow.")] = Path("acl.json"),
    device: Annotated[str, typer.Option("--device", help="Device to run the kernels on (cpu, cuda, cuda:1).")] = "cpu",
    dump_path: Annotated[Optional[str], typer.Option(
        "--dump-path", help="Override acl.json's dump_path.")] = None,
    op: Annotated[Optional[list[str]], typer.Option(
        "--op", help="Only these ops (name, short name or glob); repeatable.")] = None,
) -> None:
    """Replay each op of DUMP from its recorded inputs and dump every kernel it runs (CANN layout)."""
    with _boundary(dump):
        _require_file(dump)
        _run(dump, acl_config, device, dump_path, op)


def _require_file(p: Path) -> None:
    from dumpfile.errors import DumpFormatError

    if not p.exists():
        raise DumpFormatError(f"{p}: no such file")
    if not p.is_file():
        raise DumpFormatError(f"{p}: not a regular file (a directory, FIFO or device is not a dump)")


def _run(dump, acl_config, device, dump_path, op) -> None:
    from dumpfile.errors import DumpError

    from .acl_config import AclConfigWarning, check_acl_dump_env, load_acl_config

    try:
        check_acl_dump_env()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", AclConfigWarning)
            config = load_acl_config(acl_config)
        for w in caught:
            typer.echo(f"ir2tbe: warning: {w.message}", err=True)
        if not config.enabled:
            typer.echo(f"ir2tbe: warning: {acl_config}: dump_op_switch is \"off\": kernels run but no dumps "
                       "are written (set it to \"on\")", err=True)
        from .runner import run_dump_file

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = run_dump_file(dump, config, device=device, dump_path=dump_path, ops=op)
    except DumpError as e:
        _fail(e)
    except RuntimeError as e:   # e.g. an unknown --device string
        _fail(f"{dump}: {e}")
    typer.echo(result.summary())
    if not result.ops:
        _fail(f"{dump}: no op to map" + (f" matching {', '.join(op)}" if op else ""))
    if not result.mapped:
        # never exit 0 having mapped nothing: the usual cause is an op copied with h5copy on
        # its own whose input is a view of a tensor stored in an op that was not copied
        why = "; ".join(f"{o.op} {o.seqid}: {o.why_not}" for o in result.skipped[:3])
        _fail(f"{dump}: mapped 0 of {len(result.ops)} op(s) ({why})")


@app.command("map")
def map_command(
    op: Annotated[str, typer.Argument(help="Op name: aten.gelu.default, aten.gelu, gelu or a glob.")],
    dump: Annotated[Path, typer.Option("-i", "--input", help="Dump to take the op's recorded inputs from.")],
    device: Annotated[str, typer.Option("--device", help="Device to run on.")] = "cpu",
    seqid: Annotated[Optional[int], typer.Option("--seqid", help="Which call (default: the first).")] = None,
) -> None:
    """List the kernels an op runs, with shapes, using one of its recorded calls (nothing is written)."""
    with _boundary(dump):
        _require_file(dump)
        _map(op, dump, device, seqid)


def _map(op, dump, device, seqid) -> None:
    from dumpfile.errors import DumpError

    try:
        from dumpfile.read.reader import DumpFile
        from npu_dumper.replay.recorded import load_call

        from .kernels import lower_to_kernels
        from .runner import op_matches

        with DumpFile(dump) as df:
            recs = [r for r in df.ops() if op_matches(r.op, [op]) and (seqid is None or r.seqid == seqid)]
            if not recs:
                _fail(f"{dump}: no recorded call of {op}" + (f" with seqid {seqid}" if seqid else ""))
            rec = recs[0]
            call = load_call(rec, device=device, allow_random=True)
            if not call.ok:
                _fail(f"{dump}: {rec.op} {rec.seqid}: {call.why_not}")
            mapping = lower_to_kernels(call.func, call.args, call.kwargs)
    except DumpError as e:
        _fail(e)
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


def main(argv: list[str] | None = None) -> None:
    app(args=argv, prog_name="ir2tbe")


if __name__ == "__main__":
    main()
