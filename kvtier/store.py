"""``TieredStore``: the public API -- lookup, store, load, prefetch, pin, stats.

Decide/move split: every decision (what is present, what to evict, where to demote, what to
promote) is made by the ``BlockIndex`` and the per-tier eviction policies under one lock, in
plain single-threaded code; bytes move outside the lock, on the calling thread plus the transfer
engine's workers (synchronous load/store) or on workers alone (demotion, write-through,
prefetch). Blocks being written are not readable (``Entry.pending``); blocks being read or moved
are pinned (``Entry.pins``) and cannot be evicted.

Hierarchy rules:

- Tiers are ordered fastest first. *Local* tiers (not ``shared``) form the demotion chain: a
  block evicted from local tier i moves to the next local tier unless a lower copy exists; it
  falls off the end of the chain.
- *Shared* tiers (Redis/Valkey, Mooncake, S3) are written through asynchronously after a store
  and asked ``contains_prefix`` for blocks this process does not know (another node's work).
- A hit below the first tier is promoted into the first tier (inclusive: the lower copy stays).
- Persistent tiers are enumerated at open (warm restart).

Integrity: tiers verify header and checksum on every read; a block that fails is a miss, dropped
and counted in ``stats()["store"]["invalid_blocks"]``. Nothing wrong is ever returned.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from itertools import islice
from pathlib import Path
from typing import Any

from kvtier.config import StoreConfig
from kvtier.errors import ConfigError, LayoutError
from kvtier.index import BlockIndex
from kvtier.keys import BlockKey, Namespace, TokenIds, iter_keys
from kvtier.kvarray import host_array
from kvtier.layout import KVLayout
from kvtier.metrics import MeteredTier, enable_prometheus
from kvtier.moves import Move, StagingPool, run_moves
from kvtier.policy import DEFAULT_POLICY
from kvtier.tiers.base import Array, Tier
from kvtier.transfer import Completion, Job, TransferEngine

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Counters:
    lookups: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0
    stored_tokens: int = 0
    skipped_blocks: int = 0
    invalid_blocks: int = 0
    evictions: int = 0
    demotions: int = 0
    promotions: int = 0
    write_through: int = 0
    failed_moves: int = 0
    dropped_for_room: int = 0


@dataclass(slots=True)
class _Read:
    key: BlockKey
    tier: int
    pinned: bool  # pinned in the index (False for blocks found only in a shared tier)


class TieredStore:
    """A KV-cache block store over an ordered list of tiers. Thread-safe; a context manager."""

    def __init__(
        self,
        layout: KVLayout,
        tiers: Sequence[Tier],
        *,
        tenant: str = "default",
        model_id: str = "",
        weights_version: str = "",
        policy: str = DEFAULT_POLICY,
        workers: int = 2,
        secret: bytes = b"",
        share_group: str | None = None,
        demote_queue: int = 16,
        metrics_port: int | None = None,
        persist_on_close: bool = True,
    ) -> None:
        if not tiers:
            raise ConfigError("TieredStore needs at least one tier (e.g. a host tier)")
        for t in tiers:
            if t.layout != layout:
                raise LayoutError(
                    f"tier {t.name} was built for {t.layout}, the store uses {layout}"
                )
        if tiers[0].shared:
            raise ConfigError("the first tier must be local (host or device), not a shared tier")
        self.layout = layout
        self.tenant = tenant
        self._model_id = model_id
        self._weights_version = weights_version
        self._secret = secret
        self._share_group = share_group
        self.tiers = [MeteredTier(t) for t in tiers]
        self._local = [i for i, t in enumerate(tiers) if not t.shared]
        self._shared = [i for i, t in enumerate(tiers) if t.shared]
        self._index = BlockIndex(policy, [0 if t.shared else t.capacity_blocks for t in tiers])
        self._engine = TransferEngine(workers, demote_queue)
        self._staging = StagingPool(layout.block_bytes, keep=2 * workers * 4)
        self._lock = threading.RLock()
        self._namespaces: dict[str, Namespace] = {}
        self._counters = _Counters()
        self._tenant_counters: dict[str, _Counters] = {}
        self._closed = False
        self._persist_on_close = persist_on_close
        if metrics_port is not None:
            enable_prometheus(metrics_port)
        for i in self._local:
            if self.tiers[i].persistent:
                self._index.add_present(list(self.tiers[i].keys()), i)

    @classmethod
    def from_config(
        cls,
        config: StoreConfig | Mapping[str, Any] | str | Path,
        env: Mapping[str, str] | None = None,
    ) -> TieredStore:
        """Build a store and its tiers from a ``StoreConfig``, a config dict or a TOML path."""
        from kvtier.tiers.registry import make_tier

        if isinstance(config, str | Path):
            cfg = StoreConfig.from_file(config, env)
        elif isinstance(config, StoreConfig):
            cfg = config
        else:
            cfg = StoreConfig.from_dict(config, env)
        tiers: list[Tier] = []
        try:
            for spec in cfg.tiers:
                tiers.append(make_tier(cfg.layout, spec))
            return cls(
                cfg.layout,
                tiers,
                tenant=cfg.tenant,
                model_id=cfg.model_id,
                weights_version=cfg.weights_version,
                policy=cfg.policy,
                workers=cfg.workers,
                secret=cfg.secret,
                share_group=cfg.share_group,
                demote_queue=cfg.demote_queue,
                metrics_port=cfg.metrics_port or None,
            )
        except BaseException:
            for t in tiers:
                t.close()
            raise

    # -- helpers ---------------------------------------------------------------------------
    def namespace(self, tenant: str | None = None) -> Namespace:
        """The key namespace of ``tenant`` (the store's default tenant when None)."""
        name = tenant or self.tenant
        ns = self._namespaces.get(name)
        if ns is None:
            ns = Namespace(
                name,
                self._model_id,
                self.layout,
                self._weights_version,
                self._share_group,
                self._secret,
            )
            self._namespaces[name] = ns
        return ns

    def _tc(self, ns: Namespace) -> _Counters:
        c = self._tenant_counters.get(ns.tenant)
        if c is None:
            c = self._tenant_counters[ns.tenant] = _Counters()
        return c

    def _views(self, arr: Array, n_blocks: int, first: int = 0) -> list[Array]:
        bt = self.layout.block_tokens
        return [arr[:, :, i * bt : (i + 1) * bt] for i in range(first, first + n_blocks)]

    def _apply(self, done: Sequence[Completion]) -> None:
        """Commit the outcome of finished async jobs (under the lock)."""
        idx = self._index
        for c in done:
            moves: list[Move] = c.job.context
            for mv in moves:
                ok = mv.ok if c.error is None and mv.ok else [False] * len(mv.keys)
                if mv.dst is not None:
                    idx.end_write(mv.keys, mv.dst, ok)
                    n_ok = sum(ok)
                    self._counters.failed_moves += len(ok) - n_ok
                    if c.job.kind == "demote":
                        self._counters.demotions += n_ok
                    elif c.job.kind == "write-through":
                        self._counters.write_through += n_ok
                    else:
                        self._counters.promotions += n_ok
                if mv.delete_src:
                    for k in mv.keys:
                        idx.drop(k, mv.src)
                idx.unpin(mv.keys)

    def _poll(self) -> None:
        done = self._engine.poll()
        if done:
            with self._lock:
                self._apply(done)

    def _next_local(self, tier: int) -> int | None:
        later = [i for i in self._local if i > tier and self.tiers[i].healthy]
        return later[0] if later else None

    def _plan_eviction(self, tier: int, victims: list[BlockKey], moves: list[Move]) -> None:
        """Plan what happens to ``victims`` leaving ``tier`` (under the lock), deepest first."""
        idx = self._index
        self._counters.evictions += len(victims)
        lower = self._next_local(tier)
        below = ~((2 << tier) - 1)  # bits of every tier after this one
        move_keys = [k for k in victims if lower is not None and not idx.entries[k].tiers & below]
        drop_keys = [k for k in victims if k not in set(move_keys)]
        if move_keys and lower is not None:
            room = idx.plan_room(lower, len(move_keys))
            if room is None:  # lower tier pinned solid: the victims fall off
                drop_keys += move_keys
                move_keys = []
            elif room:
                self._plan_eviction(lower, room, moves)
        if move_keys and lower is not None:
            for k in move_keys:
                idx.begin_write(k, lower)
            moves.append(Move(tier, lower, move_keys, [""] * len(move_keys), delete_src=True))
        if drop_keys:
            moves.append(Move(tier, None, drop_keys, [""] * len(drop_keys), delete_src=True))
        idx.pin(victims)

    def _submit(self, kind: str, moves: list[Move]) -> None:
        if moves:
            tiers = self.tiers
            staging = self._staging
            self._engine.submit(Job(kind, lambda: run_moves(tiers, moves, staging), moves))

    def _room_in_first(self, n: int) -> int:
        """Make room for up to ``n`` blocks in tier 0; return how many fit now (under lock)."""
        idx = self._index
        while True:
            if idx.free(0) >= n:
                return n
            victims = idx.plan_room(0, n)
            if victims is None:
                victims = idx.plan_room(0, n - 1) if n > 1 else None
                if victims is None:
                    return max(0, min(n, idx.free(0)))
                n -= 1
            moves: list[Move] = []
            if victims:
                self._plan_eviction(0, victims, moves)
            # the room appears when the demotion job completes: wait for it (backpressure)
            self._lock.release()
            try:
                self._submit("demote", moves)
                self._engine.wait_any(timeout=1.0)
                done = self._engine.poll()
            finally:
                self._lock.acquire()
            self._apply(done)

    # -- queries ---------------------------------------------------------------------------
    def _readable_prefix(self, keys: Iterator[BlockKey], limit: int) -> list[_Read]:
        """Leading blocks readable from a local-index tier (under lock)."""
        reads = []
        for key in islice(keys, limit):
            e = self._index.readable(key)
            if e is None:
                break
            reads.append(_Read(key, e.best_tier(), True))
        return reads

    def _shared_extension(
        self, ns: Namespace, toks: TokenIds, have: int, limit: int
    ) -> list[_Read]:
        """Blocks after the first ``have`` found in shared tiers (one round trip per tier)."""
        if not self._shared or have >= limit:
            return []
        rest = list(islice(iter_keys(ns, toks), have, limit))
        for i in self._shared:
            n = self.tiers[i].contains_prefix(rest, ns.owner)
            if n:
                return [_Read(k, i, False) for k in rest[:n]]
        return []

    def lookup(self, tokens: Any, tenant: str | None = None) -> int:
        """How many leading tokens are cached (a multiple of ``block_tokens``). No side effects
        on the cache (only counters)."""
        toks = TokenIds(tokens)
        ns = self.namespace(tenant)
        limit = len(toks) // self.layout.block_tokens
        entries = self._index.entries
        n = 0
        with self._lock:
            for key in islice(iter_keys(ns, toks), limit):
                e = entries.get(key)
                if e is None or not e.tiers:
                    break
                n += 1
            self._counters.lookups += 1
        n += len(self._shared_extension(ns, toks, n, limit))
        return n * self.layout.block_tokens

    def locate(self, tokens: Any, tenant: str | None = None) -> list[str]:
        """Name of the fastest tier holding each leading cached block."""
        toks = TokenIds(tokens)
        ns = self.namespace(tenant)
        limit = len(toks) // self.layout.block_tokens
        with self._lock:
            reads = self._readable_prefix(iter_keys(ns, toks), limit)
        reads += self._shared_extension(ns, toks, len(reads), limit)
        return [self.tiers[r.tier].name for r in reads]

    # -- store -----------------------------------------------------------------------------
    def store(self, tokens: Any, kv: Any, tenant: str | None = None) -> int:
        """Store every full block of ``kv`` not already cached; return the tokens written.

        ``kv`` is ``[layers, kv_factor, n, kv_heads, head_dim]`` (numpy in the layout's storage
        dtype, or a torch tensor), ``n <= len(tokens)``; blocks cover ``tokens[:n]``. Raises
        ``TokenError``/``LayoutError`` before storing anything if the input is malformed. When
        the first tier is pinned full, the leading blocks that fit are stored.
        """
        self._check_open()
        toks = TokenIds(tokens)
        arr = host_array(kv, self.layout, "kv")
        if arr.shape[2] > len(toks):
            raise LayoutError(
                f"kv covers {arr.shape[2]} tokens but only {len(toks)} token ids were given"
            )
        ns = self.namespace(tenant)
        n_blocks = arr.shape[2] // self.layout.block_tokens
        keys = list(islice(iter_keys(ns, toks), n_blocks))
        views = self._views(arr, n_blocks)
        self._poll()
        with self._lock:
            new = [i for i, k in enumerate(keys) if k not in self._index.entries]
            self._counters.skipped_blocks += n_blocks - len(new)
        # a store larger than the first tier goes in slices: earlier slices get demoted
        step = self.tiers[0].capacity_blocks or len(new) or 1
        written = 0
        for start in range(0, len(new), step):
            part = new[start : start + step]
            done = self._store_blocks([keys[i] for i in part], [views[i] for i in part], ns)
            written += done
            if done < len(part):
                break
        with self._lock:  # the whole chain, in prefix order, so parents outlive children
            in_first = [k for k in keys if (e := self._index.entries.get(k)) and e.tiers & 1]
            self._index.touch(in_first, 0)
        return written * self.layout.block_tokens

    def _store_blocks(self, keys: list[BlockKey], views: list[Array], ns: Namespace) -> int:
        """Write new blocks (prefix order) into the first tier; return how many were written."""
        idx = self._index
        with self._lock:
            fit = self._room_in_first(len(keys))
            if fit < len(keys):
                self._counters.dropped_for_room += len(keys) - fit
            items = [
                (k, v) for k, v in zip(keys[:fit], views[:fit], strict=True) if k not in idx.entries
            ]  # another thread may have stored it meanwhile
            new_keys = [k for k, _ in items]
            for k in new_keys:
                idx.begin_write(k, 0)
        owner = ns.owner
        first = self.tiers[0]
        try:
            ok = self._engine.run_parallel(
                lambda part: first.put([k for k, _ in part], [v for _, v in part], owner), items
            )
        except BaseException:
            with self._lock:
                idx.end_write(new_keys, 0, [False] * len(new_keys))
            raise
        with self._lock:
            idx.end_write(new_keys, 0, ok)
            written = sum(ok)
            tokens = written * self.layout.block_tokens
            self._counters.stored_tokens += tokens
            self._tc(ns).stored_tokens += tokens
            through = self._plan_write_through(
                [k for k, g in zip(new_keys, ok, strict=True) if g], owner
            )
        self._submit("write-through", through)
        return written if fit == len(keys) else min(written, fit)

    def _plan_write_through(self, keys: list[BlockKey], owner: str) -> list[Move]:
        if not keys or not self._shared:
            return []
        moves = []
        for i in self._shared:
            if self.tiers[i].healthy:
                for k in keys:
                    self._index.begin_write(k, i)
                self._index.pin(keys)
                moves.append(Move(0, i, list(keys), [owner] * len(keys), delete_src=False))
        return moves

    # -- load ------------------------------------------------------------------------------
    def load(self, tokens: Any, out: Any, tenant: str | None = None) -> int:
        """Fill ``out[:, :, :n]`` with the cached prefix of ``tokens``; return ``n`` (tokens).

        ``out`` is a writable host array ``[layers, kv_factor, m, kv_heads, head_dim]`` in the
        layout's storage dtype (or a CPU torch tensor) with room for every full block of
        ``tokens`` (``LayoutError`` otherwise). Tokens beyond ``n`` in ``out`` are unspecified.
        Only verified blocks count.
        """
        self._check_open()
        toks = TokenIds(tokens)
        arr = host_array(out, self.layout, "out", writable=True)
        ns = self.namespace(tenant)
        bt = self.layout.block_tokens
        if arr.shape[2] < len(toks) // bt * bt:
            raise LayoutError(
                f"out holds {arr.shape[2]} tokens but the {len(toks)} tokens given cover "
                f"{len(toks) // bt * bt} tokens of full blocks; pass a larger out or "
                f"tokens[:{arr.shape[2]}]"
            )
        limit = len(toks) // bt
        done = 0
        for _ in range(3):  # a block moved by a finishing demotion is re-read from its new tier
            got, retry = self._load_pass(ns, toks, arr, done, limit)
            done += got
            if not retry or done >= limit:
                break
            self._engine.wait_idle(timeout=5.0)  # rare: let the move that raced us finish
        return done * self.layout.block_tokens

    def _load_pass(
        self, ns: Namespace, toks: TokenIds, arr: Array, first: int, limit: int
    ) -> tuple[int, bool]:
        """Load blocks ``first..`` into ``arr``; return (blocks loaded, worth retrying)."""
        self._poll()
        with self._lock:
            reads = self._readable_prefix(islice(iter_keys(ns, toks), first, None), limit - first)
            self._index.pin([r.key for r in reads])
        reads += self._shared_extension(ns, toks, first + len(reads), limit)
        views = self._views(arr, len(reads), first)
        ok = self._read_blocks(reads, views, ns.owner)
        n = ok.index(False) if False in ok else len(ok)
        promote, retry = self._finish_load(reads, ok, n, ns)
        if promote:
            self._promote([reads[i] for i in promote], [views[i] for i in promote], ns.owner)
        return n, retry

    def _read_blocks(self, reads: list[_Read], views: list[Array], owner: str) -> list[bool]:
        ok: list[bool] = []
        start = 0
        while start < len(reads):  # one parallel batch per run of blocks from the same tier
            tier = reads[start].tier
            end = start
            while end < len(reads) and reads[end].tier == tier:
                end += 1
            src = self.tiers[tier]
            items = list(zip(reads[start:end], views[start:end], strict=True))
            ok += self._engine.run_parallel(
                lambda part, src=src: src.get_into(  # type: ignore[misc]
                    [r.key for r, _ in part], [v for _, v in part], owner
                ),
                items,
            )
            if not all(ok):
                ok += [False] * (len(reads) - len(ok))
                break
            start = end
        return ok

    def _finish_load(
        self, reads: list[_Read], ok: list[bool], n: int, ns: Namespace
    ) -> tuple[list[int], bool]:
        """Unpin, drop invalid blocks, refresh policies; return (positions to promote, retry)."""
        idx = self._index
        bt = self.layout.block_tokens
        retry = False
        with self._lock:
            idx.unpin([r.key for r in reads if r.pinned])
            if n < len(reads) and reads[n].pinned:
                failed = reads[n]
                e = idx.entries.get(failed.key)
                if e is not None and e.pending & ~e.tiers:
                    retry = True  # being moved right now: the index catches up on poll
                elif e is not None and e.tiers & ~(1 << failed.tier):
                    idx.drop(failed.key, failed.tier)
                    retry = True  # another tier still holds a copy
                else:  # the index said present: lost or corrupt
                    idx.drop(failed.key, failed.tier)
                    self._counters.invalid_blocks += 1
            by_tier: dict[int, list[BlockKey]] = {}
            for r in reads[:n]:
                by_tier.setdefault(r.tier, []).append(r.key)
            for tier, keys in by_tier.items():
                if tier in self._shared:
                    idx.add_present(keys, tier)
                idx.touch(keys, tier)
            for cnt in (self._counters, self._tc(ns)):
                cnt.hit_tokens += n * bt
                cnt.miss_tokens += max(0, len(reads) - n) * bt
        return [i for i, r in enumerate(reads[:n]) if r.tier != 0], retry

    def _promote(self, reads: list[_Read], views: list[Array], owner: str) -> None:
        """Copy blocks just loaded from a lower tier into the first tier.

        If the first tier has room now, the copy is made from ``views`` (already in host
        memory) before returning; otherwise the promotion is a background job that first makes
        room (demoting victims) and then re-reads the blocks -- the load path never waits on a
        demotion.
        """
        idx = self._index
        moves: list[Move] = []
        with self._lock:
            todo = [
                (r.key, v)
                for r, v in zip(reads, views, strict=True)
                if (e := idx.entries.get(r.key)) is not None and not (e.tiers | e.pending) & 1
            ]
            if idx.free(0) < len(todo):
                wanted = {k for k, _ in todo}
                moves = self._plan_fetch([r for r in reads if r.key in wanted], owner)
                todo = []
            for k, _ in todo:
                idx.begin_write(k, 0)
        self._submit("promote", moves)
        if not todo:
            return
        first = self.tiers[0]
        ok = self._engine.run_parallel(
            lambda part: first.put([k for k, _ in part], [v for _, v in part], owner), todo
        )
        with self._lock:
            idx.end_write([k for k, _ in todo], 0, ok)
            self._counters.promotions += sum(ok)

    def _plan_fetch(self, reads: list[_Read], owner: str) -> list[Move]:
        """Moves that bring ``reads`` up into the first tier, evictions first (under lock)."""
        idx = self._index
        moves: list[Move] = []
        victims = idx.plan_room(0, len(reads))
        if victims is None:  # only what fits without evicting pinned blocks
            reads = reads[: max(0, idx.free(0))]
        elif victims:
            self._plan_eviction(0, victims, moves)
        by_src: dict[int, list[BlockKey]] = {}
        for r in reads:
            idx.begin_write(r.key, 0)
            idx.pin([r.key])
            by_src.setdefault(r.tier, []).append(r.key)
        for src, keys in by_src.items():
            moves.append(Move(src, 0, keys, [owner] * len(keys), delete_src=False))
        return moves

    def prefetch(self, tokens: Any, tenant: str | None = None) -> int:
        """Start bringing the cached prefix of ``tokens`` up into the first tier; return how
        many tokens' blocks were scheduled. Asynchronous: ``flush()`` waits for it."""
        toks = TokenIds(tokens)
        ns = self.namespace(tenant)
        limit = len(toks) // self.layout.block_tokens
        self._poll()
        with self._lock:
            reads = self._readable_prefix(iter_keys(ns, toks), limit)
        shared = self._shared_extension(ns, toks, len(reads), limit)
        with self._lock:
            for r in shared:
                self._index.add_present([r.key], r.tier)
            todo = [
                r
                for r in reads + shared
                if (e := self._index.entries.get(r.key)) is not None
                and not (e.tiers | e.pending) & 1
            ]
            moves = self._plan_fetch(todo, ns.owner)
        self._submit("promote", moves)
        return sum(len(m.keys) for m in moves if m.dst == 0) * self.layout.block_tokens

    # -- prefetch / pin --------------------------------------------------------------------
    @contextlib.contextmanager
    def pin(self, tokens: Any, tenant: str | None = None) -> Iterator[int]:
        """Pin the cached prefix of ``tokens`` (no eviction while held); yields its length."""
        toks = TokenIds(tokens)
        ns = self.namespace(tenant)
        with self._lock:
            reads = self._readable_prefix(iter_keys(ns, toks), len(toks))
            keys = [r.key for r in reads]
            self._index.pin(keys)
        try:
            yield len(keys) * self.layout.block_tokens
        finally:
            with self._lock:
                self._index.unpin(keys)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until pending demotions, promotions and write-throughs have completed."""
        self._engine.wait_idle(timeout)
        self._poll()

    def stats(self) -> dict[str, Any]:
        """Counters of the store, per tenant and per tier (see ``MeteredTier.snapshot``)."""
        self._poll()
        with self._lock:
            store = asdict(self._counters)
            tenants = {t: asdict(c) for t, c in self._tenant_counters.items()}
            store["indexed_blocks"] = len(self._index.entries)
            store["pending_jobs"] = self._engine.pending
        looked = store["hit_tokens"] + store["miss_tokens"]
        store["token_hit_ratio"] = store["hit_tokens"] / looked if looked else 0.0
        return {
            "store": store,
            "tenants": tenants,
            "tiers": {t.name: t.snapshot() for t in self.tiers},
        }

    # -- lifecycle -------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("TieredStore is closed")

    def _persist_volatile(self) -> None:
        """Copy blocks held only in volatile local tiers down to the first persistent local
        tier (most recently used first, evicting its coldest blocks if needed), so a warm
        restart finds what this process had cached."""
        target = next((i for i in self._local if self.tiers[i].persistent), None)
        if target is None or not self.tiers[target].healthy:
            return
        idx = self._index
        keep = 1 << target
        with self._lock:
            by_src: dict[int, list[BlockKey]] = {}
            for key, e in idx.entries.items():
                src = e.best_tier()
                if src >= 0 and src < target and not (e.tiers | e.pending) & keep and not e.pins:
                    by_src.setdefault(src, []).append(key)
            moves: list[Move] = []
            for src, keys in by_src.items():
                keys = keys[-max(0, self.tiers[target].capacity_blocks) :]
                room = idx.plan_room(target, len(keys))
                if room is None:
                    continue
                if room:
                    self._plan_eviction(target, room, moves)
                for k in keys:
                    idx.begin_write(k, target)
                idx.pin(keys)
                moves.append(Move(src, target, keys, [""] * len(keys), delete_src=False))
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
