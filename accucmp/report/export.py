"""`accucmp export`: a dump in the original Ascend layout (`--layout legacy`), which the
real `msaccucmp.py compare` reads, and back (`--layout native`). Torch-free.

Rules (dumpfile/read/legacy.py, docs/FORMAT.md "The original layout"): op groups at the root
named by `legacy_names`, groups without attributes, no empty groups, values with only the
original's attributes (`Type`, `DataType`, `DeviceType`, `FormatType`, `Stride`; plus
`source_dtype` where the original had no DataType), views materialised, Half as float32
with DataType 10, bfloat16/float8 as float32 with DataType 1 and `source_dtype`. Our
bookkeeping (full op names, the source's root attributes) is one JSON root attribute,
`npu_dumper`: outside the op tree, where the original's readers never look.
"""

from __future__ import annotations

import json
import os

import h5py
import numpy as np

from dumpfile.read import legacy as L
from dumpfile import schema as S
from dumpfile import jsontext
from dumpfile.errors import DumpFormatError, DumpWriteError
from dumpfile.read.reader import DumpFile, ValueRecord
from dumpfile.safe_output import output_path
from dumpfile.write.writer import DumpWriter, TensorMeta

EXPORT_ATTR = "npu_dumper"      # root attribute of a legacy export: JSON bookkeeping
LAYOUTS = ("legacy", "native")


class ExportError(Exception):
    pass


def _tensor_for_legacy(rec: ValueRecord) -> tuple[np.ndarray, dict] | None:
    """(data, attrs) of a tensor entry in the original layout; None: not representable."""
    dtype = rec.dtype
    if rec.uninitialized:
        return None            # garbage values: the original tool would compare them
    if dtype in L.ORIGINAL_DATA_TYPES:
        code = L.ORIGINAL_DATA_TYPES[dtype]
        extra = {}
    elif dtype in L.UPCAST_TO_FLOAT32:
        code, extra = 1, {S.ATTR_SOURCE_DTYPE: dtype}
    else:
        return None            # complex, unsigned 16-64 bit: no original DataType
    data = np.asarray(rec.read())
    if dtype == "float16" or dtype in L.UPCAST_TO_FLOAT32:
        data = data.astype(np.float32)      # the original stored Half as F32; exact
    device = rec.attrs.get(S.ATTR_DEVICE)
    if isinstance(device, bytes):
        device = device.decode("utf-8", "replace")
    if device is not None:
        dev_code = L.ORIGINAL_DEVICE_TYPES.get(str(device).split(":")[0], 0)
    else:       # an original file: its own DeviceType when it is one of the original's
        dev_code = int(rec.attrs.get(S.ATTR_DEVICE_TYPE, 0))
        dev_code = dev_code if dev_code in L.ORIGINAL_DEVICE_TYPES.values() else 0
    attrs = {
        S.ATTR_TYPE: np.int64(S.TYPE_TENSOR),
        S.ATTR_DATA_TYPE: np.int64(code),
        S.ATTR_DEVICE_TYPE: np.int64(dev_code),
        S.ATTR_FORMAT_TYPE: np.int64(int(rec.attrs.get(S.ATTR_FORMAT_TYPE, S.FORMAT_ND))),
        S.ATTR_STRIDE: np.asarray(S.contiguous_strides(data.shape), dtype=np.int64),
        **extra,
    }
    return data, attrs


def _write_legacy_value(parent: h5py.Group, name: str, rec: ValueRecord, device_type: int | None,
                        counts: dict) -> bool:
    """Write one entry; False when nothing was written (so no empty group is left)."""
    if rec.is_list:
        grp = parent.create_group(name)
        wrote = False
        for c in rec.children:
            wrote |= _write_legacy_value(grp, c.name, c, device_type, counts)
        if not wrote:
            del parent[name]
        return wrote
    if rec.type in (S.TYPE_TENSOR, S.TYPE_TENSOR_VIEW):
        got = _tensor_for_legacy(rec)
        if got is None:
            counts["skipped_tensors"] += 1
            return False
        data, attrs = got
        if device_type is not None:
            attrs[S.ATTR_DEVICE_TYPE] = np.int64(device_type)
        ds = parent.create_dataset(name, data=data)
        for k, v in attrs.items():
            ds.attrs[k] = v
        counts["tensors"] += 1
        return True
    if rec.type in L.ORIGINAL_VALUE_TYPES:
        try:
            val = rec.file.h5[rec.path][()]
        except (KeyError, OSError, ValueError, TypeError):
            return False
        ds = parent.create_dataset(name, data=val)
        ds.attrs[S.ATTR_TYPE] = np.int64(rec.type)
        return True
    counts["skipped_values"] += 1
    return False          # our own value kinds (None, str, device, stats...): the original had none


