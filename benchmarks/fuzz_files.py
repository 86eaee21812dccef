"""Fuzz every reader with mutated real dumps (issue 32).

    python benchmarks/fuzz_files.py [--pairs 3000] [--seed 0] [--timeout 60] [--keep DIR]
                                    [--commands ls,compare_target,...] [--show exit3,hang,...]

1. Seeds: real files of every kind the project writes, made once (torch, npu_dumper):
   a full dump of a small model with a planted fault (`target`) and of the clean model
   (`reference`); statistics dumps with a histogram of both (`stats`, `stats_ref`); a
   load-replay dump (`replay`); an original-layout export (`legacy`); a golden (fp64)
   dump (`golden`); an extract of two ops (`extract`); the kernel dumps of `ir2tbe run`
   (`kernels`, a folder); compare's result csv (`csv`).
2. Mutants: byte-level (bit flips, truncation, a zeroed 4 KiB page) and h5py-level edits
   (`MUTATIONS`: types, shapes, kinds swapped, links, view references, nesting, counts,
   JSON attributes, index rows, statistics table columns).
3. Each (mutant, command) pair runs in a forked child of one process that imported
   everything once (a fork costs ~10 ms where starting `accucmp` costs ~1 s), under an
   address-space limit (RLIMIT_AS) and a time limit (SIGKILL past it), stdout and stderr to
   files; `--exec` runs real `python -m accucmp.cli` processes instead. Commands: every
   `accucmp` command on the kinds it takes, both roles of compare, `ir2tbe map/run`,
   `npu_dumper.load(as_torch=True)` reading every value, load-replay of the mutant.
4. Outcomes: ok (exit 0), verdict (exit 1), refusal (exit 2, one line), refusal_multiline
   (exit 2, more lines), exit3 (internal error), traceback (a traceback on stderr, or an
   API raising something else than a DumpError), hang (killed at the time limit), killed
   (a signal: the memory limit), changed_verdict (compare's exit 0 where the unmutated
   pair fails: a fault hidden by the damage). Prints counts by outcome and by command, and
   the first lines of the worst outcomes.

The seeded subset in the suite: tests/test_fuzz_files.py. The full run and its numbers:
docs/FORMAT.md, "Reading untrusted files".
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import resource
import shutil
import signal
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# address space a child may map: torch alone maps ~1.5 GB of it at import
AS_LIMIT = 6 << 30

# ---- seeds ------------------------------------------------------------------------

ACL_JSON = '{"dump": {"dump_list": [], "dump_path": "%s", "dump_mode": "all", "dump_op_switch": "on"}}'


def _model():
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16),
                               torch.nn.Linear(16, 4))


def _step(m, x):
    loss = m(x).softmax(-1).sum()
    loss.backward()
    return loss


SEED_KINDS = ("target", "reference", "stats", "stats_ref", "replay", "replay_noown", "legacy", "golden", "extract")


def build_seeds(folder: str) -> dict[str, str]:
    """The seed files (kind -> path), written once into `folder` (reused when present)."""
    done = os.path.join(folder, "seeds.json")
    if os.path.exists(done):
        with open(done) as f:
            cached = json.load(f)
        if all(k in cached for k in SEED_KINDS):
            return cached
    import torch
    import npu_dumper  # noqa: F401  (installs torch.utils.dumper)
    from accucmp.cli.main import main as accucmp
    os.makedirs(folder, exist_ok=True)
    p = {k: os.path.join(folder, f"{k}.h5") for k in SEED_KINDS}
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))

    def dump(path, fault: bool, **kw):
        m = _model()
        if fault:
            with torch.no_grad():
                m[3].weight[0, :] *= 1.5          # the second Linear: a planted fault
        with torch.utils.dumper(use_dump=True, dump_path=path, **kw):
            _step(m, x)

    dump(p["target"], True)
    dump(p["reference"], False)
    dump(p["stats"], True, stats_only=True, stats_histogram=True)
    dump(p["stats_ref"], False, stats_only=True, stats_histogram=True)
    with torch.utils.dumper(use_load=True, load_file_path=p["reference"], dump_path=p["replay"]):
        _step(_model(), x)
    # a bf16 replay without own error: compare recomputes how much its sums cancel from the
    # golden's recorded terms (accucmp/compare/cancellation.py), a read of the golden's inputs
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.utils.dumper(
            use_load=True, load_file_path=p["reference"], dump_path=p["replay_noown"], own_error=False):
        _step(_model(), x)

    def cli(*args):
        try:
            accucmp(list(args))
        except SystemExit as e:
            if e.code not in (0, 1, None):
                raise RuntimeError(f"seed command {args} exited {e.code}") from None

    cli("export", "-i", p["target"], "-o", p["legacy"], "--layout", "legacy")
    cli("golden", "-i", p["target"], "-o", p["golden"], "-q")
    from dumpfile import DumpFile
    with DumpFile(p["target"]) as df:
        ops = {o.op: o.seqid for o in df.ops()}
    picks = [f"/{op}/{ops[op]}/" for op in ("aten.gelu.default", "aten.native_layer_norm.default")]
    cli("extract", "-i", p["target"], "-o", p["extract"], "-s", picks[0], "-s", picks[1], "-q")
    out = os.path.join(folder, "cmp")
    cli("compare", "-m", p["target"], "-g", p["reference"], "-out", out, "-q")
    csvs = [f for f in os.listdir(out) if f.endswith(".csv")]
    p["csv"] = os.path.join(folder, "result.csv")
    shutil.copy(os.path.join(out, csvs[0]), p["csv"])
    kd = os.path.join(folder, "kd")
    acl = os.path.join(folder, "acl.json")
    with open(acl, "w") as f:
        f.write(ACL_JSON % kd)
    p["acl"] = acl
    from ir2tbe.cli import main as ir2tbe
    try:
        ir2tbe(["run", p["extract"], "--acl-config", acl, "--device", "cpu"])
    except SystemExit as e:
        if e.code not in (0, None):
            raise RuntimeError(f"ir2tbe run exited {e.code}") from None
    p["kernels"] = kd
    with open(done, "w") as f:
        json.dump(p, f)
    return p


# ---- mutations ----------------------------------------------------------------------
# each takes (h5, rng) on a copy of a seed opened "a" and returns a short description,
# or None when the file has nothing it applies to

def _objects(h5, want):
    import h5py
    found = []

    def visit(name, obj):
        if want(name, obj):
            found.append(name)
    h5.visititems(visit)
    return found


def _datasets(h5, under_ops=True):
    import h5py
    return _objects(h5, lambda n, o: isinstance(o, h5py.Dataset) and (not under_ops or not n.startswith("_npu")))


def _groups(h5):
    import h5py
    return _objects(h5, lambda n, o: isinstance(o, h5py.Group))


def _io_groups(h5):
    import h5py
    return _objects(h5, lambda n, o: isinstance(o, h5py.Group) and n.rsplit("/", 1)[-1] in ("input", "output"))


def _views(h5):
    import h5py
    return _objects(h5, lambda n, o: isinstance(o, h5py.Dataset) and int(o.attrs.get("Type", -1)) == 40
                    if "Type" in o.attrs and getattr(o.attrs["Type"], "ndim", 0) == 0 else False)


def m_type_array(h5, rng):
    ds = _datasets(h5)
    if not ds:
        return None
    t = rng.choice(ds)
    h5[t].attrs["Type"] = [0, 0]
    return f"Type array on {t}"


def m_type_other(h5, rng):
    objs = _datasets(h5) + [g for g in _groups(h5) if g.count("/") >= 3]
    if not objs:
        return None
    t = rng.choice(objs)
    code = rng.choice([0, 1, 2, 3, 5, 9, 10, 11, 31, 40, 41, 99, -1, "x", 1.5])
    h5[t].attrs["Type"] = code
    return f"Type={code!r} on {t}"


def m_shape(h5, rng):
    ds = _datasets(h5)
    if not ds:
        return None
    t = rng.choice(ds)
    v = rng.choice([[1 << 40], [-1], [], [3, 3, 3, 3], "abc", [2.5], [[1, 2]], [0]])
    h5[t].attrs["shape"] = v
    return f"shape={v!r} on {t}"


def m_stride(h5, rng):
    ds = _datasets(h5)
    if not ds:
        return None
    t = rng.choice(ds)
    v = rng.choice([[1 << 40], [-1], [], [0, 0], "abc"])
    h5[t].attrs[rng.choice(["Stride", "live_stride", "storage_offset"])] = v
    return f"stride-ish={v!r} on {t}"


def m_dtype_attr(h5, rng):
    ds = _datasets(h5)
    if not ds:
        return None
    t = rng.choice(ds)
    v = rng.choice(["float64", "bfloat16", "complex32", "float8_e4m3fn", "bool", "nope", "int64", "longdouble"])
    h5[t].attrs["dtype"] = v
    return f"dtype={v} on {t}"


def m_data_type(h5, rng):
    """Replace a dataset's data by one of another numpy type / shape."""
    import numpy as np
    ds = _datasets(h5)
    if not ds:
        return None
    t = rng.choice(ds)
    attrs = dict(h5[t].attrs)
    shape = h5[t].shape
    choice = rng.choice(["longdouble", "string", "compound", "2d", "empty", "bigger", "bool", "int8"])
    del h5[t]
    n = int(np.prod(shape)) if shape else 1
    if choice == "longdouble":
        d = h5.create_dataset(t, data=np.ones(shape or (), np.longdouble))
    elif choice == "string":
        d = h5.create_dataset(t, data="not a tensor")
    elif choice == "compound":
        d = h5.create_dataset(t, data=np.zeros(max(n, 1), dtype=[("a", "i4"), ("b", "f4")]))
    elif choice == "2d":
        d = h5.create_dataset(t, data=np.ones((n, 2), np.float32))
    elif choice == "empty":
        import h5py
        d = h5.create_dataset(t, data=h5py.Empty("f4"))
    elif choice == "bigger":
        d = h5.create_dataset(t, data=np.ones(n + 7, np.float32))
    elif choice == "bool":
        d = h5.create_dataset(t, data=np.ones(shape or (), bool))
    else:
        d = h5.create_dataset(t, data=np.ones(shape or (), np.int8))
    for k, v in attrs.items():
        d.attrs[k] = v
    return f"{choice} data at {t}"


