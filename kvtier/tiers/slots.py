"""A thread-safe table of fixed-size slots: which key lives in which slot, who is reading it.

Shared by the arena tiers (host DRAM, device memory) and usable by any tier built on
preallocated slots. Two-phase writes: ``reserve`` hands out a free slot that no reader can see,
``publish`` makes it visible once the bytes are in place (or ``abort`` returns it). Readers
``acquire`` a slot (pinning it) and ``release`` it; a slot removed while being read is freed only
when its last reader releases it, so a reader never sees its bytes overwritten.

All operations are O(1) under one short lock; no bytes are moved here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence

from kvtier.keys import BlockKey
from kvtier.tiers.base import Tier, TierUsage

#: memory one slot of a ``SlotTable`` takes once it holds a key (free-list int, reader count,
#: key -> slot entry and the 32-byte key object), rounded up from a tracemalloc measurement
SLOT_TABLE_BYTES = 160


class SlotTable:
    """Key -> slot map with a free list, reader pins and deferred frees."""

    __slots__ = ("_capacity", "_doomed", "_free", "_lock", "_readers", "_slots", "_writing")

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._free = list(range(capacity - 1, -1, -1))  # pop() hands out slot 0 first
        self._slots: dict[BlockKey, int] = {}
        self._writing: set[BlockKey] = set()
        self._readers = [0] * capacity
        self._doomed: set[int] = set()
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        return self._capacity

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, key: object) -> bool:
        return key in self._slots

    def keys(self) -> Iterator[BlockKey]:
        with self._lock:
            return iter(list(self._slots))

    def prefix_len(self, keys: list[BlockKey] | tuple[BlockKey, ...]) -> int:
        slots = self._slots
        n = 0
        for k in keys:
            if k not in slots:
                break
            n += 1
        return n

    def reserve(self, key: BlockKey) -> int | None:
        """A free slot for ``key``; -1 if ``key`` is present or being written; None if full."""
        with self._lock:
            if key in self._slots or key in self._writing:
                return -1
            if not self._free:
                return None
            self._writing.add(key)
            return self._free.pop()

    def publish(self, key: BlockKey, slot: int) -> None:
        with self._lock:
            self._writing.discard(key)
            self._slots[key] = slot

    def abort(self, key: BlockKey, slot: int) -> None:
        with self._lock:
            self._writing.discard(key)
            self._free.append(slot)

    def acquire(self, key: BlockKey) -> int | None:
        """Pin and return the slot of ``key``, or None if absent."""
        with self._lock:
            slot = self._slots.get(key)
            if slot is not None:
                self._readers[slot] += 1
            return slot

    def release(self, slot: int) -> None:
        with self._lock:
            self._readers[slot] -= 1
            if self._readers[slot] == 0 and slot in self._doomed:
                self._doomed.discard(slot)
                self._free.append(slot)

    def remove(self, key: BlockKey) -> int | None:
        """Unmap ``key``; its slot is freed now, or when its last reader releases it."""
        with self._lock:
            slot = self._slots.pop(key, None)
            if slot is None:
                return None
            if self._readers[slot]:
                self._doomed.add(slot)
            else:
                self._free.append(slot)
            return slot

    # -- for persistent tiers --------------------------------------------------------------
    def restore(self, mapping: Mapping[BlockKey, int]) -> None:
        """Install ``key -> slot`` entries read from disk (at open, before any other use)."""
        with self._lock:
            self._slots.update(mapping)
            used = set(self._slots.values())
            self._free = [s for s in range(self._capacity - 1, -1, -1) if s not in used]

    def retire(self, key: BlockKey, slot: int) -> None:
        """Abort a reserved write without returning its slot (its medium failed)."""
        with self._lock:
            self._writing.discard(key)

    def restock(self, slots: Sequence[int]) -> None:
        """Return slots set aside by ``retire`` to the free list (their medium is usable again)."""
        if slots:
            with self._lock:
                self._free.extend(slots)

    def purge(self, lost: Callable[[int], bool]) -> int:
        """Unmap every key and forget every free slot for which ``lost(slot)``; return the
        number of keys dropped."""
        with self._lock:
            gone = [k for k, s in self._slots.items() if lost(s)]
            for k in gone:
                del self._slots[k]
            self._free = [s for s in self._free if not lost(s)]
            return len(gone)


class SlotTier(Tier):
    """Base of tiers whose blocks live in fixed slots tracked by a ``SlotTable`` (``_table``,
    set by the subclass): the queries every such tier answers the same way."""

    _table: SlotTable

    @property
    def capacity_blocks(self) -> int:
        return self._table.capacity

    def usage(self) -> TierUsage:
        return TierUsage(len(self._table), self._table.capacity, self.block_bytes)

    def contains_prefix(self, keys: Sequence[BlockKey], tenant: str = "") -> int:
        return self._table.prefix_len(list(keys))

    def keys(self) -> Iterator[BlockKey]:
        return self._table.keys()
