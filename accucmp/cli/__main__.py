"""`python -m accucmp.cli`: the same as the `accucmp` command."""
from accucmp.cli.main import main

main()
