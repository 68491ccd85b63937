"""S3-FIFO (Yang et al., SOSP'23), made prefix-aware: the default policy.

Three FIFO queues: a *small* probation queue that new blocks enter, a *main* queue for blocks
hit while on probation (or that come back soon after being dropped), and a *ghost* list of
recently dropped keys (no data). Every resident key carries a hit counter (0..``MAX_FREQ``).
Eviction takes from ``small`` while it holds at least its share of the tier: a hit block moves
to ``main``, an unhit one is dropped (and remembered in ``ghost``). From ``main``, a hit block
goes round again with its counter lowered (CLOCK-like), an unhit one is dropped. One-shot tails
of long prompts leave quickly; shared prefixes, hit again and again, stay.

Prefix awareness: a request's chain is queued *leaf first* (the root enters last), so within
one chain the leaf leaves a FIFO before its parent, and a parent's counter is never below its
child's (a hit on a child is a hit on its parent too). ``BlockS3FIFO`` (``s3fifo-block``, the
simulator's baseline only) queues parent first, as a plain block cache would, and so breaks the
prefix contract (``kvtier.policy.base``).

The sizes are the paper's: probation is a tenth of the tier, the ghost list remembers as many
drops as ``main`` holds. Reuse-class hints are ignored (``insert``'s ``hint``).

The ghost list is a dict of key -> drop number: a key is in it while fewer than its length of
later keys were dropped; stale entries are cleared in bulk when the dict is twice that long.
Eviction work is bounded: a key is passed at most ``MAX_FREQ + 1`` times per victim taken, and a
pinned key is rotated at most once between two steps that make progress.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable, Sequence
from typing import Any, ClassVar

from kvtier.policy.base import EvictionPolicy, K

MAX_FREQ = 3


class S3FIFO(EvictionPolicy[K]):
    """Prefix-aware S3-FIFO (module docstring). Not thread-safe."""

    name = "s3fifo"
    #: share of the tier the probation queue holds before eviction takes from it first
    small_fraction: ClassVar[float] = 0.1
    #: ghost entries, as a share of the tier (the paper: as many as ``main`` holds)
    ghost_fraction: ClassVar[float] = 0.9
    #: queue a chain leaf first (prefix-aware) or parent first (block-level)
    leaf_first: ClassVar[bool] = True

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._small: OrderedDict[K, None] = OrderedDict()
        self._main: OrderedDict[K, None] = OrderedDict()
        self._freq: dict[K, int] = {}  # resident key -> hits (at most MAX_FREQ)
        self._ghost: dict[K, int] = {}  # dropped key -> its drop number
        self._drops = 0
        self._small_cap = max(1, int(capacity * self.small_fraction))
        self._ghost_cap = max(1, int(capacity * self.ghost_fraction))

    def insert(self, keys: Sequence[K], hint: Hashable | None = None) -> None:
        """New keys enter probation (or ``main``, if dropped recently); resident keys in
        ``keys`` count as a hit. ``hint`` is ignored."""
        freq, ghost, small, main = self._freq, self._ghost, self._small, self._main
        fresh = max(self._drops - self._ghost_cap, 0)  # ghost entries above this are live
        for k in reversed(keys) if self.leaf_first else keys:
            f = freq.get(k)
            if f is None:
                freq[k] = 0
                if ghost.pop(k, 0) > fresh:
                    main[k] = None
                else:
                    small[k] = None
            elif f < MAX_FREQ:
                freq[k] = f + 1

    def access(self, keys: Sequence[K]) -> None:
        freq = self._freq
        for k in keys:
            f = freq.get(k)
            if f is not None and f < MAX_FREQ:
                freq[k] = f + 1

    def refresh(self, keys: Sequence[K]) -> None:
        """Move resident ``keys`` behind everything in their queue, leaf first (the root ends
        last), counters untouched."""
        freq, small, main = self._freq, self._small, self._main
        for k in reversed(keys):
            if k in freq:
                (main if k in main else small).move_to_end(k)

    def remove(self, key: K) -> None:
        if self._freq.pop(key, None) is None:
            return
        if key in self._small:
            del self._small[key]
        else:
            del self._main[key]

    def evict(self, n: int, evictable: Callable[[K], bool]) -> list[K] | None:
        """All-or-nothing (queue order may age during a failed attempt). Pinned keys rotate to
        the back of their queue."""
        if n <= 0:
            return []
        freq, small, main, ghost = self._freq, self._small, self._main, self._ghost
        if n > len(freq):
            return None
        victims: list[K] = []
        drops = self._drops
        ns, nm = len(small), len(main)
        small_cap = self._small_cap
        pop_small, pop_main = small.popitem, main.popitem
        skip_small = skip_main = 0  # pinned keys passed since the last progress
        while len(victims) < n:
            main_open = skip_main < nm
            if skip_small < ns and (ns >= small_cap or not main_open):
                k = pop_small(last=False)[0]
                if freq[k]:  # hit on probation: promoted
                    freq[k] = 0
                    main[k] = None
                    ns -= 1
                    nm += 1
                    skip_small = skip_main = 0
                    continue
                if not evictable(k):
                    small[k] = None
                    skip_small += 1
                    continue
                del freq[k]
                ns -= 1
                drops += 1
                ghost[k] = drops
            elif main_open:
                k = pop_main(last=False)[0]
                f = freq[k]
                if f:
                    freq[k] = f - 1
                    main[k] = None
                    skip_small = skip_main = 0
                    continue
                if not evictable(k):
                    main[k] = None
                    skip_main += 1
                    continue
                del freq[k]
                nm -= 1
            else:  # every resident key is pinned: restore the victims, unhit, at the front
                for v in reversed(victims):
                    ghost.pop(v, None)
                    freq[v] = 0
                    small[v] = None
                    small.move_to_end(v, last=False)
                return None
            victims.append(k)
            skip_small = skip_main = 0
        self._drops = drops
        self._trim_ghost()
        return victims

    def evicted(self, keys: Sequence[K]) -> None:
        """``keys`` were evicted from the tier by another ranking (``kvtier.policy.duel``):
        forget them and remember them in the ghost list, as if this policy had dropped them, so
        one that comes back soon enters ``main`` here too."""
        ghost = self._ghost
        drops = self._drops
        for k in keys:
            if k in self._freq:
                self.remove(k)
                drops += 1
                ghost[k] = drops
        self._drops = drops
        self._trim_ghost()

    def _trim_ghost(self) -> None:
        """Clear stale ghost entries in bulk once the dict is twice the live list's length."""
        if len(self._ghost) > 2 * self._ghost_cap:
            live = max(self._drops - self._ghost_cap, 0)
            self._ghost = {k: d for k, d in self._ghost.items() if d > live}

    def describe(self) -> dict[str, Any]:
        """Queue sizes (``TieredStore.stats()["policies"]``)."""
        live = max(self._drops - self._ghost_cap, 0)
        return {
            "small": len(self._small),
            "main": len(self._main),
            "ghost": sum(1 for d in self._ghost.values() if d > live),
        }

    def resident(self) -> Collection[object]:
        return self._freq


class BlockS3FIFO(S3FIFO[K]):
    """S3-FIFO as a plain block cache (parent first): the prefix-unaware baseline."""

    name = "s3fifo-block"
    leaf_first = False
