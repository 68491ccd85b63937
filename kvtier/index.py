"""The block index: what lives where, what is in flight, what is pinned -- the decider's state.

Plain single-threaded code: the ``TieredStore`` calls it under its lock and never while bytes
move. Each block has an ``Entry``:

- ``tiers`` -- bitmask of tiers holding a complete, readable copy (bit i = tier i);
- ``pending`` -- bitmask of tiers being written (not readable there yet);
- ``pins`` -- readers, in-flight moves out of it, and request pins; a pinned block is never
  chosen for eviction;
- ``leaving`` -- bitmask of tiers an eviction is taking it out of (its copy there may vanish
  before the move is committed).

Each tier that the store manages (bounded, local) has an eviction policy tracking exactly the keys
resident there. ``plan_room`` asks it for victims, all-or-nothing, skipping pinned or pending
blocks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from kvtier.keys import BlockKey
from kvtier.policy import EvictionPolicy, make_policy

#: a policy name (``kvtier.policy.POLICIES``), or a factory of tier ``t``'s policy from
#: ``(t, capacity in blocks)``
PolicySource = str | Callable[[int, int], EvictionPolicy[BlockKey]]


@dataclass(slots=True)
class Entry:
    tiers: int = 0
    pending: int = 0
    pins: int = 0
    leaving: int = 0

    def best_tier(self) -> int:
        """Index of the fastest tier holding the block; -1 if none."""
        t = self.tiers
        return (t & -t).bit_length() - 1 if t else -1

    def read_tier(self) -> int:
        """The tier a reader should use: the fastest copy no eviction is taking away; else,
        while a move carries it to another tier (``pending``), the copy it is leaving (readable
        until the move deletes it, then from its new tier); -1 if no copy will be left (its
        drop is planned, or it is not written yet): a block a pin cannot keep."""
        t = self.tiers & ~self.leaving or (self.tiers if self.pending else 0)
        return (t & -t).bit_length() - 1 if t else -1


class BlockIndex:
    """Entries by key plus one eviction policy per managed tier. Not thread-safe."""

    def __init__(self, policy: PolicySource, capacities: Sequence[int]) -> None:
        """``capacities[i]`` is tier i's size in blocks, 0 for a tier the store does not evict
        from (unbounded / shared tiers evict on their own). ``policy`` names each tier's policy
        or builds it from the tier's capacity."""
        self.entries: dict[BlockKey, Entry] = {}
        self.capacities = list(capacities)
        build = policy if callable(policy) else lambda _t, c: make_policy(policy, c)
        self.policies: list[EvictionPolicy[BlockKey] | None] = [
            build(t, c) if c else None  # type: ignore[misc]
            for t, c in enumerate(capacities)
        ]
        self.resident = [0] * len(capacities)  # complete + pending-in, per tier
        #: tiers below the first whose policy wants to hear of the lookups that missed it
        self._told_misses = [
            t
            for t, p in enumerate(self.policies)
            if t and p is not None and type(p).missed is not EvictionPolicy.missed
        ]

    # -- queries ---------------------------------------------------------------------------
    def readable(self, key: BlockKey) -> Entry | None:
        """The entry of ``key`` if a reader can get its bytes (``Entry.read_tier``), else None.
        A copy whose drop is already planned does not count: a pin cannot stop a move the
        workers already carry out, so a pin or a lookup counting it would promise a miss."""
        e = self.entries.get(key)
        return e if e is not None and e.read_tier() >= 0 else None

    def free(self, tier: int) -> int:
        cap = self.capacities[tier]
        return cap - self.resident[tier] if cap else 1 << 62

    # -- updates ---------------------------------------------------------------------------
    def begin_write(self, key: BlockKey, tier: int) -> Entry:
        """Mark ``key`` as being written into ``tier`` (counts against its room)."""
        e = self.entries.get(key)
        if e is None:
            e = self.entries[key] = Entry()
        e.pending |= 1 << tier
        self.resident[tier] += 1
        return e

    def begin_writes(self, keys: Sequence[BlockKey], tier: int) -> None:
        """``begin_write`` of each of ``keys`` into ``tier``, in one loop."""
        entries, bit = self.entries, 1 << tier
        for key in keys:
            e = entries.get(key)
            if e is None:
                e = entries[key] = Entry()
            e.pending |= bit
        self.resident[tier] += len(keys)

    def end_write(
        self,
        keys: Sequence[BlockKey],
        tier: int,
        ok: Sequence[bool],
        reuse_class: Hashable | None = None,
    ) -> None:
        """Commit (``ok``) or roll back the writes of ``keys`` into ``tier``; prefix order.
        ``reuse_class`` labels the committed keys for the tier's policy (a store's new blocks).

        A commit into the first tier is also told to each lower tier's policy
        (``EvictionPolicy.missed``) for the keys that tier does not hold: lookups that reached
        it and missed.

        Exception-safe: if the policy raises while taking the committed keys, every write of
        the call is rolled back (none stays in the index, so none is left that the policy cannot
        evict) and the exception propagates; the caller must delete them from the tier."""
        bit = 1 << tier
        policy = self.policies[tier]
        entries = self.entries
        committed = []
        undone = 0
        for key, good in zip(keys, ok, strict=True):
            e = entries.get(key)
            if e is None or not e.pending & bit:
                continue
            e.pending &= ~bit
            if good and not e.tiers & bit:
                e.tiers |= bit
                committed.append(key)
            else:
                undone += 1
                if not e.tiers and not e.pending and e.pins <= 0:
                    del entries[key]
        self.resident[tier] -= undone
        if policy is not None and committed:
            try:
                policy.insert(committed, reuse_class)
            except BaseException:
                self._uncommit(committed, tier)
                raise
        if not tier and committed and self._told_misses:
            for t in self._told_misses:
                b = 1 << t
                missed = [k for k in committed if not (entries[k].tiers | entries[k].pending) & b]
                if missed:
                    self.policies[t].missed(missed)  # type: ignore[union-attr]

    def _uncommit(self, keys: Sequence[BlockKey], tier: int) -> None:
        """Take back the commit of ``keys`` into ``tier`` (its policy raised while taking them):
        a block the policy may not track could never be evicted, so none of them is stored. The
        caller deletes them from the tier."""
        bit = 1 << tier
        policy = self.policies[tier]
        for key in keys:
            e = self.entries[key]
            e.tiers &= ~bit
            self.resident[tier] -= 1
            if policy is not None:
                with contextlib.suppress(Exception):  # it may hold some of them, or none
                    policy.remove(key)
            self._forget_if_empty(key, e)

    def add_present(self, keys: Sequence[BlockKey], tier: int) -> None:
        """Record blocks found already present in ``tier`` (warm restart, a shared hit)."""
        bit = 1 << tier
        policy = self.policies[tier]
        fresh = []
        for key in keys:
            e = self.entries.get(key)
            if e is None:
                e = self.entries[key] = Entry()
            if not (e.tiers | e.pending) & bit:
                e.tiers |= bit
                self.resident[tier] += 1
                fresh.append(key)
        if policy is not None and fresh:
            policy.insert(fresh)

    def drop(self, key: BlockKey, tier: int) -> None:
        """``key`` is no longer in ``tier`` (deleted, evicted, found corrupt or missing)."""
        e = self.entries.get(key)
        bit = 1 << tier
        if e is None or not e.tiers & bit:
            return
        evicted = e.leaving & bit  # an eviction's victim: its policy forgot it when it chose it
        e.tiers &= ~bit
        e.leaving &= ~bit
        self.resident[tier] -= 1
        policy = self.policies[tier]
        if policy is not None and not evicted:
            policy.remove(key)
        self._forget_if_empty(key, e)

    def drop_all(self, keys: Sequence[BlockKey], tier: int) -> None:
        """``drop`` of each of ``keys`` (a move out of ``tier`` completed), in one loop."""
        entries, bit, policy = self.entries, 1 << tier, self.policies[tier]
        gone = 0
        for key in keys:
            e = entries.get(key)
            if e is None or not e.tiers & bit:
                continue
            if policy is not None and not e.leaving & bit:
                policy.remove(key)
            e.tiers &= ~bit
            e.leaving &= ~bit
            gone += 1
            if not e.tiers and not e.pending and e.pins <= 0:
                del entries[key]
        self.resident[tier] -= gone

    def touch(self, keys: Sequence[BlockKey], tier: int) -> None:
        """Hits on ``keys`` in ``tier`` (a load)."""
        policy = self.policies[tier]
        if policy is not None and keys:
            policy.access(keys)

    def refresh(self, keys: Sequence[BlockKey], tier: int) -> None:
        """``keys`` are the cached parents of blocks just stored: no hit (``EvictionPolicy.
        refresh``), only order, so a parent outlives its children."""
        policy = self.policies[tier]
        if policy is not None and keys:
            policy.refresh(keys)

    def pin(self, keys: Sequence[BlockKey]) -> None:
        entries = self.entries
        for key in keys:
            entries[key].pins += 1

    def unpin(self, keys: Sequence[BlockKey]) -> None:
        entries = self.entries
        for key in keys:
            e = entries.get(key)
            if e is not None:
                e.pins -= 1
                if e.pins <= 0 and not e.tiers and not e.pending:
                    del entries[key]

    def plan_room(self, tier: int, n: int) -> list[BlockKey] | None:
        """Victims to evict from ``tier`` so ``n`` more blocks fit; None if impossible.

        The victims are removed from the tier's policy (the caller must then move or drop them;
        they still count as resident until ``drop``).
        """
        need = n - self.free(tier)
        if need <= 0:
            return []
        policy = self.policies[tier]
        if policy is None:
            return []
        entries = self.entries

        def evictable(key: BlockKey) -> bool:
            e = entries[key]
            return not (e.pins or e.pending)

        return policy.evict(need, evictable)

    def plan_room_up_to(self, tier: int, n: int) -> tuple[int, list[BlockKey]]:
        """Like ``plan_room``, but when pinned or in-flight blocks leave too little to evict,
        plan for as many blocks as can be made to fit: returns (how many fit, victims)."""
        victims = self.plan_room(tier, n)
        if victims is not None:
            return n, victims
        bit = 1 << tier
        evictable = sum(
            1 for e in self.entries.values() if e.tiers & bit and not e.pins and not e.pending
        )
        k = max(0, min(n, self.free(tier) + evictable))
        victims = self.plan_room(tier, k)
        if victims is None:  # the policy disagrees with the count: only what is free now
            return max(0, min(n, self.free(tier))), []
        return k, victims

    def _forget_if_empty(self, key: BlockKey, e: Entry) -> None:
        if not e.tiers and not e.pending and e.pins <= 0:
            self.entries.pop(key, None)
