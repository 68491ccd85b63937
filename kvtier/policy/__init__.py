"""Eviction policies, picked by name from a registry.

``make_policy("lru", capacity)``. Each policy is a small class implementing
``kvtier.policy.base.EvictionPolicy``; register new ones in ``POLICIES``.
"""

from __future__ import annotations

from collections.abc import Hashable

from kvtier.errors import ConfigError
from kvtier.policy.base import EvictionPolicy
from kvtier.policy.density import HitDensity
from kvtier.policy.fallback import DensityOrLRU
from kvtier.policy.lru import LRU
from kvtier.policy.s3fifo import S3FIFO

POLICIES: dict[str, type[EvictionPolicy[Hashable]]] = {
    LRU.name: LRU,
    S3FIFO.name: S3FIFO,
    HitDensity.name: HitDensity,
    DensityOrLRU.name: DensityOrLRU,
}
# Chosen by the policy-quality benchmark on the Mooncake trace (docs/simulation.md): 0.8x
# Belady's token hit ratio at 10k blocks (S3-FIFO 0.78x); plain LRU in a cache too small to
# learn from, so never below LRU (``density-always`` learns at every size).
DEFAULT_POLICY = DensityOrLRU.name


def make_policy(name: str, capacity: int) -> EvictionPolicy[Hashable]:
    """A new policy instance for a tier of ``capacity`` blocks; ``ConfigError`` if unknown."""
    try:
        cls = POLICIES[name.lower()]
    except KeyError:
        raise ConfigError(
            f"unknown eviction policy {name!r}; choose one of {', '.join(sorted(POLICIES))}"
        ) from None
    return cls(capacity)


__all__ = ["DEFAULT_POLICY", "POLICIES", "EvictionPolicy", "make_policy"]
