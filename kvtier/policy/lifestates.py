"""The states a learned policy gives a block's life, the one int that carries them, and the
ghost that keeps the lives of evicted blocks open.

A block's *state* is set at its last use from what the policy knew then:

* a block a request brought in: ``("new", hint, place)`` -- the request's class (the caller's
  ``hint``) and the block's place among the request's new blocks, counted from the leaf (the last
  ``TAIL_CLASSES`` places have their own state, the rest share one);
* a block used again: ``("used", count)``, its use count capped at ``max_uses``.

States are small ints handed out in order of first use, at most ``max_states`` (a caller passing
a new hint with every request gets state 0, the catch-all, once they are used up). A state's
*family* is its place among the new blocks whatever the hint (a state not of new blocks is a
family of its own): a rare hint's state learns little alone, and the life table smooths its rate
towards its family's (``LifeTable.families``). A resident
block's *meta* packs its state, use count and the clock of its last use into one int:
``start << START_SHIFT | uses << USES_SHIFT | state``. A policy queues its entries (a key or a
run, with its meta) per state, oldest at the right; ``queue_heads`` prices the oldest of each.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from collections.abc import Callable, Hashable, Sequence
from itertools import groupby, repeat
from typing import Any

import numpy.typing as npt

from kvtier.policy.lifetable import LifeTable

#: the last new keys of a request that get a state of their own (place 0 = the leaf)
TAIL_CLASSES = 3
STATE_BITS = 12
MAX_STATES = 1 << STATE_BITS
USES_SHIFT = STATE_BITS
START_SHIFT = STATE_BITS + 8
STATE_MASK = MAX_STATES - 1
MAX_USE_COUNT = 255


class LifeStates:
    """State ids by name, shared by every tier of one hierarchy. Not thread-safe."""

    def __init__(self, max_states: int, max_uses: int, grown: Callable[[int], None]) -> None:
        """``grown(n)`` is called when state ``n - 1`` is handed out (the caller makes room)."""
        self.max_states = min(max_states, MAX_STATES)
        self.names: list[Hashable] = []
        #: each state's family (dense ints, by state): the same place among new blocks, any hint
        self.families: list[int] = []
        self._ids: dict[Hashable, int] = {}
        self._family_ids: dict[Hashable, int] = {}
        self._new: dict[Hashable, list[int]] = {}
        self._grown = grown
        self.id(("unlabelled",))  # state 0: the catch-all
        used = [self.id(("used", u)) for u in range(max_uses + 1)]
        #: by a key's use count so far: its next use count and state as they sit in its meta
        #: (``uses << USES_SHIFT | state``)
        self.steps = [
            min(u + 1, max_uses) << USES_SHIFT | used[min(u, max_uses)]
            for u in range(MAX_USE_COUNT + 1)
        ]

    def id(self, name: Hashable) -> int:
        """The state called ``name`` (a new one if there is room, else the catch-all, 0)."""
        s = self._ids.get(name)
        if s is None:
            if len(self.names) >= self.max_states:
                return 0
            s = self._ids[name] = len(self.names)
            self.names.append(name)
            family = ("new", name[2]) if isinstance(name, tuple) and name[0] == "new" else name
            self.families.append(self._family_ids.setdefault(family, len(self._family_ids)))
            self._grown(len(self.names))
        return s

    def new(self, hint: Hashable | None) -> list[int]:
        """The states of a request's new blocks with ``hint``, by place (the last: the rest)."""
        ids = self._new.get(hint)
        if ids is None:
            ids = [self.id(("new", hint, p)) for p in range(TAIL_CLASSES + 1)]
            if len(self._new) < self.max_states:
                self._new[hint] = ids
        return ids

    def arrivals(
        self, new: list[Any], new_ids: list[int], stamp: int, ghost: Ghost
    ) -> list[tuple[list[Any], int]]:
        """The metas a request's new keys ``new`` (prefix order) start with at ``stamp``
        (``now << START_SHIFT``), as runs (keys, meta): a brand-new key gets the state of its
        place (``new_ids``, from ``new``: the last ``TAIL_CLASSES`` keys one each, the rest the
        body's); a key back from ``ghost`` is taken from it, and its life there ends in a use
        (learned in the ghost's table at its true age). Neighbours with one meta are one run."""
        nn = len(new)
        t = TAIL_CLASSES
        runs: list[tuple[list[Any], int]] = []
        gh = ghost.keys
        gids = list(map(gh.pop, new, repeat(None))) if gh else None
        if gids is None or gids.count(None) == nn:  # all brand new: body and tail places
            if nn > t:
                runs.append((new[: nn - t], stamp | 1 << USES_SHIFT | new_ids[t]))
            for p in range(min(nn, t) - 1, -1, -1):
                runs.append(([new[nn - 1 - p]], stamp | 1 << USES_SHIFT | new_ids[p]))
            return runs
        table, steps = ghost.table, self.steps
        now = stamp >> START_SHIFT
        body = stamp | 1 << USES_SHIFT | new_ids[t]
        place = 0
        x = nn
        for gi, it in reversed([(g, len(list(it))) for g, it in groupby(gids)]):  # leaf first
            c = it
            g = ghost.take(gi, c) if gi is not None else None
            if g is None:  # brand new (or forgotten by the ghost): places count these
                while place < t and c:
                    runs.append(([new[x - 1]], stamp | 1 << USES_SHIFT | new_ids[place]))
                    place += 1
                    x -= 1
                    c -= 1
                if c:
                    runs.append((new[x - c : x], body))
                    x -= c
            else:
                table.close(g & STATE_MASK, g >> START_SHIFT, now, c)
                runs.append((new[x - c : x], stamp | steps[(g >> USES_SHIFT) & MAX_USE_COUNT]))
                x -= c
        runs.reverse()
        merged: list[tuple[list[Any], int]] = []
        for ks, m in runs:
            if merged and merged[-1][1] == m:
                merged[-1][0].extend(ks)
            else:
                merged.append((ks, m))
        return merged

    def top(
        self, counts: Counter[int], hazard: npt.NDArray[Any], dens: npt.NDArray[Any]
    ) -> list[dict[str, Any]]:
        """The 16 states with the most keys (``counts``: keys by state): name, keys, learned
        hazard of a use in the first age bucket, density at age 0."""
        return [
            {
                "state": repr(self.names[s]),
                "resident": n,
                "hazard_first_bucket": round(float(hazard[s][0]), 4) if s < len(hazard) else 0.0,
                "density_age0": round(float(dens[s][0]), 6),
            }
            for s, n in counts.most_common(16)
        ]


