"""The records a DumpFile hands out (torch-free): `ValueRecord` (one input or output entry),
`OpRecord` (one op: a view of a row of the file's op index, dumpfile.read.opindex) and their
variants for statistics tables and for ops found by walking the groups. Their reads go
back to the file (DumpFile.read_value, .values), so the rules for reading live there."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

import h5py
import numpy as np

from dumpfile import schema as S
from dumpfile import stats_table as T
from dumpfile.errors import DumpFormatError, raised_by_h5py
from dumpfile.printable import printable
from dumpfile.read import legacy
from dumpfile.read.h5util import H5_ERRORS, _attr_str, corrupt_dump_error

if TYPE_CHECKING:
    from dumpfile.read.reader import DumpFile

# the longest optimizer class name reports show (a longer one, or no identifier: none shown)
_OPTIMIZER_NAME_MAX = 64


def shown_place(phase: str, module: str, optimizer: Any) -> tuple[str, str]:
    """(Phase, Module) as reports show an op recorded with `phase` and `module` that the step
    of optimizer class `optimizer` ran (op attribute `optimizer`; a replay departure's field):
    ("optimizer", "AdamW.step") outside any module; as recorded otherwise, and where the name
    is no identifier of at most _OPTIMIZER_NAME_MAX characters (a damaged or hostile file)."""
    if not module and isinstance(optimizer, str) and optimizer.isidentifier() \
            and len(optimizer) <= _OPTIMIZER_NAME_MAX:
        return S.PHASE_OPTIMIZER, f"{optimizer}.step"
    return phase, module


def _guarded(method):
    """h5_errors around a method of a DumpFile (self.path) or of a record (self.file.path)."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:      # a plain try, not h5_errors: free when nothing fails, and shapes are read often
            return method(self, *args, **kwargs)
        except H5_ERRORS as e:
            if not raised_by_h5py(e):
                raise
            owner = getattr(self, "file", self)     # a record's file, or the DumpFile itself
            raise corrupt_dump_error(owner.path, e) from e
    return wrapper




def type_code(attr: Any, where: str) -> int:
    """A `Type` attribute as its integer code (one integer; a hostile or damaged file may
    hold a string, a float or an array there: int() of them raised as an internal error,
    or a float was truncated into another kind of value)."""
    a = np.asarray(attr)
    if a.dtype.kind not in "iu" or a.size != 1 or a.ndim > 1:
        raise DumpFormatError(f"{where}: its Type attribute {printable(repr(attr))[:80]} is not an "
                              "integer code; refused")
    return int(a.reshape(()))


def check_kind(file_path: str, path: str, code: int, is_group: bool) -> None:
    """A value's HDF5 object kind must be its Type's: lists (and tuples) are groups; tensors,
    views, statistics and plain values are datasets. A group where a tensor belongs was
    read as a list of its members; a dataset with a list's Type as a list of nothing."""
    if code in S.LIST_TYPES and not is_group:
        raise DumpFormatError(f"{file_path}: {path}: a list (Type {code}) stored as a dataset, not a group; "
                              "refused")
    if is_group and code not in S.LIST_TYPES:
        raise DumpFormatError(f"{file_path}: {path}: a group where a value of Type {code} (a dataset) belongs; "
                              "refused")


def _sizes(attr: Any, where: str) -> tuple[int, ...]:
    """A `shape` attribute as sizes: integers >= 0 (a hostile or damaged file may hold a
    string, floats or negative sizes there: int() of them raised as an internal error, or
    a negative size was shown as the tensor's)."""
    a = np.asarray(attr)
    if a.size == 0 and a.ndim <= 1:          # a 0-d tensor's (), whatever dtype it was stored as
        return ()
    if a.dtype.kind not in "iu" or a.ndim > 1 or int(a.min()) < 0:
        raise DumpFormatError(f"{where}: its shape attribute {printable(repr(attr))[:80]} is not a list of "
                              "sizes (integers >= 0); refused")
    return tuple(int(x) for x in a.reshape(-1))


@dataclass
class ValueRecord:
    """One input or output entry: a tensor, a view, statistics, a value, or a list."""

    file: "DumpFile"
    path: str
    name: str
    type: int
    attrs: dict[str, Any]
    children: list["ValueRecord"] = field(default_factory=list)

    @property
    def is_tensor(self) -> bool:
        return self.type in S.TENSOR_TYPES

    @property
    def is_list(self) -> bool:
        return self.type in S.LIST_TYPES

    @property
    def is_stats(self) -> bool:
        return self.type == S.TYPE_TENSOR_STATS

    @property
    def dtype(self) -> str:
        d = _attr_str(self.attrs.get(S.ATTR_DTYPE, ""))
        if d or self.type != S.TYPE_TENSOR:
            return d
        # no dtype attribute (the original dumper's files, hand-written ones): the original's
        # DataType (Half stored as F32 is float16, Bool is bool), else the data's own dtype
        try:
            ds = self.file.h5[self.path]
        except (KeyError, TypeError, ValueError, OSError):
            return ""
        return legacy.dtype_of(self.attrs, ds.dtype) if isinstance(ds, h5py.Dataset) else ""

    @property
    @_guarded
    def shape(self) -> tuple[int, ...]:
        a = self.attrs.get(S.ATTR_SHAPE)
        if type(a) is tuple:                 # (records from the catalog: checked ints already)
            return a
        if a is not None:
            return _sizes(a, f"{self.file.path}: {self.path}")
        ds = self.file.h5[self.path]
        return tuple(ds.shape) if isinstance(ds, h5py.Dataset) and ds.shape is not None else ()

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def uninitialized(self) -> bool:
        return bool(self.attrs.get(S.ATTR_UNINITIALIZED, False))

    def read(self) -> Any:
        """Tensor -> numpy array (decoded); stats -> dict; value -> Python value; list -> list."""
        return self.file.read_value(self)

    def stats(self) -> dict[str, float]:
        if not self.is_stats:
            raise DumpFormatError(f"{self.file.path}: {self.path} holds no statistics")
        return self.file.read_value(self)

    def iter_chunks(self, chunk_elements: int = 1 << 22) -> Iterator[np.ndarray]:
        """Flattened (C-order) decoded values in pieces of about `chunk_elements`."""
        yield from self.file.iter_chunks(self, chunk_elements)


class OpRecord:
    """One op of a dump: a view of row `_i` of the file's OpIndex (dumpfile.read.opindex).
    All of a file's ops are held for a whole compare (10^5-10^6 per file): two slots and
    an optional file, no strings or ints of its own."""

    __slots__ = ("_ix", "_i")

    def __init__(self, ix, i: int):
        self._ix = ix
        self._i = i

    @property
    def file(self) -> "DumpFile":
        return self._ix.file

    @file.setter
    def file(self, f: "DumpFile") -> None:
        # a forked compare worker rebinds each op to the file it opened again: the ops of
        # one index move to one copy of it bound to that file (no slot per op for it)
        self._ix = self._ix.bound_to(f)

    @property
    def op(self) -> str:
        return self._ix.names[self._ix.op_code[self._i]]

    @property
    def seqid(self) -> int:
        return self._ix.seqid[self._i]

    @property
    def phase(self) -> str:
        return self._ix.phase_of(self._i)

    @property
    def module(self) -> str:
        return self._ix.modules[self._ix.module_code[self._i]]

    @property
    def grad_fn(self) -> str:
        return self._ix.grad_fns[self._ix.grad_fn_code[self._i]]

    @property
    def index_row(self) -> int:
        """The op's row in /_npu_dumper/index (and the catalog); -1 when it has none."""
        return self._ix.row[self._i]

    def __repr__(self) -> str:
        return f"OpRecord({self.op!r}, {self.seqid}, phase={self.phase!r}, module={self.module!r})"

    def __eq__(self, other) -> bool:
        if not isinstance(other, OpRecord):
            return NotImplemented
        return (self.file is other.file and self.op == other.op and self.seqid == other.seqid)

    __hash__ = None      # (as the dataclass it replaces: equal records are not dict keys)

    @property
    def path(self) -> str:
        return S.op_group_path(self.op, self.seqid)

    @property
    def attrs(self) -> dict[str, Any]:
        """The op group's attributes (read once, when first asked)."""
        cache = self._ix.attrs
        a = cache.get(self._i)
        if a is None:
            a = cache[self._i] = self._read_attrs()
        return a

    @_guarded
    def _read_attrs(self) -> dict[str, Any]:
        from dumpfile.read import safety
        grp = self.file.h5[self.path]
        safety.check_attributes(self.file.path, len(grp.attrs), self.path)
        return {k: (_attr_str(v) if isinstance(v, bytes) else v) for k, v in grp.attrs.items()}

    @property
    def shown_place(self) -> tuple[str, str]:
        """(Phase, Module) as reports show them: an op an optimizer's step ran outside any
        module (op attribute `optimizer`) is the update, Phase "optimizer" and Module
        "AdamW.step", where its recorded phase says forward and its module is empty."""
        module = self.module
        return shown_place(self.phase, module, None if module else self.attrs.get(S.OP_OPTIMIZER))

    def inputs(self) -> dict[str, ValueRecord]:
        return self.file.values(f"{self.path}/{S.INPUT_GROUP}")

    def outputs(self) -> dict[str, ValueRecord]:
        return self.file.values(f"{self.path}/{S.OUTPUT_GROUP}")


@dataclass
class TableValueRecord(ValueRecord):
    """A value of a table-backed statistics file (format 1.1): no HDF5 object of its own;
    `path` is where the tree layout would have put it (for messages and matching)."""

    value: Any = None

    @property
    def shape(self) -> tuple[int, ...]:
        if S.ATTR_SHAPE in self.attrs:
            return tuple(int(x) for x in np.asarray(self.attrs[S.ATTR_SHAPE]).reshape(-1))
        return ()


class _TableOpRecord(OpRecord):
    """An op of a table-backed statistics file: attributes from the index and op_attrs rows."""

    __slots__ = ()

    def _read_attrs(self) -> dict[str, Any]:
        a = {S.OP_SEQID: self.seqid, S.OP_NAME: self.op, S.OP_PHASE: self.phase,
             S.OP_MODULE: self.module, S.OP_GRAD_FN: self.grad_fn}
        a.update(self.file._table.op_attrs.get(self.seqid, {}))
        return a

    def inputs(self) -> dict[str, ValueRecord]:
        return self.file._table_values(self, T.IO_INPUT)

    def outputs(self) -> dict[str, ValueRecord]:
        return self.file._table_values(self, T.IO_OUTPUT)


class _LazyOpRecord(OpRecord):
    """An op found by walking the groups (or asked for by name): phase/module/grad_fn are
    the group's attributes, read when first asked."""

    __slots__ = ()

    @property
    def phase(self) -> str:
        attrs = self.attrs
        if S.OP_PHASE not in attrs:
            # an original file: its ops carry no attributes; backward ops are autograd
            # node names (AddmmBackward)
            return legacy.phase_of(self.op)
        return _attr_str(attrs.get(S.OP_PHASE, ""))

    @property
    def module(self) -> str:
        return _attr_str(self.attrs.get(S.OP_MODULE, ""))

    @property
    def grad_fn(self) -> str:
        return _attr_str(self.attrs.get(S.OP_GRAD_FN, ""))


