"""`accucmp export`: the original layout's rules (dumpfile/read/legacy.py) and the way back.
Runs without the real msaccucmp (tests/test_interop_msaccucmp.py runs that one)."""

from __future__ import annotations

import json
import re

import h5py
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from accucmp.cli.main import app
from accucmp.compare.matching import canonical_op
from dumpfile.read import legacy as L
from dumpfile import schema as S
from dumpfile.read.reader import DumpFile

ORIGINAL_ATTRS = {"Type", "DataType", "DeviceType", "FormatType", "Stride", S.ATTR_SOURCE_DTYPE}


def _dump(path):
    from npu_dumper import dumper

    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8).to(torch.bfloat16)
    conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 8, requires_grad=False).to(torch.bfloat16)
    img = torch.randn(1, 3, 6, 6).to(memory_format=torch.channels_last)
    h = torch.randn(4, 5).half()
    with dumper(dump_path=str(path)):
        lin(x).float().sum().backward()
        conv(img)
        (h * 2).gt(0)
        torch.add(h, h, alpha=2)


def test_legacy_export_follows_the_original_rules_and_comes_back(tmp_path):
    src, leg, back = tmp_path / "d.h5", tmp_path / "legacy.h5", tmp_path / "back.h5"
    _dump(src)
    r = CliRunner().invoke(app, ["export", "-i", str(src), "-o", str(leg), "--layout", "legacy"])
    assert r.exit_code == 0, r.output
    with h5py.File(leg, "r") as f:
        book = json.loads(f.attrs["npu_dumper"])
        assert set(f.attrs) == {"npu_dumper"}
        groups, datasets = [], []
        f.visititems(lambda n, o: (groups if isinstance(o, h5py.Group) else datasets).append((n, o)))
        for op in f.keys():               # op groups only, names of [A-Za-z0-9_], digit seqids
            assert re.fullmatch(r"[A-Za-z0-9_]+", op) and all(k.isdigit() for k in f[op].keys()), op
        for n, g in groups:
            assert len(g.attrs) == 0 and len(g.keys()) > 0, n     # no attributes, none empty
        tensors = {n: d for n, d in datasets if int(d.attrs["Type"]) == 0}
        for n, d in tensors.items():
            assert set(d.attrs) <= ORIGINAL_ATTRS, (n, set(d.attrs))
            # Stride describes the stored data: as_strided with it is the identity
            assert tuple(d.attrs["Stride"]) == S.contiguous_strides(d.shape), n
        bf = [d for d in tensors.values() if d.attrs.get(S.ATTR_SOURCE_DTYPE) == "bfloat16"]
        assert bf and all(d.dtype == np.float32 and int(d.attrs["DataType"]) == 1 for d in bf)
        half = [d for d in tensors.values() if int(d.attrs["DataType"]) == 10]
        assert half and all(d.dtype == np.float32 for d in half)
        assert any(d.dtype == np.bool_ and int(d.attrs["DataType"]) == 9 for d in tensors.values())
        assert any(int(d.attrs["FormatType"]) == S.FORMAT_NHWC for d in tensors.values())
        assert book["ops"]["addmm"] == "aten.addmm.default" and book["layout"] == "legacy"
    # our reader reads the legacy file at the right dtypes
    with DumpFile(src) as a, DumpFile(leg) as b:
        ta = {(L.legacy_op_name(o.op), o.seqid, n): v for o in a.ops() for n, v in o.outputs().items()}
        tb = {(o.op, o.seqid, n): v for o in b.ops() for n, v in o.outputs().items()}
        assert set(tb) == set(ta)
        for k, v in tb.items():
            assert v.dtype == ta[k].dtype, k
            np.testing.assert_array_equal(np.asarray(v.read(), dtype=np.float64),
                                          np.asarray(ta[k].read(), dtype=np.float64))
    r = CliRunner().invoke(app, ["export", "-i", str(leg), "-o", str(back), "--layout", "native"])
    assert r.exit_code == 0, r.output
    with DumpFile(src) as a, DumpFile(back) as b:
        assert b.attrs[S.ROOT_FORMAT_VERSION] == S.FORMAT_VERSION
        ops_a = {(o.op, o.seqid): o for o in a.ops()}
        assert any(o.phase == "backward" for o in ops_a.values())
        for o in b.ops():                  # full names restored, dtypes and values exact
            assert (o.op, o.seqid) in ops_a, o.op
            w_op = ops_a[(o.op, o.seqid)]
            assert (o.phase, o.module, o.grad_fn) == (w_op.phase, w_op.module, w_op.grad_fn)
            for n, v in o.outputs().items():
                w = ops_a[(o.op, o.seqid)].outputs()[n]
                assert v.dtype == w.dtype
                np.testing.assert_array_equal(v.read(), w.read())


