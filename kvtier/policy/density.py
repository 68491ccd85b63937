"""Hit-density eviction (LHD, Beckmann et al., NSDI'18), prefix-aware, learned online.

Every resident block has a *state*, set at its last use (``kvtier.policy.lifestates``: for a
block a request brought in, the request's class -- the caller's ``hint``, e.g. ``output_class``
-- and its place among the request's new blocks; for a block used again, its use count, capped),
and an *age* (time since then).

A ``LifeTable`` learns per state and age how likely a next use is and how soon, weighting recent
observations most, and gives each (state, age) a *hit density*: the chance of a use within the
next ``horizon_fraction`` capacities' worth of the clock over the space-time held until then.
Nothing about the workload is coded in; a state without data gets its family's rate (the same
place, any hint), and before anything is learned the oldest blocks go first. The clock is
*churn* (new blocks inserted), so ages, bucket width, horizon and recency weighting are all
fractions of the capacity. Results: ``docs/simulation.md``.

Each state keeps a FIFO queue in order of last use. A block's density is taken as the lowest it
had at any age up to its own (so it never rises with age), which makes a queue's oldest entry its
least dense: eviction takes the queue whose oldest entry has the lowest density, from that end,
and never ranks blocks one by one. Queue heads sit in a heap, repriced when the ages move a
bucket or the table is refit.

The unit is the *run* (``kvtier.policy.runs``): consecutive keys of a chain that share their last
use. Queues hold runs, lives open and close per run, and eviction cuts keys off a run's end (leaf
first), as many as needed; a use of a run's first keys splits it. A run whose kid runs are
resident keeps its last key: met by an eviction, it waits out of its queue until they left, then
is queued first in line. Per-key work is set membership, the ghost (evicted keys and their
metas, so a return is learned at its true age) and C-level slicing.

In a hierarchy this class serves the top tier; the tiers below rank what it demotes with its
table (``feed_by_demotion`` hands them a ``kvtier.policy.densitybelow.DensityBelow``).
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from collections.abc import Callable, Collection, Hashable, Sequence
from itertools import repeat
from typing import Any, ClassVar

from kvtier.policy.base import EvictionPolicy, K, always
from kvtier.policy.lifestates import (
    MAX_USE_COUNT,
    START_SHIFT,
    STATE_MASK,
    USES_SHIFT,
    Ghost,
    LifeStates,
    queue_heads,
)
from kvtier.policy.lifetable import DensityTable
from kvtier.policy.runs import Cut, Run, RunIndex, resolve

Entry = tuple[Run, int]  # a queued run and the meta it was queued with (stale once it changed)
_INF = float("inf")


class HitDensity(EvictionPolicy[K]):
    """Prefix-aware hit-density eviction with an online life table (module docstring)."""

    name = "density-always"  # the default, ``density``, is this or LRU (kvtier.policy.fallback)
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
    #: refit every this many buckets of the clock, at most every ``min_refit_blocks`` of it
    refit_buckets: ClassVar[int] = 8
    min_refit_blocks: ClassVar[int] = 64
    #: a reused block's state: used once, or more (finer states did worse: docs/simulation.md)
    max_uses: ClassVar[int] = 2
    #: states learned at most (a row of the life table each; then hints share the catch-all)
    max_states: ClassVar[int] = 512
    #: evicted keys remembered (state, last use) as a multiple of the capacity
    ghost_factor: ClassVar[float] = 3.0
    #: hazards past the clock fall by this factor a bucket; smoothing pulls this share towards
    #: the state's rate over this much exposure at the nearest younger ages (x prior: LifeTable)
    unseen_decay: ClassVar[float] = 0.9
    mean_pull: ClassVar[float] = 0.7
    mean_window: ClassVar[float] = 64.0
    mean_window_below: ClassVar[float] = 0.0  # for the tiers below (a window there cost: docs)

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        cap = max(1, capacity)
        #: this tier's life table and the densities it ranks by
        self.ranked = self._scale(cap, self.mean_window)
        self.table = self.ranked.table
        self.width = self.ranked.width
        #: the churn clock (new blocks inserted so far), and its age bucket
        self.now = 0
        self._bucket = 0
        self._runs = RunIndex(self._requeue)
        self.ghost = Ghost(int(cap * self.ghost_factor), self.table)
        self._queues: list[deque[Entry]] = []  # per state: newest at the left
        self._heap: list[tuple[float, int, int]] = []  # (density, start, state) of queue heads
        self._top: list[int] = []  # per state: the start of its live heap entry (-1: none)
        self._stale = 0  # queue entries that no longer stand for a live run
        self._last_root: Run | None = None  # the last insert's first new run, if parentless
        #: with a tier below: the last victims' metas and their parents here (``passed``)
        self.passes_down = False
        self.passed: dict[K, int] = {}
        self.passed_parent: dict[K, K | None] = {}
        #: the tiers below: their blocks, and a table each at the scale down to it (``extend``)
        self.below = 0
        self._scales: list[DensityTable] = []
        self.states = LifeStates(self.max_states, self.max_uses, self._grow)  # (last: grows)
        self.table.families = self.states.families

    @classmethod
    def _scale(cls, blocks: int, window: float) -> DensityTable:
        """A life table at the scale of ``blocks`` blocks, with this policy's settings."""
        return DensityTable(
            blocks,
            width_fraction=cls.width_fraction,
            buckets=cls.buckets,
            tau_fraction=cls.tau_fraction,
            horizon_fraction=cls.horizon_fraction,
            prior_fraction=cls.prior_fraction,
            refit_buckets=cls.refit_buckets,
            min_refit=cls.min_refit_blocks,
            unseen_decay=cls.unseen_decay,
            mean_pull=cls.mean_pull,
            mean_window=window,
        )

    def extend(self, capacity: int) -> DensityTable:
        """A tier of ``capacity`` blocks joins below (before any use). The ghost grows to
        ``ghost_factor`` times the whole hierarchy (it holds the keys below too), so a return
        from any tier, or after the last, is learned at its true age; the same lives feed a table
        at the scale of the hierarchy down to that tier, which it ranks by (this tier's table
        sees ages up to twice its capacity only; a tier below holds older blocks)."""
        self.below += capacity
        self.ghost.cap = max(self.ghost.cap, int(self.ghost_factor * (self.capacity + self.below)))
        scale = self._scale(max(1, self.capacity) + self.below, self.mean_window_below)
        scale.grow(len(self._queues))
        scale.table.families = self.states.families
        (self._scales[-1] if self._scales else self.ranked).table.also = scale.table
        self._scales.append(scale)
        return scale

    def _grow(self, states: int) -> None:
        """Room for states ``0 .. states - 1``: table rows, queues, densities."""
        self.ranked.grow(states)
        for scale in self._scales:
            scale.grow(states)
        while len(self._queues) < states:
            self._queues.append(deque())
            self._top.append(-1)

    # -- uses ----------------------------------------------------------------------------------
    def insert(self, keys: Sequence[K], hint: Hashable | None = None) -> None:
        n_new = self._use(keys, self.states.new(hint))
        if n_new:
            self.now = now = self.now + n_new
            if now // self.width != self._bucket or now >= self.ranked.next_refit:
                self._advance()

    def access(self, keys: Sequence[K]) -> None:
        self._use(keys, None)

    def refresh(self, keys: Sequence[K]) -> None:
        """No use is counted (their load was): ``keys`` are the cached prefix of the keys the
        last insert brought in, so that insert's first run goes below the last of them."""
        root = self._last_root
        self._last_root = None
        if not keys or root is None or root.meta < 0 or root.pkey is not None:
            return
        pk = keys[-1]
        if pk in self._runs.res and pk not in root.keys:
            head = self._runs.hang(root, pk)
            if head is not None:
                self._requeue(head)  # a parent now: it waits when met

    def _use(self, keys: Sequence[K], new_ids: list[int] | None) -> int:
        """Record a use of ``keys`` (prefix order) now: the runs of its leading resident keys
        end their lives (learned) and start new ones, split where the use ends; with
        ``new_ids`` (an insert) the rest become resident in new runs. Returns how many did."""
        chain = keys if isinstance(keys, list) else list(keys)
        n = len(chain)
        if not n:
            return 0
        runs = self._runs
        res, first = runs.res, runs.first
        steps = self.states.steps
        used: list[tuple[Run, int]] = []  # the runs used, with the metas they had
        i = 0
        r = first.get(chain[0])
        while r is not None:  # the leading resident keys, run by run
            ks = r.keys
            ln = len(ks)
            if chain[i : i + ln] == ks:
                used.append((r, r.meta))
                i += ln
                if i == n:
                    break
                r = first.get(chain[i])
                continue
            seg = chain[i : i + ln]
            pres = list(map(res.__contains__, seg))
            j = pres.index(False) if False in pres else len(seg)
            if j == 0 or ks[:j] != seg[:j]:
                break  # not a prefix of this run: handled below
            m = r.meta
            new_m = (self.now << START_SHIFT) | steps[(m >> USES_SHIFT) & MAX_USE_COUNT]
            used.append((runs.split(r, j, new_m != m), m))
            i += j
            break
        # keys past the leading run that are resident anyway: prefix order broken by the caller
        if new_ids is not None and i < n and not res.isdisjoint(chain[i:] if i else chain):
            for k in chain[i:]:
                if k in res:
                    HitDensity.remove(self, k)  # this ranking's only (an LRU mirror keeps it)
        table, queues, top = self.table, self._queues, self._top
        now = self.now
        stamp = now << START_SHIFT
        # the used runs: lives end, new ones start (a run whose parent run gets the same new
        # meta, and is its only kid, merges into it)
        filed: list[Run] = []
        queued: list[Run] = []  # used runs whose queue entry stays valid (meta unchanged)
        prev: Run | None = None
        for r, m in used:
            if r.meta >= 0 and not r.wait:  # (a run split off here: its entry is the tail's)
                if m == stamp | steps[(m >> USES_SHIFT) & MAX_USE_COUNT]:
                    queued.append(r)  # used again at the same clock: same meta
                else:
                    self._stale += 1  # its queue entry goes stale
            table.close(m & STATE_MASK, m >> START_SHIFT, now, len(r.keys))
            new = stamp | steps[(m >> USES_SHIFT) & MAX_USE_COUNT]
            if prev is not None and prev.meta == new and prev.kids == [r]:
                runs.merge(prev, r)
                continue
            r.meta = new
            r.wait = False
            filed.append(r)
            prev = r
        n_new = 0
        if new_ids is not None:
            self._last_root = None
            if i < n:
                n_new = n - i
                fresh = self.states.arrivals(chain[i:], new_ids, stamp, self.ghost)
                added = runs.add(fresh, chain[i - 1] if i else None)
                if added[0].pkey is None:
                    self._last_root = added[0]
                filed += added
        # file leaf first: the deepest run ends nearest the eviction end among equals
        dens, nb = self.ranked.dens, self.buckets
        for r in reversed(filed):
            m = r.meta
            s = m & STATE_MASK
            table.open(s, now, len(r.keys))
            if queued and r in queued:
                continue
            queues[s].appendleft((r, m))
            if top[s] < 0:
                top[s] = now
                heapq.heappush(self._heap, (dens[s * nb], now, s))
        return n_new

    def _advance(self) -> None:
        """The clock moved into a new age bucket or past a refit: tick and refit the tables
        when due, reprice the heap of queue heads."""
        now = self.now
        self._bucket = now // self.width
        if self.ranked.advance(now):
            self._reprice()
        for scale in self._scales:
            scale.advance(now)

    def density(self, s: int, start: int) -> float:
        """The density of a block of state ``s`` last used at ``start``, now."""
        return self.ranked.density(s, self.now - start)

    def _reprice(self) -> None:
        """Reprice the heap's live entries at the current ages. An entry may name a start older
        than its queue's live head (the head's run left): ``evict`` then pushes the head."""
        top = self._top
        heap = [(self.density(s, st), st, s) for _, st, s in self._heap if top[s] == st]
        heapq.heapify(heap)
        self._heap = heap

    def _rebuild(self) -> None:
        """Every state's heap entry from its queue's oldest live entry (queues changed mid-way)."""
        stale = 0
        for q in self._queues:
            while q:
                r, m = q[-1]
                if r.meta == m:
                    break
                live = resolve(r, m)
                if live is None:
                    q.pop()
                    stale += 1
                else:
                    q[-1] = (live, m)
                    break
        self._stale -= stale
        self._heap = queue_heads(self._queues, self._top, self.density)

    # -- eviction -----------------------------------------------------------------------------
    def _requeue(self, r: Run) -> None:
        """Queue ``r`` at the eviction end of its state's queue (first in line)."""
        m = r.meta
        s = m & STATE_MASK
        self._queues[s].append((r, m))
        start = m >> START_SHIFT
        if self._top[s] < 0 or start < self._top[s]:
            self._top[s] = start
            heapq.heappush(self._heap, (self.density(s, start), start, s))

    def evict(self, n: int, evictable: Callable[[K], bool]) -> list[K] | None:
        """Lowest density first, leaves first; all-or-nothing. A run whose kids are resident
        waits (out of its queue) until they left; a pinned key's run is held (it keeps its
        place), the keys after it may go."""
        if n <= 0:
            return []
        runs = self._runs
        res, first, last = runs.res, runs.first, runs.last
        if n > len(res):
            return None
        chunks: list[tuple[list[Any], int]] = []
        cuts: list[Cut] = []
        held: list[tuple[deque[Entry], Entry]] = []
        check = evictable is not always
        heap, top, queues, dens = self._heap, self._top, self._queues, self.ranked.dens
        w, lastb, now, nb = self.width, self.buckets - 1, self.now, self.buckets
        taken = stale = 0
        while taken < n and heap:
            _, start, s = heapq.heappop(heap)
            if top[s] != start:
                continue  # superseded by a later entry of this state
            top[s] = -1
            q = queues[s]
            bound = heap[0][0] if heap else _INF  # the next queue's head (or less)
            while q:
                r, m = q[-1]
                if r.meta != m:
                    live = resolve(r, m)
                    if live is None:
                        q.pop()
                        stale += 1
                        continue  # stale: the run was used again or left
                    r = live
                    q[-1] = (r, m)
                st = m >> START_SHIFT
                if st != start:  # a younger entry: its density
                    age = (now - st) // w
                    if dens[s * nb + (age if age < lastb else lastb)] > bound:
                        break  # another queue's head goes first
                    start = st
                if taken == n:
                    break
                if r.kids:
                    q.pop()
                    r.wait = True
                    cuts.append((r, [], m, False))
                    continue
                ks = r.keys
                want = n - taken
                ln = len(ks)
                cut = ln - want if want < ln else 0
                if check and not all(map(evictable, ks[cut:])):
                    x = ln
                    while x > cut and evictable(ks[x - 1]):
                        x -= 1
                    held.append((q, q.pop()))  # a pinned key: the run keeps its place
                    if x == ln:
                        continue
                    cut = x
                if cut:
                    chunk = ks[cut:]
                    del ks[cut:]
                    del last[chunk[-1]]
                    last[ks[-1]] = r
                    died = False
                else:
                    chunk = ks
                    q.pop()
                    del first[ks[0]]
                    del last[ks[-1]]
                    died = True
                res.difference_update(chunk)
                chunks.append((chunk, m))
                cuts.append((r, chunk, m, died))
                taken += len(chunk)
                if died:
                    runs.drop(r)
            if q:  # this state's entry, from its (live) head
                st = q[-1][1] >> START_SHIFT
                if top[s] < 0 or st < top[s]:
                    top[s] = st
                    age = (now - st) // w
                    heapq.heappush(heap, (dens[s * nb + (age if age < lastb else lastb)], st, s))
        self._stale -= stale
        for q, e in reversed(held):
            q.append(e)
        if taken < n:  # only parents of pinned keys are left: take them, leaves first
            cands: list[Any] = []
            for r in first.values():
                cands += [k for k in r.keys[::-1] if evictable(k)][: n - taken - len(cands)]
                if taken + len(cands) == n:
                    break
            if taken + len(cands) < n:
                runs.undo(cuts)
                self._compact(requeue_all=True)
                return None
            for k in cands:
                chunks.append(([k], runs.detach(k)))
            self._rebuild()
        elif held:
            self._rebuild()
        out: list[Any] = []
        for ck, _ in chunks:
            out += ck
        self.ghost.remember(chunks, now)
        if self.passes_down:
            self._pass_down(cuts, chunks)
        if self._stale > len(first) + 1024:
            self._compact()
        return out

    def _pass_down(self, cuts: list[Cut], chunks: list[tuple[list[Any], int]]) -> None:
        """Each victim's meta and its parent here, for the tier below (``passed``): ``cuts``
        are the runs cut, ``chunks`` every victim chunk (the last, beyond the cuts, taken one
        key at a time when pins left too few: passed without a parent)."""
        passed: dict[K, int] = {}
        parents: dict[K, K | None] = {}
        self.passed, self.passed_parent = passed, parents
        for r, ck, _, died in cuts:
            if ck:
                parents[ck[0]] = r.pkey if died else r.keys[-1]
                parents.update(zip(ck[1:], ck[:-1], strict=True))
        for ck, m in chunks:
            passed.update(zip(ck, repeat(m)))

    def _compact(self, requeue_all: bool = False) -> None:
        """Drop stale entries (order kept); with ``requeue_all`` queue every live run afresh
        (by last use, newest at the left). Rebuilds the heap."""
        if requeue_all:
            by_state: dict[int, list[Run]] = {}
            for r in self._runs.first.values():
                by_state.setdefault(r.meta & STATE_MASK, []).append(r)
            for s in range(len(self._queues)):
                ranked = sorted(by_state.get(s, []), key=lambda r: -(r.meta >> START_SHIFT))
                self._queues[s] = deque((r, r.meta) for r in ranked)
        else:
            for s, q in enumerate(self._queues):
                live = []
                for r, m in q:
                    x = resolve(r, m) if r.meta != m else r
                    if x is not None and not x.wait:
                        live.append((x, m))
                self._queues[s] = deque(live)
        self._stale = 0
        self._rebuild()

    def remove(self, key: K) -> None:
        """Forget ``key`` (O(1) at a run's ends, else its run is found by a scan: the store removes
        a resident key only when it is deleted or found corrupt)."""
        if key in self._runs.res:
            m = self._runs.detach(key)
            self.table.censor(m & STATE_MASK, m >> START_SHIFT, self.now)

    def release(self) -> None:
        """Another ranking takes over the resident keys (``kvtier.policy.fallback``): drop the
        runs and queues, keep the resident set (callers hold it) and what was learned."""
        self._runs.first.clear()
        self._runs.last.clear()
        self._queues = [deque() for _ in self._queues]
        self._heap = []
        self._top = [-1] * len(self._top)

    # -- hierarchy -----------------------------------------------------------------------------
    def feed_by_demotion(self, upper: EvictionPolicy[K] | None = None) -> EvictionPolicy[K]:
        """A tier below: ``DensityBelow``, ranking what is demoted by its state and age here."""
        from kvtier.policy.densitybelow import DensityBelow

        return DensityBelow(self.capacity, upper)

    # -- introspection -------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """Resident and remembered keys, runs, and the learned states with the most keys."""
        counts: Counter[int] = Counter()
        for r in self._runs.first.values():
            counts[r.meta & STATE_MASK] += len(r.keys)
        return {
            "resident": len(self._runs.res),
            "ghost": len(self.ghost),
            "runs": len(self._runs),
            "states": self.states.top(counts, self.table.hazard, self.ranked.array),
        }

    def resident(self) -> Collection[object]:
        return self._runs.res
