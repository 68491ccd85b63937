"""The decider: every choice about where blocks live, made in plain single-threaded code.

``Decider`` owns the ``BlockIndex`` (entries, per-tier policies) and turns requests into
``Move`` specs for the transfer engine: which victims leave a tier and where they go (deepest
first, so room exists before anything is written into it), which blocks are written through to
shared tiers, which are fetched up to the first tier, what is persisted at close. It also
commits completions (``apply``) and the outcome of synchronous loads (``finish_load``).

It never moves bytes and never blocks: the ``TieredStore`` calls it under its lock and hands
the moves to the engine. Counters of what was decided live here too.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Protocol

from kvtier.errors import RequestError
from kvtier.index import BlockIndex, PolicySource
from kvtier.keys import BlockKey
from kvtier.moves import Move
from kvtier.transfer import Completion


class TierFacts(Protocol):
    """What the decider reads of a tier: a ``kvtier.tiers.base.Tier`` in the store, a plain
    value in the simulator (``kvtier.sim.storemodel``)."""

    @property
    def shared(self) -> bool: ...
    @property
    def persistent(self) -> bool: ...
    @property
    def healthy(self) -> bool: ...
    @property
    def capacity_blocks(self) -> int: ...


@dataclass(slots=True)
class TenantCounters:
    """What one tenant's requests did, in blocks or tokens (``stats()["tenants"][name]``; the
    store's totals in ``stats()["store"]`` carry the same fields).

    ``hit_tokens`` / ``miss_tokens``: of the full-block tokens each ``load`` asked for, those it
    served and those it did not (not cached, or dropped as lost or corrupt); ``token_hit_ratio``
    in ``stats()`` is hits over both. ``lookup_tokens`` / ``lookup_hit_tokens``: the full-block
    tokens each ``lookup`` asked about and found; ``lookup_hit_ratio`` in ``stats()`` is the
    request-level hit ratio for an engine that looks a prompt up, then loads what was found
    (the HF integration, vLLM-style connectors), whose loads never miss.
    """

    lookups: int = 0
    lookup_tokens: int = 0
    lookup_hit_tokens: int = 0
    loads: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0
    stored_tokens: int = 0
    skipped_blocks: int = 0


@dataclass(slots=True)
class Counters(TenantCounters):
    """The store's totals (``stats()["store"]``): every tenant's counters summed, plus what the
    store does for all tenants at once (moves between tiers), counted only here.

    ``invalid_blocks``: blocks the index listed as present that a tier could not return
    verified (lost or corrupt), not blocks an eviction was already taking away.
    """

    invalid_blocks: int = 0
    evictions: int = 0
    demotions: int = 0
    promotions: int = 0
    write_through: int = 0
    write_through_skipped: int = 0
    failed_moves: int = 0
    dropped_for_room: int = 0


def checked_reuse_class(value: object) -> Hashable | None:
    """``value`` if it can label a request for the policies (``None`` or hashable, as a dict
    key must be); ``RequestError`` otherwise, before the store writes anything: a label the
    policy cannot take would otherwise fail after the blocks are in the tier."""
    try:
        hash(value)
    except Exception as exc:
        raise RequestError(
            f"reuse_class must be hashable (None, a str, an int, or a tuple of them), got "
            f"{type(value).__name__} {value!r:.80} ({exc})"
        ) from None
    return value  # hashable: hash() accepted it


@dataclass(slots=True)
class Read:
    """One block a load will read, and from which tier."""

    key: BlockKey
    tier: int
    pinned: bool  # pinned in the index (False for blocks found only in a shared tier)


class Decider:
    """Index + policies + move planning. Not thread-safe: callers hold the store's lock."""

    def __init__(self, tiers: Sequence[TierFacts], policy: PolicySource, block_tokens: int) -> None:
        """``policy``: a registry name, or a factory of tier ``t``'s policy from ``(t,
        capacity)`` (the simulator's, with its offline policies)."""
        self.tiers = tiers
        self.block_tokens = block_tokens
        self.local = [i for i, t in enumerate(tiers) if not t.shared]
        self.shared = [i for i, t in enumerate(tiers) if t.shared]
        self.index = BlockIndex(policy, [0 if t.shared else t.capacity_blocks for t in tiers])
        self.counters = Counters()
        self._tenants: dict[str, TenantCounters] = {}
        #: victims per tier whose move out is planned but not yet applied (room on its way)
        self.evicting = [0] * len(tiers)

    def tenant_counters(self, tenant: str) -> TenantCounters:
        c = self._tenants.get(tenant)
        if c is None:
            c = self._tenants[tenant] = TenantCounters()
        return c

    def tenants(self) -> dict[str, TenantCounters]:
        return self._tenants

    def counted(self, tenant: str) -> tuple[Counters, TenantCounters]:
        """The store's counters and ``tenant``'s: an event is counted in both."""
        return self.counters, self.tenant_counters(tenant)

    def count_load(self, tenant: str, got: int, asked: int) -> None:
        """A load served ``got`` of the ``asked`` full blocks of its tokens."""
        bt = self.block_tokens
        for cnt in self.counted(tenant):
            cnt.loads += 1
            cnt.hit_tokens += got * bt
            cnt.miss_tokens += (asked - got) * bt

    def apply(self, done: Sequence[Completion]) -> None:
        """Commit the outcome of finished async jobs (under the lock)."""
        idx = self.index
        for c in done:
            moves: list[Move] = c.job.context
            for mv in moves:
                ok = mv.ok if len(mv.ok) == len(mv.keys) else [False] * len(mv.keys)
                if mv.dst is not None:
                    idx.end_write(mv.keys, mv.dst, ok)
                    n_ok = sum(ok)
                    self.counters.failed_moves += len(ok) - n_ok
                    if c.job.kind == "demote":
                        self.counters.demotions += n_ok
                    elif c.job.kind == "write-through":
                        self.counters.write_through += n_ok
                    else:
                        self.counters.promotions += n_ok
                if mv.delete_src:
                    self.evicting[mv.src] -= len(mv.keys)
                    idx.drop_all(mv.keys, mv.src)
                idx.unpin(mv.keys)

    def next_local(self, tier: int) -> int | None:
        later = [i for i in self.local if i > tier and self.tiers[i].healthy]
        return later[0] if later else None

    def plan_eviction(self, tier: int, victims: list[BlockKey], moves: list[Move]) -> None:
        """Plan what happens to ``victims`` leaving ``tier`` (under the lock), deepest first."""
        idx = self.index
        self.counters.evictions += len(victims)
        self.evicting[tier] += len(victims)
        lower = self.next_local(tier)
        # a victim already held by a later local tier is dropped here (inclusive hierarchy); a
        # copy in a shared tier does not count: the pool evicts on its own and is slower than
        # any local tier, so the victim still goes down the local chain
        below = sum(1 << i for i in self.local if i > tier)
        entries, bit = idx.entries, 1 << tier
        move_keys: list[BlockKey] = []
        drop_keys: list[BlockKey] = []
        for k in victims:  # its copy there is going away: a failed read of it is no loss
            e = entries[k]
            e.leaving |= bit
            (drop_keys if lower is None or e.tiers & below else move_keys).append(k)
        if move_keys and lower is not None:
            fit, room = idx.plan_room_up_to(lower, len(move_keys))
            drop_keys += move_keys[fit:]  # what the lower tier cannot take falls off
            move_keys = move_keys[:fit]
            if room:
                self.plan_eviction(lower, room, moves)
        if move_keys and lower is not None:
            idx.begin_writes(move_keys, lower)
            moves.append(Move(tier, lower, move_keys, [""] * len(move_keys), delete_src=True))
        if drop_keys:
            moves.append(Move(tier, None, drop_keys, [""] * len(drop_keys), delete_src=True))
        idx.pin(victims)

    def readable_prefix(self, keys: Iterator[BlockKey], limit: int) -> list[Read]:
        """Leading blocks readable from a local-index tier (under lock)."""
        reads = []
        get = self.index.entries.get
        for key in islice(keys, limit):
            e = get(key)
            if e is None:
                break
            t = e.read_tier()  # inline BlockIndex.readable: this loop is the lookup's
            if t < 0:
                break
            reads.append(Read(key, t, True))
        return reads

    def plan_write_through(self, keys: list[BlockKey], owner: str) -> list[Move]:
        """Copies of new first-tier blocks for every shared tier. A tier that is not
        ``healthy`` (its breaker open) is skipped, counted in ``write_through_skipped``; one
        whose breaker is due for a trial reports healthy, so write-through resumes by itself."""
        if not keys or not self.shared:
            return []
        moves = []
        for i in self.shared:
            if self.tiers[i].healthy:
                for k in keys:
                    self.index.begin_write(k, i)
                self.index.pin(keys)
                moves.append(Move(0, i, list(keys), [owner] * len(keys), delete_src=False))
            else:
                self.counters.write_through_skipped += len(keys)
        return moves

    def finish_load(
        self, reads: list[Read], ok: list[bool], n: int, tenant: str
    ) -> tuple[list[int], bool]:
        """Unpin, drop invalid blocks, refresh policies; return (positions to promote, retry).
        The caller counts the load's hits and misses (``count_load``) once it is done."""
        idx = self.index
        retry = False
        idx.unpin([r.key for r in reads if r.pinned])
        if n < len(reads) and reads[n].pinned:
            failed = reads[n]
            e = idx.entries.get(failed.key)
            bit = 1 << failed.tier
            if e is None:
                pass  # forgotten meanwhile: a plain miss
            elif e.pending & ~e.tiers:
                retry = True  # being moved right now: the index catches up on poll
            elif e.tiers & ~bit:
                idx.drop(failed.key, failed.tier)
                retry = True  # another tier still holds a copy
            elif not e.tiers & bit or e.leaving & bit:
                pass  # an eviction took it out of that tier, or is doing so: a plain miss
            elif failed.tier in self.shared:
                # a shared tier evicts on its own, and its breaker may be open: a plain miss
                # (the tier drops and counts what it finds corrupt itself)
                idx.drop(failed.key, failed.tier)
            else:  # the index says it is there: lost or corrupt
                idx.drop(failed.key, failed.tier)
                self.counters.invalid_blocks += 1
        by_tier: dict[int, list[BlockKey]] = {}
        for r in reads[:n]:
            by_tier.setdefault(r.tier, []).append(r.key)
        for tier, keys in by_tier.items():
            if tier in self.shared:
                idx.add_present(keys, tier)
            idx.touch(keys, tier)
        return [i for i, r in enumerate(reads[:n]) if r.tier != 0], retry

    def plan_fetch(self, reads: list[Read], owner: str) -> list[Move]:
        """Moves that bring ``reads`` up into the first tier, evictions first (under lock)."""
        idx = self.index
        moves: list[Move] = []
        fit, victims = idx.plan_room_up_to(0, len(reads))
        reads = reads[:fit]
        if victims:
            self.plan_eviction(0, victims, moves)
        by_src: dict[int, list[BlockKey]] = {}
        for r in reads:
            idx.begin_write(r.key, 0)
            idx.pin([r.key])
            by_src.setdefault(r.tier, []).append(r.key)
        for src, keys in by_src.items():
            moves.append(Move(src, 0, keys, [owner] * len(keys), delete_src=False))
        return moves

    def persistent_tier(self) -> int | None:
        """The first persistent local tier (where ``plan_persist`` copies to), if any."""
        return next((i for i in self.local if self.tiers[i].persistent), None)

    def volatile_only(self) -> int:
        """Blocks held in a local tier but in no persistent one: what a crash would lose."""
        local = sum(1 << i for i in self.local)
        kept = sum(1 << i for i in self.local if self.tiers[i].persistent)
        return sum(1 for e in self.index.entries.values() if e.tiers & local and not e.tiers & kept)

    def plan_persist(self) -> list[Move]:
        """Moves copying blocks held only in volatile local tiers down to the first persistent
        local tier (most recently stored first, evicting its coldest blocks if needed). A
        pinned block is copied too (a copy leaves its source in place); one an eviction is
        taking out of its tier is not (its bytes are on their way out)."""
        target = self.persistent_tier()
        if target is None or not self.tiers[target].healthy:
            return []
        idx = self.index
        keep = 1 << target
        by_src: dict[int, list[BlockKey]] = {}
        for key, e in idx.entries.items():
            src = e.best_tier()
            if 0 <= src < target and not (e.tiers | e.pending) & keep and not e.leaving:
                by_src.setdefault(src, []).append(key)
        moves: list[Move] = []
        for src, keys in by_src.items():
            fit, room = idx.plan_room_up_to(target, len(keys))
            keys = keys[len(keys) - fit :]  # the most recently stored
            if not keys:
                continue
            if room:
                self.plan_eviction(target, room, moves)
            for k in keys:
                idx.begin_write(k, target)
            idx.pin(keys)
            moves.append(Move(src, target, keys, [""] * len(keys), delete_src=False))
        return moves