# op group attributes the legacy layout carries in its op tree (the group names) or in the
# bookkeeping's "op_attrs"; every other one (a load-replay's replayed, own_error,
# input_dtypes, compute_dtype, ...) goes to the bookkeeping's "op_extra"
_OP_TREE_ATTRS = (S.OP_SEQID, S.OP_NAME, S.OP_PHASE, S.OP_MODULE, S.OP_GRAD_FN)
# root attributes the writer of the native file sets itself
_WRITER_ROOT_ATTRS = (S.ROOT_FORMAT, S.ROOT_FORMAT_VERSION, S.ROOT_MODE, S.ROOT_COMPLETE, S.ROOT_CREATED,
                      S.ROOT_NUM_OPS)


def _jsonable(v):
    """An HDF5 attribute value as JSON can hold it (None: it cannot)."""
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    if isinstance(v, (np.integer, np.floating, np.bool_)):
        v = v.item()
    if isinstance(v, (str, bool, int)) or (isinstance(v, float) and np.isfinite(v)):
        return v
    if isinstance(v, np.ndarray) and v.dtype.kind in "biuf" and v.ndim == 1:
        return {"array": v.tolist(), "dtype": str(v.dtype)}
    return None


def _from_json(v):
    if isinstance(v, dict) and "array" in v:
        return np.asarray(v["array"], dtype=v.get("dtype"))
    return v


def _name_text(name) -> str:
    """An attribute's name as JSON text: h5py hands a name that is not UTF-8 (a damaged
    file's) as bytes, which json.dumps refuses as a key (an internal error, found by
    benchmarks/fuzz_files.py --seed 41: 4 bit flips in a dump)."""
    return name.decode("utf-8", "replace") if isinstance(name, bytes) else str(name)


def export_legacy(src: str, dst: str, *, device_type: str | None = None) -> dict:
    counts = {"ops": 0, "tensors": 0, "skipped_tensors": 0, "skipped_ops": 0, "skipped_values": 0,
              "skipped_attrs": 0}
    dev = None if device_type in (None, "keep") else L.ORIGINAL_DEVICE_TYPES[device_type]
    with DumpFile(src) as f:
        if f.is_table:
            raise ExportError(f"{src}: a statistics-only dump has no tensors to export")
        ops = f.ops()
        names = L.legacy_names(o.op for o in ops)
        tmp = dst          # run_export hands a fresh temporary file (dumpfile.safe_output)
        # v108 object headers: the bookkeeping attribute may pass 64 KB (dense attribute
        # storage); any HDF5 >= 1.8 reads the file
        op_attrs: dict[str, list] = {}
        op_extra: dict[str, dict] = {}
        with h5py.File(tmp, "w", libver=("v108", "v110")) as out:
            for op in ops:
                lname = names[op.op]
                grp = out.require_group(lname).create_group(str(op.seqid))
                wrote = False
                for io, values in ((S.INPUT_GROUP, op.inputs()), (S.OUTPUT_GROUP, op.outputs())):
                    if not values:
                        continue
                    iog = grp.create_group(io)
                    w = False
                    for name, rec in values.items():
                        w |= _write_legacy_value(iog, name, rec, dev, counts)
                    if not w:
                        del grp[io]
                    wrote |= w
                if wrote:
                    counts["ops"] += 1
                    if op.phase == S.PHASE_BACKWARD or op.module or op.grad_fn:
                        op_attrs[f"{lname}/{op.seqid}"] = [op.phase, op.module, op.grad_fn]
                    extra = {}
                    for k, v in f.h5[op.path].attrs.items():
                        if k in _OP_TREE_ATTRS:
                            continue
                        j = _jsonable(v)
                        if j is None:
                            counts["skipped_attrs"] += 1
                        else:
                            extra[_name_text(k)] = j
                    if extra:
                        op_extra[f"{lname}/{op.seqid}"] = extra
                else:
                    del out[lname][str(op.seqid)]
                    counts["skipped_ops"] += 1
                    if not len(out[lname]):
                        del out[lname]
            book = {"layout": "legacy", "source": os.path.abspath(src),
                    "ops": {v: k for k, v in names.items() if v in out},
                    # "{group}/{seqid}": [phase, module, grad_fn] where not forward/""/""
                    "op_attrs": op_attrs,
                    # "{group}/{seqid}": the op's other attributes (a load-replay's replayed,
                    # own_error, input_dtypes, compute_dtype): what `--layout native` restores
                    "op_extra": op_extra,
                    "root": {_name_text(k): (j if (j := _jsonable(v)) is not None else str(v))
                             for k, v in f.attrs.items()}}
            out.attrs[EXPORT_ATTR] = json.dumps(book, default=str)
    return counts


