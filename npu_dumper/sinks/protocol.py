"""What the dispatch mode hands a sink, and the protocol every sink implements.

The mode (npu_dumper.capture.mode) knows only this module: one `OpJob` per recorded op, given
to `Sink.submit` on the model's thread, and `Sink.failed`, which it reads before each op
(a sink whose first write failed stops recording; the user's step goes on and the
block raises at exit). The sinks (thread.py, process.py, stats.py) implement it; the
dumper block creates one and closes it.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class OpJob:
    op: str
    seqid: int
    phase: str
    module: str
    grad_fn: str
    attrs: dict
    inputs: list            # [(name, node)]
    outputs: list
    nbytes: int = 0
    captures: list = field(default_factory=list)
    batched: bool = False   # (statistics writer: its tensors were looked at for a batch)


def settle_attrs(job: OpJob) -> None:
    """Replace the attributes of `job` that are still being computed (a `Future`: an own-error
    measurement made off the model's thread, npu_dumper/replay/measure_worker.py) by their
    values, waiting for them; one that came to None, failed or was cancelled is left out.
    Every sink calls this on its writer thread before it writes the op."""
    attrs = job.attrs
    for key in [k for k, v in attrs.items() if isinstance(v, Future)]:
        try:
            value = attrs[key].result()
        except BaseException:  # noqa: BLE001 - (cancelled, or the measurement failed): not written
            value = None
        if value is None:
            del attrs[key]
        else:
            attrs[key] = value


class Sink(Protocol):
    """Takes recorded ops off the model's thread and writes them."""

    @property
    def failed(self) -> bool:
        """True once a write failed: the mode stops recording."""

    def submit(self, job: OpJob) -> None:
        """Queue one op; called on the model's thread, returns without writing."""

    def close(self) -> None:
        """Write what is queued and stop (the block's exit)."""