def test_legacy_names_are_collision_free_and_match_ours():
    names = L.legacy_names(["aten.add.Tensor", "aten.add_Tensor.default", "aten.addmm.default",
                            "aten.add_.Tensor", "mylib.fused.default", "aten.add_Tensor.default"])
    assert names["aten.addmm.default"] == "addmm" and names["aten.add_.Tensor"] == "add__Tensor"
    assert names["aten.add.Tensor"] == "add_Tensor" and names["aten.add_Tensor.default"] == "add_Tensor_x2"
    assert names["mylib.fused.default"] == "mylib_fused"
    assert len(set(names.values())) == len(names)
    assert canonical_op("addmm") == canonical_op("aten.addmm.default")
    assert canonical_op("add_Tensor") == canonical_op("aten.add.Tensor")
    assert canonical_op("addmm") != canonical_op("aten.mm.default")
    assert L.phase_of("MulBackward0") == "backward" and L.phase_of("AddmmBackward") == "backward"
    assert L.phase_of("addmm") == "forward"


def test_export_errors_are_one_line(tmp_path):
    from npu_dumper import dumper

    stats = tmp_path / "s.h5"
    with dumper(dump_path=str(stats), stats_only=True):
        torch.ones(3) + 1
    cases = [
        (["export", "-i", str(stats), "-o", str(tmp_path / "o.h5")], "statistics-only"),
        (["export", "-i", str(stats), "-o", str(stats)], "must not be the input"),
        (["export", "-i", str(tmp_path / "nope.h5"), "-o", str(tmp_path / "o.h5")], "nope.h5"),
        (["export", "-i", str(stats), "-o", str(tmp_path / "o.h5"), "--layout", "xml"], "unknown layout"),
        (["export", "-i", str(stats), "-o", str(tmp_path / "o.h5"), "--device-type", "tpu"], "--device-type"),
    ]
    for args, want in cases:
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 2 and want in r.output and "Traceback" not in r.output, (args, r.output)
        assert len(r.output.strip().splitlines()) == 1, r.output
    assert not (tmp_path / "o.h5").exists()


def test_native_export_of_an_original_file(tmp_path):
    """An original dumper's file (Half as F32 with DataType 10, bool, a Backward node) into
    our format: dtypes stored natively, phases from the names, names kept (compare matches
    them to ours), and the converted file compares like the original one."""
    from accucmp.compare.pipeline import compare_dumps

    y = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    src, dst = tmp_path / "orig.h5", tmp_path / "native.h5"
    with h5py.File(src, "w") as f:
        for p, a, code in (("/addmm/1/output/result", y.astype(np.float16).astype(np.float32), 10),
                           ("/AddmmBackward/2/output/grad_inputs", y, 1),
                           ("/gt/3/output/result", (y > 0).astype(np.int8), 9)):
            ds = f.create_dataset(p, data=a)
            ds.attrs.update({"Type": 0, "DataType": code, "DeviceType": 10, "FormatType": 2,
                             "Stride": np.array([4, 1], np.int64)})
    r = CliRunner().invoke(app, ["export", "-i", str(src), "-o", str(dst), "--layout", "native"])
    assert r.exit_code == 0, r.output
    with DumpFile(dst) as f, h5py.File(dst, "r") as h:
        ops = {o.op: o for o in f.ops()}
        assert set(ops) == {"addmm", "AddmmBackward", "gt"}
        assert ops["AddmmBackward"].phase == "backward" and ops["addmm"].phase == "forward"
        res = ops["addmm"].outputs()["result"]
        assert res.dtype == "float16" and h[res.path].dtype == np.float16
        np.testing.assert_array_equal(res.read(), y.astype(np.float16))
        gt = ops["gt"].outputs()["result"]
        assert gt.dtype == "bool" and gt.read().dtype == np.bool_
        assert f.attrs[S.ROOT_DEVICE_TYPE] == 10 and f.attrs[S.ROOT_DEVICE] == "npu"
    a = compare_dumps(str(src), str(dst)).table
    assert (a["CosineSimilarity"].astype(float) == 1.0).all() and len(a) == 3


def _verdict(target, golden):
    from accucmp.compare.pipeline import compare_dumps
    from accucmp.compare.verdict import apply_verdict

    t = apply_verdict(compare_dumps(str(target), str(golden)).table)
    return sorted(zip(t["NPUDumpPath"].astype(str), t["Result"].astype(str), t["Origin"].astype(str)))


