"""`accucmp convert`: CANN kernel dump files -> .npy (and flattened .txt), torch-free.

As msaccucmp.py convert: each dump file `F` gives `{F}.input.{i}.npy` and
`{F}.output.{i}.npy` in the output folder; `.txt` is `np.savetxt` of the flattened
array (what the user guide does by hand). A file that is not a valid kernel dump
is reported by name and skipped; the others still convert.

In a folder, files are picked by the CANN naming rule (the last dot-separated field
is the numeric timestamp); other files (ir2tbe_map.csv, .npy, ...) are ignored.
Files named explicitly are always tried.

Outputs follow dumpfile.safe_output: each file is created new (an existing one is refused
unless force), two inputs with the same base name get distinct names (`F`, `F~1`), and an
OutputBudget caps the files and bytes one run writes, checked for a whole dump file
before any of its outputs is written. Inputs that are not regular files (a FIFO) are
refused before they are opened.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from dumpfile.errors import DumpError, DumpWriteError
from dumpfile.safe_output import NameSet, OutputBudget, open_output, output_dir
from ir2tbe.dump_data import read_kernel_dump

FORMATS = ("npy", "txt", "both")
FAILED_LIST_NAME = "convert_failed_file_list.txt"


@dataclass
class ConvertResult:
    converted: list[tuple[str, list[str]]] = field(default_factory=list)  # (source, files written)
    failed: list[tuple[str, str]] = field(default_factory=list)           # (source, one-line reason)
    skipped: list[str] = field(default_factory=list)                      # non-dump files in folders

    @property
    def ok(self) -> bool:
        return not self.failed


def looks_like_kernel_dump_name(name: str) -> bool:
    """`{op_type}.{op_name}.{taskid}[.{stream_id}].{timestamp}`: the last field is digits."""
    parts = name.split(".")
    return len(parts) >= 4 and parts[-1].isdigit()


def find_dump_files(sources: Iterable[str]) -> tuple[list[str], list[str], list[tuple[str, str]]]:
    """(files to convert, files skipped, missing sources)."""
    files, skipped, missing = [], [], []
    for src in sources:
        if os.path.isdir(src):
            for root, dirs, names in os.walk(src):
                dirs.sort()
                for n in sorted(names):
                    (files if looks_like_kernel_dump_name(n) else skipped).append(os.path.join(root, n))
        elif os.path.exists(src):
            files.append(src)
        else:
            missing.append((src, f"{src}: no such file or directory"))
    return files, skipped, missing


# np.savetxt's default "%.18e" and a newline per element
TXT_BYTES_PER_ELEMENT = 25
NPY_HEADER_BYTES = 128


def _suffixes(formats: str) -> list[str]:
    return [s for s, on in ((".npy", formats in ("npy", "both")), (".txt", formats in ("txt", "both"))) if on]


def _write_entry(src: str, entry, base: str, formats: str, force: bool) -> list[str]:
    """One tensor to .npy/.txt, streamed chunk by chunk from the dump file (a 10 GB tensor
    does not need 10 GB of memory)."""
    out = []
    for suffix in _suffixes(formats):
        with open_output(base + suffix, force=force) as f:
            if suffix == ".npy":
                np.lib.format.write_array_header_1_0(f, {
                    "descr": np.lib.format.dtype_to_descr(entry.decoded_dtype),
                    "fortran_order": False, "shape": tuple(entry.shape)})
                for chunk in entry.chunks(src):
                    f.write(np.ascontiguousarray(chunk).tobytes())
            else:
                for chunk in entry.chunks(src):
                    np.savetxt(f, chunk.astype(np.uint8) if chunk.dtype == np.bool_ else chunk)
        out.append(base + suffix)
    return out


def convert_file(path: str, out_dir: str, formats: str = "npy", *, force: bool = False,
                 budget: OutputBudget | None = None, names: NameSet | None = None) -> list[str]:
    # the header checks every length against the file before anything is written; the
    # caps are checked from it too, before any tensor is read
    head = read_kernel_dump(path, with_data=False)
    entries = head.inputs + head.outputs
    suffixes = _suffixes(formats)
    name = (names or NameSet()).unique(os.path.basename(path))
    if budget is not None:
        nbytes = sum((e.size + NPY_HEADER_BYTES if ".npy" in suffixes else 0)
                     + (math.prod(e.shape) * TXT_BYTES_PER_ELEMENT if ".txt" in suffixes else 0)
                     for e in entries)
        budget.charge(os.path.join(out_dir, f"{name}.*"), nbytes, files=len(entries) * len(suffixes))
    written = []
    for entry in entries:
        written += _write_entry(path, entry, os.path.join(out_dir, f"{name}.{entry.kind}.{entry.index}"),
                                formats, force)
    return written


def convert_paths(sources: Iterable[str], out_dir: str, formats: str = "npy", *, force: bool = False,
                  budget: OutputBudget | None = None, advance=None) -> ConvertResult:
    """Convert every kernel dump found. A file that is not a valid dump is a failure of
    that file (the rest convert); an output problem (an existing output without force,
    a cap reached, an unwritable folder) stops the run with a DumpWriteError."""
    if formats not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {formats!r}")
    output_dir(out_dir)
    budget = budget or OutputBudget()
    names = NameSet()
    files, skipped, missing = find_dump_files(list(sources))
    result = ConvertResult(skipped=skipped, failed=list(missing))
    for path in files:
        if advance is not None:       # a progress bar: once per file
            advance()
        try:
            result.converted.append((path, convert_file(path, out_dir, formats, force=force, budget=budget,
                                                        names=names)))
        except DumpWriteError:
            raise
        except DumpError as e:
            result.failed.append((path, str(e)))
        except OSError as e:
            result.failed.append((path, f"{path}: {e.strerror or e}"))
    if result.failed:
        # a report of this run, like compare's result csv: a re-run into the same folder
        # gets the next free name instead of being refused (--force replaces the first)
        stem, ext = os.path.splitext(FAILED_LIST_NAME)
        name, i = FAILED_LIST_NAME, 0
        while not force and os.path.lexists(os.path.join(out_dir, name)):
            i += 1
            name = f"{stem}_{i}{ext}"
        with open_output(os.path.join(out_dir, name), "w", force=force, encoding="utf-8") as f:
            f.writelines(f"{src}\t{why}\n" for src, why in result.failed)
    return result
