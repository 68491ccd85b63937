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
