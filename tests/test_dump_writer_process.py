"""dumper(..., writer="process"): the HDF5 work in a child process, the same file as the thread writer."""

from __future__ import annotations

import json
import os

import h5py
import numpy as np
import pytest
import torch

import npu_dumper
from dumpfile import DumpFile
from dumpfile import schema as S
from dumpfile.write.remote import RemoteDumpWriter
from npu_dumper.errors import DumperError
from npu_dumper.sinks.process import ProcessWriter

from ._kill_helpers import killed_dump_tail, sigkill_mid_dump


def _step(model, x):
    model.zero_grad(set_to_none=True)
    out = model(x)
    out.square().mean().backward()
    with torch.no_grad():
        model[0].weight.add_(1.0)   # in place after the dump saw it: copy-on-write


def _model():
    torch.manual_seed(0)
    # 256 x 128 fp32 = 128 KiB: above the direct-write size, so bytes go through pwrite
    return torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(),
                               torch.nn.Linear(256, 128), torch.nn.LayerNorm(128))


def _contents(path) -> dict:
    """Every link path -> (attributes, value bytes or the view's target), except `created`.

    Walks links, not objects: whether a repeated tensor became a hard link or a second
    dataset depends on when its storage was freed (timing), and both read the same.
    Datasets marked uninitialized (empty-like outputs) hold garbage: compared by attributes."""
    out = {}
    with h5py.File(path, "r") as f:
        out["/"] = {k: np.asarray(v).tolist() for k, v in f.attrs.items() if k != "created"}

        def visit(name, obj):
            attrs = {k: np.asarray(v).tolist() for k, v in obj.attrs.items()}
            value = None
            if isinstance(obj, h5py.Dataset):
                if obj.attrs.get(S.ATTR_UNINITIALIZED):
                    value = "uninitialized"
                elif h5py.check_ref_dtype(obj.dtype) is not None:
                    value = f[obj[()]].name
                elif obj.shape is None:
                    value = "empty"
                elif obj.dtype.hasobject:
                    value = np.asarray(obj[()]).tolist()
                else:
                    value = (str(obj.dtype), obj.shape, obj[()].tobytes())
            out[name] = (attrs, value)
            if isinstance(obj, h5py.Group):
                for child in obj:
                    visit(f"{name}/{child}" if name else child, obj[child])

        for top in f:
            visit(top, f[top])
    return out


def test_process_writer_file_equals_thread_writer_file(tmp_path):
    x = torch.randn(64, 128)
    files = {}
    for writer in ("thread", "process"):
        model = _model()
        files[writer] = tmp_path / f"{writer}.h5"
        with npu_dumper.dumper(use_dump=True, dump_path=str(files[writer]), writer=writer) as d:
            _step(model, x)
        assert d.summary["bytes_written"] > 1 << 20
    a, b = _contents(files["thread"]), _contents(files["process"])
    # the catalog (an accelerator) spells a repeated tensor as a link or as a dataset at
    # an offset, as each writer stored it (timing): the same entries, not the same bytes
    cat = S.CATALOG_PATH.lstrip("/")
    names = [[[e["n"] for e in json.loads(row)["i"]] for row in c.pop(cat)[1]] for c in (a, b)]
    assert names[0] == names[1]
    assert a.keys() == b.keys()
    assert a == b
    with DumpFile(files["process"]) as f:      # and the reader agrees with the live values
        ops = f.ops()
        addmm = next(o for o in ops if o.op == "aten.addmm.default")
        np.testing.assert_array_equal(addmm.inputs()["self"].read(), _model()[0].bias.detach().numpy())


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_small_tensors_of_every_layout_equal_the_thread_writers(tmp_path, monkeypatch):
    """Small tensors go to the child as their storage's bytes (process.py, _small_bytes)
    where their layout allows it, else as arrays: dtypes stored as raw bits (bfloat16),
    bool, a scalar, an empty tensor, an offset slice, a transposed (not C-order) tensor,
    complex32, all read back as the values the ops saw and as the thread writer wrote."""
    torch.manual_seed(0)
    base = torch.randn(6, 8)
    seen = {
        "bf16": base.to(torch.bfloat16),
        "bool": base > 0,
        "i8": (base * 10).to(torch.int8),
        "scalar": base[0, 0].clone(),
        "empty": base[:0].clone(),
        "slice": base[2:4],                  # a storage offset
        "t": base.t(),                       # not C order
        "c32": torch.complex(base[0], base[1]).to(torch.complex32),
    }

    def run():      # one op per tensor, which reads it as its `self`
        for k, v in seen.items():
            v.logical_not() if k == "bool" else v.clone() if k == "c32" else v.add(0)

    import npu_dumper.sinks.process as process
    as_bytes = []
    small_bytes = process._small_bytes
    monkeypatch.setattr(process, "_small_bytes",
                        lambda cap: as_bytes.append(small_bytes(cap) is not None) or small_bytes(cap))
    files = {}
    for writer in ("thread", "process"):
        files[writer] = tmp_path / f"{writer}.h5"
        with npu_dumper.dumper(use_dump=True, dump_path=str(files[writer]), writer=writer):
            run()
    # sent as bytes: every input and output but the empty ones (no storage kept), the
    # transposed ones (add keeps the layout) and complex32's
    assert as_bytes.count(True) == 10 and as_bytes.count(False) == 6
    a, b = _contents(files["thread"]), _contents(files["process"])
    cat = S.CATALOG_PATH.lstrip("/")
    a.pop(cat), b.pop(cat)
    assert a == b
    with npu_dumper.load(files["process"]) as f:
        inputs = [o.inputs()["self"] for o in f.ops()]
        assert len(inputs) == len(seen)
        for rec, (name, live) in zip(inputs, seen.items()):
            got = f.tensor(rec)
            assert got.dtype == live.dtype and got.shape == live.shape, name
            assert torch.equal(got.view(torch.int16) if got.dtype == torch.complex32 else got,
                               live.view(torch.int16) if got.dtype == torch.complex32 else live), name


