"""A tier below a hit-density tier: what the tier above demotes, ranked with its table.

``HitDensity.feed_by_demotion`` makes this the policy of every tier below a density tier. A
victim comes down with the state and last use it had above (``HitDensity.passed``), and this
tier ranks it with the top tier's life table, clock and densities: the top tier's ghost
remembers as many keys as the whole hierarchy holds, so a return from any tier is learned there
at its true age, and this tier learns nothing itself.

Victims come down leaf first, a block per eviction and between other chains' blocks, so keys
are the unit here, not runs: each state keeps a FIFO queue of keys by last use, a block's
density is the lowest it had at any age up to its own, and eviction takes the queue whose oldest
entry has the lowest density (a heap of queue heads, rebuilt when the top tier's ages or
densities moved). A key used again is queued anew and leaves a stale entry behind, skipped when
met. Prefix links follow the tier above's (``ChainLinks.adopt``): a key whose child is resident
is never a victim; met by an eviction, it waits until its last child leaves, then is queued
first in line. Under a tier of another policy there is no table: blocks are linked to their
neighbour in each batch and leave oldest first.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Collection, Hashable, Sequence
from typing import Any

from kvtier.policy.base import EvictionPolicy, K, always
from kvtier.policy.chainlinks import ChainLinks
from kvtier.policy.density import HitDensity
from kvtier.policy.lifestates import START_SHIFT, STATE_MASK, queue_heads

Entry = tuple[Any, int]  # a queued key and the meta it was queued with (stale once it changed)
_FLAT = [0.0]  # the densities without a table: one state, one bucket, all equal


class DensityBelow(EvictionPolicy[K]):
    """A tier fed by the demotions of a density tier (module docstring)."""

    name = "density"
    #: with a tier below: the last victims' metas and their parents here
    passes_down: bool
    passed: dict[K, int]
    passed_parent: dict[K, K | None]

    def __init__(self, capacity: int, upper: EvictionPolicy[K] | None) -> None:
        super().__init__(capacity)
        root = upper.root if isinstance(upper, DensityBelow) else upper
        #: the top tier (its table, clock, densities and ghost), None under another policy
        self.root: HitDensity[K] | None = root if isinstance(root, HitDensity) else None
        self._upper: HitDensity[K] | DensityBelow[K] | None = None
        if isinstance(upper, (HitDensity, DensityBelow)):
            self._upper = upper
            upper.passes_down = True
        #: the table this tier ranks by: the top tier's lives at the scale of the hierarchy
        #: down to this tier (``HitDensity.extend``)
        self._scale = self.root.extend(capacity) if self.root is not None else None
        self._meta: dict[K, int] = {}  # resident key -> start, uses, state (one int)
        self._links: ChainLinks[K] = ChainLinks(self._requeue_freed, max(1, capacity))
        self._queues: list[deque[Entry]] = []  # per state: newest at the left
        self._heap: list[tuple[float, int, int]] = []  # (density, start, state) of queue heads
        self._top: list[int] = []  # per state: the start of its live heap entry (-1: none)
        self._stale = 0  # queue entries that no longer hold their key
        self._epoch = -1  # the top tier's epoch the heap was built at
        self.passes_down = False
        self.passed = {}
        self.passed_parent = {}

    def _clock(self) -> tuple[int, int, int, Sequence[float]]:
        """The top tier's clock, and the bucket width, buckets and densities (flat) of the
        table this tier ranks by."""
        scale = self._scale
        if self.root is None or scale is None:
            return 0, 1, 1, _FLAT
        return self.root.now, scale.width, scale.buckets, scale.dens

    def _density(self, s: int, start: int) -> float:
        now, w, nb, dens = self._clock()
        age = (now - start) // w
        return dens[s * nb + (age if age < nb else nb - 1)]

    # -- uses ----------------------------------------------------------------------------------
    def insert(self, keys: Sequence[K], hint: Hashable | None = None) -> None:
        """``keys`` are the tier above's victims, in prefix order; each keeps the meta (state,
        last use) and the parent it had there. A child that came down before its parent waits
        for it (``ChainLinks.adopt``)."""
        meta = self._meta
        upper = self._upper
        passed = upper.passed if upper is not None else {}
        parents = upper.passed_parent if upper is not None else None
        stamp = self._clock()[0] << START_SHIFT
        opened: list[tuple[int, K]] = []
        prev: K | None = None
        for k in keys:
            if k in meta:
                prev = k
                continue
            m = passed.get(k, stamp)
            meta[k] = m
            if parents is not None:
                self._links.adopt(k, parents.get(k), meta)
            elif prev is not None:
                self._links.link(k, prev)
            opened.append((m, k))
            prev = k
        for m, k in reversed(opened):  # leaf first, each at the newest end of its queue
            self._queue(k, m, newest=True)

    def access(self, keys: Sequence[K]) -> None:
        """Hits here move to the newest end of their queues, state kept; the top tier learns
        the use when the block comes back up (from its ghost). Ages are the top tier's."""
        meta = self._meta
        stamp = self._clock()[0] << START_SHIFT
        for k in reversed(keys):
            m = meta.get(k)
            if m is None:
                continue
            new = m & ((1 << START_SHIFT) - 1) | stamp
            if new != m:
                meta[k] = new
                self._stale += 1
                self._queue(k, new, newest=True)

    def refresh(self, keys: Sequence[K]) -> None:
        """Nothing: a tier below holds no chains stored into it (the top tier links them)."""

    def _queue(self, key: K, m: int, newest: bool) -> None:
        """Queue ``key`` (meta ``m``) at the newest end of its state's queue, or the eviction
        end (first in line)."""
        s = m & STATE_MASK
        queues, top = self._queues, self._top
        while len(queues) <= s:  # the top tier's states, as they come
            queues.append(deque())
            top.append(-1)
        if newest:
            queues[s].appendleft((key, m))
        else:
            queues[s].append((key, m))
        start = m >> START_SHIFT
        if top[s] < 0 or (not newest and start < top[s]):
            top[s] = start
            heapq.heappush(self._heap, (self._density(s, start), start, s))

    def _rebuild(self) -> None:
        """Every state's heap entry from its queue's oldest live entry."""
        meta = self._meta
        stale = 0
        for q in self._queues:
            while q and meta.get(q[-1][0]) != q[-1][1]:
                q.pop()
                stale += 1
        self._stale -= stale
        self._heap = queue_heads(self._queues, self._top, self._density)

    # -- eviction -----------------------------------------------------------------------------
    def remove(self, key: K) -> None:
        if self._meta.pop(key, None) is not None:
            self._stale += 1
            self._links.forget(key)

    def _requeue_freed(self, key: K) -> None:
        """A waiting parent whose last child left is queued again, first in line."""
        m = self._meta.get(key)
        if m is not None:
            self._queue(key, m, newest=False)

    def evict(self, n: int, evictable: Callable[[K], bool]) -> list[K] | None:
        """Lowest density first, leaves first; all-or-nothing. A key whose children are
        resident waits (out of its queue) until they left; a pinned key is skipped (it keeps
        its place)."""
        if n <= 0:
            return []
        meta = self._meta
        if n > len(meta):
            return None
        epoch = self._scale.epoch if self._scale is not None else 0
        if self._epoch != epoch:  # the top tier's ages or densities moved
            self._epoch = epoch
            self._rebuild()
        out: list[K] = []  # victims, with their metas and parents (to restore on failure)
        metas: list[int] = []
        parents: list[K | None] = []
        held: list[tuple[deque[Entry], Entry]] = []
        parked: list[Entry] = []  # keys sent to wait by this call (restored on failure)
        links = self._links
        kids, waiting, unlink = links.kids, links.waiting, links.unlink
        check = evictable is not always
        heap, top, queues = self._heap, self._top, self._queues
        now, w, nb, dens = self._clock()
        last = nb - 1
        stale = 0
        while len(out) < n and heap:
            _, start, s = heapq.heappop(heap)
            if top[s] != start:
                continue  # superseded by a later entry of this state
            top[s] = -1
            q = queues[s]
            bound = heap[0][0] if heap else float("inf")  # the next queue's head (or less)
            while q:
                e = q[-1]
                k, m = e
                if meta.get(k) != m:
                    q.pop()
                    stale += 1
                    continue  # stale: the key moved on or left
                st = m >> START_SHIFT
                if st != start:  # a younger entry (or a parent queued again): its density
                    age = (now - st) // w
                    if dens[s * nb + (age if age < last else last)] > bound:
                        break  # another queue's head goes first
                    start = st
                if len(out) == n:
                    break
                q.pop()
                if k in kids:
                    waiting.add(k)
                    parked.append(e)
                    continue
                if check and not evictable(k):
                    held.append((q, e))
                    continue
                del meta[k]
                out.append(k)
                metas.append(m)
                parents.append(unlink(k))  # (a parent whose last child this was: requeued)
            if q:  # this state's entry, from its (live) head
                st = q[-1][1] >> START_SHIFT
                if top[s] < 0 or st < top[s]:
                    top[s] = st
                    heapq.heappush(heap, (self._density(s, st), st, s))
        self._stale -= stale
        queued = len(out)  # victims taken from the queues (the rest from the waiting set)
        if len(out) < n:  # only parents of resident keys left (links out of date): take them
            for k in list(waiting):
                if len(out) == n:
                    break
                if k in meta and evictable(k):
                    waiting.discard(k)
                    metas.append(meta.pop(k))
                    parents.append(unlink(k))
                    out.append(k)
        for q, e in reversed(held):
            q.append(e)
        if len(out) < n:  # put everything back as it was
            self._restore(out, metas, parents, queued, parked)
            return None
        if held:
            self._rebuild()
        if self.passes_down:
            self.passed = dict(zip(out, metas, strict=True))
            self.passed_parent = dict(zip(out, parents, strict=True))
        if self._stale > len(meta) + 1024:
            self._compact()
        return out

    def _restore(
        self,
        out: list[K],
        metas: list[int],
        parents: list[K | None],
        queued: int,
        parked: list[Entry],
    ) -> None:
        """Undo a failed ``evict``: victims resident again (the first ``queued`` back in their
        queues, the rest waiting again), keys it sent to wait queued again; queues re-sorted by
        last use (restored entries first among equals), heap rebuilt."""
        meta, waiting = self._meta, self._links.waiting
        for k, m, p in zip(out, metas, parents, strict=True):
            meta[k] = m
            if p is not None:
                self._links.link(k, p)
        waiting.update(out[queued:])
        back = list(zip(out[:queued], metas[:queued], strict=True)) + parked
        waiting.difference_update(k for k, _ in back)
        by_state: dict[int, list[Entry]] = {}
        for e in back:
            by_state.setdefault(e[1] & STATE_MASK, []).append(e)
        for s, entries in by_state.items():
            live = [e for e in self._queues[s] if meta.get(e[0]) == e[1]] + entries
            live.sort(key=lambda e: -(e[1] >> START_SHIFT))  # stable: newest at the left
            self._queues[s] = deque(live)
        self._compact()

    def _compact(self) -> None:
        """Drop every stale entry from the queues (order kept) and rebuild the heap."""
        meta = self._meta
        self._queues = [deque(e for e in q if meta.get(e[0]) == e[1]) for q in self._queues]
        self._stale = 0
        self._rebuild()

    # -- hierarchy -----------------------------------------------------------------------------
    def feed_by_demotion(self, upper: EvictionPolicy[K] | None = None) -> EvictionPolicy[K]:
        """Already a tier below."""
        return self

    def describe(self) -> dict[str, Any]:
        return {"resident": len(self._meta)}

    def resident(self) -> Collection[object]:
        return self._meta
