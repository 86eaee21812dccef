"""The op-name map used by load-replay: which recorded ops a live op may take inputs from.

The built-in groups and argument renames are plain data in dumpfile.opmap_data (torch-
free, shared with accucmp). Users extend them process-wide with `register_op_map` or
per block with `dumper(..., op_map={...})`; `get_op_map()` (also torch.utils.get_op_map)
returns the map in effect.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Iterator

from dumpfile import opmap_data

_lock = threading.Lock()
_user_ops: dict[str, list[str]] = {}
_user_renames: dict[str, str] = {}


class OpMap(Mapping):
    """Read-only mapping: op packet name -> names it may match; `.renames`: arg name -> aliases.

    Look-ups accept full overload names: map["aten.cudnn_batch_norm.default"] works.
    """

    def __init__(self, extra_ops: Mapping[str, object] | None = None,
                 extra_renames: Mapping[str, str] | None = None):
        ops = {**_user_ops, **{k: ([v] if isinstance(v, str) else list(v)) for k, v in (extra_ops or {}).items()}}
        self._map = opmap_data.build_equivalence(extra={_packet(k): [_packet(x) for x in v]
                                                        for k, v in ops.items()})
        self.renames = opmap_data.build_renames(extra={**_user_renames, **(extra_renames or {})})

    def __getitem__(self, name: str) -> tuple[str, ...]:
        return self._map[_packet(name)]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and _packet(name) in self._map

    def __iter__(self) -> Iterator[str]:
        return iter(self._map)

    def __len__(self) -> int:
        return len(self._map)

    def equivalents(self, name: str) -> tuple[str, ...]:
        """Other op packet names `name` (packet or overload) may match; () when none."""
        return self._map.get(_packet(name), ())

    def __repr__(self) -> str:
        return f"OpMap({len(self._map)} ops, {len(self.renames)} argument renames)"


def _packet(name: str) -> str:
    return opmap_data.packet_of(name.replace("::", "."))


def register_op_map(ops: Mapping[str, object] | None = None, renames: Mapping[str, str] | None = None) -> None:
    """Add equivalences for this process: register_op_map({"mylib.fused_ln": "aten.native_layer_norm"}).

    Values may be one name or a list; names are "namespace.op" or full overload names.
    renames: {"x": "input"} lets an argument stored as "input" feed one named "x".
    """
    with _lock:
        for k, v in (ops or {}).items():
            _user_ops.setdefault(k, []).extend([v] if isinstance(v, str) else list(v))
        _user_renames.update(renames or {})


def clear_user_op_map() -> None:
    """Forget everything register_op_map added (tests)."""
    with _lock:
        _user_ops.clear()
        _user_renames.clear()


def get_op_map(extra: Mapping[str, object] | None = None) -> OpMap:
    """The op-name map in effect: built-in groups + registered entries (+ `extra`)."""
    return OpMap(extra)
