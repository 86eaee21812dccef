"""`npu_dumper.dumper` (installed as `torch.utils.dumper`): the public context manager.

    with torch.utils.dumper(use_dump=True, dump_path="./model_gpu.h5") as dump:
        loss = model(x).sum(); loss.backward()
    print(dump.path, dump.num_ops)

It validates everything before the model runs, picks the policies (dump, load-replay,
overflow, ACL kernel dump), opens the file, starts the writer thread and the module
tracker, and enters the private DumpMode. On exit it drains the writer, writes the
final root attributes and marks the file complete (only on a clean exit).

Where the file goes is dump_paths.py, the signals while it closes close_signals.py. The
rest (~410 lines) is the `dumper` class alone: its options, entry and exit share one
state (the file, the writer, the policies, the mode), and its option checks name the
user's arguments.
"""

from __future__ import annotations

import difflib
import inspect
import os
import threading
from typing import Any

import torch

from dumpfile import schema as S
from dumpfile.errors import DumpError, writer_error_message
from dumpfile.write.stats import StatsDumpWriter
from dumpfile.write import remote
from dumpfile.write.remote import RemoteDumpWriter
from dumpfile.write.writer import DumpWriter, set_attrs

from .capture import CaptureRegistry
from .close_signals import SignalsNoted
from .dump_paths import dist_rank, path_option, resolve_dump_path, resolve_load_path
from .errors import DumperError
from .capture.mode import DumpMode
from .capture.selection import OpFilter
from .capture.module_tracking import ModuleTracker
from .capture.policy import Policy, make_policy
from .capture.tensor_hash import HASH_ALGORITHM
from .sinks.stats import StatsWriterThread
from .sinks.process import ProcessWriter
from .sinks.thread import WriterThread

_active_lock = threading.Lock()
_active: "dumper | None" = None


def parallel_layout(tracker: ModuleTracker, mode: DumpMode) -> str:
    """Root attribute `parallel_layout` (JSON): the data-parallel wrappers found on the
    model the block ran (DistributedDataParallel, FSDP2's fully_shard) and the distinct
    device meshes of the DTensors it saw and of the model's DTensor parameters, so a reader
    knows the layout without the names. FSDP2 (`fully_shard`) keeps its mesh on the
    parameters only: the ops it dispatches run on the all-gathered plain tensors, so no op
    argument is a DTensor (before: `"meshes": []` for every FSDP2 run)."""
    import json
    wrappers = set()
    root = tracker.root
    param_meshes = []
    if root is not None:
        for m in root.modules():
            cls = type(m)
            if cls.__name__ == "DistributedDataParallel":
                wrappers.add("ddp")
            elif any(c.__name__ == "FSDPModule" for c in cls.__mro__):
                wrappers.add("fsdp2")
        param_meshes = _parameter_meshes(root)
    meshes = []
    for spec in sorted(mode.dtensor_layouts):
        d = json.loads(spec)
        mesh = {"mesh_shape": d["mesh_shape"], "mesh_dim_names": d["mesh_dim_names"],
                "mesh_ranks": d["mesh_ranks"]}
        if mesh not in meshes:
            meshes.append(mesh)
    for mesh in param_meshes:
        if mesh not in meshes:
            meshes.append(mesh)
    return json.dumps({"wrappers": sorted(wrappers), "meshes": meshes}, separators=(",", ":"))


def _parameter_meshes(root) -> list[dict]:
    """The distinct device meshes of the model's DTensor parameters (FSDP2's sharded
    parameters, tensor parallel's), as the `dtensor` attribute describes a mesh. FSDP2
    swaps a parameter for its unsharded plain tensor between all-gather and reshard
    (reshard_after_forward=False keeps it so after forward): the mesh is then read from
    the module's FSDP state (its parameter group's mesh_info)."""
    out: list[dict] = []

    def add(mesh) -> None:
        try:
            d = {"mesh_shape": list(mesh.shape),
                 "mesh_dim_names": list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
                 "mesh_ranks": mesh.mesh.flatten().tolist()}
        except Exception:  # noqa: BLE001 - a mesh torch cannot describe: the layout goes without it
            return
        if d not in out:
            out.append(d)

    try:
        for p in root.parameters():
            mesh = getattr(p, "device_mesh", None)
            if mesh is not None:
                add(mesh)
        for m in root.modules():
            state = getattr(m, "_get_fsdp_state", None)
            group = getattr(state(), "_fsdp_param_group", None) if callable(state) else None
            for fp in getattr(group, "fsdp_params", None) or ():
                mesh = getattr(getattr(fp, "mesh_info", None), "mesh", None)
                if mesh is not None:
                    add(mesh)
    except Exception:  # noqa: BLE001 - the layout is a description: never lose the dump over it
        pass
    return out