def test_process_writer_reused_across_blocks_and_rejects_bad_option(tmp_path):
    for i in range(3):
        with npu_dumper.dumper(use_dump=True, dump_path=str(tmp_path / f"{i}.h5"), writer="process"):
            torch.ones(300, 300) * i
        with DumpFile(tmp_path / f"{i}.h5") as f:
            mul = f.ops()[-1]
            assert mul.op == "aten.mul.Tensor" and mul.outputs()["result"].read()[0, 0] == i
    with pytest.raises(DumperError, match="writer"):
        npu_dumper.dumper(use_dump=True, dump_path=str(tmp_path / "x.h5"), writer="fork")


def test_process_writer_byte_write_failure_surfaces_in_user_thread(tmp_path, monkeypatch):
    def boom(self, offset, data):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(RemoteDumpWriter, "write_at", boom)
    p = tmp_path / "full.h5"
    with pytest.raises(DumperError) as ei:
        with npu_dumper.dumper(use_dump=True, dump_path=str(p), writer="process"):
            for _ in range(50):
                torch.ones(300, 300) * 2
    msg = str(ei.value)
    assert "\n" not in msg and str(p) in msg and "No space left" in msg
    with h5py.File(p) as f:            # readable, marked incomplete, nothing half-written listed
        assert not f.attrs["complete"]
        assert int(f.attrs["num_ops"]) == 0


def test_process_writer_child_failure_surfaces_in_user_thread(tmp_path, monkeypatch):
    real = ProcessWriter._record

    def bad(self, gpath, name, node):
        return ("no-such-kind",) if name == "other" else real(self, gpath, name, node)
    monkeypatch.setattr(ProcessWriter, "_record", bad)
    p = tmp_path / "bad.h5"
    with pytest.raises(DumperError) as ei:
        with npu_dumper.dumper(use_dump=True, dump_path=str(p), writer="process"):
            x = torch.ones(3)
            x = x * 2.0          # (Scalar other: a Value -> a Tensor `other` for mul.Tensor)
            for _ in range(50):
                x = x * torch.ones(3)
    msg = str(ei.value)
    assert "\n" not in msg and str(p) in msg and "no-such-kind" in msg
    with h5py.File(p) as f:
        assert not f.attrs["complete"]
    # the pooled child still serves the next dump
    monkeypatch.undo()
    with npu_dumper.dumper(use_dump=True, dump_path=str(tmp_path / "ok.h5"), writer="process"):
        torch.ones(3) * 2
    with DumpFile(tmp_path / "ok.h5") as f:
        assert [o.op for o in f.ops()][-1] == "aten.mul.Tensor"


def test_process_writer_sigkill_leaves_readable_file(tmp_path):
    p = sigkill_mid_dump(tmp_path, settle_s=2.5, writer="process")
    # the writer process dies with the user's process (PR_SET_PDEATHSIG), a moment later:
    # until then its HDF5 file lock refuses readers
    for o in killed_dump_tail(p, wait_unlocked_s=10):
        assert o.inputs()["self"].read().shape == (32, 32)


