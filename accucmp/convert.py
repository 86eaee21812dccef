"""`accucmp convert`: CANN kernel dump files -> .npy (and flattened .txt), torch-free.

As msaccucmp.py convert: each dump file `F` gives `{F}.input.{i}.npy` and
`{F}.output.{i}.npy` in the output folder; `.txt` is `np.savetxt` of the flattened
array (what the user guide does by hand). A file that is not a valid kernel dump
is reported by name and skipped; the others still convert.

In a folder, files are picked by the CANN naming rule (the last dot-separated field
is the numeric timestamp); other files (ir2tbe_map.csv, .npy, ...) are ignored.
Files named explicitly are always tried.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from dumpfile.errors import DumpError
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


def _write_array(arr: np.ndarray, base: str, formats: str) -> list[str]:
    out = []
    if formats in ("npy", "both"):
        np.save(base + ".npy", arr)
        out.append(base + ".npy")
    if formats in ("txt", "both"):
        flat = arr.reshape(-1)
        if flat.dtype == np.bool_:
            flat = flat.astype(np.uint8)
        np.savetxt(base + ".txt", flat)
        out.append(base + ".txt")
    return out


def convert_file(path: str, out_dir: str, formats: str = "npy") -> list[str]:
    dump = read_kernel_dump(path)      # validates the whole file before anything is written
    name = os.path.basename(path)
    written = []
    for entry in dump.inputs + dump.outputs:
        base = os.path.join(out_dir, f"{name}.{entry.kind}.{entry.index}")
        written += _write_array(entry.array(), base, formats)
    return written


def convert_paths(sources: Iterable[str], out_dir: str, formats: str = "npy") -> ConvertResult:
    if formats not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {formats!r}")
    os.makedirs(out_dir, exist_ok=True)
    files, skipped, missing = find_dump_files(list(sources))
    result = ConvertResult(skipped=skipped, failed=list(missing))
    for path in files:
        try:
            result.converted.append((path, convert_file(path, out_dir, formats)))
        except DumpError as e:
            result.failed.append((path, str(e)))
        except OSError as e:
            result.failed.append((path, f"{path}: {e.strerror or e}"))
    if result.failed:
        with open(os.path.join(out_dir, FAILED_LIST_NAME), "w", encoding="utf-8") as f:
            f.writelines(f"{src}\t{why}\n" for src, why in result.failed)
    return result
