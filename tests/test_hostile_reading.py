"""Every reading command on every file of the hostile corpus (tests/hostile_corpus.py), in
a subprocess with 2 GB of address space and a timeout: exit 2, one line on stderr naming
the file, no traceback, no byte of the secret marker in stdout or in any file written."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from . import hostile_corpus

AS_LIMIT = 2 << 30
TIMEOUT = 600      # a hang guard, never a slow machine's: the slowest case takes ~10 s on an idle 2-core VM
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# The limit is set by the child itself before it imports anything: preexec_fn (a fork that
# runs Python before exec) can deadlock in a parent that has threads (torch's, the pool's).
_LAUNCH = ("import resource, runpy, sys; n = int(sys.argv[1]); "
           "resource.setrlimit(resource.RLIMIT_AS, (n, n)); "
           "sys.argv = ['accucmp'] + sys.argv[2:]; runpy.run_module('accucmp.cli.main', run_name='__main__')")


def _commands(hostile: str, good: str, out: str) -> dict[str, list[str]]:
    return {
        "ls": ["ls", hostile, "--plain", "--stats"],
        "ls_catalog": ["ls", hostile, "--plain"],
        "compare": ["compare", "-m", hostile, "-g", good, "-o", os.path.join(out, "cmp"), "-p", "-q"],
        "compare_as_golden": ["compare", "-m", good, "-g", hostile, "-o", os.path.join(out, "cmpg"), "-p", "-q"],
        "extract": ["extract", "-i", hostile, "-o", os.path.join(out, "x.h5"), "-s", hostile_corpus.VICTIM_OP],
    }


def _run(args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("ACCUCMP_MAX_DATASET_BYTES", None)      # the default limit, derived from RLIMIT_AS here
    try:
        return subprocess.run([sys.executable, "-c", _LAUNCH, str(AS_LIMIT), *args], capture_output=True,
                              timeout=TIMEOUT, env=env, cwd=ROOT, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{args}: still running after {TIMEOUT} s (hangs on a hostile file)")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("hostile"))
    cases, marker = hostile_corpus.build(folder)
    good = os.path.join(folder, "good.h5")
    jobs = {}
    for case, path in cases.items():
        for cmd, args in _commands(path, good, os.path.join(folder, "out", case)).items():
            os.makedirs(os.path.join(folder, "out", case), exist_ok=True)
            jobs[(case, cmd)] = args
    with ThreadPoolExecutor(max_workers=4) as pool:
        done = dict(zip(jobs, pool.map(_run, jobs.values())))
    return cases, marker, folder, done


CASES = ["external_link", "external_link_fifo", "external_link_group", "external_storage",
         "external_storage_fifo", "virtual_dataset", "declared_huge", "gzip_bomb", "chunk_bomb", "foreign_filter",
         "hardlink_cycle", "fifo_as_dump"]


def test_corpus_is_complete(results):
    cases = results[0]
    assert sorted(cases) == sorted(CASES)


@pytest.mark.parametrize("case", CASES)
def test_every_command_refuses_in_one_line(results, case):
    cases, marker, folder, done = results
    path = cases[case]
    for cmd in ("ls", "compare", "compare_as_golden", "extract"):
        r = done[(case, cmd)]
        err = r.stderr.decode("utf-8", "replace")
        where = f"{case}/{cmd}: {err!r}"
        assert r.returncode == 2, where
        assert "Traceback" not in err, where
        lines = err.strip().splitlines()
        assert len(lines) == 1 and path in lines[0], where
        assert marker not in r.stdout, where
    # no byte of the secret in anything any command wrote
    for dirpath, _, files in os.walk(os.path.join(folder, "out", case)):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                assert marker not in f.read(), os.path.join(dirpath, name)


# `ls` without --stats lists from the catalog and reads nothing under the op groups
# (dumpfile.read.safety.check_listing): what lies there is not reached, so not refused either;
# what lies at the op groups' level (or is the file itself) is
REFUSED_BY_A_LISTING = {"external_link_group", "fifo_as_dump"}


@pytest.mark.parametrize("case", CASES)
def test_a_listing_never_reaches_outside_the_file(results, case):
    cases, marker, folder, done = results
    r = done[(case, "ls_catalog")]
    err = r.stderr.decode("utf-8", "replace")
    where = f"{case}/ls: {err!r}"
    assert marker not in r.stdout and "Traceback" not in err, where
    if case in REFUSED_BY_A_LISTING:
        lines = err.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and cases[case] in lines[0], where
    else:
        # the victim listed as the catalog recorded it, nothing followed
        assert r.returncode == 0 and b"result: float32[4, 16]" in r.stdout, where


def test_the_good_dump_still_reads(results):
    """The control: the dump the corpus is made from passes the same commands."""
    _, _, folder, _ = results
    good = os.path.join(folder, "good.h5")
    r = _run(["ls", good, "--plain"])
    assert r.returncode == 0 and b"aten.mm.default" in r.stdout, r.stderr


def test_convert_refuses_a_fifo_named_like_a_kernel_dump(tmp_path):
    """A FIFO given to `convert` (alone or inside a folder) blocked open() forever."""
    fifo = tmp_path / "dumps" / "Add.add_1.3.1700000000000"
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    for src in (str(fifo), str(fifo.parent)):
        r = _run(["convert", "-d", src, "-out", str(tmp_path / "out")])
        err = r.stderr.decode("utf-8", "replace")
        assert r.returncode != 0 and "Traceback" not in err, err
        assert f"{fifo}: is a FIFO, not a regular file" in err, err


def test_report_refuses_a_fifo_as_result_csv(tmp_path):
    fifo = tmp_path / "result_1.csv"
    os.mkfifo(fifo)
    r = _run(["report", str(fifo), "-q"])
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 2 and "Traceback" not in err, err
    assert err.strip().splitlines() == [f"accucmp: error: {fifo}: is a FIFO, not a regular file; refused"]