def test_round_trip_of_a_load_replay_dump_keeps_its_replay_attributes(tmp_path):
    """issue 35 item 6: `--layout legacy` then `--layout native` of a bf16 load-replay dump
    dropped its mode and per-op replay attributes (own_error, input_dtypes, replayed): the
    verdict went from one caused-here failure to several, the faulty op 'inherited'. The
    legacy file carries them in its bookkeeping attribute; the way back restores them."""
    from npu_dumper import dumper, inject_fault

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    x = torch.randn(4, 16)
    golden, target = tmp_path / "golden.h5", tmp_path / "target.h5"
    with dumper(use_dump=True, dump_path=str(golden)):
        model(x).sum().backward()
    live = model.to(torch.bfloat16)
    with inject_fault("aten.gelu.default", rel=0.05):
        with dumper(use_load=True, load_file_path=str(golden), dump_path=str(target)):
            live(x.to(torch.bfloat16)).float().sum().backward()
    with DumpFile(str(target)) as f:
        assert f.mode == S.MODE_LOAD
        assert any(S.OP_OWN_ERROR in f.h5[o.path].attrs for o in f.ops())
    before = _verdict(target, golden)
    assert [r for r in before if r[1] == "fail" and r[2] == "caused here"], before
    leg, back = tmp_path / "legacy.h5", tmp_path / "back.h5"
    r = CliRunner().invoke(app, ["export", "-i", str(target), "-o", str(leg), "--layout", "legacy"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["export", "-i", str(leg), "-o", str(back), "--layout", "native"])
    assert r.exit_code == 0, r.output
    with DumpFile(str(target)) as a, DumpFile(str(back)) as b:
        assert b.mode == S.MODE_LOAD and b.attrs[S.ROOT_LOAD_FILE] == a.attrs[S.ROOT_LOAD_FILE]
        attrs_a = {(o.op, o.seqid): dict(a.h5[o.path].attrs) for o in a.ops()}
        for o in b.ops():
            got = dict(b.h5[o.path].attrs)
            for k in (S.OP_OWN_ERROR, S.OP_INPUT_DTYPES, S.OP_REPLAYED, S.OP_SOURCE_SEQID):
                assert (k in got) == (k in attrs_a[(o.op, o.seqid)]), (o.op, k)
                if k in got:
                    assert got[k] == attrs_a[(o.op, o.seqid)][k], (o.op, k)
    assert _verdict(back, golden) == before


def test_export_says_what_the_legacy_layout_could_not_carry(tmp_path):
    src, leg = tmp_path / "d.h5", tmp_path / "legacy.h5"
    _dump(src)                    # add's alpha, gt's bool output are carried; None/str values are not
    r = CliRunner().invoke(app, ["export", "-i", str(src), "-o", str(leg), "--layout", "legacy"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0].startswith(f"wrote {leg} (legacy): ")
    assert any(ln.startswith("  not carried: ") and "non-tensor values" in ln for ln in lines[1:]), r.output


def test_legacy_export_of_a_file_with_attribute_names_that_are_not_utf8(tmp_path):
    """A damaged file's attribute name that is no UTF-8 (h5py hands it as bytes) was an
    internal error of `export --layout legacy` (json.dumps refuses bytes keys; found by
    benchmarks/fuzz_files.py --seed 41): it is carried in the bookkeeping with the bad bytes
    replaced."""
    src, leg = tmp_path / "d.h5", tmp_path / "legacy.h5"
    _dump(src)
    with h5py.File(src, "r+") as f:
        op = next(f[k] for k in f if isinstance(f[k], h5py.Group) and not k.startswith("_"))
        group = next(g for g in op.values() if isinstance(g, h5py.Group))
        for obj in (f, group):
            space = h5py.h5s.create(h5py.h5s.SCALAR)
            attr = h5py.h5a.create(obj.id, b"bad\xffname", h5py.h5t.NATIVE_INT32, space)
            attr.write(np.array(7, dtype=np.int32))
    r = CliRunner().invoke(app, ["export", "-i", str(src), "-o", str(leg), "--layout", "legacy"])
    assert r.exit_code == 0, r.output
    with h5py.File(leg, "r") as f:
        book = json.loads(f.attrs["npu_dumper"])
    assert book["root"].get("bad\ufffdname") == 7
    assert any(extra.get("bad\ufffdname") == 7 for extra in book["op_extra"].values())
