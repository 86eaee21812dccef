"""The `accucmp` program (pyproject's entry point, and `python -m accucmp.cli`): Ctrl-C is
handled (dumpfile.interrupts) before typer, numpy or anything else is imported, so an
interrupt at any moment, imports included, is one line and exit 130; the command runs in
a child watched for a loop inside HDF5 (dumpfile.watchdog)."""


def main() -> None:
    from dumpfile import interrupts, watchdog

    interrupts.install("accucmp")
    watchdog.supervise("accucmp")          # (a loop inside HDF5 on a damaged file ends as exit 2)
    interrupts.install("accucmp")          # again, in the child the command runs in: it reports a Ctrl-C
    from accucmp.cli.main import main as run

    run()
