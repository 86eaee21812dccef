"""Tensors that hold no data an op read: destinations it overwrites without reading them.

An in-place op that writes every element of `self` from its other arguments or a random
generator (`fill_`, `copy_`, dropout's `bernoulli_`, `uniform_`, ...) never reads what the
buffer held before: typically an `empty_like` allocation, whose bytes are whatever the
allocator left there. The dumper records such inputs (and the outputs of empty-like ops)
with the attribute `uninitialized`; this table also lets the torch-free tools recognise
them in dumps written before an op was listed here. Shared by npu_dumper (capture) and
accucmp (overflow, --bitwise, whatif), so the two never disagree.
"""

from __future__ import annotations

# aten ops (overload packet names) that overwrite every element of `self` without reading it.
# The schema marks `self` written (alias_info.is_write) but cannot say the old content is not read.
OVERWRITES_SELF: frozenset[str] = frozenset((
    "copy_", "fill_", "zero_", "bernoulli_", "uniform_", "normal_", "random_",
    "exponential_", "geometric_", "cauchy_", "log_normal_"))

# aten ops whose output is an allocation nobody wrote yet
EMPTY_LIKE: frozenset[str] = frozenset((
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted"))

REASON = ("uninitialized memory (an empty-like output, or a destination the op overwrites "
          "without reading it: out=, fill_, copy_, bernoulli_, ...): not data, not judged")


def _aten_name(op: str) -> str:
    parts = str(op).split(".")
    return parts[1] if len(parts) >= 2 and parts[0] == "aten" else ""


def holds_no_data(op: str, io: str, name: str) -> bool:
    """Whether tensor `name` (io "input"/"output") of `op` ("aten.bernoulli_.float") is
    uninitialised memory by the op's nature, whatever the dump's attributes say."""
    base = _aten_name(op)
    if io == "input":
        return base in OVERWRITES_SELF and name == "self"
    return base in EMPTY_LIKE
