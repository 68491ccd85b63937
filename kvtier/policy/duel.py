"""``auto``, the default: LRU or S3-FIFO, whichever this tier's own traffic favours.

Neither classic policy wins everywhere. S3-FIFO keeps shared prefixes through floods of one-shot
prompt tails (RAG documents, system prompts, small caches); LRU keeps conversations whose next
turn comes back after more than S3-FIFO's short probation (chat at mid sizes). ``Auto`` runs both
and lets the tier's traffic decide, with no constant to tune:

* **Two real rankings.** An ``LRU`` and an ``S3FIFO`` each track the tier's resident keys (every
  ``insert``/``access``/``refresh``/``remove`` goes to both). ``evict`` asks the current winner
  for its victims and takes them out of the other too, so both always rank the same set. The
  S3-FIFO ranking remembers LRU's victims in its ghost list as it does its own
  (``S3FIFO.evicted``): a block dropped while LRU ranked and soon written again enters ``main``,
  as it would have under S3-FIFO alone, instead of being lost again from probation after the
  ranking switches back.
* **Two shadows.** A second ``LRU`` and ``S3FIFO`` of the tier's capacity simulate the same
  references on keys only (no data): each call's keys are a reference; a key a shadow holds is a
  hit *for that shadow*. The winner is the shadow with more hits so far (S3-FIFO on a tie).
  Within one request the store reports its leading hits twice (``access`` on load, ``refresh``
  on store): a ``refresh`` key the last ``access`` named is not a second reference.

**A tier below the first** judges its shadows on the lookups that reach it, as a cache of its
size serving the misses of the tiers above would: its own hits (``access``) and the blocks that
passed it by (``missed``: written into the first tier new, or read from a tier below), each a
hit for a shadow holding it and admitted into one that does not. Demotions into it (``insert``)
are not references: no request asked for those blocks, and judging on them would score the
shadows on the first tier's victims (a filtered stream that favours the ranking already in use).
The index tells only tiers below the first of ``missed``, so the first ``missed`` call is what
makes an ``Auto`` judge as a lower tier.

Memory: two rankings and two key-only shadows, about twice S3-FIFO's per block of the tier's
capacity (``heap_bytes_per_block`` in ``kvtier bench sim``; a block of KV is kilobytes to
megabytes). Work: about three times S3-FIFO's per call. Prefix-aware as its parts
(``kvtier.policy.base``). Reuse-class hints are ignored. What was tried against the misses left
and not kept: ``docs/policy-experiments.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Sequence
from typing import Any

from kvtier.policy.base import EvictionPolicy, K
from kvtier.policy.lru import LRU
from kvtier.policy.s3fifo import S3FIFO


class Shadow:
    """A key-only cache of ``capacity`` run by ``policy``, counting its hits."""

    __slots__ = ("capacity", "hits", "policy", "resident")

    def __init__(self, policy: EvictionPolicy[Any]) -> None:
        self.policy = policy
        self.capacity = policy.capacity
        self.resident = policy.resident()
        self.hits = 0

    def reference(self, keys: Sequence[Any]) -> None:
        """``keys`` (prefix order) are used: hits counted and touched, the rest admitted (as
        many as fit, the keys named here pinned while room is made)."""
        res = self.resident
        pol = self.policy
        hit: list[Any] = []
        new: list[Any] = []
        for k in keys:
            (hit if k in res else new).append(k)
        if hit:
            self.hits += len(hit)
            pol.access(hit)
        if not new:
            return
        del new[max(0, self.capacity - len(hit)) :]
        need = len(pol) + len(new) - self.capacity
        if need > 0:
            named = set(keys)
            if pol.evict(need, lambda k: k not in named) is None:
                return  # the keys named here fill it: nothing more to admit
        pol.insert(new)


class Auto(EvictionPolicy[K]):
    """LRU or S3-FIFO by shadow hits (module docstring). Not thread-safe."""

    name = "auto"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._lru: LRU[K] = LRU(capacity)
        self._s3: S3FIFO[K] = S3FIFO(capacity)
        self._shadows = (Shadow(LRU(capacity)), Shadow(S3FIFO(capacity)))
        self._accessed: set[K] = set()
        self._below = False  # told ``missed``: a tier below the first (module docstring)

    def _reference(self, keys: Sequence[K]) -> None:
        for s in self._shadows:
            s.reference(keys)

    def _lru_wins(self) -> bool:
        lru, s3 = self._shadows
        return lru.hits > s3.hits

    def insert(self, keys: Sequence[K], hint: Hashable | None = None) -> None:
        """New keys (or resident ones: a hit), prefix order; ``hint`` is ignored. A reference
        for the shadows in the first tier only (module docstring)."""
        self._lru.insert(keys)
        self._s3.insert(keys)
        if not self._below:
            self._reference(keys)

    def missed(self, keys: Sequence[K]) -> None:
        """Lookups that reached this lower tier and missed: references for the shadows."""
        self._below = True
        self._reference(keys)

    def access(self, keys: Sequence[K]) -> None:
        self._lru.access(keys)
        self._s3.access(keys)
        self._reference(keys)
        self._accessed = set(keys)

    def refresh(self, keys: Sequence[K]) -> None:
        self._lru.refresh(keys)
        self._s3.refresh(keys)
        seen = self._accessed
        fresh = [k for k in keys if k not in seen]
        if fresh:
            self._reference(fresh)
        self._accessed = set()

    def remove(self, key: K) -> None:
        if key in self._s3.resident():
            self._lru.remove(key)
            self._s3.remove(key)

    def evict(self, n: int, evictable: Callable[[K], bool]) -> list[K] | None:
        if not self._lru_wins():
            victims = self._s3.evict(n, evictable)
            if victims:
                for k in victims:
                    self._lru.remove(k)
            return victims
        victims = self._lru.evict(n, evictable)
        if victims:
            self._s3.evicted(victims)  # its ghost remembers them (module docstring)
        return victims

    def describe(self) -> dict[str, Any]:
        """Which ranking evicts, and each shadow's hits (``TieredStore.stats()``)."""
        lru, s3 = self._shadows
        return {
            "ranking": "lru" if self._lru_wins() else "s3fifo",
            "lru_shadow_hits": lru.hits,
            "s3fifo_shadow_hits": s3.hits,
        }

    def resident(self) -> Collection[object]:
        return self._s3.resident()
