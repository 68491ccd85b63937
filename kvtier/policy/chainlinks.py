"""Prefix links between the resident keys of one tier: who is whose parent.

A child is useless without its parent, so a policy must not drop a parent while its child stays.
``ChainLinks`` records, per resident key, its parent (the key before it in a chain inserted
together) and how many resident children it has. A policy that meets a parent with resident
children while choosing victims *parks* it in ``waiting``; when its last child leaves,
``on_free`` hands it back to the policy (to be queued again, first in line).

A tier fed by demotions learns links from the tier above (``adopt``): a chain comes down leaf
first, a block per eviction and between other chains' blocks, so a child may arrive before its
parent; it waits in ``orphans`` until the parent does (orphans are forgotten in bulk once as
many parents as the tier holds blocks are awaited, so parents that never come cost no memory).

The dicts are public so that hot loops can alias them; ``link``/``unlink`` keep them consistent.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Generic

from kvtier.policy.base import K


class ChainLinks(Generic[K]):
    """Parent links and resident-children counts of one tier's keys (module docstring)."""

    def __init__(self, on_free: Callable[[K], None], orphan_cap: int) -> None:
        """``on_free(parent)`` is called when a waiting parent's last child leaves."""
        self.parent: dict[K, K] = {}  # resident key -> its parent
        self.kids: dict[K, int] = {}  # resident key -> resident children
        self.waiting: set[K] = set()  # parents met by an eviction while a child stayed
        self.orphans: dict[K, list[K]] = {}  # a parent not here yet -> its children here
        self._on_free = on_free
        self._orphan_cap = max(1, orphan_cap)

    def link(self, key: K, parent: K) -> None:
        self.parent[key] = parent
        self.kids[parent] = self.kids.get(parent, 0) + 1

    def unlink(self, key: K) -> K | None:
        """Forget ``key``'s parent link; returns the parent (None if it had none). A waiting
        parent whose last child this was is freed (``on_free``)."""
        p = self.parent.pop(key, None)
        if p is not None:
            left = self.kids[p] - 1
            if left:
                self.kids[p] = left
            else:
                del self.kids[p]
                if p in self.waiting:
                    self.waiting.discard(p)
                    self._on_free(p)
        return p

    def forget(self, key: K) -> None:
        """``key`` left the tier (removed by someone else): no longer waiting, no link up."""
        self.waiting.discard(key)
        self.unlink(key)

    def adopt(self, key: K, parent: K | None, resident: Collection[object]) -> None:
        """``key`` just came down; its parent in the tier above was ``parent``. Link the
        children that came down before it, and link it to its parent if that is here (else it
        waits for it)."""
        for c in self.orphans.pop(key, ()):
            if c in resident and c not in self.parent:
                self.link(c, key)
        if parent is None:
            return
        if parent in resident:
            self.link(key, parent)
            return
        if len(self.orphans) >= self._orphan_cap:
            self.orphans.clear()
        self.orphans.setdefault(parent, []).append(key)
