"""The hostile-file check's two cheap forms (dumpfile.read.safety): the whole-file walk run in a
child process for large files (its memory goes back with the child), and the listing
check that reads only the links of the op groups' level (`accucmp ls` from the catalog)."""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest

from dumpfile import DumpFile, DumpFormatError
from dumpfile.read import safety
from dumpfile import schema as S

from . import hostile_corpus
from ._cli_helpers import model_ops, write_dump


@pytest.fixture
def files(tmp_path):
    good = write_dump(str(tmp_path / "good.h5"), model_ops())
    secret = str(tmp_path / "secret.h5")
    with h5py.File(secret, "w") as s:
        s["x"] = np.arange(64, dtype=np.float32).reshape(4, 16)
    deep = str(tmp_path / "deep.h5")          # an external link under an op group
    with open(good, "rb") as src, open(deep, "wb") as dst:
        dst.write(src.read())
    with h5py.File(deep, "a") as h5:
        del h5[hostile_corpus.VICTIM]
        h5[hostile_corpus.VICTIM] = h5py.ExternalLink(secret, "/x")
    # a soft link at the op groups' level that leads to it: a listing would follow it
    soft = str(tmp_path / "soft.h5")
    with open(deep, "rb") as src, open(soft, "wb") as dst:
        dst.write(src.read())
    with h5py.File(soft, "a") as h5:
        h5["/aten.mm.default/99"] = h5py.SoftLink("/aten.mm.default/1")
    return good, deep, soft


@pytest.fixture
def fresh(monkeypatch):
    """No file checked yet in this process (check_file remembers the files it passed)."""
    monkeypatch.setattr(safety, "_CHECKED", set())


def test_child_walk_refuses_like_the_walk_in_process(files, fresh, monkeypatch):
    good, deep, _ = files
    monkeypatch.setenv(safety.CHILD_WALK_ENV, "0")          # every file: in a child

    def not_here(*a, **k):                                  # the parent must not walk
        raise AssertionError("walked in the parent")
    monkeypatch.setattr(safety, "_check_file", not_here)
    with pytest.raises(DumpFormatError) as e:
        DumpFile(deep)
    assert str(e.value) == f"{deep}: {hostile_corpus.VICTIM} is an external link to another file; refused"
    with DumpFile(good) as f:                               # passes, and is remembered
        assert len(f) == 15
    assert any(k[1] == os.stat(good).st_ino for k in safety._CHECKED)


def test_child_walk_refuses_a_file_replaced_after_the_open(files, fresh, monkeypatch):
    good, deep, _ = files
    monkeypatch.setenv(safety.CHILD_WALK_ENV, "0")
    h5 = h5py.File(good, "r")
    try:
        # what the child would be told to check is the file open here: a path that now
        # names another file (same size or not) is not checked in its place
        key = safety._identity(good, 1 << 30)
        os.replace(deep, good)
        with pytest.raises(DumpFormatError, match="changed while being opened"):
            safety._walk_in_child(h5, good, 1 << 30, key)
    finally:
        h5.close()


def test_small_files_are_walked_in_process(files, fresh, monkeypatch):
    _, deep, _ = files
    monkeypatch.delenv(safety.CHILD_WALK_ENV, raising=False)
    monkeypatch.setattr(safety, "_walk_in_child", lambda *a: pytest.fail("a child for a small file"))
    with pytest.raises(DumpFormatError, match="external link"):
        DumpFile(deep)


def test_listing_check_reads_only_the_op_groups_level(files, fresh):
    good, deep, soft = files
    # an external link below the op groups: not reached by a listing, refused by any full open
    with DumpFile(deep, check="listing") as f:
        assert len(f) == 15 and not f._checked
        with pytest.raises(DumpFormatError, match="external link"):
            f.check_all()
    with pytest.raises(DumpFormatError, match="external link"):
        DumpFile(deep)
    # a soft link at the op groups' level may lead anywhere: the whole file is walked
    with pytest.raises(DumpFormatError, match="external link"):
        DumpFile(soft, check="listing")
    with DumpFile(good, check="listing") as f:
        assert len(f) == 15


def test_listing_check_refuses_an_external_op_group_and_a_foreign_catalog(files, fresh, tmp_path):
    good, _, _ = files
    grp = str(tmp_path / "grp.h5")
    with open(good, "rb") as src, open(grp, "wb") as dst:
        dst.write(src.read())
    with h5py.File(grp, "a") as h5:
        del h5["/aten.mm.default/1"]
        h5["/aten.mm.default/1"] = h5py.ExternalLink(str(tmp_path / "secret.h5"), "/")
    with pytest.raises(DumpFormatError) as e:
        DumpFile(grp, check="listing")
    assert str(e.value) == f"{grp}: /aten.mm.default/1 is an external link to another file; refused"
    # the catalog is read by the listing: its layout is checked
    cat = str(tmp_path / "cat.h5")
    with open(good, "rb") as src, open(cat, "wb") as dst:
        dst.write(src.read())
    with h5py.File(cat, "a") as h5:
        rows = h5[S.CATALOG_PATH][()]
        del h5[S.CATALOG_PATH]
        layout = h5py.VirtualLayout(shape=rows.shape, dtype=h5py.string_dtype())
        layout[...] = h5py.VirtualSource(str(tmp_path / "secret.h5"), "x", shape=rows.shape)
        h5.create_virtual_dataset(S.CATALOG_PATH, layout)
    with pytest.raises(DumpFormatError) as e:
        DumpFile(cat, check="listing")
    assert str(e.value) == f"{cat}: /{S.CATALOG_PATH} is a virtual dataset (its data lies in other files); refused"


def test_a_child_that_cannot_run_leaves_the_walk_to_the_parent(files, fresh, monkeypatch):
    _, deep, _ = files
    monkeypatch.setenv(safety.CHILD_WALK_ENV, "0")
    monkeypatch.setattr(safety, "_CHILD", "import sys; sys.exit(1)")     # e.g. h5py not importable
    walked = []
    real = safety._check_file
    monkeypatch.setattr(safety, "_check_file", lambda *a: (walked.append(a[1]), real(*a)))
    with pytest.raises(DumpFormatError, match="external link"):
        DumpFile(deep)
    assert walked == [deep]
    # killed (memory, a crash inside HDF5): refused, not retried in the caller
    monkeypatch.setattr(safety, "_CHILD", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    walked.clear()
    with pytest.raises(DumpFormatError, match="was killed .signal 9.; refused"):
        DumpFile(deep)
    assert walked == []
