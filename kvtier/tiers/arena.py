"""``ArenaTier``: the shared logic of in-process tiers built on a preallocated slot arena.

Host DRAM and device memory differ only in how one slot's bytes are copied in and out; slot
bookkeeping, two-phase visibility, reader pins and the tier contract live here once.
Subclasses implement ``_write(slot, block) -> None`` and ``_read(slot, out) -> bool`` (False:
the bytes failed verification and the block is dropped).
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections.abc import Sequence

from kvtier.errors import ConfigError
from kvtier.keys import BlockKey
from kvtier.layout import KVLayout
from kvtier.tiers.base import Array
from kvtier.tiers.memory import require_memory
from kvtier.tiers.slots import SLOT_TABLE_BYTES, SlotTable, SlotTier

log = logging.getLogger(__name__)


class ArenaTier(SlotTier):
    """A tier of ``capacity_bytes // block_bytes`` fixed-size slots. Thread-safe."""

    def __init__(self, layout: KVLayout, capacity_bytes: int) -> None:
        super().__init__(layout)
        n = capacity_bytes // layout.block_bytes
        if n < 1:
            raise ConfigError(
                f"{self.name} tier capacity {capacity_bytes} bytes holds no block of "
                f"{layout.block_bytes} bytes; raise capacity to at least one block"
            )
        require_memory(f"{self.name} tier capacity", capacity_bytes, self._host_bytes(n))
        self._table = SlotTable(n)

    def _host_bytes(self, n: int) -> int:
        """Host memory ``n`` slots take (checked before anything is allocated): their table."""
        return n * SLOT_TABLE_BYTES

    @abstractmethod
    def _write(self, slot: int, block: Array) -> None:
        """Copy ``block`` into ``slot`` (and record whatever verification needs)."""

    @abstractmethod
    def _read(self, slot: int, out: Array) -> bool:
        """Copy ``slot`` into ``out``; False if the bytes fail verification."""

    def get_into(
        self, keys: Sequence[BlockKey], outs: Sequence[Array], tenant: str = ""
    ) -> list[bool]:
        self.check_buffers(outs, keys)
        result = []
        for key, out in zip(keys, outs, strict=True):
            slot = self._table.acquire(key)
            if slot is None:
                result.append(False)
                continue
            try:
                ok = self._read(slot, out)
            finally:
                self._table.release(slot)
            if not ok:
                log.warning(
                    "%s tier: checksum mismatch, dropping block %s", self.name, key[:8].hex()
                )
                self._table.remove(key)
            result.append(ok)
        return result

    def put(
        self, keys: Sequence[BlockKey], blocks: Sequence[Array], tenant: str = ""
    ) -> list[bool]:
        self.check_buffers(blocks, keys)
        result = []
        for key, block in zip(keys, blocks, strict=True):
            slot = self._table.reserve(key)
            if slot is None or slot == -1:  # full, or already present / being written
                result.append(slot == -1)
                continue
            try:
                self._write(slot, block)
            except BaseException:
                self._table.abort(key, slot)
                raise
            self._table.publish(key, slot)
            result.append(True)
        return result

    def delete(self, keys: Sequence[BlockKey], tenant: str = "") -> None:
        for key in keys:
            self._table.remove(key)
