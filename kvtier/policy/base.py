"""The eviction-policy contract shared by the store and the simulator.

A policy tracks the keys resident in *one* tier and, when asked, names victims. It moves no
bytes and knows no tiers: the ``TieredStore`` (or the simulator) calls it single-threaded, under
the decider's lock, and acts on its answer.

Prefix awareness is part of the contract: keys arrive in *prefix order* (a request's blocks,
parent first), and a policy must not prefer dropping a parent while keeping its child -- a child
is useless without its parent. Policies get this by how they order a request's blocks (e.g.
LRU refreshes a chain leaf-first so the root ends most recent).

Keys are any hashable (32-byte ``BlockKey``s in the store, ints in the simulator). The
simulator drives a policy through the store's own decider (``kvtier.sim.storemodel``), so a
policy sees the same calls in both.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Hashable, Sequence
from typing import Any, ClassVar, Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class EvictionPolicy(ABC, Generic[K]):
    """Tracks resident keys of one tier and picks victims. Not thread-safe (one decider)."""

    #: registry name
    name: ClassVar[str] = ""

    def __init__(self, capacity: int) -> None:
        """``capacity`` is the tier's size in blocks (policies may size ghost lists by it)."""
        self.capacity = capacity

    @abstractmethod
    def insert(self, keys: Sequence[K], hint: Hashable | None = None) -> None:
        """Record resident keys, given in prefix order (parent first).

        Keys already tracked may be included: they count as an access. The store (and the
        simulator, which runs the store's decider) passes only keys new to the tier.
        ``hint`` is the reuse class of the request that produced the keys
        (``kvtier.policy.hints``), or ``None``; the registry's policies ignore it.
        """

    @abstractmethod
    def access(self, keys: Sequence[K]) -> None:
        """Record hits on resident keys, given in prefix order (parent first)."""

    def refresh(self, keys: Sequence[K]) -> None:
        """Resident ``keys`` (prefix order) are the cached parents of keys just inserted: order
        them so they outlive those children, *without* counting a hit (the store calls this
        when a request stores a chain whose prefix it already holds: that prefix was counted
        when it was loaded, or stored earlier by the same request). By default an ``access``,
        right for policies where an access is only recency."""
        self.access(keys)

    def missed(self, keys: Sequence[K]) -> None:
        """Lookups of ``keys`` (prefix order) reached this tier and found nothing: they were
        just written into the first tier, new or read from a tier below this one. Only tiers
        below the first are told; by default nothing."""

    @abstractmethod
    def remove(self, key: K) -> None:
        """Forget ``key`` (deleted or moved out by someone else); absent keys are ignored."""

    @abstractmethod
    def evict(self, n: int, evictable: Callable[[K], bool]) -> list[K] | None:
        """Choose and forget ``n`` victims for which ``evictable(key)`` is true.

        All-or-nothing: if fewer than ``n`` evictable keys exist, return ``None`` and change
        nothing. Bounded work: implementations should not scan more than needed.
        """

    @abstractmethod
    def resident(self) -> Collection[object]:
        """The resident keys, read only and live (it follows later inserts and evictions): the
        dict or set the policy keeps them in, so hot loops (the simulator's) test membership
        with one C-level lookup instead of a method call. Callers must not mutate it."""

    def describe(self) -> dict[str, Any]:
        """What the policy has learned, for ``TieredStore.stats()`` (empty by default)."""
        return {}

    def __len__(self) -> int:
        """Resident keys (``len(self.resident())``)."""
        return len(self.resident())

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is resident (``key in self.resident()``)."""
        return key in self.resident()


def always(_: object) -> bool:
    """An ``evictable`` predicate that accepts every key (the simulator's case)."""
    return True