def _meta(rec: ValueRecord, data: np.ndarray) -> TensorMeta:
    dev_code = rec.attrs.get(S.ATTR_DEVICE_TYPE)
    by_code = {v: k for k, v in L.ORIGINAL_DEVICE_TYPES.items()}
    device = by_code.get(int(dev_code), "cpu") if dev_code is not None else "cpu"
    return TensorMeta(dtype=rec.dtype, shape=tuple(data.shape),
                      stride=S.contiguous_strides(data.shape), device=device)


def _stored(data: np.ndarray, dtype: str) -> np.ndarray:
    """Our storage form of decoded values (schema.STORAGE_NUMPY_DTYPE)."""
    if dtype == "bfloat16":
        bits = np.asarray(data, dtype=np.float32).view(np.uint32)
        # values came from bfloat16 (exact in float32): the high half is the bf16 bits
        return (bits >> 16).astype(np.uint16)
    want = S.STORAGE_NUMPY_DTYPE.get(dtype)
    return np.asarray(data).astype(want) if want else np.asarray(data)


def export_native(src: str, dst: str) -> dict:
    """An original-layout file (or a legacy export) -> our format: op names restored from the
    export's map (an original file's names are kept: compare matches them to ours), phases
    from the names, dtypes from DataType / source_dtype, index and catalog added."""
    counts = {"ops": 0, "tensors": 0, "skipped_tensors": 0, "skipped_ops": 0}
    with DumpFile(src) as f:
        if f.is_table:
            raise ExportError(f"{src}: a statistics-only dump is already in the native format")
        full, extra, source_root, more = _bookkeeping(f.attrs.get(EXPORT_ATTR), src)
        device = _first_device(f)
        root = {S.ROOT_DEVICE: device, S.ROOT_DEVICE_TYPE: S.device_type_code(device)}
        # a legacy export of ours: the source's root attributes (its mode above all: a
        # load-replay dump pairs by seqid and compares outputs only)
        mode = source_root.get(S.ROOT_MODE)
        mode = mode if mode in S.MODES else S.MODE_DUMP
        root.update({k: _from_json(v) for k, v in source_root.items() if k not in _WRITER_ROOT_ATTRS})
        with DumpWriter(dst, mode=mode, root_attrs=root) as w:
            for op in f.ops():
                name = full.get(op.op, op.op)
                phase, module, grad_fn = extra.get(f"{op.op}/{op.seqid}", [op.phase or L.phase_of(op.op), "", ""])
                attrs = {k: _from_json(v) for k, v in more.get(f"{op.op}/{op.seqid}", {}).items()}
                w.begin_op(name, op.seqid, phase=phase or S.PHASE_FORWARD, module=module, grad_fn=grad_fn,
                           attrs=attrs or None)
                for parent, values in zip(w.io_groups(), (op.inputs(), op.outputs())):
                    for vname, rec in values.items():
                        _write_native_value(w, parent, vname, rec, counts)
                w.end_op()
                counts["ops"] += 1
    return counts