class Ghost:
    """Evicted keys with the metas they had: a key here still has an open life (its return is
    a use, learned at its true age). Keys evicted together share one *chunk* (one meta).
    ``keys`` maps a key to its chunk's id; a chunk's meta and how many of its keys are still
    remembered are in ``metas``/``alive`` (from id ``base`` on; ids below ``lo`` are
    forgotten, though their keys may linger in ``keys``). When more than ``cap`` keys are
    remembered, the oldest chunks are forgotten (their lives censored in ``table``) until half
    of ``cap`` is left: per-key work is one dict store per eviction and a share of the rebuild.
    A caller that pops a key from ``keys`` takes it back (``take``). Not thread-safe."""

    def __init__(self, cap: int, table: LifeTable) -> None:
        self.cap = max(2, cap)
        self.table = table
        self.keys: dict[Any, int] = {}
        self.metas: list[int] = []
        self.alive: list[int] = []
        self.base = 0  # id of metas[0]
        self.lo = 0  # chunks below this id are forgotten

    def remember(self, chunks: list[tuple[list[Any], int]], now: int) -> None:
        """Each chunk's keys were evicted at ``now`` with its meta."""
        keys, metas, alive = self.keys, self.metas, self.alive
        i = self.base + len(metas)
        for ck, m in chunks:
            if len(ck) == 1:
                keys[ck[0]] = i
            else:
                keys.update(zip(ck, repeat(i)))
            metas.append(m)
            alive.append(len(ck))
            i += 1
        if len(keys) > self.cap:
            self._forget(now)

    def take(self, chunk_id: int, count: int) -> int | None:
        """``count`` keys popped from ``keys`` with ``chunk_id`` came back: their meta (None
        if the chunk was forgotten: they are new)."""
        if chunk_id < self.lo:
            return None
        j = chunk_id - self.base
        self.alive[j] -= count
        return self.metas[j]

    def _forget(self, now: int) -> None:
        metas, alive, table = self.metas, self.alive, self.table
        keep = self.cap // 2
        x = len(alive)
        n = 0
        while x > 0 and n + alive[x - 1] <= keep:
            x -= 1
            n += alive[x]
        gone: dict[int, int] = {}
        for j in range(x):  # chunks 0 .. x-1 are forgotten: one censor per meta
            c = alive[j]
            if c:
                m = metas[j]
                gone[m] = gone.get(m, 0) + c
        for m, c in gone.items():
            table.censor(m & STATE_MASK, m >> START_SHIFT, now, c)
        self.base += x
        self.lo = self.base
        del metas[:x]
        del alive[:x]
        lo = self.lo
        self.keys = {k: i for k, i in self.keys.items() if i >= lo}

    def __len__(self) -> int:
        return len(self.keys)


def queue_heads(
    queues: Sequence[deque[tuple[Any, int]]], top: list[int], price: Callable[[int, int], float]
) -> list[tuple[float, int, int]]:
    """The heap of queue heads, ``(price(state, start), start, state)`` of each queue's oldest
    entry (live: the caller dropped stale ones), and ``top`` set to those starts (-1: empty)."""
    heap = []
    for s, q in enumerate(queues):
        if q:
            start = q[-1][1] >> START_SHIFT
            heap.append((price(s, start), start, s))
            top[s] = start
        else:
            top[s] = -1
    heapq.heapify(heap)
    return heap
