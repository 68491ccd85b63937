"""The default policy: hit density where the cache holds enough requests to learn from, LRU where
it does not.

``HitDensity`` ranks by what it learned of the lives of the requests the cache holds. A cache
that holds a few dozen requests learns from too few lives: on the shared Mooncake trace the
learned ranking at 240-280 blocks averages LRU's hit ratio, with a spread of about 15% either
way from one size to the next, and it ends below LRU at some sizes up to 900 blocks with reuse
classes and up to 2,625 without (``scripts/policy_grid.py``, docs/simulation.md). At such sizes
LRU is also close to the best possible: within 3% of Belady's MIN at 32 blocks.

So ``DensityOrLRU`` decides once, at the first eviction, when the cache has filled: if the
requests that brought blocks in so far number fewer than it needs, it runs plain LRU from then
on (the same ``LRU`` class, fed every use since the start, so its decisions are exactly LRU's);
otherwise it is ``HitDensity``. Until then no block has left, so the two agree. It needs
``min_requests_hinted`` (48) when at least half of them came with a ``hint`` -- a reuse class,
the strongest signal the ranking learns from: on synthetic RAG at 5% of its blocks (86 labelled
requests at fill) the learned ranking is 21% above LRU -- and ``min_requests`` (128) when not.
A tier with density tiers below it (``extend``: any with room) always stays ``HitDensity``: they
rank by its life table and the metas it passes down.

Past the threshold the learned ranking is still noisy for a while: with reuse classes it ended
below LRU at 2,290 and 2,300 blocks of the shared trace (92 requests at fill; 0.9998x and
0.987x), and went from 0.99x to 1.08x of LRU between sizes 10 blocks apart. So a cache that
fills with fewer than ``tilted_below`` (160) requests, and has no tiers below, ranks by its
densities times ``exp(-tilt x age / capacity)`` (``DensityTable.tilt``; ``tilt`` 0.25: a block
one capacity old counts at 0.78 of its density): a light prior towards recency that breaks the
learned ranking's near-ties towards LRU's order. On the shared trace it leaves no size from
1,300 to 4,000 blocks below LRU and raises the average ratio to LRU there (1.086x to 1.093x);
on synthetic workloads at 2-5% of their blocks it costs up to 1.2% (docs/simulation.md).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, ClassVar

from kvtier.policy.base import EvictionPolicy, K
from kvtier.policy.density import HitDensity
from kvtier.policy.lru import LRU


class DensityOrLRU(HitDensity[K]):
    """``HitDensity``, or ``LRU`` in a cache that fills with fewer requests than it
    ``needed()`` to learn (module docstring). ``ranking`` says which, once decided (``None``
    before). Not thread-safe (one tier, under the decider's lock), as every policy."""

    name = "density"
    #: requests (inserts that brought new blocks) a cache must hold when it first fills for
    #: the learned ranking to be used: unlabelled, and when most came with a ``hint`` (a reuse
    #: class, the strongest signal the ranking learns from)
    min_requests: ClassVar[int] = 128
    min_requests_hinted: ClassVar[int] = 48
    #: a cache that learns from fewer requests than this ranks with a tilt towards recency of
    #: this strength (``DensityTable.tilt``; per capacity of age)
    tilted_below: ClassVar[int] = 160
    tilt: ClassVar[float] = 0.25

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        #: plain LRU, fed every use until the first eviction decides (then kept or dropped)
        self._lru: LRU[K] | None = LRU(capacity)
        self.ranking: str | None = None
        self.requests = 0  # inserts that brought new blocks, until the decision
        self.hinted = 0  # of them, those with a hint
        self.tilted = False  # ranks with the recency tilt (decided with the ranking)

    def insert(self, keys: Sequence[K], hint: Hashable | None = None) -> None:
        lru = self._lru
        if lru is None:
            super().insert(keys, hint)
            return
        lru.insert(keys)
        if self.ranking is None:
            before = self.now
            super().insert(keys, hint)
            if self.now != before:
                self.requests += 1
                self.hinted += hint is not None
        else:  # LRU decides; the resident set the callers hold stays in step
            self._runs.res.update(keys)

    def _recency(self, keys: Sequence[K]) -> bool:
        """Mirror a use of resident ``keys`` into the LRU (for it, a refresh is an access);
        True when the LRU decides, so ``HitDensity`` need not see it."""
        lru = self._lru
        if lru is None:
            return False
        lru.access(keys)
        return self.ranking is not None

    def access(self, keys: Sequence[K]) -> None:
        if not self._recency(keys):
            super().access(keys)

    def refresh(self, keys: Sequence[K]) -> None:
        if not self._recency(keys):
            super().refresh(keys)

    def remove(self, key: K) -> None:
        lru = self._lru
        if lru is not None:
            lru.remove(key)
            if self.ranking is not None:
                self._runs.res.discard(key)
                return
        super().remove(key)

    def evict(self, n: int, evictable: Callable[[K], bool]) -> list[K] | None:
        if self.ranking is None and n > 0:
            self._decide()
        lru = self._lru
        if lru is None:
            return super().evict(n, evictable)
        victims = lru.evict(n, evictable)
        if victims:
            self._runs.res.difference_update(victims)
        return victims

    def _decide(self) -> None:
        """The cache is full: learn (drop the LRU) or run LRU from now on."""
        if self.below or self.requests >= self.needed():
            self.ranking = "density"
            self._lru = None
            if not self.below and self.requests < self.tilted_below:
                self.ranked.tilt(self.tilt)
                self._reprice()
                self.tilted = True
        else:
            self.ranking = "lru"
            self.release()

    def needed(self) -> int:
        """The requests the cache must fill with to learn: fewer when most were labelled."""
        if 2 * self.hinted >= self.requests > 0:
            return self.min_requests_hinted
        return self.min_requests

    def describe(self) -> dict[str, Any]:
        """``HitDensity.describe`` while it ranks; under LRU the resident keys, and why."""
        if self.ranking == "lru":
            return {
                "ranking": "lru",
                "resident": len(self._runs.res),
                "requests_at_fill": self.requests,
                "min_requests": self.needed(),
            }
        tilt = self.tilt if self.tilted else 0.0
        return {"ranking": self.ranking or "density", "recency_tilt": tilt, **super().describe()}


def tier_ranking(policies: Sequence[EvictionPolicy[Any]]) -> str | None:
    """What one tier's policies (one per node; one on a single node) ranked by at the end:
    ``"lru"`` or ``"density"`` for the default, ``"lru on k of n nodes"`` when its nodes
    differ, None for another policy or a tier that never filled (for reports)."""
    got = [p.ranking for p in policies if isinstance(p, DensityOrLRU) and p.ranking is not None]
    if not got:
        return None
    if len(set(got)) == 1:
        return got[0]
    return f"lru on {got.count('lru')} of {len(got)} nodes"
