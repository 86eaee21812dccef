"""The command line: one typer app (`main`), its shared options and the boundary that turns
domain errors into one line and an exit code. Sub-commands with many options live in their
own module (convert, demo, golden, whatif)."""
