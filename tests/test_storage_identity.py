"""What a block learns of its storages (which op made one, whether a collective wrote it last)
follows the storage, not its address: a freed storage's address goes to the next allocation
of its size, and that allocation was made by nobody (npu_dumper/replay/layout.StorageMap).

Found on timm's Swin under bf16 autocast: the bf16 copy of a weight the user had changed
landed where an activation had been, the plain dump recorded the copy as made by an op, and
the changed weight passed as an inherited difference."""

import numpy as np
import torch

from npu_dumper.replay.layout import CollectiveWrites, StorageMap


def _storages_over_one_buffer(numel: int):
    """Tensors with distinct storages over the same memory, made one at a time: what the
    allocator does with a freed storage's address, without waiting for it to (a storage made
    over a numpy array frees with its tensor; the array, and so the address, stays)."""
    buf = np.zeros(numel, dtype=np.float32)
    return buf, (lambda: torch.from_numpy(buf))


def test_a_new_storage_at_a_freed_storages_address_is_not_what_was_noted_of_it():
    made = StorageMap()
    buf, new_storage = _storages_over_one_buffer(4096)
    a = new_storage()
    made.set(a, "made by mul")
    address = a.untyped_storage().data_ptr()
    assert a in made and made.get(a[10:]) == "made by mul"     # views share the storage
    del a
    b = new_storage()
    assert b.untyped_storage().data_ptr() == address           # the same address, another storage
    assert b not in made and made.get(b) is None
    made.set(b, "a leaf's cast")
    assert made.get(b) == "a leaf's cast"
    made.discard(b)
    assert b not in made


def test_entries_of_freed_storages_are_dropped_as_the_map_grows():
    made = StorageMap()
    alive = [torch.empty(8) for _ in range(100)]
    for t in alive:
        made.set(t, True)
    for _ in range(20_000):
        made.set(torch.empty(8), True)        # each freed right after
    assert len(made) <= 2 * 4096 + 100
    assert all(t in made for t in alive)


def test_a_collective_write_is_not_inherited_by_the_next_storage_at_its_address():
    class _Info:
        written = ("self",)

    writes = CollectiveWrites()
    buf, new_storage = _storages_over_one_buffer(4096)
    out = new_storage()
    writes.note("c10d.allreduce_.default", [out])
    assert writes.copied_into("aten.copy_.default", _Info, [("self", None, out)])
    address = out.untyped_storage().data_ptr()
    del out
    fresh = new_storage()
    assert fresh.untyped_storage().data_ptr() == address
    assert not writes.copied_into("aten.copy_.default", _Info, [("self", None, fresh)])
