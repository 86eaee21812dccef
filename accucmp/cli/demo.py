"""`accucmp demo`: registered into accucmp's typer app by accucmp/cli/main.py.

Thin: options in, accucmp.demo.run_demo out. torch (through sample_models and
npu_dumper) is imported only when the command runs, so `accucmp --help` and the
other commands start without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from accucmp.cli.boundary import Status, boundary
from accucmp.cli.progress import console
from accucmp.demo import DEFAULT_MODEL, DEFAULT_SIZE
from accucmp.demo_fault import FAULT_AUTO

_MODELS_HELP = "mlp (the benchmark MLP), resnet, shufflenet, lstm_lm, transformer"


def demo_command(
    model: Annotated[str, typer.Option("--model", "-m", help=f"Sample model: {_MODELS_HELP}.")] = DEFAULT_MODEL,
    out: Annotated[Path, typer.Option("--out", "-out", "-o", help="Directory for the dumps and reports.")] = Path("accucmp_demo"),
    fault: Annotated[str, typer.Option(
        "--fault", help="Fault planted in the target run: 'auto' (a non-cube op halfway through the "
                        "forward pass, 5%), 'none', or OP[:REL[:CALL]], e.g. aten.gelu.default:0.05:3.")] = FAULT_AUTO,
    size: Annotated[str, typer.Option("--size", help="Model size: full or tiny.")] = DEFAULT_SIZE,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the weights and inputs.")] = 0,
    saturate: Annotated[bool, typer.Option("--saturate", help="Emulate float16 saturation (no inf/nan: clamp to +-65504).")] = False,
    kernels: Annotated[bool, typer.Option("--kernels/--no-kernels", help="Map the worst op to its kernels (ir2tbe).")] = True,
    top: Annotated[int, typer.Option("--top", min=0, metavar="N", help="How many worst ops the summary lists.")] = 5,
) -> None:
    """Dump a sample model on CPU fp32, replay it under emulated NPU numerics, compare, report.

    Exit 0 when the demo shows what it should (the planted fault is the first failing
    op; with --fault none: nothing fails), 1 otherwise, 2 on bad input.
    """
    with boundary():
        from accucmp.demo import run_demo

        result = run_demo(model, out, size=size, fault=fault, seed=seed, saturate=saturate,
                          map_kernels=kernels, console=console(), top=top)
    raise typer.Exit(Status.OK if result.ok else Status.FINDINGS)


def register(app: typer.Typer) -> None:
    app.command("demo")(demo_command)
