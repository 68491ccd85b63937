"""The states a learned policy gives a block's life, the one int that carries them, and the
ghost that keeps the lives of evicted blocks open.

A block's *state* is set at its last use from what the policy knew then:

* a block a request brought in: ``("new", hint, place)`` -- the request's class (the caller's
  ``hint``) and the block's place among the request's new blocks, counted from the leaf (the last
  ``TAIL_CLASSES`` places have their own state, the rest share one);
* a block used again: ``("used", count)``, its use count capped at ``max_uses``.

States are small ints handed out in order of first use, at most ``max_states`` (a caller passing
a new hint with every request gets state 0, the catch-all, once they are used up). A resident
block's *meta* packs its state, use count and the clock of its last use into one int:
``start << START_SHIFT | uses << USES_SHIFT | state``.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, Generic, TypeVar

import numpy.typing as npt

from kvtier.policy.lifetable import LifeTable

K = TypeVar("K", bound=Hashable)

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
        self._ids: dict[Hashable, int] = {}
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

    def top(
        self, metas: Iterable[int], hazard: npt.NDArray[Any], dens: Sequence[Sequence[float]]
    ) -> list[dict[str, Any]]:
        """The 16 states with the most keys among ``metas``: name, keys, learned hazard of a use
        in the first age bucket, density at age 0."""
        counts = Counter(m & STATE_MASK for m in metas)
        return [
            {
                "state": repr(self.names[s]),
                "resident": n,
                "hazard_first_bucket": round(float(hazard[s][0]), 4) if s < len(hazard) else 0.0,
                "density_age0": round(dens[s][0], 6),
            }
            for s, n in counts.most_common(16)
        ]


class Ghost(Generic[K]):
    """Evicted keys with the metas they had, oldest first, at most ``cap`` of them. A key here
    still has an open life (its return is a use, learned at its true age); forgetting the oldest
    censors theirs in ``table``. Not thread-safe."""

    def __init__(self, cap: int, table: LifeTable) -> None:
        self.cap = max(1, cap)
        self.table = table
        #: evicted key -> its meta (the policy pops a key that comes back)
        self.metas: dict[K, int] = {}
        self._order: deque[tuple[K, int]] = deque()  # as remembered, oldest first

    def remember(self, keys: list[K], metas: list[int], now: int) -> None:
        """``keys`` (with ``metas``) were evicted at ``now``; forget the oldest beyond ``cap``."""
        known, order = self.metas, self._order
        known.update(zip(keys, metas, strict=True))
        order.extend(zip(keys, metas, strict=True))
        table = self.table
        last, run = -1, 0
        while len(known) > self.cap:
            k, m = order.popleft()
            if known.get(k) != m:
                continue  # it came back since
            del known[k]
            if m != last:  # keys evicted together share their meta: one call per run
                if run:
                    table.censor(last & STATE_MASK, last >> START_SHIFT, now, run)
                last, run = m, 0
            run += 1
        if run:
            table.censor(last & STATE_MASK, last >> START_SHIFT, now, run)

    def __len__(self) -> int:
        return len(self.metas)
