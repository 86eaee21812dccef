"""Load-replay: feed each live op the inputs a recorded (golden) op saw, dump its outputs.

    with torch.utils.dumper(use_load=True, load_file_path="gpu.h5", dump_path="npu.h5"):
        loss = model(x).sum(); loss.backward()

Then `accucmp compare -m npu.h5 -g gpu.h5` shows each op's own error, not error
inherited from earlier ops: every matched op ran on exactly the golden inputs.

Matching (matching.py; REFERENCE §3, refined): the k-th live call of op X takes the k-th recorded
call of X when their signatures agree; otherwise the first unused recorded call of X,
or of a name the op map says is equivalent, whose signature agrees. A signature is,
for each argument present on both sides, the tensor shape and dtype family (float /
int / bool / complex; Int ~ Long, float32 ~ bfloat16) or the exact non-tensor value.

On a match the recorded values replace the live inputs, cast to the live dtype and
device and laid out with the live strides (a contiguous stand-in for a transposed
input would change fp32 results by a few rounding units); arguments the op writes
(in-place self, out=, batch-norm running stats) get the recorded values copied into
the live tensor instead, so the in-place semantics hold. Outputs are stored under the
running op's name and the recorded seqid, with attrs replayed=True, source_seqid.
Unmatched ops run on their live inputs and are not stored. Replacing arguments at the
dispatch level is below autograd, so the graph and gradients are untouched.

(One module, ~440 lines, for the policy's life cycle, entry checks, prefetch thread and
per-op substitution, which all share the policy's state; matching.py (which recorded call),
source.py (the load file's tensors) and layout.py (a recorded tensor laid out as the live
one) hold the rest.)
"""

from __future__ import annotations

import json
import os
import threading
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten

from dumpfile import departures as D
from dumpfile import schema as S
from dumpfile.errors import DumpError
from dumpfile.read import probe
from dumpfile.read.reader import DumpFile, ValueRecord, corrupt_dump_error

from ..errors import DumperError
from ..opmap import OpMap, get_op_map
from ..capture.snapshots import _is_dtensor
from ..capture.opschema import COLLECTIVE_REASON, arg_dict, named_returns, op_info
from ..capture.policy import OpEvent, Policy
from . import heap
from .op_names import draws_random, resolve_op
from .recorded import NotReplayable, torch_dtype
from .index import read_catalog
from .layout import bitwise_equal, like_live, usable_as_is
from .matching import Candidate, find_input, mismatch, op_packet
from .departures import DepartureLog
from .source import DEFAULT_BUDGET, RecordedTensors
from .stand_in import STAND_IN_ULPS, agrees, function_gap
from . import own_error
from .measure_worker import MeasureWorker

LOSS_SCALER_REASON = "the loss scaler's own op (GradScaler): run live, by design"

_SUMMARY_NAMES = 5


class ReplayError(DumperError):
    """The load file cannot be used for replay (missing, not HDF5, not a dump, is dump_path)."""


@dataclass
class ReplaySummary:
    recorded_ops: int = 0
    live_ops: int = 0
    matched: int = 0
    by_map: int = 0                          # matched through the op-name map
    unmatched: Counter = field(default_factory=Counter)          # live op name -> count
    unmatched_why: dict[str, str] = field(default_factory=dict)  # live op name -> first reason
    casts: Counter = field(default_factory=Counter)              # "float32->bfloat16" -> tensors
    never_used: list[str] = field(default_factory=list)          # recorded "op/seqid" not matched
    random_replayed: int = 0                 # random ops whose recorded outputs were handed on
    departures: Counter = field(default_factory=Counter)         # kind -> count (departures.py)
    first_departure: str = ""                # the first one, as the verdict will name it
    regrouped: list[str] = field(default_factory=list)           # live ops standing in for recorded ones
    skipped_copies: int = 0                  # recorded ops not called that returned an input unchanged

    def __str__(self) -> str:
        line = (f"load-replay: matched {self.matched} of {self.live_ops} live ops "
                f"({self.recorded_ops} recorded, {len(self.never_used)} of them unused)")
        if self.by_map:
            line += f"; {self.by_map} through the op-name map"
        if self.unmatched:
            n = sum(self.unmatched.values())
            parts = [f"{op} x{c} ({self.unmatched_why.get(op, '?')})"
                     for op, c in self.unmatched.most_common(_SUMMARY_NAMES)]
            more = "" if len(self.unmatched) <= _SUMMARY_NAMES else f", +{len(self.unmatched) - _SUMMARY_NAMES} more"
            line += f"; unmatched {n} (run on live inputs, not dumped): " + ", ".join(parts) + more
        if self.never_used:
            line += f"; recorded but never matched: {', '.join(self.never_used[:_SUMMARY_NAMES])}"
            if len(self.never_used) > _SUMMARY_NAMES:
                line += f", +{len(self.never_used) - _SUMMARY_NAMES} more"
        if self.random_replayed:
            line += f"; {self.random_replayed} random op(s) given their recorded outputs"
        if self.regrouped:
            line += (f"; {len(self.regrouped)} live op(s) no recorded call fits computed what recorded "
                     f"ops of their module did (within {STAND_IN_ULPS:g} u; first: {self.regrouped[0]})")
        if self.skipped_copies:
            line += (f"; {self.skipped_copies} recorded op(s) the live run did not call returned one of "
                     "their inputs unchanged (no departure)")
        if any(self.departures.values()):
            line += ("; the live run departs from the recording: "
                     + ", ".join(f"{v} {k}" for k, v in self.departures.items() if v)
                     + f" (first: {self.first_departure}; accucmp compare fails on them)")
        if self.casts:
            line += "; dtype casts: " + ", ".join(f"{k} x{v}" for k, v in self.casts.most_common())
        return line


