"""The floor of a full dump under the layout contract: HDF5's own work for exactly the objects
one training step's dump holds, as a ratio to the plain step.

A full dump of a model of many small ops is bounded by the HDF5 objects the format asks for
(docs/FORMAT.md, ../shared/REFERENCE.md): per op a group /{op}/{seqid} with input/ and
output/, a dataset per value, and on every tensor dataset the original layout's DataType,
DeviceType, FormatType, Stride, Type plus our dtype, device, shape. This script dumps one
step of each model (the real dumper), reads back the file's structure (groups, datasets with
their types, shapes and bytes, hard links, every attribute with its type and value), and
re-creates exactly those objects in a new file as fast as this machine can: every object
made by one direct call into the HDF5 C library h5py links (ctypes, all names, types,
spaces and buffers prepared beforehand, nothing but the creating calls timed), the large
datasets allocated at creation and their bytes written with os.pwrite (as the dumper does),
the file's settings as the dumper's (h5py.File, fixed metadata cache), file creation and
close included. No torch, no Python per object beyond the ctypes call.

Printed per model, as ratios to the plain step (all in this process; times are process
CPU time, which other load on a shared machine disturbs far less than wall time, and the
fastest of --rounds interleaved repeats):
  * plain: the step's time; empty mode: the step under a TorchDispatchMode that only calls
    each op (the floor of any dispatch-mode dumper in the model's thread);
  * objects: counts of groups, datasets, attributes, links in one step's dump;
  * hdf5 floor: the re-creation's time (of it, `attrs` the attribute calls, `pwrite`
    the large tensors' bytes); `ctypes` the cost of the calls themselves (a no-op
    library call per object), so `hdf5 floor - ctypes` is the library's own work;
  * variants that would change the file (reported, not used by the dumper): `latest`
    (libver='latest': v2 object headers), `compact` (datasets of < 64 KiB in the object
    header; rejected in h5objects._dcpl, it broke files killed between flushes).

A dump runs its writer beside the model (a child process), so with two free cores the end
to end time can approach max(model thread, writer); on one core it is their sum. The floor
of the ratio is therefore at least `max(empty mode, hdf5 floor) / plain` (two free cores)
and `(empty mode + hdf5 floor - plain) / plain` (one core).

    python benchmarks/bench_hdf5_floor.py [--rounds N] [MODEL ...]     (default shufflenet gpt2)

`--replay DUMP.h5 --rounds N`: re-create the op groups of an existing dump N times, untimed,
without importing torch (for callgrind, as profile_writer.py --replay: the difference of
the `I refs` of N=3 and N=1, halved, is the floor's instructions per file).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import tempfile
import time

import h5py
import numpy as np
from h5py import h5a, h5d, h5p, h5r, h5t

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dumpfile.write.h5objects import _keep_dirty_metadata  # noqa: E402

CLOCK = time.process_time
_hid = ctypes.c_int64
_DLL = ctypes.PyDLL(h5a.__file__)
DIRECT_MIN = 64 << 10


def _fn(name, restype, *argtypes):
    f = getattr(_DLL, name)
    f.restype, f.argtypes = restype, list(argtypes)
    return f


H5Gcreate2 = _fn("H5Gcreate2", _hid, _hid, ctypes.c_char_p, _hid, _hid, _hid)
H5Gclose = _fn("H5Gclose", ctypes.c_int, _hid)
H5Dcreate2 = _fn("H5Dcreate2", _hid, _hid, ctypes.c_char_p, _hid, _hid, _hid, _hid, _hid)
H5Dwrite = _fn("H5Dwrite", ctypes.c_int, _hid, _hid, _hid, _hid, _hid, ctypes.c_void_p)
H5Dclose = _fn("H5Dclose", ctypes.c_int, _hid)
H5Dget_offset = _fn("H5Dget_offset", ctypes.c_uint64, _hid)
H5Acreate2 = _fn("H5Acreate2", _hid, _hid, ctypes.c_char_p, _hid, _hid, _hid, _hid)
H5Awrite = _fn("H5Awrite", ctypes.c_int, _hid, _hid, ctypes.c_void_p)
H5Aclose = _fn("H5Aclose", ctypes.c_int, _hid)
H5Lcreate_hard = _fn("H5Lcreate_hard", ctypes.c_int, _hid, ctypes.c_char_p, _hid,
                     ctypes.c_char_p, _hid, _hid)
H5Iis_valid = _fn("H5Iis_valid", ctypes.c_int, _hid)     # the no-op call (ctypes cost)
H5S_ALL = 0
H5P_DEFAULT = 0

_VLEN_MEM = h5t.C_S1.copy()
_VLEN_MEM.set_size(h5t.VARIABLE)
_VLEN_MEM.set_cset(h5t.CSET_UTF8)


# ---- the structure of a dump ---------------------------------------------------------------
class Recipe:
    """Every object of a dump's op groups as a list of steps, in op (seqid) order:
    ("g", parent slot, name, slot), ("d", parent slot, name, slot, type, space, buffer,
    nbytes, ref target or None), ("a", slot, name, type, space, mem type, buffer),
    ("l", parent slot, name, target path), ("c", slot) to close an object."""

    def __init__(self):
        self.steps: list[tuple] = []
        self.slots = 0
        self.keep: list = []        # ids and buffers the steps point at
        self.groups = self.datasets = self.attrs = self.links = 0
        self.nbytes = 0
        self.ops = 0

    def slot(self) -> int:
        self.slots += 1
        return self.slots - 1


def _attr_steps(r: Recipe, obj, slot: int) -> None:
    for name in obj.attrs:
        aid = h5a.open(obj.id, name.encode())
        ftype, space = aid.get_type(), aid.get_space()
        r.keep += [ftype, space]
        if ftype.get_class() == h5t.STRING and ftype.is_variable_str():
            v = obj.attrs[name]
            items = [v] if space.get_simple_extent_ndims() == 0 else list(np.asarray(v).ravel())
            ptr = (ctypes.c_char_p * len(items))(
                *(x if isinstance(x, bytes) else str(x).encode() for x in items))
            r.keep.append(ptr)
            buf, mtype = ctypes.addressof(ptr), _VLEN_MEM
        else:
            arr = np.ascontiguousarray(np.asarray(obj.attrs[name]))
            mtype = h5t.py_create(arr.dtype)
            r.keep += [arr, mtype]
            buf = arr.ctypes.data if arr.size else None
        r.steps.append(("a", slot, name.encode(), ftype.id, space.id, mtype.id, buf))
        r.attrs += 1


def read_recipe(path: str) -> Recipe:
    r = Recipe()
    seen: dict = {}         # object id -> its first path (hard links)
    with h5py.File(path, "r") as f:
        ops = []
        for opname, og in f.items():
            if opname.startswith("_"):
                continue
            for seq in og:
                ops.append((int(seq), opname, seq))
        ops.sort()
        made_op_groups: dict[str, int] = {}
        root = r.slot()

        def walk(g: h5py.Group, gslot: int) -> None:
            for name in g:
                obj = g[name]
                key = obj.id        # (ObjectIDs of one object compare equal: hard links)
                if key in seen:
                    r.steps.append(("l", gslot, name.encode(), seen[key].encode()))
                    r.links += 1
                    continue
                seen[key] = obj.name
                s = r.slot()
                if isinstance(obj, h5py.Group):
                    r.steps.append(("g", gslot, name.encode(), s))
                    r.groups += 1
                    _attr_steps(r, obj, s)
                    walk(obj, s)
                    r.steps.append(("c", s, "g"))
                    continue
                ftype, space = obj.id.get_type(), obj.id.get_space()
                r.keep += [ftype, space]
                nbytes = obj.id.get_storage_size()
                ref = None
                buf = None
                mtype = None
                if h5py.check_ref_dtype(obj.dtype) is not None:
                    target = f[obj[()]]
                    ref = seen.get(target.id, target.name).encode()
                elif ftype.get_class() == h5t.STRING and ftype.is_variable_str():
                    ptr = ctypes.c_char_p(str(obj.asstr()[()]).encode())
                    r.keep.append(ptr)
                    buf, mtype = ctypes.addressof(ptr), _VLEN_MEM
                elif obj.shape is not None and obj.size:
                    arr = np.ascontiguousarray(obj[()])
                    mtype = h5t.py_create(arr.dtype)
                    r.keep += [arr, mtype]
                    buf = arr
                    r.nbytes += arr.nbytes
                r.steps.append(("d", gslot, name.encode(), s, ftype.id, space.id, buf,
                                mtype.id if mtype is not None else None, ref, nbytes))
                r.datasets += 1
                _attr_steps(r, obj, s)
                r.steps.append(("c", s, "d"))

        for seqid, opname, seq in ops:
            og = f[opname]
            if opname not in made_op_groups:
                s = made_op_groups[opname] = r.slot()
                r.steps.append(("g", root, opname.encode(), s))
                r.groups += 1
            s = r.slot()
            r.steps.append(("g", made_op_groups[opname], seq.encode(), s))
            r.groups += 1
            r.ops += 1
            g = og[seq]
            _attr_steps(r, g, s)
            walk(g, s)
            r.steps.append(("c", s, "g"))
    return r


# ---- re-creating it ------------------------------------------------------------------------
def _dcpls(compact: bool, phase: tuple | None = None):
    def make(early=False, layout=None):
        p = h5p.create(h5p.DATASET_CREATE)
        p.set_obj_track_times(False)
        if phase:
            p.set_attr_phase_change(*phase)
        if early:
            p.set_alloc_time(h5d.ALLOC_TIME_EARLY)
            p.set_fill_time(h5d.FILL_TIME_NEVER)
        if layout is not None:
            p.set_layout(layout)
        return p
    return make(), make(early=True), make(layout=h5d.COMPACT) if compact else None


def replay(r: Recipe, path: str, *, libver=None, compact: bool = False,
           phase: tuple | None = None, group_times: bool = True, file_kw: dict | None = None) -> dict:
    """Make the recipe's objects in a new file; seconds: total, of it attributes and pwrite.
    (The keywords are variants: the dumper's file is the default.)"""
    plain, early, compact_dcpl = _dcpls(compact, phase)
    gcpl = h5p.create(h5p.GROUP_CREATE)
    gcpl.set_obj_track_times(group_times)
    if phase:
        gcpl.set_attr_phase_change(*phase)
    gcpl_id = gcpl.id if (phase or not group_times) else H5P_DEFAULT
    t_attr = t_pwrite = 0.0
    clock = CLOCK
    t0 = clock()
    kw = dict(file_kw or {})
    if libver:
        kw["libver"] = libver
    f = h5py.File(path, "w", **kw)
    _keep_dirty_metadata(f)
    fd = os.open(path, os.O_WRONLY)
    lcpl = f._lcpl.id
    ids = [0] * r.slots
    ids[0] = f.id.id
    refs: dict = {}
    refbuf = np.zeros(1, dtype=h5py.ref_dtype)
    ref_type = h5t.STD_REF_OBJ.id
    for st in r.steps:
        k = st[0]
        if k == "a":
            ta = clock()
            aid = H5Acreate2(ids[st[1]], st[2], st[3], st[4], H5P_DEFAULT, H5P_DEFAULT)
            if st[6] is not None:
                H5Awrite(aid, st[5], st[6])
            H5Aclose(aid)
            t_attr += clock() - ta
        elif k == "g":
            ids[st[3]] = H5Gcreate2(ids[st[1]], st[2], lcpl, gcpl_id, H5P_DEFAULT)
        elif k == "d":
            _, parent, name, slot, ftype, space, buf, mtype, ref, nbytes = st
            big = isinstance(buf, np.ndarray) and buf.nbytes >= DIRECT_MIN
            if big:
                dcpl = early
            elif compact_dcpl is not None and isinstance(buf, np.ndarray):
                dcpl = compact_dcpl
            else:
                dcpl = plain
            did = H5Dcreate2(ids[parent], name, ftype, space, lcpl, dcpl.id, H5P_DEFAULT)
            ids[slot] = did
            if big:
                off = H5Dget_offset(did)
                tp = clock()
                os.pwrite(fd, buf, off)
                t_pwrite += clock() - tp
            elif ref is not None:
                refbuf[0] = refs.get(ref) or refs.setdefault(ref, h5r.create(f.id, ref, h5r.OBJECT))
                H5Dwrite(did, ref_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, refbuf.ctypes.data)
            elif buf is not None:
                H5Dwrite(did, mtype, H5S_ALL, H5S_ALL, H5P_DEFAULT,
                         buf.ctypes.data if isinstance(buf, np.ndarray) else buf)
        elif k == "l":
            H5Lcreate_hard(ids[st[1]], st[2], ids[0], st[3], lcpl, H5P_DEFAULT)
        else:
            (H5Gclose if st[2] == "g" else H5Dclose)(ids[st[1]])
    os.close(fd)
    f.close()
    total = clock() - t0
    return {"total": total, "attrs": t_attr, "pwrite": t_pwrite}


def ctypes_cost(n: int) -> float:
    """Seconds for n no-op library calls (what each object's ctypes call adds)."""
    t0 = CLOCK()
    for _ in range(n):
        H5Iis_valid(0)
    return CLOCK() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*", default=["shufflenet", "gpt2"])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--replay", metavar="DUMP", help="re-create this dump's objects, untimed")
    args = ap.parse_args()
    if args.replay:
        r = read_recipe(args.replay)
        with tempfile.TemporaryDirectory() as tmp:
            for _ in range(args.rounds):
                replay(r, os.path.join(tmp, "dst.h5"))
        return
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    import npu_dumper
    from bench_models import warmed_steps

    class EmptyMode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        for name, step in warmed_steps(args.models):
            src = os.path.join(tmp, "src.h5")
            with npu_dumper.dumper(use_dump=True, dump_path=src, writer="thread"):
                step()
            r = read_recipe(src)
            dst = os.path.join(tmp, "dst.h5")
            calls = sum(1 + (s[0] == "a") + (s[0] == "d" and s[6] is not None) for s in r.steps)
            res: dict[str, list] = {k: [] for k in ("plain", "empty", "floor", "latest", "compact")}
            for _ in range(args.rounds):
                t0 = CLOCK()
                step()
                res["plain"].append(CLOCK() - t0)
                t0 = CLOCK()
                with EmptyMode():
                    step()
                res["empty"].append(CLOCK() - t0)
                res["floor"].append(replay(r, dst))
                res["latest"].append(replay(r, dst, libver="latest"))
                res["compact"].append(replay(r, dst, compact=True))
            plain, empty = min(res["plain"]), min(res["empty"])
            floor = min(res["floor"], key=lambda d: d["total"])
            latest = min(d["total"] for d in res["latest"])
            compact = min(d["total"] for d in res["compact"])
            cc = min(ctypes_cost(calls) for _ in range(3))
            print(f"{name}: plain {plain * 1e3:.1f} ms; objects per step: {r.groups} groups, "
                  f"{r.datasets} datasets, {r.attrs} attributes, {r.links} links, "
                  f"{r.nbytes / 1e6:.1f} MB; {calls} library calls")
            print(f"  empty mode {empty * 1e3:.1f} ms ({empty / plain:.2f}x plain); hdf5 floor "
                  f"{floor['total'] * 1e3:.1f} ms ({floor['total'] / plain:.2f}x plain; attrs "
                  f"{floor['attrs'] * 1e3:.1f}, pwrite {floor['pwrite'] * 1e3:.1f}, ctypes {cc * 1e3:.1f}); "
                  f"per op {floor['total'] / max(r.ops, 1) * 1e3:.3f} ms ({r.ops} ops)")
            print(f"  floor of a full dump / plain: {max(empty, floor['total']) / plain:.2f}x (writer "
                  f"beside the model, two free cores), {(empty + floor['total'] - plain) / plain:.2f}x "
                  f"(one core: the model's extra work and the writer's in turn)")
            print(f"  variants not used (would change the file): libver=latest {latest * 1e3:.1f} ms "
                  f"({latest / plain:.2f}x), compact small datasets {compact * 1e3:.1f} ms "
                  f"({compact / plain:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
