"""A damaged file must not hang the process of a user who reads it through our API (issue 32).

The `accucmp` program runs its command in a watched child (dumpfile.watchdog): a loop
inside HDF5 on a damaged file ends that child, and the program exits 2 naming the file.
`npu_dumper.load` and load-replay run inside the user's own process, a training job we
may not end or fork (torch's threads make a fork unsafe). One zeroed 4 KiB page in a
golden dump's global heap (the catalog's strings) made HDF5 loop for ever inside the
read of the catalog at load-replay's entry (the fuzzer's seed 8).

`probe(path, purpose)`: before the entry opens the file, a child process (a fresh
interpreter started by `subprocess`, importing h5py, numpy and dumpfile, never torch)
makes the entry's metadata reads: the file's open and its check (every link and object
header: safety.check_file), the root attributes, the index, every catalog row and, for
load-replay, every op's recorded inputs as the entry reads them (the catalog's records,
or the walk of an op it does not describe). The child runs watched (watchdog.watch): a
call that holds the interpreter lock, or one that released it, and stays at one
position for the bound ends it by SIGALRM. Then:

- the child stalled or died: DumpFormatError, one line naming the file ("stalled
  reading its metadata ..." / "... killed the reader"); the user's process never
  touched the file;
- the child finished (the file read, or refused, or any error): the entry opens the file
  itself and meets the same answer. HDF5 reads the same bytes the same way, so reads the
  child finished finish here too. The child's check of the links and datasets is not
  made twice (safety._CHECKED, keyed by the file's identity and change time).

Not probed: tensor data, read later. Load-replay reads contiguous tensors with mmap or
preadv (no HDF5: nothing to loop in); a chunked (compressed) tensor's chunk index was
read by the check (a deflated dataset's chunks are inflated there). `npu_dumper.load`'s
values are read when the user asks for them, through h5py: not bounded.

A probe that passed is written down for later processes (probed_files.py: the file's
identity and change time, in `$ACCUCMP_PROBE_RECORD`, by default ~/.cache/accucmp/probed-files):
the next replay of the same, unchanged golden skips the child and the check.

Off where the watchdog already watches this process (the accucmp program, the
fuzzer's children) and with $ACCUCMP_STALL_SECONDS=0. Each file is probed once a
process (by identity and change time). Cost: one interpreter start with h5py and
numpy (~0.3 s) plus the metadata reads, which for a file over 64 MiB replace the check
the reader made in a child of its own anyway (docs/FORMAT.md "Reading untrusted files").
At load-replay's entry the dump writer's child is started first (Policy.starts_a_child), so
the two interpreters start side by side.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from dumpfile import watchdog
from dumpfile.child_env import ROOT, bootstrap, child_environment
from dumpfile.errors import DumpError, DumpFormatError
from dumpfile.read import probed_files, safety

LOAD = "load"          # what npu_dumper.load's open and a listing read
REPLAY = "replay"      # and every op's recorded inputs (load-replay's entry)
_COVERS = {LOAD: (LOAD,), REPLAY: (LOAD, REPLAY)}

# (file identity, purpose) probed by this process
_PROBED: set[tuple] = set()

_CHILD = bootstrap("dumpfile.read.probe")


def probe(path: str | os.PathLike, purpose: str = LOAD) -> None:
    """Make `purpose`'s metadata reads of `path` in a watched child first (module doc);
    DumpFormatError when the child stalled or died. Returns at once where the process is
    watched already or the bound is 0, and for a file this process probed."""
    path = os.fspath(path)
    seconds = watchdog.stall_seconds()
    if seconds <= 0 or watchdog.active() or not hasattr(signal, "SIGALRM"):
        return
    exe = sys.executable
    if not exe or not os.path.isfile(exe):
        return
    limit = safety.max_dataset_bytes()
    key = _key(path, limit)
    if key is None or (key, purpose) in _PROBED:
        return           # (a path that is no file: the entry's own open says so)
    covers = _COVERS.get(purpose, (purpose,))
    if probed_files.known(key[:5], purpose, limit):
        # another process probed this very file (same identity and change time): passed
        safety._CHECKED.add(key)
        _PROBED.update((key, p) for p in covers)
        return
    env = child_environment(**{safety.MAX_BYTES_ENV: str(limit),     # the check the reader would make
                               safety.CHILD_WALK_ENV: str(1 << 62)})  # made in the child itself, watched
    try:
        r = subprocess.run([exe, "-c", _CHILD, ROOT, path, purpose, str(seconds)],
                           stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                           close_fds=True, env=env, start_new_session=True)
    except OSError:
        return           # no child to be had: read as before
    if r.returncode == -signal.SIGALRM:
        raise DumpFormatError(
            f"{path}: stalled reading its metadata (root attributes, index, catalog or object headers): no progress for {seconds:g} s (HDF5 looping "
            f"on damaged metadata?); refused (${watchdog.STALL_ENV} sets the bound, 0 turns the check off)")
    if r.returncode < 0:
        raise DumpFormatError(f"{path}: reading its metadata ({purpose}) killed the reader "
                              f"({_signal_name(-r.returncode)}); refused")
    if r.returncode == 0:
        # the child's check of links and datasets holds for the file it checked: this one,
        # unchanged (the same identity and change time)
        said = r.stdout.split()
        checked = tuple(int(v) for v in said[:5]) + (limit,) if len(said) >= 5 else None
        if checked == key:
            safety._CHECKED.add(key)
            if len(said) == 6:          # (the largest dataset it declares: its walk's)
                probed_files.add(key[:5], int(said[5]), covers)
        _PROBED.update((key, p) for p in covers)


def _key(path: str, limit: int) -> tuple | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return safety._file_key(st, limit)


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _child_main(argv: list[str]) -> int:
    """In the child: the entry's metadata reads, watched. Exit 0 with the identity of the
    file checked on stdout when they pass; 2 when the file is refused; 1 on anything else
    (the entry meets it again and reports it in its own terms)."""
    path, purpose, seconds = argv[0], argv[1], float(argv[2])
    # a stall of either kind ends this process: no tensor data is read here, so one call
    # at one position for the bound is a stall whether or not it released the lock
    watchdog.watch(seconds, released_factor=1)
    try:
        st = os.stat(path)
        read_metadata(path, purpose)
    except DumpError:
        return 2
    except Exception:  # noqa: BLE001 - the entry meets it again, in its own terms
        return 1
    largest = safety.LARGEST.get(safety._file_key(st, 0)[:5])
    print(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns,
          *(() if largest is None else (largest,)), flush=True)
    return 0


def read_metadata(path: str, purpose: str) -> None:
    """What the entry of `purpose` reads before any tensor: DumpFile's open and check, the
    index (ops), every catalog row; for load-replay the reads of ReplayPolicy.begin (the
    records of every op's inputs from the catalog, a walk of each op it does not describe)."""
    from dumpfile.read.catalog import read_catalog
    from dumpfile.read.light import walk_group
    from dumpfile.read.reader import DumpFile
    from dumpfile import schema as S

    with DumpFile(path) as f:
        ops = f.ops()
        f.catalog_rows()
        if purpose != REPLAY or f.stats_only:
            return
        f.require_inputs()
        catalog = read_catalog(f) or {}
        for rec in ops:
            if catalog.get(rec.path) is None:
                rec.inputs() if f.is_table else walk_group(f, f"{rec.path}/{S.INPUT_GROUP}", layout=True,
                                                           values=True)
