"""``TieredStore``: the public API -- lookup, store, load, prefetch, pin, stats.

Decide/move split: every decision (what is present, what to evict, where to demote, what to
promote) is made by the ``Decider`` (``kvtier/decider.py``: the block index and the per-tier
eviction policies) under one lock, in plain single-threaded code; bytes move outside the lock, on
the calling thread plus the transfer engine's workers (synchronous load/store) or on workers
alone (demotion, write-through, prefetch, promotion). Blocks being written are not readable
(``Entry.pending``); blocks being read or moved are pinned (``Entry.pins``) and cannot be evicted.

Hierarchy rules:

- Tiers are ordered fastest first. *Local* tiers form the demotion chain (a victim moves down
  unless a lower copy exists); *shared* tiers are written through asynchronously and asked
  ``contains_prefix`` for blocks this process does not know (another node's work).
- A hit below the first tier is promoted into it (inclusive); persistent tiers are enumerated
  at open (warm restart) and receive volatile blocks at ``close()``.

Integrity: tiers verify header and checksum on every read; a block that fails is a miss, dropped
and counted in ``stats()["store"]["invalid_blocks"]``. Nothing wrong is ever returned.

The class is split by concern: ``store_core.StoreCore`` (shared state and helpers),
``readpath.ReadPath`` (load, promotion, prefetch, layer-wise load), and this module (lookup,
store, pin, stats, lifecycle).
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterator, Mapping
from dataclasses import asdict
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.config import StoreConfig
from kvtier.decider import checked_reuse_class
from kvtier.errors import ConfigError, LayoutError
from kvtier.keys import BlockKey, Namespace, TokenIds, iter_keys
from kvtier.kvarray import host_array
from kvtier.lease import Lease
from kvtier.moves import split_moves
from kvtier.readpath import ReadPath
from kvtier.store_core import log
from kvtier.tiers.base import Array, Tier

if TYPE_CHECKING:
    from kvtier.service.client import ServiceClient


class TieredStore(ReadPath):
    """A KV-cache block store over an ordered list of tiers. Thread-safe; a context manager.

    Construct with ``TieredStore(layout, tiers, model_id=... or identity=..., tenant=...,
    policy=..., workers=..., secret=..., share_groups=..., demote_queue=..., metrics_port=...,
    persist_on_close=...)`` (see ``StoreCore.__init__``) or ``TieredStore.from_config``.
    """

    @classmethod
    def from_config(
        cls,
        config: StoreConfig | Mapping[str, Any] | str | Path,
        env: Mapping[str, str] | None = None,
        *,
        first: Tier | None = None,
    ) -> TieredStore:
        """Build a store and its tiers from a ``StoreConfig``, a config dict or a TOML path.
        ``first``, when given, is the first tier, built by the caller from the first
        ``[[tiers]]`` table (the node service builds its host tier in shared memory); the
        store owns it from here (closed with the store, or on a failure here)."""
        from kvtier.tiers.registry import make_tiers

        cfg = StoreConfig.load(config, env)
        try:
            rest = cfg.tiers if first is None else cfg.tiers[1:]
            tiers = make_tiers(cfg.layout, rest, secret=cfg.secret)
        except BaseException:
            if first is not None:
                first.close()
            raise
        if first is not None:
            tiers.insert(0, first)
        try:
            for i, name in enumerate(cfg.tier_policies):
                if name and (tiers[i].shared or not tiers[i].capacity_blocks):
                    raise ConfigError(
                        f"[[tiers]] #{i} ({tiers[i].name}) policy = {name!r}: this tier evicts "
                        "on its own (shared or unbounded), kvtier chooses no victims there; "
                        "remove the key"
                    )
            return cls(
                cfg.layout,
                tiers,
                identity=cfg.identity,
                tenant=cfg.tenant,
                policy=cfg.policy_source(),
                workers=cfg.workers,
                secret=cfg.secret,
                share_groups=cfg.share_groups,
                demote_queue=cfg.demote_queue,
                metrics_port=cfg.metrics_port or None,
            )
        except BaseException:
            for t in tiers:
                t.close()
            raise

    @classmethod
    def connect(cls, url: str, **kwargs: Any) -> ServiceClient:
        """A client of the node-local kvtier service (``kvtier serve``) at ``url``
        (``unix:///path/kvtier.sock``) with this class's API: ``kvtier.service.client.connect``
        (keywords: ``identity``/``model_id``, ``tenant``, ``layout``, ``timeout``). Needs the
        ``service`` extra (pyzmq)."""
        from kvtier.service.client import connect

        return connect(url, **kwargs)

    def lookup(
        self,
        tokens: Any,
        tenant: str | None = None,
        *,
        adapter: str | None = None,
        salt: str | bytes | None = None,
        start: int = 0,
    ) -> int:
        """The end of the cached run of blocks from ``start`` (tokens; a multiple of
        ``block_tokens``, ``start`` when nothing is cached). No side effects on the cache (only
        counters). ``tenant``/``adapter``/``salt`` select the request's namespace
        (``kvtier.identity``); ``start`` skips blocks the engine already holds (they need not
        be cached here)."""
        self._check_open()
        toks = TokenIds(tokens)
        ns = self.namespace(tenant, adapter, salt)
        first = self._first_block(start, toks)
        limit = len(toks) // self.layout.block_tokens
        readable = self._index.readable  # what a load can read: not a block on its way out
        n = first
        with self._lock:
            for key in islice(iter_keys(ns, toks), first, limit):
                if readable(key) is None:
                    break
                n += 1
        n += len(self._shared_extension(ns, toks, n, limit))
        bt = self.layout.block_tokens
        with self._lock:
            for cnt in self._decider.counted(ns.tenant):
                cnt.lookups += 1
                cnt.lookup_tokens += (limit - first) * bt
                cnt.lookup_hit_tokens += (n - first) * bt
        return n * bt

    def locate(
        self,
        tokens: Any,
        tenant: str | None = None,
        *,
        adapter: str | None = None,
        salt: str | bytes | None = None,
        start: int = 0,
    ) -> list[str]:
        """Name of the fastest tier holding each cached block from ``start`` on."""
        self._check_open()
        toks = TokenIds(tokens)
        ns = self.namespace(tenant, adapter, salt)
        first = self._first_block(start, toks)
        limit = len(toks) // self.layout.block_tokens
        with self._lock:
            reads = self._decider.readable_prefix(
                islice(iter_keys(ns, toks), first, None), limit - first
            )
        reads += self._shared_extension(ns, toks, first + len(reads), limit)
        return [self.tiers[r.tier].name for r in reads]

    # -- store -----------------------------------------------------------------------------
    def store(
        self,
        tokens: Any,
        kv: Any,
        tenant: str | None = None,
        *,
        adapter: str | None = None,
        salt: str | bytes | None = None,
        start: int = 0,
        reuse_class: Hashable | None = None,
    ) -> int:
        """Store every full block of ``kv`` not already cached; return the tokens written.

        ``kv`` is ``[layers, kv_factor, n, kv_heads, head_dim]`` (numpy in the layout's storage
        dtype, or a torch tensor) and covers ``tokens[start : start + n]``; ``start`` (a
        multiple of ``block_tokens``) lets an engine store only what follows a prefix it
        already stored, without gathering it again. Raises ``TokenError``/``LayoutError`` (and
        ``ConfigError`` for a bad tenant/adapter/salt, ``RequestError`` for an unhashable
        ``reuse_class``) before storing anything if the input is malformed; any exception
        leaves nothing of the call stored that the store cannot evict (see
        ``BlockIndex.end_write``). A first tier that raises stores nothing of its batch
        (logged), as one that reports failure. When the first tier is pinned full, the leading
        blocks that fit are stored.

        ``reuse_class`` is a hint for the first tier's policy (``kvtier.policy.hints``): any
        hashable that tells kinds of requests apart, e.g. ``output_class(generated_tokens,
        cached_tokens > 0)``. The registry's policies (the default included) ignore it, so it
        never changes what is kept; ``None``: unlabelled.
        """
        self._check_open()
        reuse_class = checked_reuse_class(reuse_class)
        toks = TokenIds(tokens)
        arr = host_array(kv, self.layout, "kv")
        ns = self.namespace(tenant, adapter, salt)
        self._first_block(start, toks)  # a bad start is named before the sizes are compared
        if start + arr.shape[2] > len(toks):
            raise LayoutError(
                f"kv covers {arr.shape[2]} tokens from {start} but only {len(toks)} token ids "
                "were given"
            )
        n_blocks = arr.shape[2] // self.layout.block_tokens
        keys, new, held = self._begin_store(toks, start, n_blocks, ns)
        views = self._views(arr, n_blocks)
        written = 0
        try:
            for part in self._store_slices(new):
                done = self._store_blocks(
                    [keys[i] for i in part], [views[i] for i in part], ns, reuse_class
                )
                written += done
                if done < len(part):
                    break
        finally:
            self._end_store(held)
        return written * self.layout.block_tokens

    # The phases of a store, shared with stores whose bytes another process copies (the node
    # service's clients, ``kvtier.service.arena``): keys and pins, slices, room and pending
    # writes in the first tier, their commit, the pins' release.
    def _begin_store(
        self, toks: TokenIds, start: int, n_blocks: int, ns: Namespace
    ) -> tuple[list[BlockKey], list[int], list[BlockKey]]:
        """The keys of ``n_blocks`` blocks from ``start`` (every id checked), the positions of
        those not held yet, and those held -- pinned until ``_end_store``: no parent is
        evicted to make room for its own child."""
        first = self._first_block(start, toks)
        bt = self.layout.block_tokens
        keys = list(islice(iter_keys(ns, toks), first, first + n_blocks))  # checks their ids
        toks.validate((first + n_blocks) * bt)  # and the rest, before any write
        self._poll()
        with self._lock:
            new = [i for i, k in enumerate(keys) if not self._held(k)]
            for cnt in self._decider.counted(ns.tenant):
                cnt.skipped_blocks += n_blocks - len(new)
            fresh = set(new)
            held = [k for i, k in enumerate(keys) if i not in fresh]
            self._index.pin(held)
        return keys, new, held

    def _store_slices(self, new: list[int]) -> list[list[int]]:
        """``new`` in the slices a store writes one after another. A store larger than the
        first tier goes in slices: earlier slices get demoted (or written through). With
        nowhere below, later slices would only evict the earlier ones and keep a tail without
        its parents: the head that fits is stored instead."""
        step = self.tiers[0].capacity_blocks or len(new) or 1
        below = len(self._decider.local) > 1 or bool(self._shared)
        return [new[i : i + step] for i in range(0, len(new) if below else min(len(new), 1), step)]

    def _end_store(self, held: list[BlockKey]) -> None:
        """Release ``_begin_store``'s pins."""
        with self._lock:
            self._index.unpin(held)
            # the cached part is reordered after the new blocks, so parents outlive their
            # children; not a hit: it was counted when loaded, or stored by this request
            in_first = [k for k in held if (e := self._index.entries.get(k)) and e.tiers & 1]
            self._index.refresh(in_first, 0)

    def _store_blocks(
        self,
        keys: list[BlockKey],
        views: list[Array],
        ns: Namespace,
        reuse_class: Hashable | None = None,
    ) -> int:
        """Write new blocks (prefix order) into the first tier; return how many were written."""
        picked = self._begin_first(keys)
        new_keys = [keys[i] for i in picked]
        items = [(keys[i], views[i]) for i in picked]
        owner = ns.owner
        first = self.tiers[0]
        try:
            ok = self._engine.run_parallel(
                lambda part: first.put([k for k, _ in part], [v for _, v in part], owner), items
            )
        except BaseException as exc:
            # a tier that raises broke its contract: nothing of the batch is stored, and what
            # it wrote before raising is deleted, or those slots would be taken for good
            # (pending here, so no one else writes these keys into this tier)
            first.delete(new_keys, owner)
            self._end_first(new_keys, [False] * len(new_keys), ns)
            if not isinstance(exc, Exception):
                raise  # KeyboardInterrupt & co
            log.exception("store: %s raised on put; nothing stored", first.name)
            return 0
        return self._end_first(new_keys, ok, ns, reuse_class)

    def _begin_first(self, keys: list[BlockKey]) -> list[int]:
        """Make room in the first tier for the leading ``keys`` that fit and mark those not
        held meanwhile as being written there (pending: not readable); their positions."""
        with self._lock:
            fit = self._room_in_first(len(keys))
            if fit < len(keys):
                self._decider.counters.dropped_for_room += len(keys) - fit
            picked = [i for i in range(fit) if not self._held(keys[i])]  # stored meanwhile?
            for i in picked:
                self._index.begin_write(keys[i], 0)
        return picked

    def _end_first(
        self,
        new_keys: list[BlockKey],
        ok: list[bool],
        ns: Namespace,
        reuse_class: Hashable | None = None,
    ) -> int:
        """Commit (``ok``) or roll back the pending writes of ``_begin_first``, start their
        write-through; return how many were committed."""
        idx = self._index
        owner = ns.owner
        with self._lock:
            try:
                idx.end_write(new_keys, 0, ok, reuse_class)
            except BaseException:  # rolled back in the index: the tier forgets them too
                self.tiers[0].delete([k for k, g in zip(new_keys, ok, strict=True) if g], owner)
                raise
            written = sum(ok)
            tokens = written * self.layout.block_tokens
            for cnt in self._decider.counted(ns.tenant):
                cnt.stored_tokens += tokens
            through = self._decider.plan_write_through(
                [k for k, g in zip(new_keys, ok, strict=True) if g], owner
            )
        for part in split_moves(through, self._engine.workers):  # on every worker at once
            self._submit("write-through", part)
        return written

    # -- prefetch / pin --------------------------------------------------------------------
    def lease(
        self,
        tokens: Any,
        tenant: str | None = None,
        *,
        adapter: str | None = None,
        salt: str | bytes | None = None,
        start: int = 0,
    ) -> Lease:
        """Pin the readable cached run of blocks from ``start`` in local tiers (no eviction)
        until ``Lease.release()``; ``Lease.end`` is where that run ends (tokens). What an engine
        holds between a lookup and the load that follows; blocks only in a shared tier cannot
        be held (the pool evicts on its own) and are not counted. Counts only blocks a ``load``
        can read: not one whose eviction is already under way with no copy left behind
        (``BlockIndex.readable``), which a pin could not keep."""
        self._check_open()
        toks = TokenIds(tokens)
        ns = self.namespace(tenant, adapter, salt)
        first = self._first_block(start, toks)
        limit = len(toks) // self.layout.block_tokens
        with self._lock:
            reads = self._decider.readable_prefix(
                islice(iter_keys(ns, toks), first, None), limit - first
            )
            keys = [r.key for r in reads]
            self._index.pin(keys)
        bt = self.layout.block_tokens
        return Lease(start, (first + len(keys)) * bt, lambda: self._unpin(keys))

    def _unpin(self, keys: list[BlockKey]) -> None:
        with self._lock:
            self._index.unpin(keys)

    @contextlib.contextmanager
    def pin(
        self,
        tokens: Any,
        tenant: str | None = None,
        *,
        adapter: str | None = None,
        salt: str | bytes | None = None,
    ) -> Iterator[int]:
        """Pin the cached prefix of ``tokens`` (no eviction while held); yields its length.
        ``lease`` from ``start=0`` as a context manager."""
        with self.lease(tokens, tenant, adapter=adapter, salt=salt) as held:
            yield held.end

    def flush(self, timeout: float | None = None, *, durable: bool = False) -> int:
        """Wait until pending demotions, promotions and write-throughs have completed.

        ``durable``: the store's durability point. Every block held when the call starts is
        copied from the volatile tiers (host, device) down to the first persistent local tier
        (NVMe), as ``close`` does, and that tier's index is synced; on return those blocks
        survive a crash of the process (kill -9) and a power loss, and a new store over the
        same directories finds them (README: what a crash can lose). A persistent tier too
        small for everything keeps the most recently stored blocks, evicting its coldest.
        Returns how many blocks the store holds that are still on no persistent tier (0: all
        are; always 0 without ``durable``). Blocks stored by other threads during the call
        may or may not be covered. ``ConfigError`` if ``durable`` and no local tier is
        persistent. ``timeout`` bounds each wait for the workers (seconds).
        """
        self._engine.wait_idle(timeout)
        self._poll()
        if not durable:
            return 0
        target = self._decider.persistent_tier()
        if target is None:
            raise ConfigError(
                "flush(durable=True) needs a persistent tier (e.g. nvme) among the local tiers"
            )
        with self._lock:
            moves = self._decider.plan_persist()
        self._submit("demote", moves)
        self._engine.wait_idle(timeout)
        self._poll()
        self.tiers[target].sync()
        with self._lock:
            return self._decider.volatile_only()

    def stats(self) -> dict[str, Any]:
        """Counters of the store, per tenant and per tier (see ``MeteredTier.snapshot``; a
        shared tier adds ``auth``, how its blocks are authenticated, and ``rejected_blocks``,
        values that failed verification), what each tier's eviction policy has learned
        (``EvictionPolicy.describe``), and the store's ``identity``."""
        self._poll()
        with self._lock:
            store = asdict(self._decider.counters)
            tenants = {t: asdict(c) for t, c in self._decider.tenants().items()}
            store["indexed_blocks"] = len(self._index.entries)
            store["pending_jobs"] = self._engine.pending
            policies = {
                t.name: {"policy": pol.name, **pol.describe()}
                for t, pol in zip(self.tiers, self._index.policies, strict=True)
                if pol is not None
            }
        for c in (store, *tenants.values()):
            loaded = c["hit_tokens"] + c["miss_tokens"]
            c["token_hit_ratio"] = c["hit_tokens"] / loaded if loaded else 0.0
            asked = c["lookup_tokens"]
            c["lookup_hit_ratio"] = c["lookup_hit_tokens"] / asked if asked else 0.0
        tiers = {t.name: t.snapshot() for t in self.tiers}
        for t in self.tiers:
            sealer = getattr(t.inner, "sealer", None)
            if sealer is not None:  # a shared tier: how its blocks are authenticated
                tiers[t.name]["auth"] = sealer.mode
                tiers[t.name]["rejected_blocks"] = sealer.rejected
        return {
            "store": store,
            "tenants": tenants,
            "tiers": tiers,
            "policies": policies,
            "identity": self.identity.describe(),
        }

    # -- lifecycle -------------------------------------------------------------------------
    def _persist_volatile(self) -> None:
        """Write blocks held only in volatile tiers down to the persistent tier (warm restart)."""
        with self._lock:
            moves = self._decider.plan_persist()
        self._submit("demote", moves)
        self.flush()

    def close(self) -> None:
        """Finish pending moves, write volatile blocks down to the persistent tier (if any,
        and ``persist_on_close``), stop workers, close tiers. Idempotent."""
        if self._closed:
            return
        self.flush()
        if self._persist_on_close:
            self._persist_volatile()
        self._engine.close()
        self._closed = True
        for t in self.tiers:
            t.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
