"""The environment of the Python children dumpfile starts (the dump writer, the metadata probe,
the check of a file's objects): they must import what this process imports.

A caller may have found dumpfile, h5py or numpy through a sys.path it changed at run time (a
source checkout put on sys.path, no install); a child started with the plain environment then
fails to import them, or imports an installed dumpfile of another version (the dump writer's
protocol needs both ends to be the same code). So PYTHONPATH carries this process's sys.path,
in its order (the standard library stays ahead of site-packages, as here), with the folder this
dumpfile was imported from first when sys.path does not hold it (an editable install's import
hook maps the package without a sys.path entry).

Torch-free.
"""

from __future__ import annotations

import os
import sys


def child_environment(**extra: str) -> dict[str, str]:
    """os.environ with PYTHONPATH as above (any PYTHONPATH of ours after it), plus `extra`."""
    paths = [p for p in sys.path if isinstance(p, str) and p]
    ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if ours not in paths:
        paths.insert(0, ours)
    old = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths + ([old] if old else [])), **extra)
