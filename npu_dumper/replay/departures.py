"""What load-replay notes of how the live run departs from the recording (issue 31).

Replay hands each live op the recorded inputs, so a difference in what the live run *does*
would leave no trace: an op the user inserted runs on live inputs and is not dumped, the
next op gets the recorded input again, and compare passes. `DepartureLog` keeps, in
execution order, what the recording cannot explain:

- `inserted`: a live op with no recorded partner (not a by-design cast, collective or
  DTensor op: dumpfile.departures.BY_DESIGN_OPS);
- `missing`: a recorded op the live run never called (same exceptions);
- `argument`: a matched op whose value argument differs from the recorded one, the schema's
  default standing in for an argument one side did not pass (`scale=1.0` where the
  recording used the default None);
- `input`: a tensor input that no replayed op made (a parameter, buffer or the batch, also
  through a by-design cast) whose live value is not the recorded one beyond what the cast to
  the live dtype explains; measured here (relative error, max abs error) and judged by
  compare. Inputs made by a replayed op are the recording's by construction; inputs made by
  an inserted op are that op's departure, not a second one.

The rows go to the replay dump's root attribute `replay_departures` (dumpfile/departures.py).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterable

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten

from dumpfile import departures as D
from dumpfile.read.reader import ValueRecord

from ..capture.opschema import named_args, op_info
from .layout import bitwise_equal
from .matching import live_key

# what made a live tensor's storage, as far as the replay saw (the latest op that wrote it)
_REPLAYED, _INSERTED = "replayed", "inserted"   # (a storage no op made is a leaf: not in the map)
_UNSET = object()


def _storage_ptr(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):     # a wrapper subclass with no storage
        return None


def _live_text(v: Any) -> Any:
    if isinstance(v, torch.dtype):
        return str(v).replace("torch.", "")
    if isinstance(v, (torch.device, torch.layout, torch.memory_format)):
        return str(v)
    if isinstance(v, (list, tuple)):
        return [_live_text(x) for x in v]
    if isinstance(v, torch.SymInt):
        return int(v)
    return v


class DepartureLog:
    def __init__(self, check_inputs: bool = True):
        self.check_inputs = check_inputs
        self.rows: list[dict[str, Any]] = []
        self.counts: Counter = Counter()
        self._made: dict[int, str] = {}          # storage address -> _REPLAYED / _INSERTED / a leaf's made_by
        self._measured: set[tuple] = set()       # (storage, version, recorded path) measured once
        self._at = 0.0                           # the last replayed op's recorded seqid
        self._pending: dict[int, list[dict]] = {}   # live seqid -> rows of an op not yet matched for good

    # ---- per op ---------------------------------------------------------------------
    def matched(self, recorded_seqid: int) -> None:
        self._at = float(recorded_seqid)

    def forget(self, ev) -> None:
        """The op turned out not to fit after all (its rows were about a wrong partner)."""
        for row in self._pending.pop(ev.seqid, ()):
            self.rows.remove(row)
            self.counts[row["kind"]] -= 1

    def _add(self, ev, kind: str, **fields) -> dict:
        row = {"kind": kind, "op": ev.name, "module": ev.module, "phase": ev.phase, "seqid": ev.seqid,
               "at": self._at if kind != D.INSERTED else self._at + 0.5, **fields}
        self.rows.append(row)
        self.counts[kind] += 1
        self._pending.setdefault(ev.seqid, []).append(row)
        return row

    def unmatched(self, ev, why: str, *, by_design: bool, live: dict | None) -> None:
        """A live op replay runs on its live inputs. Its outputs' provenance is noted in
        outputs_made; here, whether it is a departure."""
        self._pending.pop(ev.seqid, None)
        if by_design:
            ev.notes["replay_made"] = _REPLAYED          # (a collective's result: the run's own)
            return
        if D.is_by_design_op(ev.name):
            # a cast: its output is what its input was (a cast of a parameter is still a
            # parameter, a cast of an activation an activation)
            ev.notes["replay_made"] = self._made_of(live or {})
            return
        ev.notes["replay_made"] = _INSERTED
        self._add(ev, D.INSERTED, reason=why)

    def _made_of(self, live: dict) -> Any:
        flat, _ = tree_flatten(list(live.values()))
        for t in flat:
            if isinstance(t, torch.Tensor):
                ptr = _storage_ptr(t)
                return self._made.get(ptr, "leaf") if ptr is not None else _REPLAYED
        return _REPLAYED

    def outputs_made(self, ev) -> None:
        """After an op ran: which storages it made, and as what."""
        self._pending.pop(ev.seqid, None)
        made = _REPLAYED if ev.notes.get("replay_matched") else ev.notes.get("replay_made", _REPLAYED)
        if made == "leaf":
            made = f"leaf:{ev.name}"             # a cast of a leaf: checked where it is read
        flat, _ = tree_flatten(ev.outputs)
        written = op_info(ev.func).written     # in-place and hidden writes (batch norm's running stats)
        if written:
            flat += [v for name, _, v in named_args(op_info(ev.func), ev.args, ev.kwargs) if name in written]
            flat, _ = tree_flatten(flat)
        for t in flat:
            if isinstance(t, torch.Tensor):
                ptr = _storage_ptr(t)
                if ptr is not None:
                    self._made[ptr] = made

    def check_arguments(self, ev, info, live: dict[str, Any], entry) -> None:
        """Value arguments of a matched op that differ from the recorded call's."""
        inputs = entry.inputs
        for i, name in enumerate(info.arg_names):
            if "Tensor" in info.arg_types[i] or name in D.PLACEMENT_ARGUMENTS:
                continue
            lv = live.get(name, _UNSET)
            if isinstance(lv, torch.Tensor) or (isinstance(lv, (list, tuple))
                                                 and any(isinstance(x, torch.Tensor) for x in lv)):
                continue
            rec = inputs.get(name)
            if rec is not None and (rec.is_tensor or rec.is_list and any(c.is_tensor for c in rec.children)):
                continue
            if lv is _UNSET and rec is None:
                continue                        # neither side passed it: both the default
            default = info.defaults[i] if info.has_default[i] else _UNSET
            if lv is _UNSET:
                if default is _UNSET:
                    continue
                lv = default
            lk = live_key(lv)
            try:
                rk = entry.key(name) if rec is not None else (live_key(default) if default is not _UNSET else _UNSET)
            except Exception:  # noqa: BLE001 - an unreadable recorded value: matching said it agrees
                continue
            if rk is _UNSET or lk is None or rk is None or lk == rk:
                continue
            golden = rec.read() if rec is not None else default
            live_v, golden_v = _live_text(lv), _live_text(golden)
            if D.argument_change_is_by_design(name, live_v, golden_v):
                continue
            live_t = D.value_text(live_v) + (" (the default)" if name not in live else "")
            golden_t = D.value_text(golden_v) + (" (the default)" if rec is None else "")
            self._add(ev, D.ARGUMENT, argument=name, live=live_t, golden=golden_t,
                      golden_seqid=entry.record.seqid, at=float(entry.record.seqid))

    def check_input(self, ev, name: str, value: torch.Tensor, rec: ValueRecord, load, at: int) -> None:
        """A tensor input no replayed op made: compare its live value with the recorded one."""
        if not self.check_inputs or value.is_complex() or value.layout != torch.strided:
            return
        ptr = _storage_ptr(value)
        if ptr is None:
            return
        made = self._made.get(ptr)
        if made is not None and not made.startswith("leaf"):
            return                      # made by a replayed op (or an inserted one: its own row)
        key = (ptr, value._version, value.dtype, tuple(value.shape), tuple(value.stride()),
               value.storage_offset(), rec.path)
        if key in self._measured:
            return
        self._measured.add(key)
        src = load(rec)
        if src.shape != value.shape:
            src = src.reshape(value.shape)
        with torch.no_grad(), _disable_current_modes():
            # the recorded value cast to the live dtype, bit for bit: what a device or
            # precision change does to a parameter by design (autocast's weight cast)
            if bitwise_equal(value, src if src.dtype == value.dtype and src.device == value.device
                             else src.to(device=value.device, dtype=value.dtype)):
                return
            wide = torch.float64 if torch.float64 in (value.dtype, src.dtype) else torch.float32
            a = value.detach().reshape(-1).to(wide)
            b = src.reshape(-1).to(device=a.device, dtype=wide)
            finite = torch.isfinite(a) & torch.isfinite(b)
            if not bool(finite.all()):
                same = (a == b) | (torch.isnan(a) & torch.isnan(b))
                if bool(same[~finite].all()):
                    a, b = a[finite], b[finite]
                else:
                    self._add(ev, D.INPUT, argument=name, rel_err=float("nan"), dtype=_dtype_name(value.dtype),
                              made_by=made[5:] if made else "", golden_seqid=at, at=float(at),
                              reason="NaN/Inf where the recording has none")
                    return
            d = a - b
            err = float(torch.linalg.vector_norm(d)) if d.numel() else 0.0
            ref = float(torch.linalg.vector_norm(b)) if b.numel() else 0.0
            max_abs = float(d.abs().max()) if d.numel() else 0.0
            abs_max = float(b.abs().max()) if b.numel() else 0.0
        if err == 0.0:
            return                      # equal values in another dtype: the cast was exact
        rel = err / ref if ref > 0 else float("nan")
        self._add(ev, D.INPUT, argument=name, rel_err=rel, max_abs_err=max_abs, golden_abs_max=abs_max,
                  dtype=_dtype_name(value.dtype), golden=str(rec.dtype), made_by=made[5:] if made else "",
                  golden_seqid=at, at=float(at))

    # ---- block exit ---------------------------------------------------------------------
    def missing(self, unused: Iterable) -> None:
        """Recorded ops the live run never called, at their place in the recording."""
        rows = []
        for entry in unused:
            rec = entry.record
            if D.is_by_design_op(rec.op) or _holds_dtensor(entry):
                continue
            rows.append({"kind": D.MISSING, "op": rec.op, "module": rec.module, "phase": rec.phase,
                         "golden_seqid": rec.seqid, "at": float(rec.seqid)})
        self.rows.extend(rows)
        self.counts[D.MISSING] += len(rows)
        # execution order on the recording's axis (a missing op sits where the recording had it)
        self.rows.sort(key=lambda r: (r["at"], r.get("seqid", 0)))
        self._pending.clear()

    def first_text(self) -> str:
        if not self.rows:
            return ""
        r = self.rows[0]
        where = r.get("module") or "(no module)"
        if r["kind"] == D.ARGUMENT:
            return f"{where} {r['op']}: argument {r['argument']} {r['live']}, golden {r['golden']}"
        if r["kind"] == D.INPUT:
            return f"{where} {r['op']}: input {r['argument']} differs from the recording"
        return f"{where} {r['op']} {r['kind']}"

    def encode(self) -> str:
        return D.encode(self.rows, {k: v for k, v in self.counts.items() if v > 0})


def _holds_dtensor(entry) -> bool:
    """A recorded op with DTensor arguments: replay runs those live (never matched)."""
    try:
        return any("dtensor" in rec.attrs for rec in entry.inputs.values())
    except Exception:  # noqa: BLE001 - unreadable: judged as any other op
        return False


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