def m_kind_swap(h5, rng):
    """A group where a dataset belongs, or a dataset where a group belongs."""
    import numpy as np
    objs = _datasets(h5, under_ops=False) + _io_groups(h5) + [g for g in _groups(h5) if g.count("/") == 1]
    if "_npu_dumper/index" in h5:
        objs += ["_npu_dumper/index"] * 3
    if not objs:
        return None
    t = rng.choice(objs)
    import h5py
    was_group = isinstance(h5[t], h5py.Group)
    attrs = dict(h5[t].attrs)
    del h5[t]
    o = h5.create_dataset(t, data=np.arange(4, dtype=np.float32)) if was_group else h5.create_group(t)
    if rng.random() < 0.5:
        for k, v in attrs.items():
            o.attrs[k] = v
    return f"{'group->dataset' if was_group else 'dataset->group'} at {t}"


def m_view_ref(h5, rng):
    """A view (Type 40) whose reference points at itself, a string dataset, the root, a group."""
    import h5py
    import numpy as np
    views = _views(h5)
    ds = _datasets(h5)
    if not ds:
        return None
    if not views:            # make one: a tensor turned into a view of another tensor
        t = rng.choice(ds)
        attrs = dict(h5[t].attrs)
        del h5[t]
        d = h5.create_dataset(t, data=h5[rng.choice([x for x in ds if x != t] or ["/"])].ref,
                              dtype=h5py.ref_dtype)
        for k, v in attrs.items():
            d.attrs[k] = v
        d.attrs["Type"] = 40
        return f"tensor made a view at {t}"
    t = rng.choice(views)
    attrs = dict(h5[t].attrs)
    what = rng.choice(["self", "string", "root", "group", "null", "int"])
    del h5[t]
    if what == "int":
        d = h5.create_dataset(t, data=np.int64(3))
    else:
        d = h5.create_dataset(t, shape=(), dtype=h5py.ref_dtype)
        if what == "string":
            h5.create_dataset(t + "_s", data="text")
            d[()] = h5[t + "_s"].ref
        elif what == "root":
            d[()] = h5["/"].ref
        elif what == "group":
            d[()] = h5[t.rsplit("/", 1)[0]].ref
        elif what == "self":
            d[()] = d.ref
    for k, v in attrs.items():
        d.attrs[k] = v
    if rng.random() < 0.5:
        d.attrs["base"] = rng.choice(["/", t, "/nope", "/_npu_dumper/index"])
    return f"view ref -> {what} at {t}"


