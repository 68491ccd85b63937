"""Hit-density eviction (LHD, Beckmann et al., NSDI'18), prefix-aware, learned online.

Every resident block has a *state*, set at its last use (``kvtier.policy.lifestates``: for a
block a request brought in, the request's class -- the caller's ``hint``, e.g. ``output_class``
-- and its place among the request's new blocks; for a block used again, its use count, capped),
and an *age* (time since then).

A ``LifeTable`` learns per state and age how likely a next use is and how soon, weighting recent
observations most, and gives each (state, age) a *hit density*: the chance of a use within the
next ``horizon_fraction`` capacities' worth of the clock over the space-time held until then.
Nothing about the workload is coded in; a state without data gets the pooled rate, and before
anything is learned the oldest blocks go first. The clock is *churn* (new blocks inserted), so
ages, bucket width, horizon and recency weighting are all fractions of the capacity. Results and
limits: ``docs/simulation.md`` (opt-in; S3-FIFO stays the default).

Each state keeps its blocks in a FIFO queue, in order of last use (a request's keys enter leaf
first). A block's density is taken as the lowest it had at any age up to its own (so it never
rises with age), which makes a queue's oldest block its least dense: eviction takes the queue
whose oldest block has the lowest density, from that end, and never ranks blocks one by one
(ranking cohorts by the raw density did worse: ``docs/simulation.md``). Queue heads sit in a
heap, rebuilt when the ages move a bucket or the table is refit. A key used again is queued anew
and leaves a stale entry behind, skipped when met (queues are filtered when stale entries
outnumber live ones).

Prefix awareness: a key whose child (the next key of a chain inserted with it) is resident is
never a victim; met by an eviction, it waits out of its queue until its last child leaves, then
is queued first in line. A lower tier fed by this policy's demotions (``feed_by_demotion``) ranks
them with this policy's table, by the state and age each victim had here.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Collection, Hashable, Sequence
from typing import Any, ClassVar

import numpy as np

from kvtier.policy.base import EvictionPolicy, K, always
from kvtier.policy.chainlinks import ChainLinks
from kvtier.policy.lifestates import (
    MAX_USE_COUNT,
    START_SHIFT,
    STATE_MASK,
    TAIL_CLASSES,
    USES_SHIFT,
    Ghost,
    LifeStates,
)
from kvtier.policy.lifetable import LifeTable

Entry = tuple[Any, int]  # a queued key and the meta it was queued with (stale once it changed)


class HitDensity(EvictionPolicy[K]):
    """Prefix-aware hit-density eviction with an online life table (module docstring)."""

    name = "density"
    #: age bucket width, as a fraction of the capacity (in blocks inserted)
    width_fraction: ClassVar[float] = 1 / 64
    #: age buckets kept (older ages share the last)
    buckets: ClassVar[int] = 128
    #: recency weighting of observations, as a fraction of the capacity
    tau_fraction: ClassVar[float] = 2.0
    #: how far ahead a block's density looks, as a fraction of the capacity
    horizon_fraction: ClassVar[float] = 2.0
    #: smoothing of the hazards: pseudo-observations, as a fraction of the capacity (at least 1)
    prior_fraction: ClassVar[float] = 0.003
    #: the table is refit every this many buckets of the clock, and at most every
    #: ``min_refit_blocks`` of it (a small cache would otherwise refit every few blocks)
    refit_buckets: ClassVar[int] = 2
    min_refit_blocks: ClassVar[int] = 64
    #: a reused block's state: used once, or more (finer states did worse: docs/simulation.md)
    max_uses: ClassVar[int] = 2
    #: states learned at most (a caller passing per-request hints gets the catch-all state
    #: once they are used up; each state costs a row of the life table)
    max_states: ClassVar[int] = 512
    #: evicted keys remembered (state, last use) as a multiple of the capacity
    ghost_factor: ClassVar[float] = 3.0

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        cap = max(1, capacity)
        self._w = max(1, int(cap * self.width_fraction))
        self._refit_every = max(self._w * self.refit_buckets, self.min_refit_blocks)
        self._table = LifeTable(
            width=self._w,
            buckets=self.buckets,
            tau=max(1.0, cap * self.tau_fraction),
            horizon=max(1, int(cap * self.horizon_fraction)),
            prior=max(1.0, cap * self.prior_fraction),
        )
        self._now = 0  # the churn clock: new blocks inserted so far
        self._next_refit = self._refit_every
        self._epoch = 0  # bumped whenever densities or age buckets moved (lower tiers follow)
        self._meta: dict[K, int] = {}  # resident key -> start, uses, state (one int)
        self._ghost: Ghost[K] = Ghost(int(cap * self.ghost_factor), self._table)
        self._links: ChainLinks[K] = ChainLinks(self._requeue_freed, cap)
        self._queues: list[deque[Entry]] = []  # per state: newest at the left
        self._dens: list[list[float]] = []  # per state and age bucket, non-increasing in age
        self._heap: list[tuple[float, int, int]] = []  # (density, start, state) of queue heads
        self._top: list[int] = []  # per state: the start of its live heap entry (-1: none)
        self._stale = 0  # queue entries that no longer hold their key
        self._upper: HitDensity[K] | None = None  # the tier above, when fed by its demotions
        self._root: HitDensity[K] = self  # the top tier (its table, clock and ghost)
        self._below = 0  # blocks the tiers below hold (the top tier's ghost covers them)
        self._passes_down = False  # a tier below takes this one's victims (and their metas)
        self._passed: dict[K, int] = {}  # the last victims' metas, for the tier below
        self._passed_parent: dict[K, K | None] = {}  # ... and their parents up there
        self._last_root: K | None = None  # the last insert's first key, if it has no parent
        self._states = LifeStates(self.max_states, self.max_uses, self._grow)

    def _grow(self, states: int) -> None:
        """Room for states ``0 .. states - 1``: table rows, queues, densities."""
        self._table.grow(states)
        while len(self._queues) < states:
            self._queues.append(deque())
            self._dens.append([0.0] * self.buckets)
            self._top.append(-1)

    # -- uses ----------------------------------------------------------------------------------
    def insert(self, keys: Sequence[K], hint: Hashable | None = None) -> None:
        if self._upper is not None:
            self._insert_victims(keys)
            return
        n_new = self._use(keys, self._states.new(hint))
        if n_new:
            self._advance(n_new)

    def access(self, keys: Sequence[K]) -> None:
        if self._upper is not None:
            self._touch(keys)
        else:
            self._use(keys, None)

    def _touch(self, keys: Sequence[K]) -> None:
        """A lower tier's hits move to the newest end of their queues, state kept; the top tier
        learns the use when the block comes back up (from its ghost). Ages are the top tier's:
        this tier's clock is brought up to it first (a head pushed here is priced at age 0)."""
        root = self._root
        self._now, self._dens = root._now, root._dens
        meta, queues, top = self._meta, self._queues, self._top
        stamp = self._now << START_SHIFT
        for k in reversed(keys):
            m = meta.get(k)
            if m is None:
                continue
            new = m & ((1 << START_SHIFT) - 1) | stamp
            if new != m:
                meta[k] = new
                s = m & STATE_MASK
                queues[s].appendleft((k, new))
                self._stale += 1
                if top[s] < 0:
                    self._push(s, stamp >> START_SHIFT)

    def refresh(self, keys: Sequence[K]) -> None:
        """No use is counted (their load was): ``keys`` are the cached prefix of the keys the
        last insert brought in, so the last of them becomes the parent of that insert's first
        key, and is no victim while that child stays."""
        root = self._last_root
        self._last_root = None
        if keys and root is not None and root in self._meta and root not in self._links.parent:
            p = keys[-1]
            if p in self._meta and p != root:
                self._links.link(root, p)

    def _use(self, keys: Sequence[K], new_ids: list[int] | None) -> int:
        """Record a use of ``keys`` (prefix order) now: each known key's life ends (learned) and
        a new one starts; with ``new_ids`` (an insert) unknown keys become resident in the new
        state of their place, else they are ignored. Keys are queued leaf first. Returns the
        number of keys that became resident."""
        meta, ghost = self._meta, self._ghost.metas
        table, queues, top = self._table, self._queues, self._top
        parent, kids = self._links.parent, self._links.kids
        steps = self._states.steps
        now = self._now
        stamp = now << START_SHIFT
        place = n_new = filed = 0
        last_s = last_m = -1
        n_open = n_close = 0
        q: deque[Entry] | None = None
        child: K | None = None  # the key before (deeper), if it just became resident
        for k in reversed(keys):
            m = meta.get(k)
            if m is None:
                if new_ids is None:
                    child = None
                    continue
                n_new += 1
                if child is not None:
                    parent[child] = k
                    kids[k] = kids.get(k, 0) + 1
                child = k
                if ghost:
                    m = ghost.pop(k, None)
                if m is None:  # brand new: the state of its place among the request's new keys
                    s = new_ids[place if place < TAIL_CLASSES else TAIL_CLASSES]
                    place += 1
                    new = stamp | 1 << USES_SHIFT | s
            elif child is not None:
                parent[child] = k
                kids[k] = kids.get(k, 0) + 1
                child = None
            if m is not None:  # a use: its life ends here
                if m != last_m:
                    if n_close:
                        table.close(last_m & STATE_MASK, last_m >> START_SHIFT, now, n_close)
                    last_m, n_close = m, 0
                n_close += 1
                new = stamp | steps[(m >> USES_SHIFT) & MAX_USE_COUNT]
                s = new & STATE_MASK
            meta[k] = new
            if s != last_s:
                if n_open:
                    table.open(last_s, now, n_open)
                last_s, n_open = s, 0
                q = queues[s]
                if top[s] < 0:  # no head in the heap (the queue holds nothing live)
                    self._push(s, now)
            n_open += 1
            filed += 1
            q.appendleft((k, new))  # type: ignore[union-attr]
        if n_close:
            table.close(last_m & STATE_MASK, last_m >> START_SHIFT, now, n_close)
        if n_open:
            table.open(last_s, now, n_open)
        self._last_root = child if new_ids is not None else self._last_root
        self._stale += filed - n_new  # keys queued again leave their old entries behind
        return n_new

    def _advance(self, n_new: int) -> None:
        """Move the clock on by ``n_new`` blocks; refit the table when due; rebuild the heap
        of queue heads when their age buckets or densities moved."""
        self._now += n_new
        now = self._now
        moved = self._table.tick(now)
        if now >= self._next_refit:
            self._table.refit(now)
            self._next_refit = now + self._refit_every
            self._dens = np.minimum.accumulate(self._table.density, axis=1).tolist()
            moved = True
        if moved:
            self._epoch += 1
            self._rebuild()

    def _density(self, s: int, start: int) -> float:
        age = (self._now - start) // self._w
        return self._dens[s][age if age < self.buckets else -1]

    def _push(self, s: int, start: int) -> None:
        """Make (the density of ``start`` in ``s``, ``start``) state ``s``'s heap entry."""
        self._top[s] = start
        heapq.heappush(self._heap, (self._density(s, start), start, s))

    def _rebuild(self) -> None:
        """Every state's heap entry from its queue's oldest live entry."""
        meta, top = self._meta, self._top
        heap = []
        stale = 0
        for s, q in enumerate(self._queues):
            while q and meta.get(q[-1][0]) != q[-1][1]:
                q.pop()
                stale += 1
            if q:
                start = q[-1][1] >> START_SHIFT
                heap.append((self._density(s, start), start, s))
                top[s] = start
            else:
                top[s] = -1
        self._stale -= stale
        heapq.heapify(heap)
        self._heap = heap

    # -- eviction -----------------------------------------------------------------------------
    def remove(self, key: K) -> None:
        m = self._meta.pop(key, None)
        if m is None:
            return
        self._stale += 1
        self._links.forget(key)
        if self._upper is None:
            self._table.censor(m & STATE_MASK, m >> START_SHIFT, self._now)

    def _requeue_freed(self, key: K) -> None:
        """A waiting parent whose last child left is queued again, first in line."""
        m = self._meta.get(key)
        if m is not None:
            self._requeue(key, m)

    def _requeue(self, key: K, m: int) -> None:
        """Put ``key`` (meta ``m``) at the eviction end of its state's queue."""
        s = m & STATE_MASK
        self._queues[s].append((key, m))
        start = m >> START_SHIFT
        if self._top[s] < 0 or start < self._top[s]:
            self._push(s, start)

    def evict(self, n: int, evictable: Callable[[K], bool]) -> list[K] | None:
        """Lowest density first, leaves first; all-or-nothing. A key whose children are
        resident waits (out of its queue) until they left; a pinned key is skipped (it keeps
        its place)."""
        if n <= 0:
            return []
        meta = self._meta
        if n > len(meta):
            return None
        root = self._root
        if root is not self:  # a lower tier: the top tier's clock and densities
            self._now, self._dens = root._now, root._dens
            if self._epoch != root._epoch:
                self._epoch = root._epoch
                self._rebuild()
        out: list[K] = []  # victims, with their metas and parents (to restore on failure)
        metas: list[int] = []
        parents: list[K | None] = []
        held: list[tuple[deque[Entry], Entry]] = []
        parked: list[Entry] = []  # keys sent to wait by this call (restored on failure)
        links = self._links
        kids, waiting, unlink = links.kids, links.waiting, links.unlink
        check = evictable is not always
        heap, top, queues, dens = self._heap, self._top, self._queues, self._dens
        w, last, now = self._w, self.buckets - 1, self._now
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
                    if dens[s][age if age < last else last] > bound:
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
                    self._push(s, st)
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
        if self._upper is None:
            self._ghost.remember(out, metas, self._now)
        if self._passes_down:
            self._passed = dict(zip(out, metas, strict=True))
            self._passed_parent = dict(zip(out, parents, strict=True))
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
    def feed_by_demotion(self, upper: EvictionPolicy[K] | None = None) -> None:
        """Rank demoted blocks with the top tier's table, by the state and age they had there
        (the tier above passes each victim's meta down). The top tier's ghost grows to remember
        as many keys as the whole hierarchy holds, so a return from any tier is learned as a use
        at its true age. Prefix links follow the tier above's: a victim is linked to its parent
        there once both are down here, whichever came first (a chain comes down leaf first, a
        block per eviction, between other chains' blocks). Under another policy, neighbours of
        a batch are linked."""
        if isinstance(upper, HitDensity):
            root = upper._root
            self._upper, self._root = upper, root
            self._table, self._w, self._states = root._table, root._w, root._states
            self._dens = root._dens
            upper._passes_down = True
            root._below += self.capacity
            root._ghost.cap = max(
                root._ghost.cap, int(self.ghost_factor * root.capacity) + root._below
            )
        else:
            self._upper = self  # no table above: every block one state, oldest first

    def _insert_victims(self, keys: Sequence[K]) -> None:
        """``insert`` for a tier fed by demotions: ``keys`` are the tier above's victims, in
        prefix order; each keeps the meta (state, last use) and the parent it had there. A
        child that came down before its parent waits for it (``ChainLinks.adopt``)."""
        upper = self._upper
        assert upper is not None
        meta = self._meta
        passed = upper._passed if upper is not self else {}
        pp = upper._passed_parent if upper is not self else None
        self._now = now = self._root._now
        self._dens = self._root._dens
        opened: list[tuple[int, K]] = []
        prev: K | None = None
        for k in keys:
            if k in meta:
                prev = k
                continue
            m = passed.get(k, now << START_SHIFT)
            meta[k] = m
            if pp is not None:
                self._links.adopt(k, pp.get(k), meta)
            elif prev is not None:
                self._links.link(k, prev)
            opened.append((m, k))
            prev = k
        queues, top = self._queues, self._top
        for m, k in reversed(opened):  # leaf first, each at the newest end of its queue
            s = m & STATE_MASK
            while len(queues) <= s:  # the upper tier's states, as they come
                queues.append(deque())
                top.append(-1)
            queues[s].appendleft((k, m))
            if top[s] < 0:
                self._push(s, m >> START_SHIFT)

    # -- introspection -------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """Resident and remembered keys, and the learned states with the most resident keys."""
        out: dict[str, Any] = {"resident": len(self._meta), "ghost": len(self._ghost)}
        if self._upper is None:
            out["states"] = self._states.top(self._meta.values(), self._table.hazard, self._dens)
        return out

    def resident(self) -> Collection[object]:
        return self._meta
