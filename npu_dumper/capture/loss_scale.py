"""A loss scaler's part in the step, marked op by op (torch.amp.GradScaler).

An fp16 port trains with a loss scaler; its fp32 golden usually does not. The scaler adds ops
the golden lacks (the scale's creation, `loss * scale`, the backward's seed times the scale,
the gradients' unscale and the inf check, the scale's update), and every gradient from the
loss back to the unscale is the golden's times the scale. Without knowing that, a compare
stops at the scaler's first op and every backward op differs by 65536x.

While a dump block runs, GradScaler's `scale`, `unscale_`, `update` and `step` are wrapped so that
the ops they dispatch are known as the scaler's, and its state tensors (the scale, the
growth tracker, the inverse scale, the inf flags) are known by their storage. Each op then
gets a role (schema.OP_LOSS_SCALER: "state", "apply", "unscale") where it is the scaler's,
and the scale its tensors carry where it is not 1 (schema.OP_LOSS_SCALE), followed from the
op that applied it through every backward op that reads a scaled tensor (the backward is
linear in its seed), to the unscale. An op after the backward that reads a tensor still
carrying the scale (an optimizer step before the unscale) is not scaled alike: what it
computes is not linear in it, and compare judges it as it is. Nothing here adds an op: the
storages are looked up, the scale's value read once per multiplication. Inactive (one attribute test per op) until a scaler
method runs inside the block.
"""

from __future__ import annotations

import json
import threading
import weakref
from typing import Any

import torch

from dumpfile import departures as D
from dumpfile import schema as S

from .opschema import named_args, op_info
from .policy import OpEvent, Policy
from .walk import tensors_in

ROLE_STATE, ROLE_APPLY, ROLE_UNSCALE = S.LOSS_SCALER_ROLES
# the ops that apply a scale: GradScaler's `outputs * scale`, and autograd's backward of it
# (MulBackward0: grad * other)
_APPLYING = frozenset({"aten.mul", "aten.mul_"})
# the op that multiplies gradients by the scaler's inverse scale (and checks them for Inf/NaN):
# in `unscale_` by 1/scale; in `step`'s check before a fused optimizer step by a dummy 1, which
# leaves the scale on the gradients for the fused step to divide out (its grad_scale)
_UNSCALING = frozenset({"aten._amp_foreach_non_finite_check_and_unscale_"})
# the GradScaler methods whose ops are the scaler's: `step` makes the inf flag and the dummy
# inverse scale a fused optimizer step reads
_WRAPPED = ("scale", "unscale_", "update", "step")


def _storage_key(t: torch.Tensor):
    """(data pointer, storage) of a strided tensor with storage; None otherwise."""
    try:
        st = t.untyped_storage()
        ptr = st.data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    return (ptr, st) if ptr else None


class _ByStorage:
    """Values kept per storage, valid while that storage lives (a weak reference to the
    storage object: its address can be reused once it is freed)."""

    def __init__(self):
        self._d: dict[int, tuple[Any, Any]] = {}

    def get(self, t: torch.Tensor, default=None):
        key = _storage_key(t)
        if key is None:
            return default
        e = self._d.get(key[0])
        return e[1] if e is not None and e[0]() is key[1] else default

    def put(self, t: torch.Tensor, value) -> None:
        key = _storage_key(t)
        if key is not None:
            self._d[key[0]] = (weakref.ref(key[1]), value)

    def drop(self, t: torch.Tensor) -> None:
        key = _storage_key(t)
        if key is not None:
            self._d.pop(key[0], None)


