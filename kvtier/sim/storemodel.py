"""The store's decisions without the store: ``ModelStore`` serves requests with the very
``Decider`` (block index, per-tier policies, move planning) that ``TieredStore`` runs, and carries
out each planned ``Move`` at once instead of handing it to a transfer engine.

Per request it makes the calls a sequential engine makes on a ``TieredStore``
(``kvtier.sim.storereplay`` is that engine, on a real store), in the store's order:

1. **lookup** -- the leading run of the prompt's full blocks that some tier holds;
2. **load** of that run -- each block read from the fastest tier holding it, the hits told to
   that tier's policy (``Decider.finish_load``), then the blocks read below the first tier are
   *promoted*: copied into it now when it has room, else by ``Decider.plan_fetch`` (victims
   demoted first). The lower copy stays: the hierarchy is **inclusive**;
3. **store** of every full block -- the blocks no tier holds are written into the first tier
   (room made first, victims demoted one tier down unless a lower copy already exists, the last
   tier dropping them; a prompt longer than the first tier goes in slices, or only its head
   when there is no tier below), labelled with the
   request's hint; the blocks it already held are re-ordered after them
   (``EvictionPolicy.refresh``) so a parent outlives its children.

A move completes before the next call (a demotion before the write that needed its room), as
when the engine waits for the store's background work; the real store overlaps those moves with
later requests, which changes nothing a request can see unless two of them race for one block.
Keys are the trace's int block ids. The store's code paths this mirrors are named per method, so
a change there shows up as a difference in ``tests/test_sim_store.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from kvtier.decider import Decider, Read
from kvtier.keys import BlockKey
from kvtier.moves import Move
from kvtier.policy.base import EvictionPolicy
from kvtier.sim.sharedtier import SharedTier
from kvtier.transfer import Completion, Job


@dataclass(frozen=True, slots=True)
class ModelTier:
    """What the decider reads of a simulated tier (``kvtier.decider.TierFacts``): local,
    healthy, volatile, ``capacity_blocks`` big."""

    capacity_blocks: int
    shared: bool = False
    persistent: bool = False
    healthy: bool = True


def _noop() -> None:
    return None


class ModelStore:
    """One node's store over tiers of ``capacities`` blocks (fastest first). Not thread-safe.

    ``policy(t, capacity)`` builds tier ``t``'s policy. ``promoted[t]``, ``written[t]``,
    ``evicted[t]``: blocks read out of tier ``t`` into the first tier, written into tier ``t``
    (stored, promoted or demoted), evicted out of it.
    """

    def __init__(
        self,
        capacities: Sequence[int],
        policy: Callable[[int, int], EvictionPolicy[Any]],
        shared: Sequence[SharedTier] = (),
    ) -> None:
        """``shared``: tiers after the local ones that this node shares with others (a
        cluster's pool, object storage): written through, read after the local run."""
        tiers = [ModelTier(c) for c in capacities]
        tiers += [ModelTier(s.capacity, shared=True) for s in shared]
        self.decider = Decider(tiers, policy, block_tokens=1)
        self.index = self.decider.index
        self.shared = list(shared)
        self.n_local = len(capacities)
        self.local_mask = (1 << self.n_local) - 1
        n = len(tiers)
        self.cap0 = capacities[0]
        self.promoted = [0] * n
        self.written = [0] * n
        self.evicted = [0] * n

    def local_run(self, blocks: Sequence[int]) -> int:
        """How many leading ``blocks`` this node's own tiers hold now. No side effects."""
        get, mask = self.index.entries.get, self.local_mask
        n = 0
        for k in blocks:
            e = get(k)  # type: ignore[call-overload]
            if e is None or not e.tiers & mask:
                break
            n += 1
        return n

    def serve(self, blocks: Sequence[int], hint: Callable[[int], Hashable | None]) -> list[int]:
        """Serve one request whose full blocks are ``blocks`` (prefix order): lookup, load,
        store (module docstring). ``hint(hit_blocks)`` gives the reuse class it stores with.
        Returns the tier each hit block was read from (the leading run, in order)."""
        keys = cast(list[BlockKey], list(blocks))
        reads = self._load(keys)
        self._store(keys, hint(len(reads)))
        return [r.tier for r in reads]

    # -- load: ReadPath.load / _load_pass / _promote ---------------------------------------
    def _load(self, keys: list[BlockKey]) -> list[Read]:
        if self.shared:
            return self._load_shared(keys)
        dec, idx = self.decider, self.index
        # TieredStore.lookup, then the load's readable prefix: with every move done at once no
        # copy is pending or leaving, so the two agree and one pass gives both
        reads = dec.readable_prefix(iter(keys), len(keys))
        n = len(reads)
        if not n:
            return []
        idx.pin([r.key for r in reads])
        promote, _ = dec.finish_load(reads, [True] * n, n, "")
        if promote:
            self._promote([reads[i] for i in promote])
        return reads

    def _load_shared(self, keys: list[BlockKey]) -> list[Read]:
        """``_load`` with shared tiers (ReadPath.load's passes): the index's readable run (which
        may list blocks a shared tier has dropped since this node wrote them: such a read
        fails, and a retry reads past it only if another tier holds a copy), then the leading
        run the first shared tier holding any of the rest has (``_shared_extension``)."""
        dec, idx = self.decider, self.index
        done: list[Read] = []
        for _ in range(3):
            start = len(done)
            reads = dec.readable_prefix(iter(keys[start:]), len(keys) - start)
            idx.pin([r.key for r in reads])
            have = start + len(reads)
            for i, sh in enumerate(self.shared):
                n_sh = sh.contains_prefix(keys[have:]) if have < len(keys) else 0
                if n_sh:
                    tier = self.n_local + i
                    reads += [Read(k, tier, False) for k in keys[have : have + n_sh]]
                    break
            ok = [True] * len(reads)
            for j, r in enumerate(reads):
                if r.tier >= self.n_local:
                    ok[j] = self.shared[r.tier - self.n_local].get([r.key])[0]
                    if not ok[j]:
                        ok[j + 1 :] = [False] * (len(reads) - j - 1)
                        break
            n = ok.index(False) if False in ok else len(ok)
            promote, retry = dec.finish_load(reads, ok, n, "")
            if promote:
                self._promote([reads[i] for i in promote])
            done += reads[:n]
            if not retry or len(done) >= len(keys):
                break
        return done

    def _promote(self, reads: list[Read]) -> None:
        idx = self.index
        entries = idx.entries
        todo = [
            r.key
            for r in reads
            if (e := entries.get(r.key)) is not None and not (e.tiers | e.pending) & 1
        ]
        if idx.free(0) < len(todo):
            wanted = set(todo)
            moves = self.decider.plan_fetch([r for r in reads if r.key in wanted], "")
            self._run("promote", moves)
            return
        wanted = set(todo)
        for r in reads:
            if r.key in wanted:
                self.promoted[r.tier] += 1
        idx.begin_writes(todo, 0)
        idx.end_write(todo, 0, [True] * len(todo))
        self.decider.counters.promotions += len(todo)
        self.written[0] += len(todo)

    # -- store: TieredStore.store / _store_blocks, StoreCore._room_in_first ----------------
    def _store(self, keys: list[BlockKey], hint: Hashable | None) -> None:
        idx = self.index
        entries = idx.entries
        new: list[BlockKey] = []
        held: list[BlockKey] = []
        get, mask = entries.get, self.local_mask  # a shared copy is not held: StoreCore._held
        for k in keys:
            e = get(k)
            (held if e is not None and (e.tiers | e.pending) & mask else new).append(k)
        idx.pin(held)
        step = self.cap0 or len(new) or 1
        below = len(self.decider.local) > 1 or bool(self.decider.shared)
        for start in range(0, len(new) if below else min(len(new), 1), step):
            part = new[start : start + step]
            if self._store_blocks(part, hint) < len(part):
                break
        idx.unpin(held)
        idx.refresh([k for k in held if (e := entries.get(k)) and e.tiers & 1], 0)

    def _store_blocks(self, keys: list[BlockKey], hint: Hashable | None) -> int:
        idx = self.index
        fit = self._room_in_first(len(keys))
        entries = idx.entries
        mask = self.local_mask
        new_keys = [
            k
            for k in keys[:fit]
            if (e := entries.get(k)) is None or not (e.tiers | e.pending) & mask
        ]
        idx.begin_writes(new_keys, 0)
        idx.end_write(new_keys, 0, [True] * len(new_keys), hint)
        self.written[0] += len(new_keys)
        if self.shared:
            self._run("write-through", self.decider.plan_write_through(new_keys, ""))
        return len(new_keys)

    def _room_in_first(self, n: int) -> int:
        idx, dec = self.index, self.decider
        moves: list[Move] = []
        if idx.free(0) < n:
            n, victims = idx.plan_room_up_to(0, n)
            if victims:
                dec.plan_eviction(0, victims, moves)
        self._run("demote", moves)
        return max(0, min(n, idx.free(0)))

    # -- the mover: every move done, at once ------------------------------------------------
    def _run(self, kind: str, moves: list[Move]) -> None:
        if not moves:
            return
        for mv in moves:
            mv.ok = [True] * len(mv.keys)
            if mv.dst is not None and mv.dst >= self.n_local:  # a shared tier: written through
                self.shared[mv.dst - self.n_local].put(mv.keys)
            if mv.dst is not None:
                self.written[mv.dst] += len(mv.keys)
                if mv.dst == 0:
                    self.promoted[mv.src] += len(mv.keys)
            if mv.delete_src:
                self.evicted[mv.src] += len(mv.keys)
        self.decider.apply([Completion(Job(kind, _noop, moves))])