class ReplayPolicy(Policy):
    """The load-replay policy (see module doc). `summary` is filled in at block exit."""

    starts_a_child = True       # (begin probes the golden in a watched child)
    substitutes_inputs = True

    def __init__(self, load_file_path: str | os.PathLike, op_map: OpMap | dict | None = None, *,
                 dump_path: str | os.PathLike | None = None, keep_live_strides: bool = True,
                 verbose: bool = True, prefetch_ops: int = 256, prefetch_bytes: int | None = None,
                 own_error: bool = True, max_load_bytes: int = DEFAULT_BUDGET):
        self.load_file_path = os.fspath(load_file_path) if load_file_path is not None else ""
        self.dump_path = os.fspath(dump_path) if dump_path is not None else None
        self.op_map = op_map if isinstance(op_map, OpMap) else get_op_map(op_map)
        self.keep_live_strides = keep_live_strides
        self.verbose = verbose
        # measure each op whose inputs the replay rounded against float64 on those inputs
        # (npu_dumper/replay/own_error.py): the verdict then judges the op by what it was given
        self.own_error = own_error
        self._rounded = False
        self._inputs_stored = True      # the session's dump_mode stores inputs (set in begin)
        self.summary = ReplaySummary()
        self._file: DumpFile | None = None
        self._by_name: dict[str, list[Candidate]] = {}
        self._by_packet: dict[str, list[Candidate]] = defaultdict(list)
        self._calls: Counter = Counter()
        # activation checkpointing's re-runs: per op name, the recorded calls that were re-runs
        # too (read from their op attributes at the first live re-run of that name)
        self._rerun_entries: dict[str, list[Candidate]] = {}
        self._rerun_calls: Counter = Counter()
        self._before_write = None
        # the recorded tensors: read when needed, held while a later recorded op reads them,
        # at most max_load_bytes at once (source.py); half of it may be read ahead
        self._tensors = RecordedTensors(max_load_bytes)
        self.prefetch_ops = prefetch_ops        # how far ahead of the live stream, in ops ...
        self.prefetch_bytes = max_load_bytes // 2 if prefetch_bytes is None else prefetch_bytes  # ... and bytes
        self._ahead: list[tuple[int, int]] = []   # (entry index, bytes) read ahead, prefetch thread only
        self._order: list[Candidate] = []
        self._cv = threading.Condition()
        self._consumed = 0
        self._stop = False
        self._prefetcher: threading.Thread | None = None
        self.departures = DepartureLog()     # how the live run departs from the recording
        self._measurer = MeasureWorker()     # (replaced in begin by one bound to the registry)

    # ---- block entry -----------------------------------------------------------
    def begin(self, session: Any = None) -> None:
        heap.reset()
        path = self.load_file_path
        if not path:
            raise ReplayError("load_file_path is empty: give the dump to replay")
        dump_path = self.dump_path or getattr(session, "dump_path", None)
        self._inputs_stored = getattr(session, "dump_mode", "all") in ("input", "all")
        op_filter = getattr(session, "filter", None)
        # with ops filtered out of the block, an input may come from an op replay never saw:
        # it cannot tell a parameter from an activation, so inputs are not checked
        # a compiled step (npu_dumper/compiled) calls only the ops inside its graphs, some
        # decomposed: ops missing or inserted against the eager recording are by design there
        self.departures = DepartureLog(check_inputs=op_filter is None or op_filter.trivial,
                                       structure=not getattr(session, "compiled", False))
        if dump_path and os.path.abspath(os.fspath(dump_path)) == os.path.abspath(path):
            raise ReplayError(f"{path}: load_file_path and dump_path are the same file "
                              "(the replay would overwrite the golden dump)")
        try:
            # what follows reads the file's metadata in the user's process: first in a
            # watched child, so that a loop inside HDF5 on a damaged file is a ReplayError
            # naming it, not a hung job (dumpfile.read.probe)
            probe.probe(path, probe.REPLAY)
            self._file = DumpFile(path)
        except DumpError as e:
            raise ReplayError(str(e)) from None
        if self._file.stats_only:
            self._file.close()
            raise ReplayError(f"{path}: statistics-only dump holds no tensor values to replay")
        try:
            self._file.require_inputs()
            ops = self._file.ops()
        except DumpError as e:
            self._file.close()
            raise ReplayError(str(e)) from None
        except Exception as e:  # noqa: BLE001 - h5py on a damaged file: one line naming it
            self._file.close()
            raise ReplayError(str(corrupt_dump_error(path, e))) from None
        if not ops:
            self._file.close()
            raise ReplayError(f"{path}: the dump holds no ops")
        for i, rec in enumerate(ops):
            entry = Candidate(rec, index=i)
            self._order.append(entry)
            self._by_name.setdefault(rec.op, []).append(entry)
            self._by_packet[op_packet(rec.op)].append(entry)
        self.summary = ReplaySummary(recorded_ops=len(ops))
        self.departures.source = D.source_of(self._file.attrs)
        # Every op's input metadata now: read in the block it would hold the GIL and h5py's
        # lock against the model and the dump's writer, and the model would wait for it at
        # each op. From the file's catalog (format 1.2, one dataset) when it has a usable
        # one, else (and for ops it does not describe) in one low-level pass (~0.3 ms an entry).
        try:
            catalog = read_catalog(self._file) or {}
            for entry in self._order:
                inputs = catalog.get(entry.record.path)
                if inputs is not None:
                    entry.set_inputs(inputs)
                else:
                    entry.inputs
        except Exception as e:  # noqa: BLE001 - one line naming the file, not a traceback
            self._file.close()
            raise ReplayError(f"{path}: cannot read the recorded inputs: {e}") from None
        # the dumper's copy-on-write hook: data captured earlier must be saved before we
        # overwrite a live tensor in place
        registry = getattr(session, "registry", None)
        self._before_write = getattr(registry, "before_write", None)
        # own error measured on a worker thread, overlapping the step (measure_worker.py);
        # without the dumper's registry (no write hook) on the model's thread
        self._measurer = MeasureWorker(registry)
        self._tensors.open(self._file, path)
        self._tensors.plan((e.index, e.inputs) for e in self._order)
        if self.prefetch_ops > 0:
            self._prefetcher = threading.Thread(target=self._prefetch_loop, name="npu_dumper-replay-prefetch",
                                                daemon=True)
            self._prefetcher.start()

    # ---- prefetch: read the recording ahead of the live stream -----------------------
    def _prefetch_loop(self) -> None:
        """Reads the next recorded ops' metadata and tensors while the model computes (torch
        kernels release the GIL), at most `prefetch_ops` ops and `prefetch_bytes` bytes ahead
        of the last matched op. Matching mostly follows seqid order; a miss just loads on
        demand. Errors are left for the main thread to meet and report."""
        for entry in self._order:
            with self._cv:
                while not self._stop and entry.index > self._consumed + 1 and (
                        entry.index > self._consumed + self.prefetch_ops
                        or self._bytes_ahead() > self.prefetch_bytes):
                    self._cv.wait()
                if self._stop:
                    return
            if entry.used:
                continue
            try:
                nbytes = 0
                for rec in entry.inputs.values():
                    for leaf in (rec.children if rec.is_list else (rec,)):
                        if leaf.is_tensor:
                            nbytes += self._tensors.prefetch(leaf)
                self._ahead.append((entry.index, nbytes))
            except Exception:  # noqa: BLE001 - the main thread reloads and reports
                continue

    def _bytes_ahead(self) -> int:
        """Bytes read for ops not matched yet (called with self._cv held)."""
        ahead = self._ahead
        while ahead and ahead[0][0] <= self._consumed:
            ahead.pop(0)
        return sum(n for _, n in ahead)

    # ---- per op --------------------------------------------------------------------
    def before_op(self, ev: OpEvent) -> None:
        self.summary.live_ops += 1
        if ev.group_attrs.get(S.OP_LOSS_SCALER):
            # a loss scaler's op (npu_dumper/capture/loss_scale.py): the scaler's state and
            # the scaling are the live run's own; a recorded call of the same name is another
            # computation (found_inf's `.item()` took the optimizer's step count and skipped
            # the step). Matched ops get the recording's unscaled values, so the scale ends
            # at the first of them. (Not counted among the op's calls: the k-th call of an op
            # takes its k-th recorded call.)
            self._unmatched(ev, LOSS_SCALER_REASON, by_design=True, counts_as_recorded=False)
            return
        k = self._calls[ev.name]
        self._calls[ev.name] += 1
        info = op_info(ev.func)
        live = arg_dict(info, ev.args, ev.kwargs)
        if info.collective:
            # run live, unrecorded: substituting this rank's recorded inputs cannot give the
            # recorded result unless every rank replays in step; listed with the reason
            self._unmatched(ev, COLLECTIVE_REASON, by_design=True)
            return
        if _has_dtensor(live):
            # the recording holds local shards; a DTensor op runs live (its local ops are
            # below the dispatch mode) and is listed instead of half-substituted
            self._unmatched(ev, "DTensor arguments: run live, not replayed", by_design=True)
            return
        # a backend's opaque buffer (an LSTM workspace) is sized and laid out for the dtype
        # that wrote it: it takes no part in finding the recorded call (nor in substitution)
        matched_on = {n: v for n, v in live.items() if n not in info.opaque_args} if info.opaque_args else live
        if ev.group_attrs.get(S.OP_RECOMPUTE):
            entry, why = self._match_rerun(ev.name, matched_on)
            if entry is None:
                # a forward op activation checkpointing re-runs in backward, which the
                # recording did not re-run: it recomputes what the replayed forward made, by
                # design (never a recorded backward op of the same name and shapes)
                self._calls[ev.name] -= 1
                self._unmatched(ev, why, by_design=True, counts_as_recorded=False)
                return
        else:
            entry, why = self._match(ev.name, k, matched_on, ev.module, ev.phase)
        if entry is None:
            self._unmatched(ev, why, live=live)
            return
        self._rounded = False
        try:
            self.departures.check_arguments(ev, info, live, entry)
            new_args, new_kwargs = self._substitute(ev, entry, live)
        except _NoFit as e:
            self.departures.forget(ev)
            self._unmatched(ev, str(e), live=live)
            return
        except DumperError:
            raise
        except DumpError as e:          # (the reader names the file and the object)
            raise ReplayError(str(e)) from None
        except (OSError, RuntimeError, KeyError, ValueError) as e:
            # reading the recorded inputs failed (a damaged load file): running the op on
            # live inputs instead would pass off the live values as the reference's
            raise ReplayError(str(corrupt_dump_error(self.load_file_path, e, entry.record.path))) from None
        entry.used = True
        self._tensors.release(entry.index, entry.inputs)   # (the op's arguments hold them now)
        if entry.index > self._consumed:
            with self._cv:
                self._consumed = entry.index
                self._cv.notify()
        ev.args, ev.kwargs = new_args, new_kwargs
        if self._rounded and self.own_error:
            ev.notes["replay_own_error"] = live
        if draws_random(ev.func, live):
            # A random op cannot draw the reference's numbers on another device or
            # generator: run it (the RNG advances as in a real run), then hand on the
            # recorded outputs, so later ops see the reference's mask/noise and the
            # op itself is not reported as an error it did not make.
            ev.notes["replay_outputs"] = entry
            ev.group_attrs[S.OP_RANDOM_OUTPUTS_REPLAYED] = True
            self.summary.random_replayed += 1
        ev.store_seqid = entry.record.seqid
        ev.group_attrs[S.OP_REPLAYED] = True
        ev.group_attrs[S.OP_SOURCE_SEQID] = ev.seqid
        ev.notes["replay_matched"] = True
        # its tensors are the recording's: they carry the recording's loss scale, not the live
        # one; what the live run's results would carry is kept for compare (float16's range
        # at that scale: RangeLoss), under "carried"
        ev.group_attrs.pop(S.OP_LOSS_SCALE, None)
        would = ev.notes.get("loss_scale_carried_out")
        if isinstance(would, float) and would != 1.0:
            ev.group_attrs[S.OP_LOSS_SCALE] = json.dumps({"carried": would})
        self.departures.matched(entry.record.seqid)
        carried = ev.notes.get("loss_scale_carried")
        if carried and ev.phase != S.PHASE_BACKWARD and self.departures.structure \
                and D.op_packet(ev.name) not in D.VALUE_FREE:      # (`ones_like(loss)`: the seed)
            self.departures.reads_scaled(ev, carried, entry.record.seqid)
        self.summary.matched += 1
        if entry.record.op != ev.name:
            self.summary.by_map += 1
            ev.group_attrs["source_op"] = entry.record.op

    def run_op(self, ev: OpEvent) -> Any:
        entry = ev.notes.get("replay_outputs")
        if entry is None:
            live = ev.notes.get("replay_own_error")
            if live is None:
                return NotImplemented
            prepared = own_error.prepare(ev.func, ev.args, ev.kwargs, live)
            out = ev.func(*ev.args, **ev.kwargs)
            measured = None if prepared is None else self._measurer.measure(
                ev.func, prepared, own_error.results_of(op_info(ev.func), out, ev.args, ev.kwargs))
            if measured is not None:
                ev.group_attrs[S.OP_OWN_ERROR] = measured
            return out
        out = ev.func(*ev.args, **ev.kwargs)
        self._hand_on_recorded(ev.func, out, entry)
        return out

    def op_computed(self, ev: OpEvent) -> None:
        """A compiled graph's node replayed (graph-level load-replay, npu_dumper/compiled/):
        a random op (dropout) ran compiled, drawing its own numbers; its outputs become the
        recorded ones, as run_op does for an eager op, before later nodes read them (the
        backward's dropout takes the recorded mask too)."""
        entry = ev.notes.get("replay_outputs")
        if entry is not None:
            self._hand_on_recorded(ev.func, ev.outputs, entry)

    def _hand_on_recorded(self, func: Any, out: Any, entry: Candidate) -> None:
        """The recorded outputs of `entry` written into the op's outputs `out`."""
        recorded = entry.record.outputs()
        with torch.no_grad():
            for name, _, value in named_returns(op_info(func), out):
                rec = recorded.get(name)
                if isinstance(value, torch.Tensor) and rec is not None and rec.is_tensor \
                        and rec.numel == value.numel():
                    value.copy_(self._load(rec).reshape(value.shape))

    def should_record(self, ev: OpEvent) -> bool:
        return bool(ev.notes.get("replay_matched"))

    def after_op(self, ev: OpEvent, recorded: bool) -> None:
        made = ev.notes.get("replay_made")
        if isinstance(made, tuple) and made[0] == "inserted" and made[1].get("seqid") == ev.seqid \
                and not ev.notes.get("replay_matched"):
            stood_for, other_function = self._stood_in_for(ev)
            if other_function:
                made[1]["detail"] = other_function
            if stood_for:
                for entry in stood_for:
                    entry.used = True
                    self._tensors.release(entry.index, entry.inputs)   # (read ahead for them: not held on)
                self.departures.stood_in(ev, made[1])
                self._check_stand_in_inputs(ev, stood_for)
                ops = "+".join(e.record.op for e in stood_for)
                self.summary.regrouped.append(f"{ev.module or '(no module)'}: live {ev.name} for recorded {ops}")
        self.departures.outputs_made(ev)

    def _stood_in_for(self, ev: OpEvent) -> tuple[list[Candidate], str]:
        """The recorded ops a live op no recorded call fits computes instead (one op for
        several: `F.linear` is one `addmm` on a contiguous input and `mm` + `add` on a strided
        one, and autocast's cast makes the input contiguous, so an fp32 recording and its
        bf16 replay take different paths through the same Linear, as in timm XCiT; its
        backward then sums the bias gradient over [4, 512] where the recording summed over
        [4, 1, 512]). The unused recorded ops of its module and phase around the last matched
        one, in a run no matched op of that module splits, up to the last computing op whose
        result the live result equals within STAND_IN_ULPS units of the live dtype (plus
        float32 summation noise), and which computes their function (stand_in.function_gap).
        None found: [] (the op stays an inserted op; the text says why when it agreed in value
        but not in function). Checked by value, not by name: an op that computes something
        else (a changed bias, an extra scale, another approximation) is no stand-in."""
        outs = [t for t in tree_flatten(ev.outputs)[0] if isinstance(t, torch.Tensor)]
        module = D.unwrapped_module(ev.module)
        if len(outs) != 1 or not module or not outs[0].is_floating_point() or outs[0].numel() == 0 \
                or outs[0].layout != torch.strided or outs[0].is_complex():
            return [], ""
        out = outs[0]
        here = self._consumed
        best: list[Candidate] = []
        run: list[Candidate] = []
        for entry in self._order[max(0, here - _STAND_IN_BEHIND):here + 1 + _STAND_IN_AHEAD]:
            if not _same_phase(entry, ev.phase) or D.unwrapped_module(entry.record.module) != module:
                if run and entry.index > here and not entry.used:
                    break                       # past the module's ops just ahead
                continue
            if entry.used:
                run = []                        # a matched op of the module: another run
                continue
            run.append(entry)
            if len(run) > _STAND_IN_OPS:
                break
            if D.is_by_design_op(entry.record.op) or _is_view_op(entry.record.op):
                continue
            try:
                recorded = [r for r in entry.record.outputs().values() if r.is_tensor]
                if len(recorded) != 1 or recorded[0].numel != out.numel():
                    continue
                golden = self._load(recorded[0])
            except Exception:  # noqa: BLE001 - an unreadable output: no stand-in through it
                continue
            if agrees(out, golden):
                best = list(run)
        if not best:
            return [], ""
        checked = function_gap(ev.func, ev.args, ev.kwargs, [e.record for e in best], self._load)
        if checked is not None and checked[0] > checked[1]:
            gap, allowed = checked
            ops = "+".join(e.record.op for e in best)
            return [], (f"it agrees with the recorded {ops} within {_dtype_name(out.dtype)}'s rounding, but "
                        f"computes another function: both run in float64 on the recorded inputs differ by "
                        f"{gap:.3g} of the result (allowed {allowed:.2g})")
        return best, ""

    def _check_stand_in_inputs(self, ev: OpEvent, stood_for: list[Candidate]) -> None:
        """A stand-in's tensor inputs that no replayed op made (its weight and bias, autocast's
        casts of them) against the recorded inputs of the ops it stood in for, as a matched
        op's are (DepartureLog.check_input): its result agreeing within a few units does not
        show a bias changed by a few percent. Paired by shape (the same, or the same without
        its unit dimensions: a bias added to [4, 1, 512]); an input with no such recorded
        partner is not checked."""
        recorded = [(rec, entry) for entry in stood_for for rec in entry.inputs.values() if rec.is_tensor]
        for name, value in arg_dict(op_info(ev.func), ev.args, ev.kwargs).items():
            if not isinstance(value, torch.Tensor) or value.numel() <= 1:
                continue
            shape = tuple(value.shape)
            squeezed = tuple(d for d in shape if d != 1)
            best = None
            for rec, entry in recorded:
                if rec.numel != value.numel():
                    continue
                rshape = tuple(rec.shape)
                rank = 0 if rshape == shape else 1 if tuple(d for d in rshape if d != 1) == squeezed else None
                if rank is not None and (best is None or rank < best[0]):
                    best = (rank, rec, entry)
            if best is not None:
                self.departures.check_input(ev, name, value, best[1], self._load, best[2].record.seqid)

    def end(self, session: Any = None) -> None:
        # (the writer has written every op it will: a measurement still queued is of an op
        # it dropped)
        self._measurer.close(cancel=True)
        self.summary.never_used = [f"{e.record.op}/{e.record.seqid}"
                                   for lst in self._by_name.values() for e in lst if not e.used]
        self.summary.never_used.sort(key=lambda s: int(s.rsplit("/", 1)[1]))
        self.departures.missing(self._order, self._load)
        self.summary.skipped_copies = self.departures.skipped_copies
        self.summary.departures = Counter(self.departures.counts)
        self.summary.first_departure = self.departures.first_text()
        if self._prefetcher is not None:
            with self._cv:
                self._stop = True
                self._cv.notify_all()
            self._prefetcher.join()
            self._prefetcher = None
        self._tensors.close()
        self._ahead.clear()
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.verbose:
            print(str(self.summary), flush=True)

    def root_attrs(self) -> dict[str, Any]:
        """What the replay's dump keeps of how the live run departed from the recording."""
        return {D.ROOT_ATTR: self.departures.encode()}

    # ---- matching ------------------------------------------------------------------
    def _match(self, name: str, k: int, live: dict[str, Any], module: str = "",
               phase: str = "") -> tuple[Candidate | None, str]:
        same = self._by_name.get(name, ())
        renames = self.op_map.renames
        why = ""
        module = D.unwrapped_module(module)
        kth = None
        # a call pairs with a recorded one of its own phase: a backward accumulation add must
        # not take the forward add a model without that residual no longer makes
        if k < len(same) and not same[k].used and _same_phase(same[k], phase):
            why = mismatch(same[k], live, {})
            if not why:
                kth = same[k]
                if phase != S.PHASE_FORWARD or not module or D.unwrapped_module(kth.record.module) == module:
                    return kth, ""
        fits = [e for e in same if not e.used and _same_phase(e, phase) and not mismatch(e, live, {})]
        if fits:
            # in the same module first (an op inserted elsewhere must not shift the pairing:
            # one more live addmm before it made timm XCiT's attn.k take the k-th recorded
            # addmm, attn.v's, whose shapes fit)
            own = next((e for e in fits if D.unwrapped_module(e.record.module) == module), None)
            if own is not None:
                return own, ""
            if kth is not None:
                return kth, ""
            if module and phase == S.PHASE_FORWARD and any(
                    D.unwrapped_module(e.record.module) == module and _same_phase(e, phase) for e in same):
                # The recording makes this op in this module, and each such call is taken: the
                # live module makes one more (a forward hook's `* 1.05` after a Linear, paired
                # with the module's own `mul`). Taking a later module's call instead shifted
                # every pairing after it and named the next block as the departure. (Forward
                # only: backward ops are attributed to modules less firmly; a gradient sum
                # the other run attributes elsewhere still pairs.)
                return None, f"one more call than the recording makes in {module}"
            return fits[0], ""
        for other in self.op_map.equivalents(name):
            for entry in self._by_packet.get(other, ()):
                if not entry.used and _same_phase(entry, phase) and not mismatch(entry, live, renames):
                    return entry, ""
        # the in-place variant (or the op it varies) in the same module: an inserted `add`
        # elsewhere must not take an optimizer's recorded `add_`
        partner = _in_place_partner(name)
        for entry in self._by_packet.get(partner, ()):
            if not entry.used and _same_phase(entry, phase) and D.unwrapped_module(entry.record.module) == module \
                    and not mismatch(entry, live, renames):
                return entry, ""
        # Every tensor agrees but a value argument does not (eps, scale, approximate): the
        # same call with a changed argument. It is matched (so the op still runs on the
        # recorded inputs and its outputs are compared) and the change is a departure
        # (check_arguments). Taken only in the same module, in recording order, and never
        # for an op that computes nothing (an allocation of another size, a cast: FSDP2's
        # bf16 policy allocates a cast buffer the fp32 recording lacks): it runs live.
        for entry in (([same[k]] if k < len(same) else []) + list(same)) if not D.is_by_design_op(name) else ():
            if not entry.used and D.unwrapped_module(entry.record.module) == module and _same_phase(entry, phase) \
                    and not mismatch(entry, live, {}, tensors_only=True):
                return entry, ""
        if not same and not any(self._by_packet.get(o) for o in (*self.op_map.equivalents(name), partner)):
            return None, "not in the recording"
        if not any(not e.used for e in same):
            return None, "more live calls than recorded ones"
        # `why` is against the k-th recorded call only: a call the live run alone makes (a bf16
        # model's upcast, a no-op in the fp32 recording) meets an unrelated one there
        return None, (f"no unused recorded call fits (the recorded call in its place: {why})" if why
                      else "no unused recorded call with matching inputs")

    def _match_rerun(self, name: str, live: dict[str, Any]) -> tuple[Candidate | None, str]:
        """A re-run's partner: a recorded re-run of the same op (the recording checkpointed
        too), the k-th such call when it fits, else the first unused one that does."""
        reruns = self._rerun_entries.get(name)
        if reruns is None:
            reruns = self._rerun_entries[name] = [
                e for e in self._by_name.get(name, ()) if e.record.attrs.get(S.OP_RECOMPUTE, False)]
        if not reruns:
            return None, "activation checkpointing re-ran it in backward; the recording did not"
        k = self._rerun_calls[name]
        self._rerun_calls[name] += 1
        if k < len(reruns) and not reruns[k].used and not mismatch(reruns[k], live, {}):
            return reruns[k], ""
        fit = next((e for e in reruns if not e.used and not mismatch(e, live, {})), None)
        return (fit, "") if fit is not None else (None, "no unused recorded re-run with matching inputs")

    def _unmatched(self, ev: OpEvent, why: str, *, by_design: bool = False, live: dict | None = None,
                   counts_as_recorded: bool = True) -> None:
        self.summary.unmatched[ev.name] += 1
        self.summary.unmatched_why.setdefault(ev.name, why)
        self.departures.unmatched(ev, why, by_design=by_design, live=live, counts_as_recorded=counts_as_recorded)

    # ---- substitution --------------------------------------------------------------
    def _substitute(self, ev: OpEvent, entry: Candidate, live: dict[str, Any]) -> tuple[tuple, dict]:
        renames = self.op_map.renames
        info = op_info(ev.func)
        written = info.written      # includes hidden writes (batch-norm stats)
        replaced: dict[str, Any] = {}
        overflows: dict[str, float] = {}      # inputs whose cast to the live dtype overflowed
        for name, value in live.items():
            if name in info.opaque_args:
                # a backend's opaque buffer (the LSTM workspace mkldnn_rnn_layer hands its
                # backward): its bytes are laid out for the dtype that wrote them, so the fp32
                # recording's, handed to a bf16 backward, made every gradient NaN. The live one
                # is what the live forward (replayed on the recorded inputs) wrote.
                continue
            rec = find_input(entry.inputs, name, renames)
            if rec is None and name in ev.notes.get("loss_scaler_state_args", ()):
                # the loss scaler's own tensor the recorded call did not take (GradScaler hands a
                # fused optimizer step grad_scale and found_inf; a golden without a scaler passes
                # neither): the op gets the recording's unscaled gradients, and would divide
                # them by the live scale again (AdamW's moments 1024x off). None, as recorded.
                replaced[name] = None
                continue
            if rec is None or not _has_tensor(value):
                continue
            holds_recorded = False
            if isinstance(value, torch.Tensor) and rec.is_tensor and rec.numel == value.numel():
                # a parameter, buffer or batch tensor no replayed op made: its live value is
                # the run's own, and a difference from the recording is a departure
                holds_recorded = self.departures.check_input(ev, name, value, rec, self._load,
                                                             entry.record.seqid)
            in_place = name in written
            if holds_recorded and not in_place:
                # the live tensor holds the recorded values cast to its dtype, bit for bit
                # (check_input compared them): what _replace would find after casting and
                # comparing again (a weight read by every step's ops: ~0.7 s a GPT-2 step)
                self._note_cast(rec, value)
                replaced[name] = value
                continue
            try:
                replaced[name] = got = self._replace(value, rec, in_place=in_place, arg=name, overflows=overflows)
            except NotReplayable as e:
                raise _NoFit(str(e)) from None
            if isinstance(got, torch.Tensor) and got is not value:
                heap.allocated(got.numel() * got.element_size())   # a cast or a read: heap.py
        args = list(ev.args)
        kwargs = dict(ev.kwargs)
        positions = info.positions
        for name, value in replaced.items():
            i = positions.get(name)
            if i is not None and i < len(args):
                args[i] = value
            else:
                kwargs[name] = value
        if overflows:
            ev.group_attrs[S.OP_INPUT_OVERFLOW] = json.dumps(overflows)
        return tuple(args), kwargs

    def _replace(self, live: Any, rec: ValueRecord, *, in_place: bool, arg: str, overflows: dict) -> Any:
        """The recorded value of input `arg` as the op gets it (`live`'s dtype and layout);
        `overflows` gets the inputs whose cast to that dtype overflowed (_cast_overflow)."""
        if isinstance(live, torch.Tensor):
            if not rec.is_tensor:
                raise NotReplayable(f"input '{arg}' is not a tensor in the recording")
            if rec.numel != live.numel():
                raise NotReplayable(f"input '{arg}': recorded {rec.numel} elements do not fit "
                                    f"the live {live.numel()}")
            src = self._load(rec)
            self._note_cast(rec, live, src.dtype)
            if src.shape != live.shape:        # (reshape is ~40 us even when it is a no-op)
                src = src.reshape(live.shape)
            if in_place:
                if self._before_write is not None:
                    self._before_write(live)
                with torch.no_grad():
                    live.copy_(src)
                return live
            if not self._inputs_stored and usable_as_is(live, src, self.keep_live_strides):
                # Nothing to gain from keeping the live tensor (no copy to save, no input
                # to link in the dump): hand on the recorded one without reading both.
                return src
            if bitwise_equal(live, src):
                # The live input already holds the recorded bits (shared weights, a replay into
                # the recording's own run): it is what the op would get, without the copy, and
                # the replay's dump can link it to the output that made it.
                return live
            cast = like_live(live, src, self.keep_live_strides)
            if cast is not src:
                biggest = _cast_overflow(src, cast)
                if biggest is not None:
                    overflows[arg] = biggest
                if bitwise_equal(live, cast):
                    # the same after the cast (a bf16 model's weight: the rounded recorded one):
                    # the copy goes now instead of living on in a view the backward keeps
                    return live
            return cast
        if isinstance(live, (list, tuple)):
            if len(rec.children) != len(live):
                raise NotReplayable(f"input '{arg}': recorded list has {len(rec.children)} items, "
                                    f"live {len(live)}")
            out = [self._replace(v, c, in_place=in_place, arg=f"{arg}_{i}", overflows=overflows)
                   if isinstance(v, torch.Tensor) else v
                   for i, (v, c) in enumerate(zip(live, rec.children))]
            return type(live)(out) if isinstance(live, tuple) else out
        return live

    def _note_cast(self, rec: ValueRecord, live: torch.Tensor, src_dtype: torch.dtype | None = None) -> None:
        """A recorded tensor handed to the op in the live dtype: counted in the summary, and
        whether the cast rounded (the op's own error is then measured)."""
        if src_dtype is None:
            try:
                src_dtype = torch_dtype(rec.dtype)
            except (NotReplayable, TypeError, ValueError, AttributeError):
                return
        if src_dtype != live.dtype:
            if own_error.rounds(src_dtype, live.dtype):
                self._rounded = True
            self.summary.casts[f"{rec.dtype}->{str(live.dtype).replace('torch.', '')}"] += 1

    def _load(self, rec: ValueRecord) -> torch.Tensor:
        return self._tensors.load(rec)


