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
from typing import Any, Callable, Iterable

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten

from dumpfile import departures as D
from dumpfile import schema as S
from dumpfile.opclass import is_cast
from dumpfile.read.reader import ValueRecord

from ..capture.opschema import named_args, op_info
from . import heap
from .layout import CollectiveWrites, StorageMap, bitwise_equal, storage_key
from .matching import live_key
from .own_error import computes_coarse

# what made a live tensor's storage, as far as the replay saw (the latest op that wrote it)
_REPLAYED, _INSERTED = "replayed", "inserted"   # (a storage no op made is a leaf: not in the map)
# what a cast that rounds a replayed op's result makes: (ROUNDED, the cast, the coarsest dtype)
ROUNDED = "rounded"
_UNSET = object()


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
    def __init__(self, check_inputs: bool = True, structure: bool = True):
        self.check_inputs = check_inputs
        self.structure = structure          # record inserted and missing ops
        self.rows: list[dict[str, Any]] = []
        self.counts: Counter = Counter()
        self._made = StorageMap()                # storage -> _REPLAYED / _INSERTED / a leaf's made_by
        self._measured = StorageMap()            # storage -> {(version, layout, recorded path)} measured once
        self._at = 0.0                           # the last replayed op's recorded seqid
        self._pending: dict[int, list[dict]] = {}   # live seqid -> rows of an op not yet matched for good
        self.unread_inserted = 0                  # inserted ops whose result no replayed op read
        self.skipped_copies = 0                   # missing ops whose recorded result is an input
        self._computed_coarse = False             # an op other than a cast computed below float32
        self._run_live: Counter = Counter()       # op -> calls run live by design (collectives, DTensor ops)
        self._collective = CollectiveWrites()     # storages a collective wrote last
        self.source: dict[str, Any] = {}          # the recording's identity (dumpfile.departures.source_of)

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
        optimizer = ev.group_attrs.get(S.OP_OPTIMIZER)
        if optimizer:
            row["optimizer"] = optimizer        # (the op attribute: an optimizer's step ran it)
        self.rows.append(row)
        self.counts[kind] += 1
        self._pending.setdefault(ev.seqid, []).append(row)
        return row

    def unmatched(self, ev, why: str, *, by_design: bool, live: dict | None,
                  counts_as_recorded: bool = True) -> None:
        """A live op replay runs on its live inputs. Its outputs' provenance is noted in
        outputs_made; here, whether it is a departure. `counts_as_recorded`: a by-design op
        that stands for a recorded call of it (a collective, a DTensor op), which is then not
        missing; not so activation checkpointing's re-run of a forward op or a loss scaler's
        op, which have no recorded call to excuse."""
        self._pending.pop(ev.seqid, None)
        if by_design:
            ev.notes["replay_made"] = _REPLAYED          # (a collective's result: the run's own)
            if counts_as_recorded:
                self._run_live[ev.name] += 1             # its recorded call is not missing
            return
        if D.is_by_design_op(ev.name) or _restride_only(ev, live or {}) \
                or (D.op_packet(ev.name) in D.VALUE_FREE and not op_info(ev.func).is_random):
            # a cast: its output is what its input was (a cast of a parameter is still a
            # parameter, a cast of an activation an activation); so is a restride that
            # moves no element, and what `new_zeros` makes holds no value of the run (what is
            # written into it is checked where a replayed op reads it)
            # (what `copy_` writes is what its source was, not what its destination held)
            written = op_info(ev.func).written
            ev.notes["replay_made"] = self._made_of({k: v for k, v in (live or {}).items() if k not in written})
            return
        if not self.structure:
            ev.notes["replay_made"] = _REPLAYED
            return
        row = self._add(ev, D.INSERTED, reason=why)
        # a departure once a replayed op reads what it made (check_input marks it): an op
        # whose result nothing replayed reads (a model's float16-only overflow check) changes
        # no value the comparison sees. One that updates a tensor in place may change what
        # the step ends with (a gradient): outputs_made keeps it when its write changed it
        row["_consumed"] = False
        before = self._written_before(ev, live or {})
        if before:
            ev.notes["replay_written_before"] = before
        ev.notes["replay_made"] = ("inserted", row)
        if not op_info(ev.func).written:
            ev.notes["replay_inserted_inputs"] = [t for t in tree_flatten(list((live or {}).values()))[0]
                                                  if isinstance(t, torch.Tensor)]

    def _written_before(self, ev, live: dict) -> list:
        """[(argument, tensor, copy of its values)] of the tensors an inserted op updates in
        place (not an out= buffer, not an op that overwrites what it writes: zero_, fill_),
        taken before it runs: outputs_made compares them after."""
        info = op_info(ev.func)
        if not info.written or D.op_packet(ev.name) in D.OVERWRITING_OPS:
            return []
        out = []
        for name in info.written:
            if name in info.out_args:
                continue
            flat, _ = tree_flatten(live.get(name))
            for t in flat:
                if isinstance(t, torch.Tensor) and storage_key(t) is not None and t.layout == torch.strided:
                    with torch.no_grad(), _disable_current_modes():
                        out.append((name, t, t.detach().clone()))
        return out

    @staticmethod
    def _changed_by_write(ev, before: list) -> str:
        """The argument whose values an inserted in-place op changed, unless it then equals
        another of the op's tensor inputs (autograd's `add_` of a gradient into a .grad
        zeroed with set_to_none=False: what the golden's .grad got without it); ''."""
        others = [t for t in tree_flatten([ev.args, ev.kwargs])[0] if isinstance(t, torch.Tensor)]
        with torch.no_grad(), _disable_current_modes():
            for name, t, old in before:
                try:
                    if torch.equal(t, old):
                        continue
                    if any(o is not t and o.shape == t.shape and o.dtype == t.dtype and o.device == t.device
                           and torch.equal(t, o) for o in others):
                        continue
                except RuntimeError:
                    pass
                return name
        return ""

    def _made_of(self, live: dict) -> Any:
        """What a cast's output is: what its input was. A leaf read through casts is
        ("leaf", the cast, the coarsest floating dtype along the way): a bf16 model's fp32
        buffer upcast for a rotary embedding holds bf16 rounding by design."""
        flat, _ = tree_flatten(list(live.values()))
        for t in flat:
            if isinstance(t, torch.Tensor):
                if storage_key(t) is None:
                    return _REPLAYED
                made = self._made.get(t)
                if made is None:
                    return ("leaf", "", t.dtype)
                return made
        return _REPLAYED

    def stood_in(self, ev, row: dict) -> None:
        """The inserted op `row` computed what recorded ops of its module did (the replay
        checked its result against theirs: ReplayPolicy._stood_in_for): no departure, and its
        result counts as replayed."""
        if row in self.rows:
            self.rows.remove(row)
            self.counts[row["kind"]] -= 1
        pending = self._pending.get(ev.seqid)
        if pending is not None and row in pending:
            pending.remove(row)
        ev.notes["replay_made"] = _REPLAYED

    def outputs_made(self, ev) -> None:
        """After an op ran: which storages it made, and as what."""
        self._pending.pop(ev.seqid, None)
        made = _REPLAYED if ev.notes.get("replay_matched") else ev.notes.get("replay_made", _REPLAYED)
        before = ev.notes.pop("replay_written_before", None)
        if before and isinstance(made, tuple) and made[0] == "inserted":
            changed = self._changed_by_write(ev, before)
            if changed:
                # nothing after it in the step may read the tensor it changed (a .grad not zeroed
                # before the step, gradients a clipping the golden lacks scaled): the step ends
                # with the change, so it departs whether or not a replayed op reads it
                made[1]["_consumed"] = True
                made[1]["reason"] = (made[1].get("reason", "") + f"; it changes its input {changed} in place, "
                                     "and the step ends with that change").lstrip("; ")
        if isinstance(made, tuple) and made[0] == "inserted":
            same = _returns_an_input(ev.outputs, ev.notes.get("replay_inserted_inputs", ()))
            if same is not None:
                # it computed nothing here (a clamp that clipped nothing, a where that kept
                # everything: a model's own float16 guard): no departure; its result is what
                # its input was
                made[1]["_identity"] = True
                made = self._made.get(same, ("leaf", "", same.dtype)) if storage_key(same) is not None \
                    else _REPLAYED
        if isinstance(made, tuple) and made[0] == "leaf":   # a cast of a leaf: checked where it is read
            out = next((t for t in tree_flatten(ev.outputs)[0] if isinstance(t, torch.Tensor)), None)
            made = ("leaf", made[1] or ev.name, _coarser(made[2], out.dtype) if out is not None else made[2])
        elif is_cast(ev.name) and not ev.notes.get("replay_matched") and not self._computed_coarse:
            # a cast that rounds an op's result to a coarser dtype (h.to(bfloat16)), and the casts
            # that carry it on: checked where an op computing in a finer dtype reads it
            out = next((t for t in tree_flatten(ev.outputs)[0] if isinstance(t, torch.Tensor)), None)
            src = next((t for t in tree_flatten((ev.args, ev.kwargs))[0] if isinstance(t, torch.Tensor)), None)
            if isinstance(made, tuple) and made[0] == ROUNDED and out is not None:
                made = (ROUNDED, made[1], _coarser(made[2], out.dtype))
            elif made is _REPLAYED and out is not None and src is not None and out.is_floating_point() \
                    and src.is_floating_point() and _coarser(out.dtype, src.dtype) == out.dtype != src.dtype:
                made = (ROUNDED, ev.name, out.dtype)
        flat, _ = tree_flatten(ev.outputs)
        if computes_coarse(ev.name, flat):
            # the run's precision, whose casts round by design from here on (ROUNDED is for a
            # float32 run's round trip)
            self._computed_coarse = True
        written = op_info(ev.func).written     # in-place and hidden writes (batch norm's running stats)
        if written:
            flat += [v for name, _, v in named_args(op_info(ev.func), ev.args, ev.kwargs) if name in written]
            flat, _ = tree_flatten(flat)
        for t in flat:
            if isinstance(t, torch.Tensor):
                self._made.set(t, made)
        self._collective.note(ev.name, flat)

    def check_arguments(self, ev, info, live: dict[str, Any], entry) -> None:
        """Value arguments of a matched op that differ from the recorded call's."""
        inputs = entry.inputs
        for i, name in enumerate(info.arg_names):
            # (not by the schema's type: a Python number passed for a Tensor argument, as in
            # RMSNorm's `variance + eps`, reaches the op as a number and is recorded as one;
            # skipped, a changed eps left `add` blamed for computing what it was given)
            if name in D.PLACEMENT_ARGUMENTS:
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

    def reads_scaled(self, ev, carried: dict[str, float], at: int) -> None:
        """A matched op after the backward (clipping, an optimizer step) that reads gradients
        still carrying the loss scale in the live run (capture/loss_scale.py: what they would
        carry had replay substituted no value): it runs before the scaler's unscale, which the
        replayed values hide (the op gets the recording's unscaled ones). One row, the first
        such input."""
        name, factor = next(iter(carried.items()))
        self._add(ev, D.ARGUMENT, argument=name, live=f"x{factor:g} (gradients that carry the loss scale: "
                  "read before the loss scaler unscales them, scaler.unscale_)", golden="x1 (unscaled)",
                  golden_seqid=at, at=float(at))

    def check_input(self, ev, name: str, value: torch.Tensor, rec: ValueRecord, load, at: int) -> bool:
        """A tensor input no replayed op made: compare its live value with the recorded one.
        True when it was compared now and holds the recorded values cast to its dtype, bit for
        bit (what the substitution would hand the op: it then hands the live tensor without
        casting and comparing again); False when it does not, or was not compared now (a
        check made for an earlier op is not trusted for this one: a write through `.data`
        leaves the version the key holds unchanged)."""
        info = op_info(ev.func)
        if name in info.out_args:
            return False                # an out= buffer is written, not read
        if self._collective.copied_into(ev.name, info, named_args(info, ev.args, ev.kwargs)):
            # a copy into a collective's output buffer (gloo's reduce-scatter copies its result
            # in from a tensor it made itself): what it copies is the collective's result, the
            # run's own by design, not a parameter, buffer or batch tensor
            return False
        if storage_key(value) is None:
            return False
        made = self._made.get(value)
        if isinstance(made, tuple) and made[0] == "inserted":
            made[1]["_consumed"] = True     # the inserted op's result reaches a replayed op
            return False                # (its own row says so; this input is not a second one)
        if not self.check_inputs or value.is_complex() or value.layout != torch.strided:
            return False
        if made is not None and not isinstance(made, tuple):
            return False                # made by a replayed op
        detail = ""
        if isinstance(made, tuple) and made[0] == ROUNDED:
            # a replayed op's result a cast rounded: the run's precision where the op computes in
            # that dtype (autocast's bf16 copy for a product); else a rounding the golden run
            # does not make, measured against the recording in the op's own dtype
            if _coarser(made[2], value.dtype) == value.dtype:
                return False
            via, coarsest = made[1], value.dtype
            detail = (f"an earlier op's result that the target rounds to {_dtype_name(made[2])} by a cast the "
                      f"golden run does not make ({made[1]}), read by an op that computes in {_dtype_name(value.dtype)}")
        else:
            via, coarsest = (made[1], _coarser(made[2], value.dtype)) if made is not None else ("", value.dtype)
        key = (value._version, value.dtype, tuple(value.shape), tuple(value.stride()),
               value.storage_offset(), rec.path)
        measured = self._measured.get(value)
        if measured is None:
            measured = set()
            self._measured.set(value, measured)
        if key in measured:
            return False
        measured.add(key)
        src = load(rec)
        if src.shape != value.shape:
            src = src.reshape(value.shape)
        with torch.no_grad(), _disable_current_modes():
            # the recorded value cast to the live dtype, bit for bit: what a device or
            # precision change does to a parameter by design (autocast's weight cast)
            expected = src.to(device=value.device, dtype=coarsest) if coarsest != src.dtype else src
            if expected.dtype != value.dtype or expected.device != value.device:
                expected = expected.to(device=value.device, dtype=value.dtype)
            if expected is not src:
                heap.allocated(expected.numel() * expected.element_size())   # (heap.py)
            if bitwise_equal(value, expected):
                # (the substitution casts straight to the live dtype: the same bits only
                # when no coarser dtype came between)
                return coarsest == value.dtype
            wide = torch.float64 if torch.float64 in (value.dtype, src.dtype) else torch.float32
            a = value.detach().reshape(-1).to(wide)
            b = src.reshape(-1).to(device=a.device, dtype=wide)
            finite = torch.isfinite(a) & torch.isfinite(b)
            if not bool(finite.all()):
                same = (a == b) | (torch.isnan(a) & torch.isnan(b))
                if bool(same[~finite].all()):
                    a, b = a[finite], b[finite]
                else:
                    self._add(ev, D.INPUT, argument=name, rel_err=float("nan"), dtype=_dtype_name(coarsest),
                              made_by=via, golden_seqid=at, at=float(at),
                              reason="NaN/Inf where the recording has none", **({"detail": detail} if detail else {}))
                    return False
            d = a - b
            err = float(torch.linalg.vector_norm(d)) if d.numel() else 0.0
            ref = float(torch.linalg.vector_norm(b)) if b.numel() else 0.0
            max_abs = float(d.abs().max()) if d.numel() else 0.0
            abs_max = float(b.abs().max()) if b.numel() else 0.0
        if err == 0.0:
            return False                # equal values in another dtype: the cast was exact
        rel = err / ref if ref > 0 else float("nan")
        self._add(ev, D.INPUT, argument=name, rel_err=rel, max_abs_err=max_abs, golden_abs_max=abs_max,
                  dtype=_dtype_name(coarsest), golden=str(rec.dtype), made_by=via,
                  golden_seqid=at, at=float(at), **({"detail": detail} if detail else {}))
        return False

    # ---- block exit ---------------------------------------------------------------------
    def _drop_unconsumed(self) -> None:
        kept = []
        for row in self.rows:
            consumed = row.pop("_consumed", True)
            if consumed and not row.pop("_identity", False):
                kept.append(row)
            else:
                self.counts[row["kind"]] -= 1
                self.unread_inserted += 1
        self.rows = kept

    def missing(self, order: list, load: Callable[[Any], torch.Tensor] | None = None) -> None:
        """Recorded ops the live run never called, at their place in the recording. Those after
        the last recorded op the live run did call are one row: the live run ended there (a
        shorter step, or a recording of more steps than were replayed), not one row an op.
        A recorded op whose recorded result is one of its recorded inputs bit for bit (`load`
        reads them) computed nothing the live run lacks, as an inserted op that returns its
        input (outputs_made): no row. GPT-2's key/value cache appends the keys to an empty
        past (`cat([empty, k])`, a copy of k the attention then reads); a run with
        activation checkpointing keeps no cache, and its clean replay failed there."""
        last = max((e.index for e in order if e.used), default=-1)
        live = Counter(self._run_live)

        def by_design(entry) -> bool:
            name = entry.record.op
            if live[name] > 0:          # the live call of it ran live (a DTensor op, a collective)
                live[name] -= 1
                return True
            return D.is_by_design_op(name) or _holds_dtensor(entry) or _loss_scalers(entry) \
                or D.is_constant_op(entry.record.attrs)

        unused = [e for e in order if not e.used and not by_design(e)] if self.structure else []
        rows = []
        tail = [e for e in unused if e.index > last]
        for entry in unused:
            if entry.index > last:
                continue
            if load is not None and _recorded_identity(entry, load):
                self.skipped_copies += 1
                continue
            rec = entry.record
            rows.append({"kind": D.MISSING, "op": rec.op, "module": rec.module, "phase": rec.phase,
                         "golden_seqid": rec.seqid, "at": float(rec.seqid), **_optimizer_of(rec)})
        if tail:
            rec = tail[0].record
            rows.append({"kind": D.MISSING, "op": rec.op, "module": rec.module, "phase": rec.phase,
                         "golden_seqid": rec.seqid, "at": float(rec.seqid), **_optimizer_of(rec),
                         "reason": f"the live run ended before it: {len(tail)} recorded op(s) from golden "
                                   f"#{rec.seqid} on never ran (a shorter step, or a recording of more steps "
                                   f"than were replayed)"})
        self._drop_unconsumed()
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
        return D.encode(self.rows, {k: v for k, v in self.counts.items() if v > 0}, self.source)