def test_default_writer_is_the_process_writer_and_falls_back_to_a_thread(tmp_path, monkeypatch):
    """writer="auto" (the default) writes full dumps from the child process; where no child
    can be started it writes the same file from a thread, while an explicit
    writer="process" reports the failure in one line."""
    from dumpfile.errors import DumpWriteError

    model, x = _model(), torch.randn(4, 128)
    with npu_dumper.dumper(use_dump=True, dump_path=str(tmp_path / "auto.h5")) as d:
        _step(model, x)
    assert d.summary["writer"] == "process"
    with npu_dumper.dumper(use_dump=True, stats_only=True, dump_path=str(tmp_path / "s.h5")) as s:
        _step(model, x)
    assert s.summary["writer"] == "thread"

    def no_child(self, path, **kw):
        raise DumpWriteError(f"{path}: dump writer process failed (no interpreter)")

    import sys
    monkeypatch.setattr(sys.modules["npu_dumper.dumper"], "_no_writer_process", False)
    monkeypatch.setattr(RemoteDumpWriter, "__init__", no_child)
    with npu_dumper.dumper(use_dump=True, dump_path=str(tmp_path / "fallback.h5")) as f:
        _step(model, x)
    assert f.summary["writer"] == "thread" and f.num_ops == d.num_ops > 0
    assert sys.modules["npu_dumper.dumper"]._no_writer_process   # not tried again
    with DumpFile(str(tmp_path / "auto.h5")) as a, DumpFile(str(tmp_path / "fallback.h5")) as b:
        assert [(o.op, o.seqid) for o in a.ops()] == [(o.op, o.seqid) for o in b.ops()]
        assert b.complete
    with pytest.raises(DumperError, match="dump writer process failed") as ei:
        with npu_dumper.dumper(use_dump=True, dump_path=str(tmp_path / "p.h5"), writer="process"):
            _step(model, x)
    assert "\n" not in str(ei.value)
    with pytest.raises(DumperError, match="writer must be"):
        npu_dumper.dumper(use_dump=True, dump_path=str(tmp_path / "q.h5"), writer="fork")


def test_a_killed_writer_process_is_named_as_such(tmp_path):
    import os
    import signal
    p = tmp_path / "killed.h5"
    with pytest.raises(DumperError) as ei:
        with npu_dumper.dumper(use_dump=True, dump_path=str(p), writer="process") as d:
            torch.ones(300, 300) * 2
            child = d._writer.writer._child.proc
            os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=600)
            for _ in range(50):
                torch.ones(300, 300) * 3
    msg = str(ei.value)
    assert "\n" not in msg and str(p) in msg
    assert "dump writer process died (killed by SIGKILL)" in msg, msg


def test_the_writer_child_imports_the_dumpfile_this_process_imported(tmp_path):
    """A process that found dumpfile through a sys.path it changed (a copy of the source
    put first, no install), run from a folder that holds another `dumpfile` (another
    checkout's root): the writer child it starts imports that same copy, not the installed
    one nor the working folder's (the two ends of the protocol are the same code), and
    writes the dump."""
    import shutil
    import subprocess
    import sys
    import dumpfile
    alt = tmp_path / "alt"
    shutil.copytree(os.path.dirname(dumpfile.__file__), alt / "dumpfile")
    # the copy's child says which dumpfile it runs, in a file beside the dump
    child = alt / "dumpfile" / "write" / "remote_child.py"
    source = child.read_text()
    start = 'def _child_main(argv: list[str]) -> None:\n'
    assert start in source
    child.write_text(source.replace(start, start + '    open(os.environ["WHERE_OUT"], "w").write(__file__)\n', 1))
    elsewhere = tmp_path / "elsewhere"      # the working folder, with a dumpfile that cannot run
    (elsewhere / "dumpfile").mkdir(parents=True)
    (elsewhere / "dumpfile" / "__init__.py").write_text("raise SystemExit('the working folder\\'s dumpfile')\n")
    script = (f"import sys; sys.path.insert(0, {str(alt)!r})\n"
              "import torch, npu_dumper, dumpfile\n"
              "m = torch.nn.Linear(8, 8)\n"
              f"with npu_dumper.dumper(use_dump=True, dump_path={str(tmp_path / 'd.h5')!r}) as d:\n"
              "    m(torch.ones(2, 8)).sum().backward()\n"
              "print(dumpfile.__file__, d.summary['writer'], d.summary['ops_kept'] == d.num_ops > 0)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["WHERE_OUT"] = str(tmp_path / "where")
    got = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         env=env, cwd=str(elsewhere)).stdout.split()
    assert got[0] == str(alt / "dumpfile" / "__init__.py")
    assert got[1:] == ["process", "True"]
    assert (tmp_path / "where").read_text() == str(child)
