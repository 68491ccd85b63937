"""Impossible sizes are ``ConfigError``s that name the key and say what fits on this machine,
raised before anything is allocated (or any directory touched): never a ``MemoryError`` or an
``OverflowError`` from inside an allocation."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.tiers.host import HostTier
from kvtier.tiers.nvme import NVMeTier
from kvtier.tiers.registry import make_tier
from tests.helpers import SMALL

RAM = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("capacity", [2 * RAM, 1024 << 40, "1024TiB", 1e30])
def test_a_host_tier_beyond_this_machines_memory_is_a_config_error(capacity: object) -> None:
    with pytest.raises(ConfigError, match=r"host tier capacity .* available .* at most"):
        make_tier(SMALL, {"kind": "host", "capacity": capacity})


def test_a_host_tier_that_fits_is_built() -> None:
    t = HostTier(SMALL, 8 * SMALL.block_bytes)
    assert t.capacity_blocks == 8


@pytest.mark.parametrize("capacity", [2 << 40, 1e30])
def test_an_nvme_index_too_large_for_memory_is_refused_before_the_disk_is_touched(
    tmp_path: Path, capacity: float
) -> None:
    d = tmp_path / "nvme0"
    with pytest.raises(ConfigError, match=r"nvme tier capacity .* of memory.* at most"):
        NVMeTier(SMALL, [d], int(capacity))  # 4 KiB slots: hundreds of millions of them
    assert not d.exists()


def test_an_nvme_tier_whose_index_fits_but_not_its_disk_gets_the_disk_space_error(
    tmp_path: Path,
) -> None:
    big = SMALL.__class__(layers=64, kv_heads=8, head_dim=128, dtype="float16", block_tokens=256)
    with pytest.raises(ConfigError, match="filesystem has"):
        NVMeTier(big, [tmp_path / "nvme0"], 1024 << 40)  # 1 PiB of 64 MiB slots
    assert not (tmp_path / "nvme0").exists()  # refused before the directory was made


def test_an_existing_empty_directory_too_small_is_refused_before_allocating(
    tmp_path: Path,
) -> None:
    d = tmp_path / "nvme0"
    d.mkdir()
    big = SMALL.__class__(layers=64, kv_heads=8, head_dim=128, dtype="float16", block_tokens=256)
    with pytest.raises(ConfigError, match="filesystem has"):
        NVMeTier(big, [d], 1024 << 40)
    assert list(d.iterdir()) == []  # nothing created in it
