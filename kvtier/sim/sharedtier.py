"""A tier shared by a cluster's nodes (a memory pool, object storage), as the simulator models
it: a key-only cache that every node's store writes through to and reads from, and that evicts
on its own, by its own policy.

This is the one part of a cluster replay (``kvtier.sim.cluster``) that is not the store's
decision code: a real shared tier (``kvtier.tiers.mooncake``, ``kvtier.tiers.redis``,
``kvtier.tiers.s3``) is a service with its own eviction, which no node's ``Decider`` runs. Each
node's store keeps its own index of what it wrote there, and learns that the tier dropped a
block only when a read of it fails -- as the model's nodes do (``kvtier.sim.storemodel``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtier.policy.base import EvictionPolicy, always


class SharedTier:
    """``capacity`` blocks kept by ``policy`` (fed every write and read). Not thread-safe.

    ``written`` / ``evicted``: blocks written into it (write-through, prefix order) and evicted
    out of it by its own policy.
    """

    def __init__(self, capacity: int, policy: EvictionPolicy[Any]) -> None:
        self.capacity = capacity
        self.policy = policy
        self.resident = policy.resident()
        self.written = 0
        self.evicted = 0

    def contains_prefix(self, keys: Sequence[Any]) -> int:
        """How many leading ``keys`` it holds (``Tier.contains_prefix``). No side effects."""
        res = self.resident
        n = 0
        for k in keys:
            if k not in res:
                break
            n += 1
        return n

    def get(self, keys: Sequence[Any]) -> list[bool]:
        """Read ``keys``: which it holds (a read of the others fails); the held ones are hits
        for its policy."""
        res = self.resident
        ok = [k in res for k in keys]
        hit = [k for k, g in zip(keys, ok, strict=True) if g]
        if hit:
            self.policy.access(hit)
        return ok

    def put(self, keys: Sequence[Any]) -> None:
        """Write ``keys`` (prefix order): a key it holds is rewritten (a hit for its policy),
        the others admitted, its own victims evicted first. A write larger than the tier keeps
        its head."""
        res = self.resident
        pol = self.policy
        held = [k for k in keys if k in res]
        if held:
            pol.access(held)
        new = [k for k in keys if k not in res][: self.capacity]
        if not new:
            return
        need = len(pol) + len(new) - self.capacity
        if need > 0:
            victims = pol.evict(need, always)
            assert victims is not None, "a key-only cache refused to evict"
            self.evicted += len(victims)
        pol.insert(new)
        self.written += len(new)
