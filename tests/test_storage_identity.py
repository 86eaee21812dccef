"""What a block learns of its storages (which op made one, whether a collective wrote it last)
follows the storage, not its address: a freed storage's address goes to the next allocation
of its size, and that allocation was made by nobody (npu_dumper/replay/layout.StorageMap).

Found on timm's Swin under bf16 autocast: the bf16 copy of a weight the user had changed
landed where an activation had been, the plain dump recorded the copy as made by an op, and
the changed weight passed as an inherited difference."""

import torch

from npu_dumper.replay.layout import CollectiveWrites, StorageMap


def _new_storage_at(address: int, numel: int, keep: list) -> torch.Tensor:
    """A fresh tensor whose storage starts at `address` (freed before): allocations of the
    same size are made (and kept) until the allocator hands that address out again."""
    for _ in range(10_000):
        t = torch.empty(numel)
        if t.untyped_storage().data_ptr() == address:
            return t
        keep.append(t)
    raise AssertionError("the allocator never gave the freed address back")


def test_a_new_storage_at_a_freed_storages_address_is_not_what_was_noted_of_it():
    made = StorageMap()
    a = torch.ones(4096)
    made.set(a, "made by mul")
    address = a.untyped_storage().data_ptr()
    assert a in made and made.get(a[10:]) == "made by mul"     # views share the storage
    del a
    keep: list = []
    b = _new_storage_at(address, 4096, keep)
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
    out = torch.zeros(4096)
    writes.note("c10d.allreduce_.default", [out])
    assert writes.copied_into("aten.copy_.default", _Info, [("self", None, out)])
    address = out.untyped_storage().data_ptr()
    del out
    keep: list = []
    fresh = _new_storage_at(address, 4096, keep)
    assert not writes.copied_into("aten.copy_.default", _Info, [("self", None, fresh)])