class _NoFit(Exception):
    pass


def _cast_overflow(src: torch.Tensor, cast: torch.Tensor) -> float | None:
    """The largest |recorded value| when a recorded input cast to a dtype of smaller range
    (float32 -> float16) became Inf where the recording is finite, else None: the op's own
    Inf is then the format's, and the op attribute input_overflow says so, for compare's
    verdict. One pass over the cast (float16 and float8 only: bfloat16 holds float32's range
    but for its last spacing), a second over the recording only when the cast holds an Inf."""
    if cast.dtype not in _NARROW_RANGE or not src.is_floating_point() \
            or torch.finfo(src.dtype).max <= torch.finfo(cast.dtype).max:
        return None
    with torch.no_grad(), _disable_current_modes():
        if not bool(torch.isinf(cast).any()):
            return None
        finite = src[torch.isfinite(src)]
        if finite.numel() == 0:
            return None
        biggest = float(finite.abs().max())
    return biggest if biggest > torch.finfo(cast.dtype).max else None


# floating dtypes whose range is smaller than float32's: a recorded input cast to one may
# overflow (_cast_overflow)
_NARROW_RANGE = frozenset({torch.float16, torch.float8_e4m3fn, torch.float8_e5m2})
# A live op no recorded call fits may stand in for the recorded ops of its module just ahead
# (ReplayPolicy._stood_in_for): at most this many of them (a pointwise chain's backward is
# longer than its forward: gelu_new's eight ops have eleven), found among the recorded ops
# this far behind and ahead of the last matched one
_STAND_IN_OPS = 16
_STAND_IN_BEHIND = 16
_STAND_IN_AHEAD = 64


