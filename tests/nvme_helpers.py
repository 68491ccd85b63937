"""Reaching under an NVMe tier, shared by its tests: where a block's slot lies, writing raw bytes
into a file, and what a killed process leaves behind."""

from __future__ import annotations

import os
from pathlib import Path

from kvtier.keys import BlockKey
from kvtier.tiers.nvme import NVMeTier
from kvtier.tiers.nvme_index import SLOTS_FILE


def slot_of(tier: NVMeTier, key: BlockKey) -> tuple[Path, int]:
    """(slot file, byte offset of the slot) holding ``key``."""
    slot = tier._table.acquire(key)
    assert slot is not None
    tier._table.release(slot)
    nd = len(tier._devs)
    return tier._devs[slot % nd].path / SLOTS_FILE, (slot // nd) * tier.slot_bytes


def patch_file(path: Path, offset: int, data: bytes) -> None:
    """Write ``data`` at ``offset`` of ``path``, durably (damage as a reopen will find it)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def crash(tier: NVMeTier) -> None:
    """What a killed process leaves: no snapshot written on close, files and locks released."""
    for dev in tier._devs:
        assert dev.dindex is not None
        os.close(dev.dindex._jfd)
        dev.dindex = None
        for fd in (dev.fd, dev.lock_fd):
            os.close(fd)
        dev.fd = dev.lock_fd = -1
