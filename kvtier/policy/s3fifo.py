"""S3-FIFO (Yang et al., SOSP'23), made prefix-aware: scan- and frequency-aware eviction.

Three FIFO queues: a *small* probation queue that new blocks enter, a *main* queue for blocks
that were hit while on probation (or that come back soon after being dropped), and a *ghost*
list of recently dropped keys (no data). Every resident key carries a 2-bit hit counter.
Eviction takes from ``small`` while it holds more than its share: a hit block moves to ``main``,
an unhit one is dropped (and remembered in ``ghost``). From ``main``, a hit block is reinserted
with its counter decremented (CLOCK-like), an unhit one is dropped. So one-shot tails of long
prompts leave quickly, and shared prefixes, hit again and again, stay.

Dead-tail admission: the last ``tail_blocks`` *new* keys of an ``insert`` (a request's newest
leaves: on the Mooncake trace a new last block is reused 5% of the time, the one before 17%, the
third 29%, against 38-61% deeper in) enter the probation queue at its *front*, so they are the
first victims unless hit soon. They are still admitted: a hit moves them on as usual. The rule
reads an ``insert`` as one request's chain: a tier fed by *demotions* must set the instance's
``tail_blocks = 0`` (the simulator does; with it, HBM+DRAM on the Mooncake trace falls from
0.52 to 0.48).

Prefix awareness: a request's chain is queued *leaf first* (the root enters last), so within one
chain the leaf leaves the FIFO before its parent, and a parent's counter is never below its
child's (every hit on a child is a hit on its parent too). The block-level variant
``s3fifo-block`` queues parent first, as a plain block cache would; it drops parents before their
children and does worse than LRU at small capacities. It breaks the prefix contract, so it is
not in the store's registry: only the simulator offers it, as the comparison baseline.

``insert`` accepts keys that are already resident (the served request's whole chain): those
count as hits. Eviction work is bounded: each key is moved at most ``MAX_FREQ + 1`` times per
eviction pass, and pinned (non-evictable) keys are rotated to the back at most once per victim.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import ClassVar

from kvtier.policy.base import EvictionPolicy, K, always

MAX_FREQ = 3


class S3FIFO(EvictionPolicy[K]):
    """Prefix-aware S3-FIFO. Tuned on the Mooncake trace (see ``docs/simulation.md``)."""

    name = "s3fifo"
    #: share of the capacity the probation queue may hold before eviction takes from it first
    small_fraction: ClassVar[float] = 0.2
    #: ghost list length as a multiple of the capacity
    ghost_factor: ClassVar[float] = 3.0
    #: queue a chain leaf first (prefix-aware) or parent first (block-level)
    leaf_first: ClassVar[bool] = True
    #: new keys at the end of an ``insert`` that enter probation as first victims
    tail_blocks: int = 3

    def feed_by_demotion(self) -> None:
        self.tail_blocks = 0  # a batch of victims has no dead tail

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._small: OrderedDict[K, None] = OrderedDict()
        self._main: OrderedDict[K, None] = OrderedDict()
        self._ghost: OrderedDict[K, None] = OrderedDict()
        self._freq: dict[K, int] = {}
        self._small_cap = max(1, int(capacity * self.small_fraction))
        self._ghost_cap = max(1, int(capacity * self.ghost_factor))

    def insert(self, keys: Sequence[K]) -> None:
        freq = self._freq
        ghost = self._ghost
        small = self._small
        tail = self.tail_blocks  # new keys still to be queued at the front
        front: list[K] = []
        for k in reversed(keys) if self.leaf_first else keys:
            f = freq.get(k)
            if f is not None:
                if f < MAX_FREQ:
                    freq[k] = f + 1
                tail = 0  # a resident key: the keys before it are not a new tail
            elif k in ghost:
                del ghost[k]
                self._main[k] = None
                freq[k] = 0
                tail = 0
            else:
                small[k] = None
                freq[k] = 0
                if tail:
                    front.append(k)
                    tail -= 1
        for k in reversed(front):  # parent first, so the leaf ends at the very front
            small.move_to_end(k, last=False)

    def access(self, keys: Sequence[K]) -> None:
        freq = self._freq
        for k in keys:
            f = freq.get(k)
            if f is not None and f < MAX_FREQ:
                freq[k] = f + 1

    def remove(self, key: K) -> None:
        if self._freq.pop(key, None) is not None:
            if key in self._small:
                del self._small[key]
            else:
                del self._main[key]

    def evict(self, n: int, evictable: Callable[[K], bool]) -> list[K] | None:
        """All-or-nothing on the resident set (queue order may age during a failed attempt).

        Pinned keys are rotated to the back of their queue, each at most once between two steps
        that lower some key's counter or take a victim (so the work is bounded by the counters'
        sum plus the victims). ``always`` takes a faster path with the same choices.
        """
        if n <= 0:
            return []
        freq = self._freq
        if n > len(freq):
            return None
        small, main, ghost = self._small, self._main, self._ghost
        small_cap, ghost_cap = self._small_cap, self._ghost_cap
        if evictable is always:
            return self._evict_unpinned(n)
        victims: list[K] = []
        # queue lengths kept in locals: this loop is the simulator's hot path
        ns, nm, ng, left = len(small), len(main), len(ghost), n
        skip_small = skip_main = 0
        while left:
            main_open = skip_main < nm
            if skip_small < ns and (ns >= small_cap or not main_open):
                k, _ = small.popitem(last=False)
                if freq[k]:
                    freq[k] = 0
                    main[k] = None
                    ns -= 1
                    nm += 1
                    skip_small = skip_main = 0  # progress: pinned keys may be passed again
                    continue
                if not evictable(k):
                    small[k] = None
                    skip_small += 1
                    continue
                del freq[k]
                ns -= 1
                ghost[k] = None  # resident keys are never in the ghost list
                if ng >= ghost_cap:
                    ghost.popitem(last=False)
                else:
                    ng += 1
            elif main_open:
                k, _ = main.popitem(last=False)
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
            else:  # every resident key is pinned: restore, back at the front, unhit
                for v in reversed(victims):
                    ghost.pop(v, None)
                    freq[v] = 0
                    small[v] = None
                    small.move_to_end(v, last=False)
                return None
            victims.append(k)
            left -= 1
            skip_small = skip_main = 0
        return victims

    def _evict_unpinned(self, n: int) -> list[K]:
        """``evict`` when nothing is pinned (``n <= len(self)``): no rotations, no restore."""
        small, main, ghost, freq = self._small, self._main, self._ghost, self._freq
        small_cap, ghost_cap = self._small_cap, self._ghost_cap
        ns, nm, ng = len(small), len(main), len(ghost)
        victims: list[K] = []
        append = victims.append
        while n:
            if ns and (ns >= small_cap or not nm):
                k, _ = small.popitem(last=False)
                ns -= 1
                if freq[k]:
                    freq[k] = 0
                    main[k] = None
                    nm += 1
                    continue
                del freq[k]
                ghost[k] = None
                if ng >= ghost_cap:
                    ghost.popitem(last=False)
                else:
                    ng += 1
            else:
                k, _ = main.popitem(last=False)
                f = freq[k]
                if f:
                    freq[k] = f - 1
                    main[k] = None
                    continue
                del freq[k]
                nm -= 1
            append(k)
            n -= 1
        return victims

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: object) -> bool:
        return key in self._freq


class BlockS3FIFO(S3FIFO[K]):
    """S3-FIFO as a plain block cache (paper defaults, parent first): prefix-unaware baseline."""

    name = "s3fifo-block"
    small_fraction = 0.1
    ghost_factor = 0.9
    leaf_first = False
    tail_blocks = 0
