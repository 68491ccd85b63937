"""Eviction policies, picked by name from a registry.

``make_policy("lru", capacity)``. Each policy is a small class implementing
``kvtier.policy.base.EvictionPolicy``; register new ones in ``POLICIES``.
"""

from __future__ import annotations

from collections.abc import Hashable

from kvtier.errors import ConfigError
from kvtier.policy.base import EvictionPolicy
from kvtier.policy.duel import Auto
from kvtier.policy.lru import LRU
from kvtier.policy.s3fifo import S3FIFO

POLICIES: dict[str, type[EvictionPolicy[Hashable]]] = {
    LRU.name: LRU,
    S3FIFO.name: S3FIFO,
    Auto.name: Auto,
}
#: chosen on the policy basket (every synthetic workload x 3 seeds and the Mooncake trace, 1%
#: to 50% of the distinct blocks, one tier and host + NVMe; ``docs/simulation.md``)
DEFAULT_POLICY = Auto.name
#: names of policies that were removed, and what to use instead
REMOVED = {
    "density": f"{Auto.name!r} (the default), {S3FIFO.name!r} or {LRU.name!r}",
    "density-always": f"{Auto.name!r} (the default), {S3FIFO.name!r} or {LRU.name!r}",
}


def make_policy(name: str, capacity: int) -> EvictionPolicy[Hashable]:
    """A new policy instance for a tier of ``capacity`` blocks; ``ConfigError`` if unknown."""
    key = name.lower()
    if key in REMOVED:
        raise ConfigError(
            f"eviction policy {name!r} was removed (it did not hold up against S3-FIFO and LRU "
            f"across workloads); use {REMOVED[key]}"
        )
    try:
        cls = POLICIES[key]
    except KeyError:
        raise ConfigError(
            f"unknown eviction policy {name!r}; choose one of {', '.join(sorted(POLICIES))}"
        ) from None
    return cls(capacity)


__all__ = ["DEFAULT_POLICY", "POLICIES", "EvictionPolicy", "make_policy"]
