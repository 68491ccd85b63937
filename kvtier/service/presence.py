"""``PresenceMap``: which block keys the service's index may hold, in shared memory every client
maps, so a lookup whose first block is absent is answered in the client, with no round trip.

A first-block miss is the commonest lookup an engine makes (every new prompt) and, through the
socket, the dearest per byte: the round trip is the whole cost. The map is an array of
``uint8`` counters; a key counts in slot ``key[:8] mod size`` (keys are SHA-256 digests:
uniform). The service keeps it (``PresenceEntries``: the index's entry table, counting each key
it adds and forgets); a client reads it. A counter of 0 means no key of that slot is in the
index -- the block is not cached, a miss for sure; anything else means "ask the service" (a
false positive costs the round trip it would have cost anyway). A counter that reaches 255
stays there (it is never decremented again): a slot shared by that many keys only costs round
trips.

Consistency: the service updates a counter under the store's lock, before the entry is
readable (a key enters the index pending, then becomes readable), and after it is gone. A
client reading the map while a key is being added may see 0 and serve a miss: the block was
not readable yet either. The map is only offered when the service has no shared tier (a block
absent from the node's index may still be in that tier: Redis, Mooncake, S3).

A client computes a key from its namespace's root (``kvtier.keys``), which the service tells
it for each scope it asks about (``root`` op). The root lets a client compute only its own
keys, which it could probe with lookups anyway: another tenant's keys start at another root.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from kvtier.keys import BlockKey
from kvtier.tiers.shm import SharedMemory

_MIN_SLOTS = 1 << 16
_MAX_SLOTS = 1 << 26  # 64 MiB of counters: beyond it false positives only cost round trips
_SATURATED = 255


def slots_for(blocks: int) -> int:
    """Counters for an index of up to ``blocks`` keys: a power of two with four slots per key
    (a false positive on about one lookup in five when the index is full)."""
    want = max(_MIN_SLOTS, 4 * blocks)
    return min(_MAX_SLOTS, 1 << (want - 1).bit_length())


class PresenceMap:
    """The counters, mapped. The service ``add``s and ``remove``s keys (one thread at a time:
    under the store's lock); any number of clients ``may_hold`` concurrently."""

    def __init__(self, shm: SharedMemory) -> None:
        if shm.nbytes & (shm.nbytes - 1):
            raise ValueError(f"a presence map has a power-of-two size, not {shm.nbytes}")
        self.shm = shm
        self._counts = shm.array
        self._mask = shm.nbytes - 1

    @classmethod
    def create(cls, path: str, slots: int, gid: int | None = None) -> PresenceMap:
        """A new, empty map named ``path`` (a stale one of that name is replaced)."""
        return cls(SharedMemory.create(slots, path, gid=gid, replace=True))

    @classmethod
    def attach(cls, path: str, nbytes: int) -> PresenceMap:
        """The service's map (``OSError`` if it cannot be mapped)."""
        return cls(SharedMemory.attach(path, nbytes))

    def _slot(self, key: bytes) -> int:
        return int.from_bytes(key[:8], "little") & self._mask

    def add(self, key: bytes) -> None:
        i = self._slot(key)
        c = self._counts[i]
        if c != _SATURATED:
            self._counts[i] = c + 1

    def remove(self, key: bytes) -> None:
        i = self._slot(key)
        c = self._counts[i]
        if c != _SATURATED and c:
            self._counts[i] = c - 1

    def may_hold(self, key: bytes) -> bool:
        """False only if the index holds no entry for ``key`` (see the module doc)."""
        return bool(self._counts[self._slot(key)])

    def occupancy(self) -> float:
        """The share of non-zero counters (the false-positive rate of a random absent key)."""
        return float(np.count_nonzero(self._counts)) / len(self._counts)

    def close(self) -> None:
        self.shm.close()

    def unlink(self) -> None:
        self.shm.unlink()


class PresenceEntries(dict[BlockKey, Any]):
    """The block index's entry table (``BlockIndex.entries``), counting every key it adds and
    forgets in a ``PresenceMap``. Only insertion and removal are overridden; reads are a
    plain ``dict``'s."""

    def __init__(self, pmap: PresenceMap, entries: Iterable[tuple[BlockKey, Any]] = ()) -> None:
        super().__init__()
        self.pmap = pmap
        for key, entry in entries:
            self[key] = entry

    def __setitem__(self, key: BlockKey, entry: Any) -> None:
        if key not in self:
            self.pmap.add(key)
        super().__setitem__(key, entry)

    def __delitem__(self, key: BlockKey) -> None:
        super().__delitem__(key)
        self.pmap.remove(key)

    def pop(self, key: BlockKey, *default: Any) -> Any:
        if key in self:
            self.pmap.remove(key)
        return super().pop(key, *default)

    def clear(self) -> None:
        for key in self:
            self.pmap.remove(key)
        super().clear()

    def setdefault(self, key: BlockKey, default: Any = None) -> Any:
        if key not in self:
            self.pmap.add(key)
        return super().setdefault(key, default)

    def popitem(self) -> tuple[BlockKey, Any]:
        key, entry = super().popitem()
        self.pmap.remove(key)
        return key, entry

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, entry in dict(*args, **kwargs).items():
            self[key] = entry