def m_deep_nesting(h5, rng):
    io = _io_groups(h5)
    if not io:
        return None
    t = rng.choice(io)
    depth = rng.choice([200, 2000, 3000])
    g = h5[t].create_group("deep")
    g.attrs["Type"] = 1
    for i in range(depth):
        g = g.create_group(f"deep_{0}")
        g.attrs["Type"] = 1
    return f"{depth} nested lists under {t}"


def m_many_children(h5, rng):
    import numpy as np
    io = _io_groups(h5)
    if not io:
        return None
    t = rng.choice(io)
    n = rng.choice([3000, 20000])
    g = h5[t].create_group("wide")
    g.attrs["Type"] = 1
    for i in range(n):
        g.create_dataset(f"wide_{i}", data=np.int64(i)).attrs["Type"] = 3
    return f"list of {n} children under {t}"


def m_many_attrs(h5, rng):
    objs = _datasets(h5) + [g for g in _groups(h5) if g.count("/") == 1]
    if not objs:
        return None
    t = rng.choice(objs)
    n = rng.choice([2000, 20000])
    a = h5[t].attrs
    for i in range(n):
        a[f"junk{i}"] = i
    return f"{n} attributes on {t}"


def m_seqid_name(h5, rng):
    gs = [g for g in _groups(h5) if g.count("/") == 1 and g.rsplit("/", 1)[1].isdigit()]
    if not gs:
        return None
    t = rng.choice(gs)
    name = rng.choice(["12345678901234567890123", "-1", "0", "99999999999999999999", "１２"])
    h5.move(t, t.rsplit("/", 1)[0] + "/" + name)
    return f"seqid {t} renamed {name}"


