from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvtier.layout import KVLayout
from kvtier.tiers.base import Tier
from tests.tier_conformance import TierConformance, rand_block, rand_key

torch = pytest.importorskip("torch")
from kvtier.tiers.device import DeviceTier  # noqa: E402


class TestDeviceTierCPU(TierConformance):
    def make_tier(self, layout: KVLayout, capacity_blocks: int, tmp_path: Path) -> Tier:
        return DeviceTier(layout, capacity_blocks * layout.block_bytes, device="cpu")


@pytest.mark.gpu
class TestDeviceTierCUDA(TierConformance):
    def make_tier(self, layout: KVLayout, capacity_blocks: int, tmp_path: Path) -> Tier:
        return DeviceTier(layout, capacity_blocks * layout.block_bytes, device="cuda")


def test_device_tier_takes_torch_tensors(tmp_path: Path) -> None:
    t = TestDeviceTierCPU().make_tier(TierConformance.layout, 4, tmp_path)
    block = rand_block(seed=3)
    k = rand_key()
    assert t.put([k], [torch.from_numpy(block)]) == [True]  # type: ignore[list-item]
    out = np.zeros_like(block)
    assert t.get_into([k], [out]) == [True]
    assert out.tobytes() == block.tobytes()
