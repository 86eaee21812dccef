"""The CANN kernel dump file: write it, and read it without trusting it (torch-free).

Layout (CANN "protobuf dump", what `msaccucmp.py convert` reads)::

    [8 bytes little-endian uint64: header length N]
    [N bytes: protobuf toolkit.dumpdata.DumpData]
    [raw bytes of input 0, input 1, ..., output 0, output 1, ...]   each `size` bytes

The message classes are built at import time from a FileDescriptorProto written
below, so neither protoc nor a generated *_pb2.py is needed. Field numbers follow
`dump_task.proto` (package toolkit.dumpdata) of mindspore-ai/graphengine
(metadef/graph/proto/dump_task.proto) plus the later fields `original_shape` and
`sub_format` of the msprobe/CANN 7+ copy (AclDumpMsg.proto); data type codes
follow msaccucmp's const_manager (DT_BF16 = 27, float8 34/35). See docs/IR2TBE.md.

`Shape.dim` is uint64 in the old copy and int64 in newer ones; both are varints on
the wire, so the reader declares int64 and rejects negative or absurd dims.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError

from dumpfile.read import safety
from dumpfile.errors import DumpFormatError, DumpWriteError

PROTO_PACKAGE = "toolkit.dumpdata"
HEADER_LENGTH_BYTES = 8
# Written into DumpData.version so a reader can tell our files from CANN's.
WRITER_VERSION = "2.0"
# A protobuf header larger than this is not a kernel dump header (real ones are
# a few hundred bytes); refusing it early keeps a hostile length from costing RAM.
MAX_HEADER_BYTES = 64 << 20
MAX_DIMS = 64


class KernelDumpError(DumpFormatError):
    """A kernel dump file is truncated, corrupt, or describes something we cannot decode."""


# ---- codes --------------------------------------------------------------------
# OutputDataType -> (numpy storage dtype, decoded numpy dtype, dtype name).
# Dtypes numpy lacks are stored as their raw bits and decoded exactly to float32.
DT_UNDEFINED = 0
DATA_TYPES: dict[int, tuple[str, str]] = {
    1: ("float32", "float32"), 2: ("float16", "float16"), 3: ("int8", "int8"),
    4: ("uint8", "uint8"), 5: ("int16", "int16"), 6: ("uint16", "uint16"),
    7: ("int32", "int32"), 8: ("int64", "int64"), 9: ("uint32", "uint32"),
    10: ("uint64", "uint64"), 11: ("bool", "bool"), 12: ("float64", "float64"),
    16: ("complex64", "complex64"), 17: ("complex128", "complex128"),
    27: ("uint16", "bfloat16"),
    34: ("uint8", "float8_e5m2"), 35: ("uint8", "float8_e4m3fn"),
}
DATA_TYPE_NAMES = {
    0: "DT_UNDEFINED", 1: "DT_FLOAT", 2: "DT_FLOAT16", 3: "DT_INT8", 4: "DT_UINT8",
    5: "DT_INT16", 6: "DT_UINT16", 7: "DT_INT32", 8: "DT_INT64", 9: "DT_UINT32",
    10: "DT_UINT64", 11: "DT_BOOL", 12: "DT_DOUBLE", 13: "DT_STRING",
    14: "DT_DUAL_SUB_INT8", 15: "DT_DUAL_SUB_UINT8", 16: "DT_COMPLEX64",
    17: "DT_COMPLEX128", 18: "DT_QINT8", 19: "DT_QINT16", 20: "DT_QINT32",
    21: "DT_QUINT8", 22: "DT_QUINT16", 23: "DT_RESOURCE", 24: "DT_STRING_REF",
    25: "DT_DUAL", 26: "DT_VARIANT", 27: "DT_BF16", 29: "DT_UINT1", 32: "DT_COMPLEX32",
    33: "DT_HIFLOAT8", 34: "DT_FLOAT8_E5M2", 35: "DT_FLOAT8_E4M3FN", 36: "DT_FLOAT8_E8M0",
}
CODE_BY_DTYPE = {name: code for code, (_, name) in DATA_TYPES.items()}

FORMAT_NCHW, FORMAT_NHWC, FORMAT_ND = 0, 1, 2
FORMAT_NAMES = {
    0: "NCHW", 1: "NHWC", 2: "ND", 3: "NC1HWC0", 4: "FRACTAL_Z", 5: "NC1C0HWPAD",
    6: "NHWC1C0", 7: "FSR_NCHW", 8: "FRACTAL_DECONV", 9: "C1HWNC0", 16: "HWCN",
    27: "NDHWC", 29: "FRACTAL_NZ", 30: "NCDHW", 32: "NDC1HWC0", 33: "FRACTAL_Z_3D",
}


# ---- message classes, built from a descriptor at import time --------------------
def _build_file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    F = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(
        name="npu_accuracy_toolkit/dump_data.proto", package=PROTO_PACKAGE, syntax="proto3")

    def enum(name, values):
        e = fdp.enum_type.add(name=name)
        for vname, number in values:
            e.value.add(name=vname, number=number)

    enum("OutputDataType", sorted(((n, c) for c, n in DATA_TYPE_NAMES.items()), key=lambda t: t[1]))
    enum("OutputFormat", [(f"FORMAT_{n}", c) for c, n in sorted(FORMAT_NAMES.items())]
         + [("FORMAT_RESERVED", 40)])
    enum("BufferType", [("L1", 0)])

    def message(name, fields):
        m = fdp.message_type.add(name=name)
        for fname, number, ftype, label, type_name in fields:
            f = m.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                f.type_name = f".{PROTO_PACKAGE}.{type_name}"

    opt, rep = F.LABEL_OPTIONAL, F.LABEL_REPEATED
    message("Shape", [("dim", 1, F.TYPE_INT64, rep, None)])
    message("OriginalOp", [
        ("name", 1, F.TYPE_STRING, opt, None), ("output_index", 2, F.TYPE_UINT32, opt, None),
        ("data_type", 3, F.TYPE_ENUM, opt, "OutputDataType"),
        ("format", 4, F.TYPE_ENUM, opt, "OutputFormat")])
    message("OpOutput", [
        ("data_type", 1, F.TYPE_ENUM, opt, "OutputDataType"),
        ("format", 2, F.TYPE_ENUM, opt, "OutputFormat"),
        ("shape", 3, F.TYPE_MESSAGE, opt, "Shape"),
        ("original_op", 4, F.TYPE_MESSAGE, opt, "OriginalOp"),
        ("data", 5, F.TYPE_BYTES, opt, None), ("size", 6, F.TYPE_UINT64, opt, None),
        ("original_shape", 7, F.TYPE_MESSAGE, opt, "Shape"),
        ("sub_format", 8, F.TYPE_INT32, opt, None)])
    message("OpInput", [
        ("data_type", 1, F.TYPE_ENUM, opt, "OutputDataType"),
        ("format", 2, F.TYPE_ENUM, opt, "OutputFormat"),
        ("shape", 3, F.TYPE_MESSAGE, opt, "Shape"),
        ("data", 4, F.TYPE_BYTES, opt, None), ("size", 5, F.TYPE_UINT64, opt, None),
        ("original_shape", 6, F.TYPE_MESSAGE, opt, "Shape"),
        ("sub_format", 7, F.TYPE_INT32, opt, None)])
    message("OpBuffer", [
        ("buffer_type", 1, F.TYPE_ENUM, opt, "BufferType"),
        ("data", 2, F.TYPE_BYTES, opt, None), ("size", 3, F.TYPE_UINT64, opt, None)])
    message("DumpData", [
        ("version", 1, F.TYPE_STRING, opt, None), ("dump_time", 2, F.TYPE_UINT64, opt, None),
        ("output", 3, F.TYPE_MESSAGE, rep, "OpOutput"),
        ("input", 4, F.TYPE_MESSAGE, rep, "OpInput"),
        ("buffer", 5, F.TYPE_MESSAGE, rep, "OpBuffer"),
        ("op_name", 6, F.TYPE_STRING, opt, None)])
    return fdp


# A private pool: never clashes with a real toolkit.dumpdata registered by torch_npu/msprobe.
_POOL = descriptor_pool.DescriptorPool()
_POOL.Add(_build_file_descriptor())


def _message_class(name: str):
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"{PROTO_PACKAGE}.{name}"))


DumpData = _message_class("DumpData")
OpInput = _message_class("OpInput")
OpOutput = _message_class("OpOutput")


# ---- data model ------------------------------------------------------------------
@dataclass
class TensorEntry:
    """One input or output of a kernel dump: metadata from the header plus the raw bytes."""

    kind: str                    # "input" / "output"
    index: int
    data_type: int               # OutputDataType code
    format: int
    shape: tuple[int, ...]
    raw: bytes = b""
    original_shape: tuple[int, ...] = ()
    original_op: str = ""
    offset: int = 0              # where its `size` raw bytes start in the file
    size: int = 0

    @property
    def dtype(self) -> str:
        return DATA_TYPES[self.data_type][1] if self.data_type in DATA_TYPES else ""

    @property
    def decoded_dtype(self) -> np.dtype:
        from dumpfile.read.reader import decode_raw
        storage, name = DATA_TYPES[self.data_type]
        return decode_raw(np.zeros(0, dtype=storage), name).dtype

    def chunks(self, path: str, chunk_bytes: int = 1 << 24):
        """The decoded values, flat in C order, chunk by chunk, read from `path` (the file
        this entry was parsed from): memory is bounded by the chunk, not the tensor."""
        from dumpfile.read.reader import decode_raw
        storage, name = DATA_TYPES[self.data_type]
        item = np.dtype(storage).itemsize
        step = max(item, chunk_bytes - chunk_bytes % item)
        with safety.open_regular(path) as f:
            f.seek(self.offset)
            left = self.size
            while left > 0:
                raw = f.read(min(step, left))
                if len(raw) == 0 or len(raw) % item:
                    raise KernelDumpError(f"{path}: {self.kind} {self.index} is truncated (file changed while read?)")
                left -= len(raw)
                arr = np.frombuffer(raw, dtype=np.dtype(storage).newbyteorder("<")).astype(storage, copy=False)
                yield decode_raw(arr, name)

    def array(self) -> np.ndarray:
        """The tensor as a numpy array (bf16/float8 decoded exactly to float32)."""
        from dumpfile.read.reader import decode_raw   # numpy-only helper shared with the h5 reader
        storage, name = DATA_TYPES[self.data_type]
        arr = np.frombuffer(self.raw, dtype=np.dtype(storage).newbyteorder("<")).reshape(self.shape)
        out = decode_raw(arr.astype(np.dtype(storage), copy=False), name)
        return out if out.flags.writeable else out.copy()   # frombuffer views are read-only


@dataclass
class KernelDump:
    path: str
    op_name: str
    version: str
    dump_time: int
    inputs: list[TensorEntry] = field(default_factory=list)
    outputs: list[TensorEntry] = field(default_factory=list)


# ---- writing -----------------------------------------------------------------------
def _contiguous_le(array: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(array)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return a


def encode_array(array: np.ndarray, dtype_name: str | None = None) -> tuple[int, bytes]:
    """(data type code, raw bytes) of an array. `dtype_name` names a dtype numpy lacks
    (e.g. "bfloat16") whose raw bits `array` holds (uint16)."""
    name = dtype_name or str(array.dtype)
    code = CODE_BY_DTYPE.get(name)
    if code is None:
        raise DumpWriteError(f"kernel dump: dtype {name} has no CANN data type code")
    storage = DATA_TYPES[code][0]
    a = _contiguous_le(array)
    if np.dtype(storage).itemsize != a.dtype.itemsize:
        raise DumpWriteError(f"kernel dump: {name} data must be given as {storage} bits, got {a.dtype}")
    return code, a.tobytes()


@dataclass
class TensorToWrite:
    array: np.ndarray             # values (or raw bits for dtypes numpy lacks)
    dtype_name: str = ""          # "" -> array.dtype
    format: int = FORMAT_ND
    original_op: str = ""         # OpOutput.original_op.name


def write_kernel_dump(path: str | os.PathLike, op_name: str, inputs: Sequence[TensorToWrite],
                      outputs: Sequence[TensorToWrite], *, dump_time: int = 0) -> int:
    """Write one CANN-layout kernel dump file; returns its size in bytes."""
    msg = DumpData(version=WRITER_VERSION, dump_time=int(dump_time), op_name=op_name)
    payload: list[bytes] = []
    for kind, tensors in (("input", inputs), ("output", outputs)):
        for t in tensors:
            code, raw = encode_array(t.array, t.dtype_name or None)
            entry = msg.input.add() if kind == "input" else msg.output.add()
            entry.data_type = code
            entry.format = t.format
            entry.shape.dim.extend(int(d) for d in t.array.shape)
            entry.original_shape.dim.extend(int(d) for d in t.array.shape)
            entry.size = len(raw)
            if kind == "output" and t.original_op:
                entry.original_op.name = t.original_op
            payload.append(raw)
    header = msg.SerializeToString()
    from dumpfile.safe_output import open_output

    path = os.fspath(path)
    try:
        # a new file (temporary, then linked into place): never over a file, never through a link
        with open_output(path, "wb") as f:
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            for raw in payload:
                f.write(raw)
    except OSError as e:
        raise DumpWriteError(f"{path}: cannot write kernel dump: {e.strerror or e}") from e
    return HEADER_LENGTH_BYTES + len(header) + sum(len(p) for p in payload)


# ---- reading -----------------------------------------------------------------------
def _checked_shape(path: str, where: str, dims) -> tuple[int, ...]:
    dims = tuple(int(d) for d in dims)
    if len(dims) > MAX_DIMS:
        raise KernelDumpError(f"{path}: {where} has {len(dims)} dims (corrupt header?)")
    if any(d < 0 for d in dims):
        raise KernelDumpError(f"{path}: {where} has a negative dim in shape {list(dims)}")
    return dims


# numpy refuses an array whose dims multiply (zeros taken as 1) past this many bytes
_MAX_ARRAY_BYTES = 1 << 62


def _checked_extent(path: str, where: str, dims: tuple[int, ...], itemsize: int) -> None:
    extent = itemsize
    for d in dims:
        extent *= max(d, 1)
        if extent > _MAX_ARRAY_BYTES:
            raise KernelDumpError(f"{path}: {where} shape {list(dims)} is too large for any array (corrupt header?)")


# A tensor's bytes may lie in a hole of a sparse file (`truncate -s 8G`): they read as
# zeros without being stored, and `convert` wrote an 8 GB .npy from a file of a few KB.
# Holes inside a tensor's data past this many bytes are refused (a file system that stores
# all-zero blocks as holes, as ZFS with compression does, makes the same refusal for a
# tensor holding more than this of zeros: raise it with $IR2TBE_MAX_HOLE_BYTES).
MAX_HOLE_BYTES = 64 << 20
_MAX_EXTENTS = 4096


def _check_not_sparse(fd: int, path: str, where: str, offset: int, size: int) -> None:
    limit = int(os.environ.get("IR2TBE_MAX_HOLE_BYTES", "") or MAX_HOLE_BYTES)
    if size <= limit or not hasattr(os, "SEEK_HOLE"):
        return
    holes, pos, end = 0, offset, offset + size
    try:
        for _ in range(_MAX_EXTENTS):
            if pos >= end:
                break
            hole = os.lseek(fd, pos, os.SEEK_HOLE)
            if hole >= end:
                break
            try:
                data = os.lseek(fd, hole, os.SEEK_DATA)
            except OSError:                # no data after the hole: it runs to the end of the file
                data = end
            holes += min(data, end) - hole
            pos = data
    except OSError:
        return                             # the file system cannot say: nothing to check
    if holes > limit:
        raise KernelDumpError(f"{path}: {where} declares {size} bytes of which {holes} are holes of a sparse file "
                              "(data it does not hold); refused (set $IR2TBE_MAX_HOLE_BYTES to allow more)")


def read_kernel_dump(path: str | os.PathLike, *, with_data: bool = True) -> KernelDump:
    """Parse a kernel dump, checking every length against the file before reading it.
    A FIFO, device or directory is refused before a blocking open (it would hang)."""
    path = os.fspath(path)
    try:
        # a FIFO (or device) would block open() or never end: refused before it is opened
        f = safety.open_regular(path)
        file_size = os.fstat(f.fileno()).st_size
    except DumpFormatError as e:
        raise KernelDumpError(f"{e} (not a kernel dump)") from None
    except OSError as e:
        raise KernelDumpError(f"{path}: cannot open kernel dump: {e.strerror or e}") from e
    with f:
        if file_size < HEADER_LENGTH_BYTES:
            raise KernelDumpError(f"{path}: {file_size} bytes is too short for a kernel dump "
                                  f"(needs an {HEADER_LENGTH_BYTES}-byte header length)")
        (header_len,) = struct.unpack("<Q", f.read(HEADER_LENGTH_BYTES))
        remaining = file_size - HEADER_LENGTH_BYTES
        if header_len > remaining:
            raise KernelDumpError(f"{path}: header length {header_len} runs past the end of the file "
                                  f"({remaining} bytes after the length field); not a kernel dump or truncated")
        if header_len > MAX_HEADER_BYTES:
            raise KernelDumpError(f"{path}: header length {header_len} is implausibly large")
        msg = DumpData()
        try:
            msg.ParseFromString(f.read(header_len))
        except (DecodeError, RuntimeError, ValueError) as e:
            raise KernelDumpError(f"{path}: protobuf header does not parse as {PROTO_PACKAGE}.DumpData: {e}") from e
        dump = KernelDump(path, msg.op_name, msg.version, int(msg.dump_time))
        offset = HEADER_LENGTH_BYTES + header_len
        entries = [("input", i, t) for i, t in enumerate(msg.input)] + \
                  [("output", i, t) for i, t in enumerate(msg.output)]
        for kind, i, t in entries:
            where = f"{kind} {i}"
            code = int(t.data_type)
            if code not in DATA_TYPES:
                name = DATA_TYPE_NAMES.get(code, "unknown")
                raise KernelDumpError(f"{path}: {where} has data type {code} ({name}) that this reader cannot decode")
            shape = _checked_shape(path, f"{where} shape", t.shape.dim)
            storage = np.dtype(DATA_TYPES[code][0])
            numel = 1
            for d in shape:
                numel *= d          # Python ints: no overflow on hostile dims
            size = int(t.size)
            if size > file_size - offset:
                raise KernelDumpError(f"{path}: {where} size {size} runs past the end of the file "
                                      f"({file_size - offset} bytes left at offset {offset})")
            if numel * storage.itemsize != size:
                raise KernelDumpError(f"{path}: {where} size {size} bytes does not match shape {list(shape)} "
                                      f"of {DATA_TYPE_NAMES.get(code, code)} ({numel * storage.itemsize} bytes)")
            _checked_extent(path, where, shape, storage.itemsize)   # e.g. (0, 2**62): 0 bytes, no array
            _check_not_sparse(f.fileno(), path, where, offset, size)
            raw = b""
            if with_data:
                f.seek(offset)
                raw = f.read(size)
                if len(raw) != size:
                    raise KernelDumpError(f"{path}: {where} is truncated ({len(raw)} of {size} bytes)")
            orig = t.original_op.name if kind == "output" else ""
            entry = TensorEntry(kind, i, code, int(t.format), shape, raw,
                                _checked_shape(path, f"{where} original_shape", t.original_shape.dim), orig,
                                offset=offset, size=size)
            (dump.inputs if kind == "input" else dump.outputs).append(entry)
            offset += size
        return dump
