"""How dumpfile starts its Python children (the dump writer, the metadata probe, the check of a
file's objects): each must run the dumpfile this process runs, with the h5py and numpy it found.

A caller may have found them through a sys.path it changed at run time (a source checkout put on
sys.path, no install), and a child's own first sys.path entry is its working folder, which may
hold another `dumpfile` (another checkout's root). A child that imports another dumpfile, or
none, fails or (the dump writer) speaks another version of the protocol. So every child is run
as `python -c BOOTSTRAP ROOT ...`, whose first line puts ROOT, the folder this dumpfile came
from, ahead of everything (the working folder included), and gets this process's sys.path, in
its order, as PYTHONPATH (h5py and numpy from the same places; the standard library stays
ahead of site-packages, as here).

Torch-free.
"""

from __future__ import annotations

import os
import sys

# the folder holding this process's dumpfile package
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bootstrap(module: str) -> str:
    """The `-c` source of a child that runs `module._child_main(argv)` (argv: the arguments
    after ROOT) with this dumpfile first on its path, and exits with what it returns."""
    return (f"import sys\nsys.path.insert(0, sys.argv[1])\nfrom {module} import _child_main\n"
            "sys.exit(_child_main(sys.argv[2:]))\n")


def child_environment(**extra: str) -> dict[str, str]:
    """os.environ with PYTHONPATH set to this process's sys.path, plus `extra`."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if isinstance(p, str) and p),
                **extra)
