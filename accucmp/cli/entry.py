"""The `accucmp` program (pyproject's entry point, and `python -m accucmp.cli`): Ctrl-C is
handled (dumpfile.interrupts) before typer, numpy or anything else is imported, so an
interrupt at any moment, imports included, is one line and exit 130."""


def main() -> None:
    from dumpfile import interrupts

    interrupts.install("accucmp")
    from accucmp.cli.main import main as run

    run()
