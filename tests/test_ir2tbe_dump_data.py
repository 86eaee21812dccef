"""The CANN kernel dump file and `accucmp convert`, including corrupt and hostile files (torch-free)."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest
from typer.testing import CliRunner

from ir2tbe import dump_data as D
from ir2tbe.dump_data import KernelDumpError, TensorToWrite, read_kernel_dump, write_kernel_dump

NAME = "Pooling.pool1.1147.0.1589195081588018"


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _hand_built(path, header: bytes, payload: bytes = b"", header_len: int | None = None):
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header) if header_len is None else header_len))
        f.write(header)
        f.write(payload)
    return str(path)


def _header(inputs=(), outputs=(), op_name="pool1") -> bytes:
    """inputs/outputs: [(data_type, shape, size)] written with the protobuf classes directly."""
    msg = D.DumpData(version="2.0", dump_time=1589195081588018, op_name=op_name)
    for kind, entries in (("input", inputs), ("output", outputs)):
        for dt, shape, size in entries:
            e = msg.input.add() if kind == "input" else msg.output.add()
            e.data_type = dt
            e.format = D.FORMAT_ND
            e.shape.dim.extend(shape)
            e.size = size
    return msg.SerializeToString()


def test_round_trip_every_numpy_dtype_and_bf16(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3)).astype(np.float32)
    ins = [TensorToWrite(x), TensorToWrite(np.arange(5, dtype=np.int64)),
           TensorToWrite(np.array([True, False])), TensorToWrite(np.float16(1.5) * np.ones((1, 2, 2, 1), np.float16))]
    outs = [TensorToWrite(_bf16_bits(x), "bfloat16", original_op="aten.gelu.default"),
            TensorToWrite(np.array(3.25, dtype=np.float64))]
    path = tmp_path / NAME
    size = write_kernel_dump(path, "pool1", ins, outs, dump_time=7)
    assert size == os.path.getsize(path)
    d = read_kernel_dump(path)
    assert (d.op_name, d.dump_time) == ("pool1", 7)
    np.testing.assert_array_equal(d.inputs[0].array(), x)
    np.testing.assert_array_equal(d.inputs[1].array(), np.arange(5))
    assert d.inputs[2].array().dtype == np.bool_ and d.inputs[2].array().tolist() == [True, False]
    assert d.inputs[3].shape == (1, 2, 2, 1) and d.inputs[3].array().dtype == np.float16
    bf = d.outputs[0].array()
    assert d.outputs[0].dtype == "bfloat16" and bf.dtype == np.float32
    np.testing.assert_allclose(bf, x, rtol=2 ** -8)
    assert d.outputs[0].original_op == "aten.gelu.default"
    assert d.outputs[1].shape == () and float(d.outputs[1].array()) == 3.25


def test_field_numbers_match_cann_schema():
    """Wire-level check against dump_data.proto field numbers (REFERENCE §5), not our own reader."""
    msg = D.DumpData(version="v", dump_time=5, op_name="n")
    out = msg.output.add()
    out.data_type, out.size = 2, 8
    out.original_op.name = "orig"
    inp = msg.input.add()
    inp.data_type, inp.size = 1, 4
    raw = msg.SerializeToString()
    # tag = field_number << 3 | wire_type
    assert raw.startswith(b"\x0a\x01v")          # version: field 1, length-delimited
    assert b"\x10\x05" in raw                     # dump_time: field 2, varint
    assert b"\x1a" in raw and b"\x22" in raw      # output field 3, input field 4 (messages)
    assert raw.endswith(b"\x32\x01n")             # op_name: field 6
    out_bytes = out.SerializeToString()
    assert out_bytes.startswith(b"\x08\x02")      # OpOutput.data_type = 1 (DT_FLOAT16 = 2)
    assert b"\x30\x08" in out_bytes               # OpOutput.size = field 6
    assert b"\x22\x06\x0a\x04orig" in out_bytes   # OpOutput.original_op = field 4, OriginalOp.name = 1
    assert inp.SerializeToString() == b"\x08\x01\x28\x04"   # OpInput.data_type 1, size field 5
    assert D.CODE_BY_DTYPE["float32"] == 1 and D.CODE_BY_DTYPE["float64"] == 12
    assert D.CODE_BY_DTYPE["bool"] == 11 and D.CODE_BY_DTYPE["bfloat16"] == 27


def test_reads_hand_built_cann_file(tmp_path):
    """A file assembled by hand the way CANN writes it (data after the header, inputs first)."""
    a = np.arange(6, dtype=np.float16).reshape(2, 3)
    b = np.array([[1, -2]], dtype=np.int32)
    header = _header(inputs=[(2, (2, 3), a.nbytes)], outputs=[(7, (1, 2), b.nbytes)])
    path = _hand_built(tmp_path / NAME, header, a.tobytes() + b.tobytes())
    d = read_kernel_dump(path)
    np.testing.assert_array_equal(d.inputs[0].array(), a)
    np.testing.assert_array_equal(d.outputs[0].array(), b)


@pytest.mark.parametrize("case, match", [
    ("empty", "too short"),
    ("header_past_eof", "header length 4096 runs past the end"),
    ("huge_header_len", "runs past the end"),
    ("garbage_header", "does not parse"),
    ("size_past_eof", "size 4000 runs past the end"),
    ("size_shape_mismatch", "does not match shape"),
    ("negative_dim", "negative dim"),
    ("huge_dims", "does not match shape"),
    ("unknown_dtype", "data type 13 \\(DT_STRING\\)"),
    ("unknown_code", "data type 99 \\(unknown\\)"),
])
def test_hostile_files_give_one_line_naming_the_file(tmp_path, case, match):
    path = str(tmp_path / f"{case}.op.1.0.123")
    ok = np.ones(4, np.float32).tobytes()
    if case == "empty":
        open(path, "wb").close()
    elif case == "header_past_eof":
        _hand_built(path, b"\x0a\x01v", header_len=4096)
    elif case == "huge_header_len":
        _hand_built(path, b"", header_len=(1 << 64) - 1)
    elif case == "garbage_header":
        _hand_built(path, b"\xff\xff\xff\xff\xff")
    elif case == "size_past_eof":
        _hand_built(path, _header(inputs=[(1, (1000,), 4000)]), ok)
    elif case == "size_shape_mismatch":
        _hand_built(path, _header(inputs=[(1, (3,), 16)]), ok)
    elif case == "negative_dim":
        _hand_built(path, _header(inputs=[(1, (-1, 4), 16)]), ok)
    elif case == "huge_dims":
        _hand_built(path, _header(inputs=[(1, (1 << 40, 1 << 40), 16)]), ok)
    elif case == "unknown_dtype":
        _hand_built(path, _header(inputs=[(13, (4,), 16)]), ok)
    elif case == "unknown_code":
        _hand_built(path, _header(inputs=[(99, (4,), 16)]), ok)
    with pytest.raises(KernelDumpError, match=match) as info:
        read_kernel_dump(path)
    msg = str(info.value)
    assert msg.startswith(path) and "\n" not in msg


# ---- accucmp convert -------------------------------------------------------------
def _good_dump(folder, name=NAME, seed=0):
    x = np.random.default_rng(seed).standard_normal((2, 3)).astype(np.float32)
    y = np.maximum(x, 0)
    write_kernel_dump(os.path.join(folder, name), "pool1", [TensorToWrite(x)], [TensorToWrite(y)])
    return x, y


def test_convert_writes_npy_and_flattened_txt(tmp_path):
    from accucmp.convert import convert_paths

    src, out = tmp_path / "dump", tmp_path / "out"
    (src / "0" / "1").mkdir(parents=True)
    x, y = _good_dump(src / "0" / "1")
    (src / "ir2tbe_map.csv").write_text("not a dump\n")
    res = convert_paths([str(src)], str(out), "both")
    assert res.ok and len(res.converted) == 1
    assert any(p.endswith("ir2tbe_map.csv") for p in res.skipped)
    np.testing.assert_array_equal(np.load(out / f"{NAME}.input.0.npy"), x)
    np.testing.assert_array_equal(np.load(out / f"{NAME}.output.0.npy"), y)
    np.testing.assert_allclose(np.loadtxt(out / f"{NAME}.output.0.txt"), y.reshape(-1), rtol=1e-7)


def test_convert_cli_skips_bad_files_converts_the_rest(tmp_path, monkeypatch):
    from accucmp.cli.main import app

    monkeypatch.setenv("COLUMNS", "120")
    src, out = tmp_path / "dump", tmp_path / "out"
    src.mkdir()
    x, _ = _good_dump(src, "Relu.relu1.1.0.100")
    bad = _hand_built(src / "Relu.relu2.2.0.200", _header(inputs=[(1, (1000,), 4000)]), b"\0" * 16)
    trunc = src / "Relu.relu3.3.0.300"
    trunc.write_bytes(b"\x05\x00")
    r = CliRunner().invoke(app, ["convert", "-d", str(src), "-out", str(out), "--format", "both", "-v", "2"])
    assert r.exit_code == 1, r.output
    assert "Relu.relu2.2.0.200" in r.output and "runs past the end" in r.output
    assert "Relu.relu3.3.0.300" in r.output and "Traceback" not in r.output
    np.testing.assert_array_equal(np.load(out / "Relu.relu1.1.0.100.input.0.npy"), x)
    assert (out / "Relu.relu1.1.0.100.input.0.txt").exists()
    assert not list(out.glob("Relu.relu2*.npy"))
    failed = (out / "convert_failed_file_list.txt").read_text()
    assert bad in failed and str(trunc) in failed


def test_convert_cli_single_file_long_option_and_missing(tmp_path, monkeypatch):
    from accucmp.cli.main import app

    monkeypatch.setenv("COLUMNS", "120")
    _good_dump(tmp_path)
    r = CliRunner().invoke(app, ["convert", "-d", str(tmp_path / NAME), "--out", str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == [f"{NAME}.input.0.npy", f"{NAME}.output.0.npy"]
    # a missing -d is bad input (docs/CLI.md: exit 2 for every command), named in one line
    r = CliRunner().invoke(app, ["convert", "-d", str(tmp_path / "nope"), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and f"{tmp_path / 'nope'}: no such file or directory" in r.output
    r = CliRunner().invoke(app, ["convert", "-d", f"{tmp_path / NAME},{tmp_path / 'nope'}", "--out", str(tmp_path / "o2")])
    assert r.exit_code == 2 and not (tmp_path / "o2").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    r = CliRunner().invoke(app, ["convert", "-d", str(empty), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "no kernel dump files" in r.output
