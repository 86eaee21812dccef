"""The command line: one typer app (`main.py`), the boundary every command runs in
(`boundary.py`: one line and a Status exit code per failure), shared options and output,
and the commands by concern (compare.py, dumps.py, convert, demo, golden, whatif)."""