class LossScalePolicy(Policy):
    """Marks the loss scaler's ops and the scale each op's tensors carry (module docstring).
    Its before_op runs first: load-replay reads the role to run the scaler's ops live."""

    before_others = True

    def __init__(self):
        self._state = _ByStorage()        # storages of the scaler's state tensors
        self._factor = _ByStorage()       # storage -> the scale its values carry (absent: 1)
        self._carried = _ByStorage()      # the same, had load-replay substituted no value
        self._region: list[str] = []      # the scaler methods running, innermost last
        self._thread = threading.get_ident()
        self._originals: dict[tuple, Any] = {}
        self.active = False               # a scaler method has run inside the block
        self.scales: list[float] = []     # the scales applied, in order
        self.ops = 0                      # ops given a role

    # ---- the scaler's methods ------------------------------------------------------------
    def begin(self, session: Any) -> None:
        self._thread = threading.get_ident()
        # GradScaler and its subclasses that define the methods themselves (FSDP's
        # ShardedGradScaler); a subclass that calls super() runs both wrappers, harmlessly
        for cls in _scaler_classes():
            for name in _WRAPPED:
                original = cls.__dict__.get(name)
                if original is not None:
                    self._originals[(cls, name)] = original
                    setattr(cls, name, self._wrap(name, original))

    def end(self, session: Any) -> None:
        for (cls, name), original in self._originals.items():
            setattr(cls, name, original)
        self._originals = {}

    def _wrap(self, name: str, original):
        policy = self

        def method(scaler, *args, **kwargs):
            if threading.get_ident() != policy._thread:
                return original(scaler, *args, **kwargs)
            policy.active = True
            # a scale made before the block (every step after the first) is known from here
            for t in (getattr(scaler, "_scale", None), getattr(scaler, "_growth_tracker", None)):
                if isinstance(t, torch.Tensor):
                    policy._state.put(t, True)
            policy._region.append(name)
            try:
                return original(scaler, *args, **kwargs)
            finally:
                policy._region.pop()

        method.__wrapped__ = original
        method.__name__ = getattr(original, "__name__", name)
        method.__doc__ = getattr(original, "__doc__", None)
        return method

    # ---- per op -------------------------------------------------------------------------
    def before_op(self, ev: OpEvent) -> None:
        if not self.active:
            return
        info = op_info(ev.func)
        state, data = [], []
        overwrites = D.op_packet(ev.name) in D.OVERWRITING_OPS
        for name, _, value in named_args(info, ev.args, ev.kwargs):
            members = tensors_in(value, [])
            for i, t in enumerate(members):
                label = f"{name}/{name}_{i}" if isinstance(value, (list, tuple)) else name
                if self._state.get(t):
                    state.append((label, t))
                elif (t.is_floating_point() or t.is_complex()) and not (overwrites and name in info.written):
                    data.append((label, t))
        region = self._region[-1] if self._region else None
        role = None
        if region is not None or state:
            if not data:
                role = ROLE_STATE
            elif state and D.op_packet(ev.name) in _APPLYING:
                role = ROLE_APPLY
            elif region == "unscale_" or (state and D.op_packet(ev.name) in _UNSCALING):
                role = ROLE_UNSCALE
        factors = {label: f for label, t in data if (f := self._factor.get(t, 1.0)) != 1.0}
        scale = _value(state[0][1]) if role == ROLE_APPLY else 1.0
        if role == ROLE_APPLY:
            self.scales.append(scale)
        elif role == ROLE_UNSCALE:
            # what it multiplies by (None: not read, the whole scale taken off as before)
            scale = next((_value(t) for label, t in state if label == "inv_scale"), None)
        ev.notes["loss_scaler_state_args"] = [label for label, _ in state]
        out = _carried_out(ev, role, bool(state), factors, scale)
        # what the op's tensors would carry had no value been substituted (load-replay hands a
        # matched op the recording's unscaled values, so `factors` ends at the first of them;
        # the live run's order of scaling and unscaling is still the user's, and a clipping
        # or an optimizer step that reads gradients before the unscale is a departure there)
        carried = {label: f for label, t in data if (f := self._carried.get(t, 1.0)) != 1.0}
        # (an op that takes the scaler's state undoes the scale itself: a fused optimizer step
        # given grad_scale; the scaler's own ops are the scaler's)
        ev.notes["loss_scale_carried"] = carried if not state and role is None else {}
        ev.notes["loss_scale_carried_out"] = _carried_out(ev, role, bool(state), carried, scale)
        if role is not None:
            ev.group_attrs[S.OP_LOSS_SCALER] = role
            self.ops += 1
        doc: dict[str, Any] = {}
        if factors or (out is not None and out != 1.0):
            doc = {"input": factors, "output": out}
        if state and role != ROLE_STATE:
            # the scaler's own tensors among the op's arguments (the scale `loss * scale`
            # takes, the unscale's inverse scale and inf flag): not the model's values
            doc["state"] = [label for label, _ in state]
        if doc:
            ev.group_attrs[S.OP_LOSS_SCALE] = json.dumps(doc)
        ev.notes["loss_scale_out"] = out

    def after_op(self, ev: OpEvent, recorded: bool) -> None:
        if not self.active or "loss_scale_out" not in ev.notes:
            return
        out = ev.notes.pop("loss_scale_out")
        carried = ev.notes.pop("loss_scale_carried_out", out)
        if ev.notes.get("replay_matched"):
            # a replayed op computed on the recording's inputs: its results carry the
            # recording's scale, which the golden's own records already have
            out = 1.0
        info = op_info(ev.func)
        made = tensors_in(ev.outputs, [])
        if info.written:
            for name, _, value in named_args(info, ev.args, ev.kwargs):
                if name in info.written:
                    tensors_in(value, made)
        for t in made:
            if out is None:
                self._state.put(t, True)
            for value, by in ((out, self._factor), (carried, self._carried)):
                if value is not None and value != 1.0 and (t.is_floating_point() or t.is_complex()):
                    by.put(t, value)
                else:
                    by.drop(t)

    @property
    def summary(self) -> dict[str, Any] | None:
        """The dumper's report (Dumper.summary["lossscale"]): None when no scaler ran."""
        if not self.active:
            return None
        return {"scaler_ops": self.ops, "scales": sorted(set(self.scales))}