def _in_place_partner(name: str) -> str:
    """The packet of an op's in-place variant, or of the out-of-place op an in-place one
    varies (ATen names in-place variants with a trailing underscore: relu_ / relu,
    _foreach_add_ / _foreach_add). The two compute the same from the same inputs, so a live
    `F.relu(x, inplace=True)` takes a recorded `relu` (torchvision's ResNet against a port
    that writes `F.relu(x)`); the replay copies the recorded input into the tensor an
    in-place op writes, as for any in-place op. Before, such a clean replay failed on `runs
    aten.relu_.default, which the golden run does not have`."""
    packet = op_packet(name)
    ns, _, base = packet.partition(".")
    if not base:
        return ""
    return f"{ns}.{base[:-1]}" if base.endswith("_") and not base.endswith("__") else f"{packet}_"


def _is_view_op(name: str) -> bool:
    func = resolve_op(name)
    return bool(getattr(func, "is_view", False))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _has_dtensor(live: dict[str, Any]) -> bool:
    """A DTensor among the live arguments (lists one level deep)."""
    for v in live.values():
        if isinstance(v, torch.Tensor):
            if type(v) is not torch.Tensor and _is_dtensor(v):
                return True
        elif isinstance(v, (list, tuple)):
            if any(isinstance(x, torch.Tensor) and type(x) is not torch.Tensor and _is_dtensor(x)
                   for x in v):
                return True
    return False


def _same_phase(entry: Candidate, phase: str) -> bool:
    recorded = entry.record.phase
    return not phase or not recorded or recorded == phase


def _has_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    return isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value)


__all__ = ["ReplayPolicy", "ReplaySummary", "ReplayError"]