def _restride_only(ev, live: dict) -> bool:
    """A live `as_strided(_)` (before it runs) that moves no element of `self`."""
    if D.op_packet(ev.name) not in D.RESTRIDES:
        return False
    t = live.get("self")
    if not isinstance(t, torch.Tensor):
        return False
    offset = live.get("storage_offset")
    return D.restride_moves_no_element(ev.name, t.shape, t.stride(), live.get("size", ()), live.get("stride", ()),
                                       t.storage_offset(), t.storage_offset() if offset is None else offset)


def _loss_scalers(entry) -> bool:
    """A recorded loss scaler's op (the golden trained with a GradScaler): the live run's
    scaler, if it has one, runs live (load_replay.ReplayPolicy.before_op), so the recorded
    one is never called, by design. (Read only for ops the live run left unused.)"""
    try:
        return bool(D.loss_scaler_role(entry.record.attrs.get(S.OP_LOSS_SCALER)))
    except Exception:  # noqa: BLE001 - unreadable: judged as any other op
        return False


def _holds_dtensor(entry) -> bool:
    """A recorded op with DTensor arguments: replay runs those live (never matched)."""
    try:
        return any("dtensor" in rec.attrs for rec in entry.inputs.values())
    except Exception:  # noqa: BLE001 - unreadable: judged as any other op
        return False


