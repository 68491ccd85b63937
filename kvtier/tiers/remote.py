"""What every tier on a shared server has in common: sealing, tenant quotas, a circuit breaker.

The Redis, Mooncake Store and S3 tiers differ in how they move bytes; around that they do the
same things, gathered here once:

- **Sealing.** Every value is one ``BlockSealer`` frame: header + payload + a MAC keyed with the
  deployment secret, or AES-GCM per tenant. A tier whose blocks would be read unauthenticated
  refuses to start (``ConfigError``) unless it is told ``trust_pool``.
- **Quotas.** ``reserve``/``refund`` charge whole blocks to a tenant's ``TenantQuotas`` budget
  (a no-op while no quota is configured); ``seal_charged`` is "reserve, then seal, refunding if
  the tenant has no key".
- **Outages.** ``guard(fn, fallback)`` runs a server call through the tier's ``CircuitBreaker``:
  an error of ``errors`` opens it and the caller gets ``fallback`` (a miss, ``False``), never an
  exception. ``healthy`` is the breaker's state.
- **Capacity.** The server evicts (or expires) on its own: ``capacity_blocks`` is 0.
- **Refusals.** A request the server answers with an error about that request alone (the Redis
  and S3 tiers tell it from an outage, each by its own protocol) is a miss that leaves the breaker
  closed; ``Refusals`` counts them and says which is the first of its kind, to log.
- **Zero-copy.** ``flat_bytes`` says whether a caller buffer can be read or written in place.
- **Config.** ``security_section`` checks a ``[[tiers]]`` table's keys (the tier's own plus
  ``SECURITY_KEYS``) and builds the sealer and quotas from it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import numpy as np

from kvtier.config import check_keys
from kvtier.errors import ConfigError
from kvtier.keys import BlockKey
from kvtier.layout import KVLayout
from kvtier.tiers.base import Array, Tier
from kvtier.tiers.breaker import CircuitBreaker
from kvtier.tiers.secure import (
    SECURITY_KEYS,
    BlockSealer,
    TenantQuotas,
    require_authentication,
    security_from_config,
)

T = TypeVar("T")


class RemoteTier(Tier):
    """Base class of the shared tiers; see the module docstring. Thread-safe."""

    shared = True
    persistent = False
    #: exceptions that mean "the server failed" (they open the breaker, never reach callers)
    errors: tuple[type[BaseException], ...] = (OSError,)

    def __init__(
        self,
        layout: KVLayout,
        *,
        breaker_name: str,
        cooldown_s: float,
        sealer: BlockSealer | None = None,
        quotas: TenantQuotas | None = None,
        secret: bytes = b"",
        trust_pool: bool = False,
    ) -> None:
        """``sealer`` frames values; without one, ``secret`` (the deployment secret, the same on
        every node) authenticates them with a MAC, or ``trust_pool`` accepts them plain.
        ``ConfigError`` when nothing would authenticate the blocks read."""
        super().__init__(layout)
        if sealer is None:
            sealer = BlockSealer(layout, secret=secret, trusted=trust_pool)
        elif secret or trust_pool:
            raise ConfigError(f"{breaker_name}: give a sealer or secret/trust_pool, not both")
        self.sealer = sealer
        self._tier_label = breaker_name
        self.quotas = quotas or TenantQuotas(name=self.name)
        self.breaker = CircuitBreaker(breaker_name, cooldown_s)

    def require_authentication(self) -> None:
        """``ConfigError`` unless the blocks read will be authenticated, or the pool is
        trusted. Each tier calls it once its own arguments are checked (so a bad argument is
        named first) and before it connects."""
        require_authentication(self.sealer, self._tier_label)

    @staticmethod
    def security_section(
        layout: KVLayout, spec: Mapping[str, Any], section: str, allowed: Iterable[str]
    ) -> tuple[BlockSealer, TenantQuotas]:
        """Check ``spec``'s keys against ``allowed`` plus ``SECURITY_KEYS`` (``ConfigError``
        naming an unknown one), then build the sealer and quotas it configures."""
        check_keys(section, spec, set(allowed) | SECURITY_KEYS)
        return security_from_config(layout, spec, section)

    # -- queries ---------------------------------------------------------------------------
    @property
    def capacity_blocks(self) -> int:
        return 0

    @property
    def healthy(self) -> bool:
        return self.breaker.healthy

    @property
    def value_bytes(self) -> int:
        """Size of one stored value (header + payload, + nonce and tag when encrypted)."""
        return self.sealer.value_bytes

    # -- outages ---------------------------------------------------------------------------
    def guard(self, fn: Callable[[], T], fallback: T) -> T:
        """``fn()`` through the breaker; ``fallback`` if it is open or ``fn`` raises ``errors``."""
        return self.breaker.call(fn, fallback, self.errors)

    # -- quotas ----------------------------------------------------------------------------
    def reserve(self, tenant: str) -> bool:
        """Charge one block to ``tenant``; ``False`` (counted, logged) if over its quota."""
        return not self.quotas.active or self.quotas.reserve(tenant, self.block_bytes)

    def refund(self, tenant: str, blocks: int = 1) -> None:
        """Give back ``blocks`` charged blocks (deleted, or reserved but not stored)."""
        if self.quotas.active and blocks:
            self.quotas.release(tenant, blocks * self.block_bytes)

    def seal_charged(self, key: BlockKey, block: Array, tenant: str) -> memoryview | None:
        """``reserve`` then seal ``block``; ``None`` (nothing charged) if refused or unsealable."""
        if not self.reserve(tenant):
            return None
        value = self.sealer.seal(key, block, tenant)
        if value is None:
            self.refund(tenant)
        return value


class Refusals:
    """Requests a server refused (a miss each, not an outage), counted in ``count``. ``add``
    says whether one is the first of its kind, which the tier logs: a full server refuses every
    put, and that is one line, not one per put. Thread-safe."""

    __slots__ = ("_kinds", "_lock", "count")

    def __init__(self) -> None:
        self.count = 0
        self._kinds: set[str] = set()
        self._lock = threading.Lock()

    def add(self, kind: str) -> bool:
        """Count one refused request of ``kind``; True if it is the first of that kind."""
        with self._lock:
            self.count += 1
            first = kind not in self._kinds
            self._kinds.add(kind)
        return first


def flat_bytes(a: Array) -> Array | None:
    """A flat uint8 view of ``a`` if it is C-contiguous (zero-copy capable), else None."""
    if not a.flags.c_contiguous:
        return None
    return a.reshape(-1).view(np.uint8)
