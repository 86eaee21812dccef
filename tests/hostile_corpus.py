"""A corpus of hostile dump files, each a real small dump (tests._cli_helpers.write_dump)
with one object replaced by something a reader must refuse (issue 16): data that lives
outside the file (external links, external storage, virtual datasets, pointing at a
secret file or at a FIFO), a FIFO given as the dump, declared sizes far beyond memory,
a gzip bomb (declared huge, and a chunk inflating past its size), a filter no writer uses,
a group hard-linked below itself (a cycle).

`build(folder)` writes the corpus and returns (cases, marker): {name: path of the hostile
dump} and the random bytes stored in the secret files the hostile objects point at; no
output of any command may contain them.
"""

from __future__ import annotations

import os
import zlib

import h5py
import numpy as np

from dumpfile import schema as S

from ._cli_helpers import model_ops, write_dump

# the tensor each case replaces (an mm output: ls lists it, compare reads it, extract copies it)
VICTIM = "/aten.mm.default/1/output/result"
VICTIM_OP = "/aten.mm.default/1/"


def _replace(path: str, make) -> None:
    """Replace VICTIM by what `make(h5, parent, name, attrs, shape, dtype)` creates."""
    with h5py.File(path, "a") as h5:
        old = h5[VICTIM]
        attrs, shape, dtype = dict(old.attrs), old.shape, old.dtype
        parent, name = VICTIM.rsplit("/", 1)
        del h5[VICTIM]
        obj = make(h5, h5[parent], name, attrs, shape, dtype)
        if obj is not None:
            for k, v in attrs.items():
                if k != S.ATTR_SHAPE or obj.shape == shape:
                    obj.attrs[k] = v


def build(folder: str) -> tuple[dict[str, str], bytes]:
    os.makedirs(folder, exist_ok=True)
    marker = os.urandom(24)
    good = write_dump(os.path.join(folder, "good.h5"), model_ops())
    # the secrets: raw bytes (for external storage) and an HDF5 file (for links, virtual datasets)
    shape = (4, 16)
    n = int(np.prod(shape)) * 4
    secret_raw = os.path.join(folder, "secret.bin")
    with open(secret_raw, "wb") as f:
        f.write((marker * (n // len(marker) + 1))[:n])
    secret_h5 = os.path.join(folder, "secret.h5")
    with h5py.File(secret_h5, "w") as s:
        s["x"] = np.frombuffer(open(secret_raw, "rb").read(), dtype=np.float32).reshape(shape)
    fifo = os.path.join(folder, "fifo")
    os.mkfifo(fifo)

    makers = {
        "external_link": lambda h5, p, name, *_: p.__setitem__(name, h5py.ExternalLink(secret_h5, "/x")),
        "external_link_fifo": lambda h5, p, name, *_: p.__setitem__(name, h5py.ExternalLink(fifo, "/x")),
        "external_storage": lambda h5, p, name, a, shp, dt: p.create_dataset(
            name, shape=shp, dtype=dt, external=[(secret_raw, 0, h5py.h5f.UNLIMITED)]),
        "external_storage_fifo": lambda h5, p, name, a, shp, dt: p.create_dataset(
            name, shape=shp, dtype=dt, external=[(fifo, 0, h5py.h5f.UNLIMITED)]),
        "virtual_dataset": _virtual(secret_h5),
        # declared 8 GiB, never written: reads as zeros, all of them
        "declared_huge": lambda h5, p, name, a, shp, dt: p.create_dataset(name, shape=(1 << 31,), dtype=dt),
        "gzip_bomb": _gzip_bomb,
        "chunk_bomb": _chunk_bomb,
        "foreign_filter": lambda h5, p, name, a, shp, dt: p.create_dataset(
            name, data=np.ones(shp, dt), scaleoffset=4, chunks=shp),
        # the op's group hard-linked below itself: a cycle (readers recursed until RecursionError)
        "hardlink_cycle": lambda h5, p, name, *_: p.__setitem__(name, h5[VICTIM_OP]),
    }
    cases: dict[str, str] = {}
    for case, make in makers.items():
        path = os.path.join(folder, f"{case}.h5")
        with open(good, "rb") as src, open(path, "wb") as dst:
            dst.write(src.read())
        _replace(path, make)
        cases[case] = path
    # a whole op group that is an external link
    path = os.path.join(folder, "external_link_group.h5")
    with open(good, "rb") as src, open(path, "wb") as dst:
        dst.write(src.read())
    with h5py.File(secret_h5, "a") as s:
        g = s.create_group("aten.mm.default/1/output")
        g["result"] = np.frombuffer(open(secret_raw, "rb").read(), dtype=np.float32).reshape(shape)
    with h5py.File(path, "a") as h5:
        del h5["/aten.mm.default/1"]
        h5["/aten.mm.default"]["1"] = h5py.ExternalLink(secret_h5, "/aten.mm.default/1")
    cases["external_link_group"] = path
    cases["fifo_as_dump"] = fifo
    return cases, marker


def _virtual(secret_h5: str):
    def make(h5, parent, name, attrs, shape, dtype):
        layout = h5py.VirtualLayout(shape=shape, dtype=dtype)
        layout[...] = h5py.VirtualSource(secret_h5, "x", shape=shape)
        return parent.create_virtual_dataset(name, layout)
    return make


def _gzip_bomb(h5, parent, name, attrs, shape, dtype):
    """4 GiB of zeros in deflated 1 MiB chunks: a few MB on disk."""
    chunk = (1 << 18,)
    ds = parent.create_dataset(name, shape=(1 << 30,), dtype=np.float32, chunks=chunk, compression="gzip")
    blob = zlib.compress(bytes(4 << 18), 9)
    for i in range(0, 1 << 30, 1 << 18):
        ds.id.write_direct_chunk((i,), blob)
    return ds


def _chunk_bomb(h5, parent, name, attrs, shape, dtype):
    """The victim's own shape, one deflated chunk that inflates to 256 MiB (HDF5's
    deflate filter grows its buffer until the stream ends)."""
    ds = parent.create_dataset(name, shape=shape, dtype=dtype, chunks=shape, compression="gzip")
    z = zlib.compressobj(9)
    zeros = bytes(16 << 20)
    blob = b"".join(z.compress(zeros) for _ in range(16)) + z.flush()
    ds.id.write_direct_chunk((0,) * len(shape), blob)
    return ds