def _returns_an_input(out: Any, inputs: list) -> torch.Tensor | None:
    """The input an op's (single tensor) result equals bit for bit, else None."""
    flat = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    if len(flat) != 1:
        return None
    o = flat[0]
    with torch.no_grad(), _disable_current_modes():
        for t in inputs:
            if t.shape == o.shape and t.dtype == o.dtype and t.device == o.device \
                    and not o.is_complex() and o.layout == torch.strided and t.layout == torch.strided:
                try:
                    if torch.equal(t, o):
                        return t
                except RuntimeError:
                    continue
    return None


def _recorded_identity(entry, load: Callable[[Any], torch.Tensor]) -> bool:
    """Whether a recorded op's one tensor result is one of its recorded tensor inputs bit for
    bit (the same shape and dtype; values compared as _returns_an_input does). An unreadable
    record says no: the op stays a departure."""
    try:
        outs = [r for r in entry.record.outputs().values() if r.is_tensor]
        if len(outs) != 1:
            return False
        out = outs[0]
        leaves = [leaf for rec in entry.inputs.values()
                  for leaf in (rec.children if rec.is_list else (rec,)) if leaf.is_tensor]
        same = [r for r in leaves
                if tuple(r.shape) == tuple(out.shape) and str(r.dtype) == str(out.dtype)]
        if not same:
            return False
        o = load(out)
        with torch.no_grad(), _disable_current_modes():
            return any(not o.is_complex() and bool(torch.equal(load(r), o)) for r in same)
    except Exception:  # noqa: BLE001 - unreadable: no proof it computed nothing
        return False


def _coarser(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The floating dtype of the two with the larger unit roundoff (a when neither floats)."""
    fa, fb = a.is_floating_point, b.is_floating_point
    if fa and fb:
        return a if torch.finfo(a).eps >= torch.finfo(b).eps else b
    return a if fa or not fb else b


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _optimizer_of(rec) -> dict:
    """{"optimizer": class name} of a recorded op an optimizer's step ran (op attribute
    `optimizer`), {} otherwise: a missing op of the update is shown as AdamW.step's."""
    if rec.module:
        return {}
    try:
        name = rec.attrs.get(S.OP_OPTIMIZER)
    except Exception:  # noqa: BLE001 - an unreadable attribute: shown where it was recorded
        return {}
    return {"optimizer": name} if isinstance(name, str) and name else {}