# Set when writer="auto" could not start the writer process although the dump file could be
# created: later blocks of this process go straight to the thread writer.
_no_writer_process = False


class dumper:  # noqa: N801 - the original API's name (torch.utils.dumper)
    """Record every op of the block into one HDF5 file (see docs/FORMAT.md).

    Modes (what the original's users type): `use_dump=True` dumps; `load_file_path`
    given (with use_load, use_dump or neither) replays that dump; `check_overflow=True`
    dumps only overflowing ops (replaying load_file_path's inputs when one is given); `load_with_acl_dump=True` adds the ACL kernel dump to replay.
    `dump_path` alone (no mode flag) also dumps. With no flag and no path the block
    does nothing (as the original with use_dump=False).
    """

    def __init__(self, use_dump: bool = False, dump_path: str | os.PathLike | None = None,
                 use_load: bool = False, load_file_path: str | os.PathLike | None = None,
                 check_overflow: bool = False, load_with_acl_dump: bool = False,
                 acl_config: str | None = None, *, dump_mode: str | None = None, include=None,
                 exclude=None, modules=None, phases=None, record_views: bool = False,
                 record_stack: bool = False, stats_only: bool = False, overflow_dtype=None,
                 overflow_limit=None, overflow_raise: bool = False, op_map=None,
                 flush_interval: float = 1.0, max_pending_bytes: int = 512 << 20,
                 dedup: bool = True, writer: str = "auto", step: int | None = None,
                 stats_histogram: bool = False, own_error: bool = True, max_load_bytes: int = 128 << 20,
                 compiled: bool | str = False, **unknown: Any):
        if unknown:      # a misspelt option must not silently give another dump than asked
            known = [n for n in inspect.signature(dumper.__init__).parameters if n not in ("self", "unknown")]
            name = sorted(unknown)[0]
            close = difflib.get_close_matches(name, known, n=1)
            raise DumperError(f"unknown option {name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise DumperError(f"step must be an int >= 0, got {step!r}")
        # one block per training step: the step goes into the file name and root attributes
        self.step = step
        self.dump_path = path_option("dump_path", dump_path)
        self.load_file_path = path_option("load_file_path", load_file_path)
        self.load_with_acl_dump = load_with_acl_dump
        self.acl_config = acl_config
        self.stats_only = stats_only
        # statistics dumps: also a histogram of log2|x| per tensor (accucmp whatif on them)
        self.stats_histogram = bool(stats_histogram)
        if self.stats_histogram and not stats_only:
            raise DumperError("stats_histogram=True needs stats_only=True (a full dump holds the values)")
        self.overflow_dtype = overflow_dtype
        self.overflow_limit = overflow_limit
        self.overflow_raise = overflow_raise
        self.op_map = op_map
        # torch.compile'd steps as compiled (npu_dumper/compiled/, docs/COMPILED.md):
        # True or "node" (every ATen op its own compiled piece), or "module"
        if compiled is True:
            compiled = "node"
        if compiled not in (False, None, "node", "module"):
            raise DumperError(f"compiled must be True, False, 'node' or 'module', got {compiled!r}")
        self.compiled = compiled or None
        if self.compiled == "module" and load_file_path is not None:
            raise DumperError("compiled='module' does not replay a load file: graph-level "
                              "load-replay runs each op on its recorded inputs (compiled=True)")
        if self.compiled and (check_overflow or load_with_acl_dump):
            raise DumperError("compiled=True records a compiled step's values (or replays a load "
                              "file through it); it does not combine with check_overflow or "
                              "load_with_acl_dump")
        if isinstance(flush_interval, bool) or not isinstance(flush_interval, (int, float)) \
                or not flush_interval >= 0:
            raise DumperError(f"flush_interval must be a number of seconds >= 0, got {flush_interval!r}")
        if isinstance(max_pending_bytes, bool) or not isinstance(max_pending_bytes, int) \
                or max_pending_bytes <= 0:
            raise DumperError(f"max_pending_bytes must be a positive int, got {max_pending_bytes!r}")
        self.flush_interval = float(flush_interval)
        self.max_pending_bytes = max_pending_bytes
        # load-replay: bytes of recorded tensors held at once (read ahead of the model, or
        # kept for a later op that reads them again); docs/REPLAY.md "Memory"
        if isinstance(max_load_bytes, bool) or not isinstance(max_load_bytes, int) or max_load_bytes <= 0:
            raise DumperError(f"max_load_bytes must be a positive int, got {max_load_bytes!r}")
        self.max_load_bytes = max_load_bytes
        self.dedup = dedup
        # load-replay: measure ops whose inputs were rounded against float64 on those inputs;
        # plain dumps: every op of a run in reduced precision against float64 on its inputs
        self.own_error = own_error
        # "thread": HDF5 written by a thread of this process; "process": by a child process
        # with its own GIL (docs/FORMAT.md, durability); "auto": the process writer for full
        # dumps (h5py holds the GIL for all its metadata work, which in a thread competes
        # with the model's Python), the thread writer where no child can be started.
        # Statistics-only dumps always use a thread (little HDF5 work).
        if writer not in ("auto", "thread", "process"):
            raise DumperError(f"writer must be 'auto', 'thread' or 'process', got {writer!r}")
        self.writer = writer
        self.record_views = record_views
        self.record_stack = record_stack
        if dump_mode is not None and dump_mode not in S.DUMP_MODES:
            raise DumperError(f"dump_mode must be one of {S.DUMP_MODES}, got {dump_mode!r}")
        self.filter = OpFilter(include, exclude, modules, phases)
        if use_load and not self.load_file_path:
            raise DumperError("use_load=True needs load_file_path (the dump to replay)")
        # The guide writes `use_dump=True, load_file_path=...` and the overflow example
        # passes load_file_path too: a load file given always means "replay it".
        if check_overflow:
            self.mode = S.MODE_OVERFLOW
        elif self.load_file_path:
            self.mode = S.MODE_LOAD
        elif use_dump or self.dump_path:
            self.mode = S.MODE_DUMP
        else:
            self.mode = None     # disabled
        # Load-replay stores outputs only by default, as the original did: a matched op's
        # inputs are the golden's values (cast to the live dtype), so storing them again
        # only doubles the replay's writing. dump_mode="all" keeps them.
        if dump_mode is None:
            dump_mode = "output" if self.mode == S.MODE_LOAD else "all"
        self.dump_mode = dump_mode
        self.path: str | None = None
        self.policies: list[Policy] = []
        self.summary: dict[str, Any] = {}
        self.rank, self.world_size = None, None
        self._mode: DumpMode | None = None
        self._writer: WriterThread | None = None
        self._tracker: ModuleTracker | None = None

    @property
    def enabled(self) -> bool:
        return self.mode is not None

    @property
    def num_ops(self) -> int:
        """Ops recorded (written or queued for writing) so far."""
        return self._mode.num_recorded if self._mode is not None else 0

    # ---- policies (lazy imports: only the modes in use are loaded) ----------------------
    def _make_policies(self) -> list[Policy]:
        policies: list[Policy] = []
        if self.load_file_path:
            from .replay.load_replay import ReplayPolicy
            # ReplayPolicy(load_file_path, *, op_map=...): match live ops to recorded ones
            policies.append(ReplayPolicy(self.load_file_path, op_map=self.op_map, own_error=self.own_error,
                                         max_load_bytes=self.max_load_bytes))
        if self.mode == S.MODE_DUMP and self.own_error and not self.stats_only:
            from .replay.own_error import PlainOwnError
            # a run in reduced precision: each op's own error on the inputs it got, so an
            # independent compare blames an op only for what it added
            policies.append(PlainOwnError())
        if self.mode == S.MODE_OVERFLOW:
            from .replay.overflow import OverflowPolicy
            # OverflowPolicy(*, dtype=, limit=, raise_on_overflow=): record only overflowing ops
            policies.append(OverflowPolicy(dtype=self.overflow_dtype, limit=self.overflow_limit,
                                           raise_on_overflow=self.overflow_raise))
        if self.load_with_acl_dump:
            # ir2tbe's AclDumpPolicy: kernel-level dump around each replayed op
            policies.append(make_policy("load_with_acl_dump", self))
        from .capture.loss_scale import LossScalePolicy
        # (every mode: a GradScaler's ops and scaled gradients are marked whatever is recorded)
        return policies + [LossScalePolicy()]

    def _validate(self) -> None:
        if self.dump_path is None:
            raise DumperError(f"dump_path is required for mode {self.mode!r}")
        if self.load_file_path is not None:
            self.load_file_path = resolve_load_path(self.load_file_path, self.rank, self.step)
            if os.path.isdir(self.load_file_path):
                raise DumperError(f"{self.load_file_path}: load_file_path is a directory, not a dump file")
            if not os.path.isfile(self.load_file_path):
                raise DumperError(f"{self.load_file_path}: load_file_path does not exist")
            target = self.dump_path
            if os.path.isdir(target) or not os.path.exists(target):
                same = False
            else:
                same = os.path.samefile(target, self.load_file_path)
            if same or os.path.abspath(target) == os.path.abspath(self.load_file_path):
                raise DumperError(f"{self.dump_path}: dump_path is the load_file_path; "
                                  "it would overwrite the dump being replayed")

    # ---- context manager ----------------------------------------------------------
    def __enter__(self):
        global _active
        if not self.enabled:
            return self
        with _active_lock:
            if _active is not None:
                raise DumperError(f"{self.dump_path}: a dumper is already active "
                                  f"(writing {_active.path}); nested dumpers are not supported")
            _active = self
        try:
            self._start()
        except BaseException:
            with _active_lock:
                _active = None
            self._abort()
            raise
        return self

    def _start(self) -> None:
        self.rank, self.world_size = dist_rank()
        self._validate()
        self.path = resolve_dump_path(self.dump_path, self.mode, self.rank, self.step)
        self._created = not os.path.exists(self.path)
        self.policies = self._make_policies()
        # Policies first: a load file or ACL config they refuse is reported before the
        # dump file is created (or an existing one at dump_path truncated).
        self.registry = CaptureRegistry()
        if self._uses_writer_process() and any(p.starts_a_child for p in self.policies):
            # the writer's child starts while load-replay's probe of its golden (a child of
            # its own, ~0.3-0.5 s) runs: the two interpreters side by side (ResNet-50's
            # replay entry 0.91 -> 0.73 s, docs/REPLAY.md "Fifth round")
            remote.spawn()
        self._begin_policies()
        root = {
            S.ROOT_TORCH_VERSION: str(torch.__version__),
            S.ROOT_RANK: self.rank if self.rank is not None else 0,
            S.ROOT_WORLD_SIZE: self.world_size if self.world_size is not None else 1,
            S.ROOT_STEP: self.step,
            S.ROOT_DUMP_MODE: self.dump_mode,
            S.ROOT_STATS_ONLY: bool(self.stats_only),
            S.ROOT_CONTENT_HASH: HASH_ALGORITHM if self.stats_only else None,
            S.ROOT_STATS_HISTOGRAM: True if self.stats_histogram else None,
            S.ROOT_LOAD_FILE: self.load_file_path,
            # with links, an input that is no link into an earlier op's output is a parameter,
            # buffer or batch tensor (accucmp's independent compares read that: departures.py)
            S.ROOT_DEDUP: bool(self.dedup) and not self.stats_only,
            # what was selected, so compare can pass the other dump's ops through it too
            S.ROOT_OP_FILTER: None if self.filter.trivial else self.filter.to_json(),
            S.ROOT_COMPILED: self.compiled,
        }
        # statistics-only dumps are tables, not op groups (docs/FORMAT.md: why)
        # (the writer thread creates a statistics file, overlapping the model's first ops:
        # resolve_dump_path has checked what can be checked up front)
        try:
            w = self._file_writer(root)
        except DumpError as e:
            raise DumperError(str(e)) from e
        registry = self.registry
        if self.stats_only:
            thread_cls = StatsWriterThread
        elif isinstance(w, RemoteDumpWriter):
            thread_cls = ProcessWriter
        else:
            thread_cls = WriterThread
        extra = {"histograms": True} if self.stats_histogram else {}
        self._writer = thread_cls(w, registry, max_pending_bytes=self.max_pending_bytes,
                                  flush_interval=self.flush_interval, dedup=self.dedup, **extra)
        self._tracker = ModuleTracker()
        if not self.compiled:   # (compiled graphs carry their module paths themselves)
            self._tracker.__enter__()
        self._mode = DumpMode(writer=self._writer, registry=registry, policies=self.policies,
                              op_filter=self.filter, tracker=self._tracker,
                              dump_mode=self.dump_mode, record_views=self.record_views,
                              record_stack=self.record_stack)
        if self.compiled:
            # no dispatch mode: under one TorchDynamo would run the model eagerly; the
            # compiled graphs hand their nodes to this mode's recording path instead
            from .compiled.session import CompiledSession
            self._compiled_session = CompiledSession(self._mode, split=self.compiled).__enter__()
        else:
            self._mode.__enter__()

    def _begin_policies(self) -> None:
        """begin() each policy; when one refuses, end the ones already begun (files and
        threads they opened), quietly, and re-raise."""
        begun = []
        try:
            for p in self.policies:
                p.begin(self)
                begun.append(p)
        except BaseException:
            for p in reversed(begun):
                if hasattr(p, "verbose"):
                    p.verbose = False
                try:
                    p.end(self)
                except Exception:  # noqa: BLE001 - the first error is the one to report
                    pass
            self.policies = []
            raise

    def _uses_writer_process(self) -> bool:
        """Whether the file is written by the writer process (else by this one)."""
        return not self.stats_only and (self.writer == "process"
                                        or (self.writer == "auto" and not _no_writer_process))

    def _file_writer(self, root: dict) -> Any:
        """What writes the file: a statistics table writer; for full dumps the writer
        process, or with writer="auto" this process's DumpWriter when the child cannot be
        started (no usable interpreter, dumpfile not importable there; a path problem then
        raises from DumpWriter as it would have); writer="thread": the DumpWriter."""
        global _no_writer_process
        kw = dict(mode=self.mode, root_attrs=root, flush_interval=self.flush_interval)
        if self.stats_only:
            return StatsDumpWriter(self.path, defer_open=True, **kw)
        if self._uses_writer_process():
            try:
                return RemoteDumpWriter(self.path, **kw)
            except (DumpError, OSError) as e:
                if self.writer == "process":
                    raise DumperError(str(e)) from e
                w = DumpWriter(self.path, **kw)
                _no_writer_process = True   # the path was fine: the child is what failed; not again
                return w
        return DumpWriter(self.path, **kw)

    def _abort(self) -> None:
        """Entry failed (e.g. a policy refused its load file) before the model ran: close the
        writer and remove the file this block created, which holds no op."""
        if self._writer is not None:
            self._writer.close()
            try:
                self._writer.writer.close(complete=False)
            except DumpError:
                pass
        if self.path and getattr(self, "_created", False) and self._mode is None:
            try:
                os.remove(self.path)
            except OSError:
                pass

    def __exit__(self, exc_type, exc, tb):
        global _active
        if not self.enabled or self._mode is None:
            return False
        with SignalsNoted() as noted:
            try:
                if self.compiled:
                    self._compiled_session.__exit__(exc_type, exc, tb)
                else:
                    self._mode.__exit__(exc_type, exc, tb)
            finally:
                try:
                    self._tracker.__exit__(exc_type, exc, tb)
                    self._drain(noted)
                    for p in self.policies:
                        p.end(self)
                    writer_ok = not self._writer.failed and not noted.signals
                    self._finish(clean=exc_type is None and writer_ok,
                                 step_raised=_raised_text(exc_type, exc) if writer_ok else None)
                finally:
                    with _active_lock:
                        _active = None
        noted.deliver()     # a SIGTERM noted above: the process now ends as it asked
        if noted.signals and exc_type is None:
            raise KeyboardInterrupt
        if exc_type is None and self._writer.failed:
            self._raise_failure()
        return False

    def _drain(self, noted: "SignalsNoted") -> None:
        """Wait for the writer to write what is queued (at most ~0.4 x flush_interval of
        its work: WriterThread.max_lag), also when a Ctrl-C ended the block. A Ctrl-C (or
        SIGTERM) while it waits stops that: the ops not yet written are dropped and the
        file is closed with the ops written so far (complete False). Signals are only
        noted meanwhile (a second Ctrl-C cannot break the close) and acted on once the
        file is closed."""
        wt = self._writer
        noted.arm(wt.abandon)
        wt.close()

    def _raise_failure(self) -> None:
        """The writer's first failure, as one line: file, error, ops the file keeps."""
        err = self._writer._error
        kept = self.summary.get("ops_kept")
        msg = writer_error_message(err, self.path)
        if kept is not None:
            msg += f"; recording stopped, the file keeps {kept} ops"
        raise DumperError(msg) from err

    def _finish(self, clean: bool, step_raised: str | None = None) -> None:
        """Close the file: complete only on a clean exit. `step_raised`: the user's step
        raised and the writer closed cleanly, so the file says so (root `step_raised` and
        the op it had reached, `step_raised_at`: `accucmp ls` tells that apart from a
        writer that did not close)."""
        wt = self._writer
        w = wt.writer
        dev = self._mode.first_device or "cpu"
        layout = parallel_layout(self._tracker, self._mode) if self.rank is not None else None
        policy_attrs: dict[str, Any] = {}
        for policy in self.policies:
            try:
                policy_attrs.update(policy.root_attrs())
            except Exception:  # noqa: BLE001 - a mode's report must not lose the dump
                pass
        extra = {S.ROOT_DEVICE: dev, S.ROOT_DEVICE_TYPE: S.device_type_code(dev)}
        if layout:
            extra[S.ROOT_PARALLEL_LAYOUT] = layout
        if step_raised is not None:
            extra[S.ROOT_STEP_RAISED] = step_raised
            extra[S.ROOT_STEP_RAISED_AT] = int(self._mode.seqid)
            extra[S.ROOT_STEP_RAISED_IN_OP] = self._mode.raised_in == self._mode.seqid
        extra.update(policy_attrs)
        if isinstance(w, RemoteDumpWriter):
            w.extra_root_attrs = extra
        elif (f := w.file) is not None and f.id.valid and (getattr(wt, "device_written", None) != dev or layout
                                                           or step_raised is not None or policy_attrs):
            try:
                set_attrs(f, extra)
            except Exception:  # noqa: BLE001 - e.g. disk full: close() below reports
                pass
        try:
            w.close(complete=clean)
        except DumpError as e:
            # e.g. disk full at the final flush: the same one-line DumperError the user's
            # thread gets for a failure during the block (after the summary is made)
            if wt._error is None:
                wt._error = e
        self.summary = {
            "path": self.path, "mode": self.mode, "ops_seen": self._mode.seqid,
            "ops_recorded": self._mode.num_recorded, "datasets": wt.num_datasets,
            "links": wt.num_links, "views": wt.num_views, "bytes_written": w.bytes_written,
            "writer": "process" if isinstance(w, RemoteDumpWriter) else "thread",
            # ops the closed file holds (fewer than recorded after a failure or a Ctrl-C)
            "ops_kept": w.durable_ops,
        }
        # Each mode's own report (replay matches, overflows, kernel dumps) under its name.
        for policy in self.policies:
            report = getattr(policy, "summary", None)
            if report is not None:
                self.summary[type(policy).__name__.removesuffix("Policy").lower()] = report


def _raised_text(exc_type, exc) -> str | None:
    """'ValueError: first line of its message' of what ended the block; None: it did not raise."""
    if exc_type is None:
        return None
    msg = str(exc).strip().splitlines()[0][:200] if exc is not None and str(exc).strip() else ""
    return f"{exc_type.__name__}: {msg}" if msg else exc_type.__name__