def _bookkeeping(raw, src: str) -> tuple[dict[str, str], dict[str, tuple[str, str, str]], dict, dict]:
    """The legacy export's bookkeeping attribute (export_legacy writes it): the original
    names' map {legacy name: our op name} and {"{group}/{seqid}": (phase, module,
    grad_fn)}, checked where it is read: the file is input, and invalid JSON, a list where
    an object belongs, numbers where names belong or short tuples raised internal errors.
    Also the source's root attributes and each op's other attributes ({"{group}/{seqid}":
    {name: value}}), what --layout native restores. No attribute (an original file): all empty."""
    if raw is None:
        return {}, {}, {}, {}
    where = f"{src}: root attribute {EXPORT_ATTR!r}"
    if isinstance(raw, bytes):
        raw = raw.decode("utf-8", "replace")
    if not isinstance(raw, str):
        raise DumpFormatError(f"{where} is not JSON text; refused")
    if not raw:
        return {}, {}, {}, {}
    try:
        book = jsontext.loads(raw)
    except ValueError as e:
        raise DumpFormatError(f"{where} is not valid JSON ({e}); refused") from None
    ops = book.get("ops", {}) if isinstance(book, dict) else None
    extra = book.get("op_attrs", {}) if isinstance(book, dict) else None
    if not isinstance(ops, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in ops.items()):
        raise DumpFormatError(f"{where}: its \"ops\" is not a map of op names to op names; refused")
    if not isinstance(extra, dict) or not all(
            isinstance(v, list) and len(v) == 3 and all(isinstance(x, str) for x in v) for v in extra.values()):
        raise DumpFormatError(f"{where}: its \"op_attrs\" is not a map of ops to [phase, module, grad_fn]; "
                              "refused")
    root = book.get("root", {})
    more = book.get("op_extra", {})
    if not isinstance(root, dict) or not all(isinstance(k, str) for k in root):
        raise DumpFormatError(f"{where}: its \"root\" is not a map of attribute names; refused")
    if not isinstance(more, dict) or not all(isinstance(v, dict) and all(isinstance(k, str) for k in v)
                                             for v in more.values()):
        raise DumpFormatError(f"{where}: its \"op_extra\" is not a map of ops to attributes; refused")
    return ops, {k: tuple(v) for k, v in extra.items()}, root, more


def _first_device(f: DumpFile) -> str:
    """The device of the first tensor (the original's DeviceType code), as a dump's root says."""
    by_code = {v: k for k, v in L.ORIGINAL_DEVICE_TYPES.items()}
    for op in f.ops():
        for values in (op.inputs(), op.outputs()):
            for rec in values.values():
                if rec.is_tensor and S.ATTR_DEVICE_TYPE in rec.attrs:
                    return by_code.get(int(rec.attrs[S.ATTR_DEVICE_TYPE]), "cpu")
    return "cpu"


def _write_native_value(w: DumpWriter, parent, name: str, rec: ValueRecord, counts: dict) -> None:
    if rec.is_list:
        grp = w.create_list(parent, name, S.TYPE_TENSOR_LIST, len(rec.children))
        for c in rec.children:
            _write_native_value(w, grp, c.name, c, counts)
        return
    if rec.is_tensor:
        data = np.asarray(rec.read())
        w.write_tensor(parent, name, _stored(data, rec.dtype), _meta(rec, data))
        counts["tensors"] += 1
        return
    val = rec.read()
    w.write_value(parent, name, val)


def run_export(src: str, dst: str, layout: str, *, device_type: str | None = None,
               force: bool = False) -> dict:
    if layout not in LAYOUTS:
        raise ExportError(f"unknown layout {layout!r}; use one of {', '.join(LAYOUTS)}")
    if os.path.abspath(src) == os.path.abspath(dst):
        raise ExportError(f"{dst}: the output must not be the input file")
    try:
        # written to a temporary file in dst's folder and renamed into place: never through
        # a link, never over an existing file unless `force` (dumpfile.safe_output)
        with output_path(dst, force=force) as tmp:
            if layout == "legacy":
                return export_legacy(src, tmp, device_type=device_type)
            return export_native(src, tmp)
    except (DumpFormatError, DumpWriteError) as e:
        raise ExportError(str(e)) from e
    except OSError as e:
        raise ExportError(f"{dst}: cannot write ({e})") from e


def not_carried(counts: dict, layout: str) -> list[str]:
    """What an export could not carry, one line each (nothing: the round trip keeps it all)."""
    lines = []
    if counts.get("skipped_tensors"):
        lines.append(f"{counts['skipped_tensors']} tensors with no {layout} form (uninitialized memory, "
                     "complex or unsigned 16-64 bit dtypes)")
    if counts.get("skipped_values"):
        lines.append(f"{counts['skipped_values']} non-tensor values the original layout has no Type for "
                     "(None, strings, devices, dtypes)")
    if counts.get("skipped_ops"):
        lines.append(f"{counts['skipped_ops']} ops with no tensor the {layout} layout can hold")
    if counts.get("skipped_attrs"):
        lines.append(f"{counts['skipped_attrs']} op attributes that are not numbers, strings or 1-D arrays")
    return lines
