"""`python -m accucmp.cli`: the same as the `accucmp` command."""
from accucmp.cli.entry import main

main()
