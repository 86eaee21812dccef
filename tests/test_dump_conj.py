"""Complex tensors with the conjugate / negative bit (rotary embeddings' `freqs.conj()`):
recorded with the values the op saw, never linked to the un-conjugated storage, and a
self-replay reproduces every recorded output bit for bit."""

from __future__ import annotations

import numpy as np
import torch

import npu_dumper  # noqa: F401 - installs torch.utils.dumper
from dumpfile import DumpFile


class Rotary(torch.nn.Module):
    """Llama-style rotary embedding on complex numbers, applied to q and k."""

    def __init__(self, dim=8, heads=2, seq=5):
        super().__init__()
        self.q = torch.nn.Linear(dim * heads, dim * heads)
        self.k = torch.nn.Linear(dim * heads, dim * heads)
        inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        angles = torch.outer(torch.arange(seq).float(), inv)
        self.register_buffer("freqs", torch.polar(torch.ones_like(angles), angles))
        self.heads, self.dim = heads, dim

    def rope(self, x, freqs):
        b, t, _ = x.shape
        xc = torch.view_as_complex(x.reshape(b, t, self.heads, self.dim // 2, 2))
        return torch.view_as_real(xc * freqs[None, :, None, :]).reshape(b, t, -1)

    def forward(self, x):
        q = self.rope(self.q(x), self.freqs)
        k = self.rope(self.k(x), self.freqs.conj())        # the conj view of the same buffer
        qc = torch.view_as_complex(q.reshape(*q.shape[:-1], -1, 2))
        # x * conj(x) and -x: conj and neg views of one storage, in one op
        energy = torch.view_as_real(qc * qc.conj() + torch.neg(qc.conj()).conj())
        return (q * k).sum() + energy.sum()


def _outputs(path):
    out = {}
    with DumpFile(path) as f:
        for o in f.ops():
            for name, v in o.outputs().items():
                if v.is_tensor:
                    out[(o.op, o.seqid, name)] = np.asarray(v.read())
    return out


def test_conj_views_are_recorded_as_seen_and_self_replay_is_bit_exact(tmp_path):
    torch.manual_seed(0)
    model = Rotary()
    x = torch.randn(3, 5, 16)
    ref = str(tmp_path / "ref.h5")
    with torch.utils.dumper(use_dump=True, dump_path=ref):
        model(x).backward()
    freqs = model.freqs
    with DumpFile(ref) as f:
        muls = [o for o in f.ops() if o.op == "aten.mul.Tensor" and o.attrs.get("phase") == "forward"
                and o.inputs()["other"].dtype == "complex64" and o.inputs()["other"].shape[1] == 5]
        seen = [np.asarray(o.inputs()["other"].read()).reshape(5, -1) for o in muls]
        # qc * qc.conj(): one storage, two values; the second is not a link to the first
        pairs = [(np.asarray(o.inputs()["self"].read()), np.asarray(o.inputs()["other"].read()))
                 for o in f.ops() if o.op == "aten.mul.Tensor" and o.attrs.get("phase") == "forward"
                 and o.inputs()["self"].dtype == "complex64"
                 and o.inputs()["other"].shape == o.inputs()["self"].shape == (3, 5, 8)]
        assert pairs and all(np.array_equal(b, np.conj(a)) and not np.isreal(a).all() for a, b in pairs)
    # the q rotation multiplied by freqs, the k rotation by its conjugate: both recorded
    assert any(np.array_equal(s, freqs.numpy()) for s in seen)
    assert any(np.array_equal(s, freqs.conj().resolve_conj().numpy()) for s in seen)
    out = str(tmp_path / "replay.h5")
    with torch.utils.dumper(load_file_path=ref, dump_path=out) as d:
        model(x).backward()
    assert d.summary["replay"].matched == d.num_ops
    a, b = _outputs(ref), _outputs(out)
    assert len(b) > 20 and set(b) <= set(a)
    for key, v in b.items():
        assert v.dtype == a[key].dtype and v.tobytes() == a[key].tobytes(), key


def test_a_storage_resized_under_a_pending_capture_is_copied_first_and_unrecorded():
    """FSDP2 frees parameter storage with `untyped_storage().resize_(0)` (not an aten op)
    while captures still alias it: the guard copies them first, without the copy being
    dispatched to the modes of the block (whose captures would alias the freed storage)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from npu_dumper.capture.snapshots import CaptureRegistry, StorageGuard, TensorCapture

    class Seen(TorchDispatchMode):
        ops: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    reg = CaptureRegistry()
    w = torch.arange(12.0).reshape(3, 4)
    cap = TensorCapture(w.t(), reg._gen, clone=False)
    reg.add(cap)
    ptr = w.untyped_storage().data_ptr()
    with StorageGuard(reg), Seen() as seen:
        w.untyped_storage().resize_(0)
    assert seen.ops == []
    # dedup keys carry the write generation: none made before the resize matches after it
    assert reg.generation(ptr) == cap.gen + 1
    assert torch.equal(cap.tensor, torch.arange(12.0).reshape(3, 4).t())
    assert "resize_" not in torch.UntypedStorage.__dict__      # the guard is gone