def _carried_out(ev: OpEvent, role: str | None, takes_state: bool, factors: dict[str, float],
                 scale: float | None) -> float | None:
    """The scale an op's results carry (None: they are the scaler's state) from the role the
    op plays, the scales its inputs carry and `scale`: what an applying op multiplies by, what
    an unscaling op multiplies by (None: the whole scale)."""
    if role == ROLE_STATE:
        return None
    if role == ROLE_APPLY:
        return max(factors.values(), default=1.0) * scale
    if role == ROLE_UNSCALE and scale is not None:
        left = max(factors.values(), default=1.0) * scale
        return 1.0 if abs(left - 1.0) <= 1e-6 else left     # (1/1000 in float32: 0.99999994)
    if role == ROLE_UNSCALE or takes_state:
        return 1.0          # the unscale, or an op that takes the scale to undo it (a fused step)
    if ev.phase == S.PHASE_BACKWARD and D.op_packet(ev.name) not in D.VALUE_FREE:
        # (not an op that takes only its input's shape: `ones_like(loss)` is the backward's
        # seed, 1 whatever scale the loss carries)
        # the backward is linear in its seed: what it computes from a scaled tensor is
        # scaled alike. Not so an op after it (an optimizer, clipping): one that reads a
        # gradient the scaler has not unscaled computes something else (Adam's second
        # moment: scale squared), and its result is compared as it is
        return max(factors.values(), default=1.0)
    return 1.0


def _value(t: torch.Tensor) -> float:
    """The scale a state tensor holds (one number: GradScaler's scale is a 0-dim tensor)."""
    try:
        return float(t.detach().reshape(-1)[0].item()) if t.numel() else 1.0
    except (RuntimeError, ValueError):
        return 1.0


def _scaler_classes() -> list:
    """torch.amp.GradScaler and every subclass imported so far."""
    try:
        from torch.amp.grad_scaler import GradScaler
    except ImportError:        # (an older torch: torch.cuda.amp's)
        return []
    out, todo = [], [GradScaler]
    while todo:
        cls = todo.pop()
        if cls not in out:
            out.append(cls)
            todo += cls.__subclasses__()
    return out
