"""``DirectStore``: stores and loads whose bytes the client copies itself, in the shared arena.

With ``[service] data = "arena"`` the host tier's arena is named shared memory every client maps
(``kvtier.tiers.host.HostTier(shm_path=...)``), so a client moves KV bytes with one copy per
direction, as in-process -- the same fused copy + checksum (``codec.copy_in``/``copy_out``),
run in the client's process:

- **store**: ``reserve`` runs the store's own first phases (keys, pins on the cached part,
  room in the first tier, pending index entries: ``TieredStore._begin_store``/``_begin_first``)
  and reserves a host slot per new block, invisible to every reader. The client copies each
  block into its slot, computing the checksum as it goes, and ``commit`` publishes the slots
  with those checksums and commits the index (``_end_first``), slice by slice. Only committed
  blocks are ever visible. A reservation belongs to the client's session: one it never
  commits (the client was killed) is aborted when the session expires -- its slots return to
  the free list unread and its index entries are rolled back.
- **load**: ``acquire`` pins the leading run of cached blocks held in the host tier (in the
  index: not evicted; in the slot table: not reused) and returns their slots and checksums;
  the client copies out, verifying as it goes, straight into the caller's array, and
  ``release`` reports how many verified, which the store's read path accounts for as its own
  load would (``Decider.finish_load``: a block that failed is dropped, a miss). Blocks after
  that run held only in lower tiers are the client's to load through its staging region.

Trust: a client that maps the arena can read (and write) every block in it, whatever its
identity or tenant. The arena is shared only with processes that may open the socket (same
owner or group); ``data = "staging"`` keeps every client to its own staging region.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from itertools import islice

from kvtier.decider import Read
from kvtier.keys import BlockKey, Namespace, TokenIds, iter_keys
from kvtier.store import TieredStore
from kvtier.tiers.host import HostTier


@dataclass(slots=True)
class Reservation:
    """A store whose bytes a client is copying: the slots of its current slice.

    ``pending``/``slots`` are the positions (blocks from the call's ``start``) and host slots
    reserved now; ``slices`` those still to come."""

    ns: Namespace
    reuse_class: Hashable | None
    keys: list[BlockKey]
    held: list[BlockKey]
    slices: list[list[int]]
    pending: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    written: int = 0  # blocks committed so far
    done: bool = False
    store: DirectStore | None = None

    def release(self) -> None:
        """Abort what is not committed (the session ended first). Idempotent."""
        if self.store is not None:
            self.store.abort_store(self)


@dataclass(slots=True)
class SlotRead:
    """Host slots a client is copying out of, pinned until ``release``."""

    ns: Namespace
    keys: list[BlockKey]
    slots: list[int]
    sums: list[int]
    store: DirectStore | None = None

    def release(self) -> None:
        """Unpin without accounting a load (the session ended first). Idempotent."""
        if self.store is not None:
            self.store.end_read(self, None)


class DirectStore(TieredStore):
    """A ``TieredStore`` whose host arena clients map (see the module docstring).

    Thread-safe as the store is; one reservation or read is used by one call at a time."""

    @property
    def arena(self) -> HostTier | None:
        """The first tier when it is a host tier in named shared memory, else ``None``."""
        first = self.tiers[0].inner
        return first if isinstance(first, HostTier) and first.shm.path is not None else None

    def _host(self) -> HostTier:
        host = self.arena
        assert host is not None, "direct transfers need the shared host arena"
        return host

    # -- store -------------------------------------------------------------------------------
    def reserve_store(
        self,
        toks: TokenIds,
        start: int,
        n_blocks: int,
        ns: Namespace,
        reuse_class: Hashable | None,
    ) -> Reservation:
        """Reserve host slots for the first slice of new blocks among ``n_blocks`` from
        ``start``; ``done`` when there is nothing to copy. Raises what ``store`` raises for bad
        input, before reserving anything."""
        self._check_open()
        keys, new, held = self._begin_store(toks, start, n_blocks, ns)
        res = Reservation(ns, reuse_class, keys, held, self._store_slices(new), store=self)
        try:
            self._next_slice(res)
        except BaseException:
            self.abort_store(res)
            raise
        return res

    def _next_slice(self, res: Reservation) -> None:
        host = self._host()
        while res.slices and not res.pending:
            part = res.slices.pop(0)
            keys = [res.keys[i] for i in part]
            picked = self._begin_first(keys)
            slots = host.reserve([keys[i] for i in picked])
            lost = [keys[i] for i, s in zip(picked, slots, strict=True) if s is None]
            if lost:  # the index had room the slot table has not: those are not stored
                self._end_first(lost, [False] * len(lost), res.ns)
            res.pending = [part[i] for i, s in zip(picked, slots, strict=True) if s is not None]
            res.slots = [s for s in slots if s is not None]
            if len(res.pending) < len(part):
                res.slices = []  # as a store: a slice that did not fit all ends the call
        if not res.pending:
            self._finish_store(res)

    def commit_store(self, res: Reservation, checksums: list[int]) -> None:
        """Publish the current slice (its bytes are in place; ``checksums`` as
        ``codec.copy_in`` returned them, one per slot) and reserve the next, if any."""
        if res.done or len(checksums) != len(res.slots):
            raise ValueError(f"commit of {len(checksums)} checksums for {len(res.slots)} slots")
        host = self._host()
        keys = [res.keys[i] for i in res.pending]
        host.publish(keys, res.slots, checksums)
        # the tier's metrics, as if it had copied them (the client's time is not known here)
        self.tiers[0]._record(res.ns.owner, "write", [True] * len(keys), 0.0)
        res.pending, res.slots = [], []
        res.written += self._end_first(keys, [True] * len(keys), res.ns, res.reuse_class)
        self._next_slice(res)

    def reserve_may_wait(self) -> bool:
        """Whether ``reserve_store`` may block: room in the first tier may have to wait for
        its victims' demotion to a lower local tier (victims with nowhere to go are dropped
        at once). Any lower local tier counts, healthy or not: one that recovers while the
        call runs would be demoted to."""
        return len(self._decider.local) > 1

    def commit_may_wait(self, res: Reservation) -> bool:
        """Whether ``commit_store(res)`` may block: it starts write-through copies to a shared
        tier (the transfer engine's queue may be full) or reserves a next slice that may wait
        (``reserve_may_wait``). A commit that cannot is a few table updates."""
        return bool(self._shared) or (bool(res.slices) and self.reserve_may_wait())

    def abort_store(self, res: Reservation) -> None:
        """Return the uncommitted slots unread and roll back their index entries."""
        if res.done:
            return
        if res.pending:
            keys = [res.keys[i] for i in res.pending]
            self._host().abort(keys, res.slots)
            self._end_first(keys, [False] * len(keys), res.ns)
            res.pending, res.slots = [], []
        res.slices = []
        self._finish_store(res)

    def _finish_store(self, res: Reservation) -> None:
        if not res.done:
            res.done = True
            self._end_store(res.held)

    # -- load --------------------------------------------------------------------------------
    def begin_read(self, toks: TokenIds, start: int, ns: Namespace) -> tuple[SlotRead, bool]:
        """Pin the leading cached blocks from ``start`` that the host tier holds; also whether
        cached blocks follow them in other tiers (the client loads those another way)."""
        self._check_open()
        first = self._first_block(start, toks)
        limit = len(toks) // self.layout.block_tokens
        self._poll()
        with self._lock:
            reads = self._decider.readable_prefix(
                islice(iter_keys(ns, toks), first, None), limit - first
            )
            n = next((i for i, r in enumerate(reads) if r.tier != 0), len(reads))
            keys = [r.key for r in reads[:n]]
            self._index.pin(keys)
        got = self._host().acquire(keys)
        if len(got) < len(keys):  # a block left the host tier between the index and here
            self._unpin(keys[len(got) :])
            keys = keys[: len(got)]
        # what follows is in a lower tier, or may be in a shared one (asked by a load)
        more = len(keys) < len(reads) or (bool(self._shared) and first + len(reads) < limit)
        read = SlotRead(ns, keys, [s for s, _ in got], [c for _, c in got], store=self)
        return read, more

    def end_read(self, read: SlotRead, verified: int | None, asked: int = 0) -> None:
        """Unpin ``read``'s slots. ``verified``: how many of them the client copied out and
        verified (the first one after them failed, if any, is dropped as corrupt), and the
        load is counted as ``verified`` of ``asked`` blocks; ``None``: abandoned, nothing is
        counted. Idempotent."""
        if read.store is None:
            return
        read.store = None
        host = self._host()
        host.release(read.slots)
        if verified is None:
            self._unpin(read.keys)
            return
        reads = [Read(k, 0, True) for k in read.keys]
        ok = [i < verified for i in range(len(reads))]
        self.tiers[0]._record(read.ns.owner, "read", ok[: verified + 1], 0.0)
        with self._lock:
            _, retry = self._decider.finish_load(reads, ok, verified, read.ns.tenant)
            self._decider.count_load(read.ns.tenant, verified, max(asked, verified))
        if verified < len(reads) and not retry:
            self.tiers[0].delete([reads[verified].key], read.ns.owner)
