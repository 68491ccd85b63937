"""Least-recently-used, prefix-aware: a request's chain is refreshed leaf-first, so a parent is
always at least as recent as any child touched with it and is evicted after it."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable, Sequence

from kvtier.policy.base import EvictionPolicy, K


class LRU(EvictionPolicy[K]):
    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[K, None] = OrderedDict()

    def insert(self, keys: Sequence[K], hint: Hashable | None = None) -> None:
        order = self._order
        for k in reversed(keys):
            if k in order:
                order.move_to_end(k)
            else:
                order[k] = None  # appended: the most recent end

    def access(self, keys: Sequence[K]) -> None:
        order = self._order
        for k in reversed(keys):
            if k in order:
                order.move_to_end(k)

    def remove(self, key: K) -> None:
        self._order.pop(key, None)

    def evict(self, n: int, evictable: Callable[[K], bool]) -> list[K] | None:
        if n <= 0:
            return []
        victims: list[K] = []
        for k in self._order:
            if evictable(k):
                victims.append(k)
                if len(victims) == n:
                    break
        if len(victims) < n:
            return None
        for k in victims:
            del self._order[k]
        return victims

    def resident(self) -> Collection[object]:
        return self._order