def m_index(h5, rng):
    """Index rows renamed, repeated, shuffled, types changed."""
    import numpy as np
    if "_npu_dumper/index" not in h5:
        return None
    ix = h5["_npu_dumper/index"][()]
    what = rng.choice(["rename_op", "repeat", "shuffle", "seqid_big", "drop_col", "2d", "duplicate_rows"])
    if what == "rename_op" and ix.dtype.names and "op" in ix.dtype.names:
        ops = sorted(set(ix["op"]))
        victim = rng.choice(ops)
        ix["op"][ix["op"] == victim] = b"aten.gone.default"
        desc = f"index rows of {victim!r} renamed"
    elif what == "repeat":
        ix = np.tile(ix, rng.choice([50, 2500]))
        desc = f"index repeated ({len(ix)} rows)"
    elif what == "shuffle":
        ix = ix[np.random.default_rng(rng.randrange(1 << 30)).permutation(len(ix))]
        desc = "index shuffled"
    elif what == "seqid_big" and ix.dtype.names and "seqid" in ix.dtype.names:
        ix["seqid"][rng.randrange(len(ix))] = np.iinfo(ix["seqid"].dtype).max
        desc = "index seqid max"
    elif what == "drop_col" and ix.dtype.names:
        keep = [n for n in ix.dtype.names if n != rng.choice(ix.dtype.names)]
        ix = ix[keep]
        desc = "index column dropped"
    elif what == "2d":
        ix = np.stack([ix, ix], axis=1)
        desc = "index 2-d"
    else:
        ix = np.concatenate([ix, ix[: max(1, len(ix) // 3)]])
        desc = "index rows duplicated"
    del h5["_npu_dumper/index"]
    h5.create_dataset("_npu_dumper/index", data=ix)
    return desc


def m_op_group_gone(h5, rng):
    gs = [g for g in _groups(h5) if g.count("/") == 1 and not g.startswith("_npu")]
    if not gs:
        return None
    t = rng.choice(gs)
    del h5[t]
    return f"op group {t} deleted (index kept)"


def m_json_attr(h5, rng):
    """Root JSON attributes (op_filter, parallel_layout, legacy bookkeeping) made hostile."""
    deep = "[" * 100000 + "]" * 100000
    keys = ["op_filter", "parallel_layout"] + [k for k in h5.attrs if "json" in k.lower() or "layout" in k.lower()
                                                or "legacy" in k.lower() or "origin" in k.lower()]
    for g in _groups(h5):
        keys_g = [k for k in h5[g].attrs if "json" in k.lower() or k in ("dtensor",)]
        if keys_g and rng.random() < 0.2:
            k = rng.choice(keys_g)
            h5[g].attrs[k] = rng.choice([deep, "{", "[1,2", "null", '{"a": 1}', "[]"])
            return f"attr {k} of {g} made hostile"
    k = rng.choice(keys)
    v = rng.choice([
        '{"exclude": ["(.|.)*Z"]}', '{"include": ["(a+)+$"]}', '{"include": ' + deep + "}",
        deep, "{", "[]", '{"include": [1, 2]}', '{"include": "aten"}', '{"exclude": ["["]}',
        '{"include": ["no.such.op"]}', '{"phases": [3]}', "null", '"x"' * 3,
        '{"wrappers": 1, "meshes": {}}', '[["a", 1]]', '{"ops": [[1]]}'])
    h5.attrs[k] = v
    return f"root attr {k}={v[:40]!r}"


def m_stats_table(h5, rng):
    """The statistics table (/_npu_dumper/stats) made 2-d, a column dropped, rows retyped,
    histograms cut, the value column deeply nested JSON."""
    import numpy as np
    name = next((n for n in ("_npu_dumper/stats",) if n in h5), None)
    if name is None:
        return None
    t = h5[name][()]
    attrs = dict(h5[name].attrs)
    what = rng.choice(["2d", "drop", "type40", "hist_odd", "deep_value", "io", "short", "name_slash"])
    if what == "2d":
        t = np.stack([t, t], axis=1)
    elif what == "drop" and t.dtype.names:
        keep = [n for n in t.dtype.names if n != rng.choice(t.dtype.names)]
        t = t[keep]
    elif what == "type40" and "Type" in (t.dtype.names or ()):
        t["Type"][:] = rng.choice([40, 1, 99, 0])
    elif what == "hist_odd" and t.dtype.names:
        hn = [n for n in t.dtype.names if "hist" in n]
        if hn:
            new = [(n, t.dtype[n] if n not in hn else (t.dtype[n].base, (3,)) if t.dtype[n].shape else t.dtype[n])
                   for n in t.dtype.names]
            t2 = np.zeros(t.shape, dtype=new)
            for n in t.dtype.names:
                if n in hn and t.dtype[n].shape:
                    t2[n] = t[n][..., :3]
                else:
                    t2[n] = t[n]
            t = t2
    elif what == "deep_value" and "value" in (t.dtype.names or ()):
        new = [(n, t.dtype[n] if n != "value" else object) for n in t.dtype.names]
        import h5py
        new = [(n, h5py.string_dtype() if d is object else d) for n, d in new]
        t2 = np.zeros(t.shape, dtype=new)
        for n in t.dtype.names:
            t2[n] = t[n] if n != "value" else "[" * 50000 + "]" * 50000
        t = t2
    elif what == "io" and "io" in (t.dtype.names or ()):
        t["io"][:] = 7
    elif what == "short":
        t = t[: len(t) // 2]
    elif what == "name_slash" and "name" in (t.dtype.names or ()):
        t["name"][:] = b"a/b/c"
    else:
        return None
    del h5[name]
    d = h5.create_dataset(name, data=t)
    for k, v in attrs.items():
        d.attrs[k] = v
    return f"stats table: {what}"


def m_links(h5, rng):
    import h5py
    objs = _datasets(h5) + _io_groups(h5)
    if not objs:
        return None
    t = rng.choice(objs)
    what = rng.choice(["soft_self", "soft_missing", "soft_root", "hard_dup"])
    del h5[t]
    if what == "soft_self":
        h5[t] = h5py.SoftLink("/" + t)
    elif what == "soft_missing":
        h5[t] = h5py.SoftLink("/nowhere")
    elif what == "soft_root":
        h5[t] = h5py.SoftLink("/")
    else:
        other = rng.choice(_datasets(h5) or ["_npu_dumper/index"])
        if other in h5:
            h5[t] = h5[other]
    return f"link {what} at {t}"


def m_order_attr(h5, rng):
    io = _io_groups(h5)
    if not io:
        return None
    t = rng.choice(io)
    v = rng.choice([["x"] * 5000, [1, 2], "self", "[" * 10000, [""]])
    h5[t].attrs["order"] = v
    return f"order={str(v)[:20]} on {t}"


H5_MUTATIONS = [m_type_array, m_type_other, m_shape, m_stride, m_dtype_attr, m_data_type, m_kind_swap,
                m_view_ref, m_deep_nesting, m_many_children, m_many_attrs, m_seqid_name, m_index,
                m_op_group_gone, m_json_attr, m_stats_table, m_links, m_order_attr]


# the share of h5 mutants made by byte edits (the rest: h5py edits), and the kinds drawn
BYTE_EDITS = 0.3
MUTANT_KINDS = [*(k for k in ("target", "reference", "stats", "stats_ref", "replay", "legacy", "golden",
                              "extract") for _ in range(3)), "replay_noown", "kernels", "csv"]


def byte_mutation(path: str, rng: random.Random) -> str:
    size = os.path.getsize(path)
    what = rng.choice(["flip", "flip", "truncate", "zero_page", "zero_page"])
    with open(path, "r+b") as f:
        if what == "flip":
            n = rng.choice([1, 4, 32])
            for _ in range(n):
                off = rng.randrange(size)
                f.seek(off)
                b = f.read(1)
                f.seek(off)
                f.write(bytes([b[0] ^ (1 << rng.randrange(8))]))
            return f"{n} bit flips"
        if what == "truncate":
            cut = rng.randrange(size)
            f.truncate(cut)
            return f"truncated at {cut}/{size}"
        page = rng.randrange(max(1, size // 4096))
        f.seek(page * 4096)
        f.write(bytes(min(4096, size - page * 4096)))
        return f"zeroed page {page}"


def kernel_mutation(folder: str, rng: random.Random) -> str:
    """Edits of a kernel dump (protobuf header + data): flips, truncation, a header
    declaring a huge tensor."""
    files = [os.path.join(r, f) for r, _, fs in os.walk(folder) for f in fs if not f.endswith(".csv")]
    if not files:
        return "nothing"
    t = rng.choice(files)
    what = rng.choice(["flip", "truncate", "huge"])
    data = bytearray(open(t, "rb").read())
    if what == "flip":
        for _ in range(rng.choice([1, 8])):
            i = rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
    elif what == "truncate":
        data = data[: rng.randrange(len(data))]
    else:
        # every varint 0x08 <small> (shape dims are repeated int64 fields) made 2^40
        i = data.find(b"\x08", 8)
        if i > 0:
            data[i + 1:i + 2] = bytes([0x80, 0x80, 0x80, 0x80, 0x80, 0x20])
    with open(t, "wb") as f:
        f.write(data)
    return f"kernel {what} {os.path.basename(t)}"


def csv_mutation(path: str, rng: random.Random) -> str:
    lines = open(path, encoding="utf-8", errors="replace").read().splitlines()
    what = rng.choice(["seqid_abc", "truncate", "cols", "nan", "binary"])
    if what == "seqid_abc" and len(lines) > 1:
        head = lines[0].split(",")
        i = next((k for k, h in enumerate(head) if h.lower() in ("seqid", "opseqid")), 0)
        for r in range(1, len(lines)):
            cells = lines[r].split(",")
            if i < len(cells):
                cells[i] = "abc"
            lines[r] = ",".join(cells)
    elif what == "truncate":
        lines = lines[: rng.randrange(1, max(2, len(lines)))]
        lines[-1] = lines[-1][: len(lines[-1]) // 2]
    elif what == "cols" and len(lines) > 1:
        lines[1] = lines[1] + ",x,y,z"
    elif what == "nan" and len(lines) > 1:
        lines[1] = ",".join("nan" if c.replace(".", "").replace("e-", "").isdigit() else c for c in lines[1].split(","))
    else:
        with open(path, "wb") as f:
            f.write(os.urandom(300))
        return "csv binary"
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return f"csv {what}"


# ---- commands -----------------------------------------------------------------------
# name -> (kinds it takes, argv builder(mutant, seeds, out)); argv[0] names the program:
# accucmp, ir2tbe, or "api:" for the Python API drivers below

H5_KINDS = ("target", "reference", "stats", "stats_ref", "replay", "replay_noown", "legacy", "golden", "extract")
FULL_KINDS = ("target", "reference", "replay", "legacy", "golden", "extract")
_FIRST_OP = "aten.gelu.default"

COMMANDS = {
    "ls": (H5_KINDS, lambda m, s, o: ["accucmp", "ls", "--plain", "-q", m]),
    "ls_stats": (H5_KINDS, lambda m, s, o: ["accucmp", "ls", "--stats", "--plain", "-q", m]),
    "compare_target": (("target", "replay", "replay_noown", "legacy", "golden", "extract", "stats"), lambda m, s, o: [
        "accucmp", "compare", "-m", m, "-g", s["stats_ref"] if "stats" in os.path.basename(m) else s["reference"],
        "-out", o, "-q", "-p", "--format", "csv,jsonl,html"]),
    # the golden's recorded inputs read for a replay without own error (sums' cancellation)
    "compare_replay_noown": (("reference",), lambda m, s, o: [
        "accucmp", "compare", "-m", s["replay_noown"], "-g", m, "-out", o, "-q"]),
    "compare_golden": (("reference", "stats_ref", "golden"), lambda m, s, o: [
        "accucmp", "compare", "-m", s["stats"] if "stats" in os.path.basename(m) else s["target"], "-g", m,
        "-out", o, "-q"]),
    "bitwise": (("stats", "stats_ref"), lambda m, s, o: [
        "accucmp", "compare", "--bitwise", "-m", m, "-g", s["stats_ref"] if m.endswith("stats.h5") else s["stats"],
        "-out", o, "-q"]),
    "extract": (FULL_KINDS, lambda m, s, o: ["accucmp", "extract", "-i", m, "-o", os.path.join(o, "x.h5"),
                                             "-s", f"/{_FIRST_OP}/", "-q"]),
    "export_legacy": (FULL_KINDS, lambda m, s, o: ["accucmp", "export", "-i", m, "-o", os.path.join(o, "x.h5"),
                                                   "--layout", "legacy"]),
    "export_native": (("legacy",), lambda m, s, o: ["accucmp", "export", "-i", m, "-o", os.path.join(o, "x.h5"),
                                                    "--layout", "native"]),
    "whatif": (("target", "stats", "reference"), lambda m, s, o: ["accucmp", "whatif", m, "-out", o]),
    "golden": (("target", "extract", "replay"), lambda m, s, o: ["accucmp", "golden", "-i", m, "-o",
                                                                os.path.join(o, "g.h5"), "-q"]),
    "report": (("csv",), lambda m, s, o: ["accucmp", "report", m, "-out", o, "-q", "--format", "html"]),
    "convert": (("kernels",), lambda m, s, o: ["accucmp", "convert", "-d", m, "-out", o, "-q"]),
    "ir2tbe_map": (("extract", "target"), lambda m, s, o: ["ir2tbe", "map", "gelu", "-i", m]),
    "ir2tbe_run": (("extract",), lambda m, s, o: ["ir2tbe", "run", m, "--acl-config", s["acl"] + ".fuzz",
                                                  "--device", "cpu"]),
    "load": (H5_KINDS, lambda m, s, o: ["api:load", m]),
    "replay": (("reference", "target"), lambda m, s, o: ["api:replay", m, os.path.join(o, "r.h5")]),
    # under bf16 autocast: the recorded inputs rounded, each op's own error measured on the
    # worker thread (npu_dumper/replay/measure_worker.py)
    "replay_bf16": (("reference", "target"), lambda m, s, o: ["api:replay_bf16", m, os.path.join(o, "r.h5")]),
}


def _api_load(path: str) -> None:
    import npu_dumper
    with npu_dumper.load(path, as_torch=True) as df:
        for op in df.ops():
            for rec in list(op.inputs().values()) + list(op.outputs().values()):
                rec.read()


def _api_replay(path: str, out: str, bf16: bool = False) -> None:
    import contextlib
    import torch
    import npu_dumper  # noqa: F401
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with amp, torch.utils.dumper(use_load=True, load_file_path=path, dump_path=out):
        _step(_model(), x)


def _run_in_child(argv: list[str], out: str) -> int:
    """In the forked child: run one command; the exit code as the CLI would give it."""
    import traceback
    try:
        if argv[0] in ("accucmp", "ir2tbe"):
            # as the accucmp program runs (accucmp/cli/entry.py): a loop inside HDF5 is cut
            # by the watchdog (dumpfile.watchdog), here within half the pair's time limit (main)
            from dumpfile import watchdog
            watchdog.supervise(argv[0], seconds=float(os.environ.get("FUZZ_STALL_SECONDS", "30")))
        if argv[0] == "accucmp":
            from accucmp.cli.main import main
            main(argv[1:])
        elif argv[0] == "ir2tbe":
            from ir2tbe.cli import main
            main(argv[1:])
        else:
            # the API's own bound (dumpfile.read.probe: the metadata read first in a watched
            # child) at half the pair's time limit too
            os.environ["ACCUCMP_STALL_SECONDS"] = os.environ.get("FUZZ_PROBE_SECONDS", "30")
            from dumpfile.errors import DumpError
            try:
                if argv[0] == "api:load":
                    _api_load(*argv[1:])
                else:
                    _api_replay(*argv[1:], bf16=argv[0] == "api:replay_bf16")
            except DumpError as e:
                print(f"refused: {e}", file=sys.stderr)
                return 2
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    except BaseException:          # noqa: BLE001 - what the fuzzer is looking for
        traceback.print_exc()
        return 97


def run_pair(argv: list[str], out: str, timeout: float, use_exec: bool) -> tuple[int | None, str, str]:
    """(exit code or None for a hang, -signal when killed, stdout, stderr)."""
    os.makedirs(out, exist_ok=True)
    so, se = os.path.join(out, ".stdout"), os.path.join(out, ".stderr")
    pid = os.fork()
    if pid == 0:                      # the child
        try:
            os.setpgid(0, 0)
            resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))
            fo = os.open(so, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            fe = os.open(se, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(fo, 1)
            os.dup2(fe, 2)
            os.chdir(out)
            if use_exec:
                exe = {"accucmp": ["-m", "accucmp.cli"], "ir2tbe": ["-m", "ir2tbe.cli"]}.get(argv[0])
                if exe is not None:
                    os.execv(sys.executable, [sys.executable, *exe, *argv[1:]])
            code = _run_in_child(argv, out)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        except BaseException:          # noqa: BLE001
            os._exit(98)
    deadline = time.monotonic() + timeout
    status = None
    while True:
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:
            status = st
            break
        if time.monotonic() > deadline:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
            break
        time.sleep(0.02)
    read = lambda p: open(p, encoding="utf-8", errors="replace").read() if os.path.exists(p) else ""  # noqa: E731
    if status is None:
        return None, read(so), read(se)
    code = os.waitstatus_to_exitcode(status)
    return code, read(so), read(se)


def classify(code: int | None, err: str, baseline: int | None) -> str:
    if code is None:
        return "hang"
    if "Traceback (most recent call last)" in err or code in (97, 98):
        return "traceback"
    if code < 0:
        return "killed"
    if code == 3:
        return "exit3"
    if code == 0:
        return "changed_verdict" if baseline == 1 else "ok"
    if code == 1:
        return "verdict"
    if code == 2:
        lines = [ln for ln in err.splitlines() if ln.strip()]
        return "refusal" if len(lines) <= 1 else "refusal_multiline"
    if code == 130:
        return "interrupted"
    return f"exit{code}"


BAD = ("exit3", "traceback", "hang", "changed_verdict", "refusal_multiline", "killed")


def _copy_seed(src: str, dst: str) -> None:
    if os.path.isdir(src):
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)
    else:
        shutil.copy(src, dst)


def make_mutant(kind: str, seeds: dict, dst: str, rng: random.Random) -> str:
    """Copy the seed of `kind` to dst and mutate it; the description of the edit."""
    import h5py
    _copy_seed(seeds[kind], dst)
    if kind == "kernels":
        return kernel_mutation(dst, rng)
    if kind == "csv":
        return csv_mutation(dst, rng)
    if rng.random() < BYTE_EDITS:
        return byte_mutation(dst, rng)
    for _ in range(8):
        m = rng.choice(H5_MUTATIONS)
        _copy_seed(seeds[kind], dst)
        try:
            with h5py.File(dst, "a") as h5:
                desc = m(h5, rng)
        except Exception as e:                         # noqa: BLE001 - this edit does not apply
            desc = None
        if desc:
            return f"{m.__name__}: {desc}"
    return byte_mutation(dst, rng)


def fuzz(seeds: dict, work: str, pairs: int, seed: int, timeout: float, commands: list[str] | None,
         use_exec: bool, log=lambda m: print(m, flush=True)) -> dict:
    rng = random.Random(seed)
    with open(seeds["acl"]) as f:
        acl = f.read().replace("kd", "kd_fuzz")
    with open(seeds["acl"] + ".fuzz", "w") as f:
        f.write(acl)
    names = commands or list(COMMANDS)
    counts: collections.Counter = collections.Counter()
    by_cmd: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    examples: dict[str, list[str]] = collections.defaultdict(list)
    # the unmutated pairs' exit codes: compare's verdict on the seeds
    baseline: dict[tuple[str, str], int | None] = {}
    n = 0
    mutant_no = 0
    while n < pairs:
        kind = rng.choice(MUTANT_KINDS)
        cmds = [c for c in names if kind in COMMANDS[c][0]]
        if not cmds:
            continue
        mutant_no += 1
        ext = "" if kind == "kernels" else ".csv" if kind == "csv" else ".h5"
        # the kind stays in the name: builders pick the other file by it
        mdir = os.path.join(work, f"m{mutant_no}")
        os.makedirs(mdir, exist_ok=True)
        mpath = os.path.join(mdir, kind + ext)
        desc = make_mutant(kind, seeds, mpath, rng)
        for c in cmds:
            if n >= pairs:
                break
            argv = COMMANDS[c][1](mpath, seeds, os.path.join(mdir, "out_" + c))
            key = (c, kind)
            if (c.startswith("compare") or c == "bitwise") and key not in baseline:
                if True:
                    bargv = COMMANDS[c][1](seeds[kind], seeds, os.path.join(work, "base_" + c + kind))
                    baseline[key] = run_pair(bargv, os.path.join(work, "base_" + c + kind), timeout * 4,
                                             use_exec)[0]
            code, out, err = run_pair(argv, os.path.join(mdir, "out_" + c), timeout, use_exec)
            outcome = classify(code, err, baseline.get(key))
            n += 1
            counts[outcome] += 1
            by_cmd[c][outcome] += 1
            if outcome in BAD and len(examples[outcome]) < 200:
                tail = " | ".join(ln for ln in err.strip().splitlines()[-2:])[:300]
                examples[outcome].append(f"{c} on {kind} [{desc}] (m{mutant_no}): {tail}")
                log(f"[{outcome}] {examples[outcome][-1]}")
            if n % 100 == 0:
                log(f"  {n} pairs: {dict(counts)}")
        if not any(o in BAD for o in by_cmd_outcomes(examples, mutant_no)):
            shutil.rmtree(mdir, ignore_errors=True)
    return {"pairs": n, "mutants": mutant_no, "counts": dict(counts),
            "by_command": {k: dict(v) for k, v in by_cmd.items()}, "examples": dict(examples)}


def by_cmd_outcomes(examples: dict, mutant_no: int) -> list[str]:
    """Outcomes of mutant `mutant_no` worth keeping its files for."""
    tag = f"(m{mutant_no})"
    return [o for o, ex in examples.items() if any(tag in e for e in ex)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per pair before it counts as a hang")
    ap.add_argument("--keep", help="folder for seeds and kept mutants (reused)")
    ap.add_argument("--commands", help="comma-separated subset of: " + ",".join(COMMANDS))
    ap.add_argument("--exec", action="store_true", help="real processes instead of forks of this one")
    ap.add_argument("--show", default=",".join(BAD), help="outcomes whose examples to print")
    ap.add_argument("--json", help="also write the counts and examples here")
    ap.add_argument("--mutations", help="only these h5py edits (comma-separated m_* names); no byte edits")
    ap.add_argument("--kinds", help="only mutants of these seed kinds (comma-separated)")
    a = ap.parse_args()
    if a.mutations:
        global H5_MUTATIONS, BYTE_EDITS
        H5_MUTATIONS = [m for m in H5_MUTATIONS if m.__name__ in a.mutations.split(",")]
        BYTE_EDITS = 0.0
    if a.kinds:
        global MUTANT_KINDS
        MUTANT_KINDS = [k for k in MUTANT_KINDS if k in a.kinds.split(",")]
    work = a.keep or tempfile.mkdtemp(prefix="fuzz_files_")
    os.environ.setdefault("XDG_STATE_HOME", os.path.join(work, "state"))
    # a stall is cut within half the pair's time limit: the watchdog's bound for a call that
    # released the interpreter lock is RELEASED_FACTOR times its own; the probe's is its own
    from dumpfile import watchdog
    os.environ["FUZZ_STALL_SECONDS"] = str(max(1.0, a.timeout / (2 * watchdog.RELEASED_FACTOR)))
    os.environ["FUZZ_PROBE_SECONDS"] = str(max(1.0, a.timeout / 2))
    # the seeds are made in a child: torch's thread pools must not be running in the
    # process every pair is forked from
    import subprocess
    subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {ROOT!r}); "
                    f"sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
                    f"import fuzz_files; fuzz_files.build_seeds({os.path.join(work, 'seeds')!r})"],
                   check=True, stdout=subprocess.DEVNULL)
    seeds = build_seeds(os.path.join(work, "seeds"))
    # everything a child runs, imported once before the forks
    import torch  # noqa: F401
    torch.set_num_threads(1)
    import accucmp.cli.main  # noqa: F401
    import ir2tbe.cli  # noqa: F401
    import npu_dumper  # noqa: F401
    import accucmp.compare  # noqa: F401
    t0 = time.time()
    res = fuzz(seeds, os.path.join(work, "runs"), a.pairs, a.seed, a.timeout,
               a.commands.split(",") if a.commands else None, a.exec)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    me = resource.getrusage(resource.RUSAGE_SELF)
    res["cpu_seconds"] = round(kids.ru_utime + kids.ru_stime + me.ru_utime + me.ru_stime, 1)
    print(f"{res['pairs']} (mutant, command) pairs over {res['mutants']} mutants, seed {a.seed}, "
          f"{res['cpu_seconds']:.0f} s CPU (seeds included), {time.time() - t0:.0f} s wall, {os.cpu_count()} cores, "
          f"load {os.getloadavg()[0]:.1f}")
    print("outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(res["counts"].items())))
    for c, v in sorted(res["by_command"].items()):
        print(f"  {c:15s} " + ", ".join(f"{k} {n}" for k, n in sorted(v.items())))
    for o in a.show.split(","):
        for e in res["examples"].get(o, [])[:40]:
            print(f"[{o}] {e}")
    print(f"files: {work}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
