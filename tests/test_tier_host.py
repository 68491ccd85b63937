from __future__ import annotations

from pathlib import Path

from kvtier.keys import BlockKey
from kvtier.layout import KVLayout
from kvtier.tiers.base import Tier
from kvtier.tiers.host import HostTier
from tests.tier_conformance import TierConformance


class TestHostTier(TierConformance):
    def make_tier(self, layout: KVLayout, capacity_blocks: int, tmp_path: Path) -> Tier:
        return HostTier(layout, capacity_blocks * layout.block_bytes)

    def corrupt(self, tier: Tier, key: BlockKey) -> bool:
        assert isinstance(tier, HostTier)
        slot = tier._table.acquire(key)
        if slot is None:
            return False
        tier.slot_view(slot)[5] ^= 0x10
        tier._table.release(slot)
        return True


def test_the_arena_starts_off_the_page_boundary_in_every_mapping(tmp_path: Path) -> None:
    """Slots sit 64 bytes past a page boundary, anonymous or named, in the creator and in a
    process that attaches (``kvtier.tiers.shm``): cache-line aligned as torch's tensors are,
    and not where a page-aligned slot would alias a numpy array's copies."""
    import mmap

    import numpy as np
    import torch

    from kvtier.tiers.shm import DATA_OFFSET, SharedMemory, shm_dir

    lay = KVLayout(layers=2, kv_heads=2, head_dim=64, block_tokens=16, dtype="float16")
    assert lay.block_bytes % mmap.PAGESIZE == 0  # every slot at the same offset in its page
    tensor = torch.empty(1 << 22, dtype=torch.uint8)
    assert tensor.data_ptr() % 64 == 0 == DATA_OFFSET % 64  # torch aligns tensors to 64 bytes
    assert DATA_OFFSET % mmap.PAGESIZE != 0  # off the page boundary (module docstring)
    anonymous = HostTier(lay, 4 * lay.block_bytes)
    named = HostTier(lay, 4 * lay.block_bytes, shm_path=f"{shm_dir()}/kvtier-test-{tmp_path.name}")
    try:
        for tier in (anonymous, named):
            assert all(
                tier.slot_view(s).ctypes.data % mmap.PAGESIZE == DATA_OFFSET for s in range(4)
            )
        assert named.shm.path is not None
        other = SharedMemory.attach(named.shm.path, named.shm.nbytes)
        assert other.array.ctypes.data % mmap.PAGESIZE == DATA_OFFSET
        named.slot_view(3)[-4:] = [9, 8, 7, 6]  # the last bytes: the same in both mappings
        assert np.array_equal(other.array[-4:], [9, 8, 7, 6])
        other.close()
    finally:
        anonymous.close()
        named.close()
