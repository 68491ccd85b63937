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
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict
from itertools import islice
from pathlib import Path
from typing import Any

from kvtier.config import StoreConfig
from kvtier.decider import Decider, Read
from kvtier.errors import ConfigError, LayoutError
from kvtier.keys import BlockKey, Namespace, TokenIds, iter_keys
from kvtier.kvarray import host_array
from kvtier.layerload import LayerLoad, start_layer_load
from kvtier.layout import KVLayout
from kvtier.metrics import MeteredTier, enable_prometheus
from kvtier.moves import Move, StagingPool, run_moves
from kvtier.policy import DEFAULT_POLICY
from kvtier.tiers.base import Array, Tier
from kvtier.transfer import Job, TransferEngine

log = logging.getLogger(__name__)


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
        self._decider = Decider(self.tiers, policy, layout.block_tokens)
        self._index = self._decider.index
        self._shared = self._decider.shared
        self._local_mask = sum(1 << i for i in self._decider.local)
        self._engine = TransferEngine(workers, demote_queue)
        self._staging = StagingPool(layout.block_bytes, keep=2 * workers * 4)
        self._lock = threading.RLock()
        self._namespaces: dict[str, Namespace] = {}
        self._closed = False
        self._persist_on_close = persist_on_close
        if metrics_port is not None:
            enable_prometheus(metrics_port)
        for i in self._decider.local:
            if self.tiers[i].persistent:
                self._index.add_present(list(self.tiers[i].keys()), i)

    @classmethod
    def from_config(
        cls,
        config: StoreConfig | Mapping[str, Any] | str | Path,
        env: Mapping[str, str] | None = None,
    ) -> TieredStore:
        """Build a store and its tiers from a ``StoreConfig``, a config dict or a TOML path."""
        from kvtier.tiers.registry import make_tiers

        cfg = StoreConfig.load(config, env)
        tiers = make_tiers(cfg.layout, cfg.tiers)
        try:
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

    def _views(self, arr: Array, n_blocks: int, first: int = 0) -> list[Array]:
        bt = self.layout.block_tokens
        return [arr[:, :, i * bt : (i + 1) * bt] for i in range(first, first + n_blocks)]

    def _held(self, key: BlockKey) -> bool:
        """True if a local tier holds ``key`` or is writing it (under the lock). A copy only in
        a shared tier does not count: the pool may evict it at any time."""
        e = self._index.entries.get(key)
        return e is not None and bool((e.tiers | e.pending) & self._local_mask)

    def _poll(self) -> None:
        done = self._engine.poll()
        if done:
            with self._lock:
                self._decider.apply(done)

    def _submit(self, kind: str, moves: list[Move]) -> None:
        if moves:
            tiers = self.tiers
            staging = self._staging
            self._engine.submit(Job(kind, lambda: run_moves(tiers, moves, staging), moves))

    def _room_in_first(self, n: int) -> int:
        """Make room for up to ``n`` blocks in tier 0; return how many fit now (under lock).

        Victims already on their way out count as room coming, so a slow demotion is waited
        for, not answered with more evictions. Pinned blocks limit how many can fit."""
        idx, dec = self._index, self._decider
        while True:
            moves: list[Move] = []
            coming = dec.evicting[0]
            if idx.free(0) + coming < n:
                fit, victims = idx.plan_room_up_to(0, n - coming)
                n = fit + coming
                if victims:
                    dec.plan_eviction(0, victims, moves)
            if idx.free(0) >= n:
                self._lock.release()  # drops need no wait, but must still be carried out
                try:
                    self._submit("demote", moves)
                finally:
                    self._lock.acquire()
                return n
            if not moves and not dec.evicting[0]:
                return max(0, min(n, idx.free(0)))
            self._lock.release()  # the room appears when the demotion completes (backpressure)
            try:
                self._submit("demote", moves)
                self._engine.wait_any(timeout=1.0)
                done = self._engine.poll()
            finally:
                self._lock.acquire()
            dec.apply(done)

    # -- queries ---------------------------------------------------------------------------
    def _shared_extension(self, ns: Namespace, toks: TokenIds, have: int, limit: int) -> list[Read]:
        """Blocks after the first ``have`` found in shared tiers (one round trip per tier)."""
        if not self._shared or have >= limit:
            return []
        rest = list(islice(iter_keys(ns, toks), have, limit))
        for i in self._shared:
            n = self.tiers[i].contains_prefix(rest, ns.owner)
            if n:
                return [Read(k, i, False) for k in rest[:n]]
        return []

    def lookup(self, tokens: Any, tenant: str | None = None) -> int:
        """How many leading tokens are cached (a multiple of ``block_tokens``). No side effects
        on the cache (only counters)."""
        self._check_open()
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
            self._decider.counters.lookups += 1
        n += len(self._shared_extension(ns, toks, n, limit))
        return n * self.layout.block_tokens

    def locate(self, tokens: Any, tenant: str | None = None) -> list[str]:
        """Name of the fastest tier holding each leading cached block."""
        self._check_open()
        toks = TokenIds(tokens)
        ns = self.namespace(tenant)
        limit = len(toks) // self.layout.block_tokens
        with self._lock:
            reads = self._decider.readable_prefix(iter_keys(ns, toks), limit)
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
            new = [i for i, k in enumerate(keys) if not self._held(k)]
            self._decider.counters.skipped_blocks += n_blocks - len(new)
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
                self._decider.counters.dropped_for_room += len(keys) - fit
            items = [  # another thread may have stored some meanwhile
                (k, v) for k, v in zip(keys[:fit], views[:fit], strict=True) if not self._held(k)
            ]
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
            self._decider.counters.stored_tokens += tokens
            self._decider.tenant_counters(ns.tenant).stored_tokens += tokens
            through = self._decider.plan_write_through(
                [k for k, g in zip(new_keys, ok, strict=True) if g], owner
            )
        self._submit("write-through", through)
        return written

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
            reads = self._decider.readable_prefix(
                islice(iter_keys(ns, toks), first, None), limit - first
            )
            self._index.pin([r.key for r in reads])
        reads += self._shared_extension(ns, toks, first + len(reads), limit)
        views = self._views(arr, len(reads), first)
        try:
            ok = self._read_blocks(reads, views, ns.owner)
        except Exception:  # a tier broke its contract: a miss for the engine, not a crash
            log.exception("load: a tier raised; serving the blocks as misses")
            ok = [False] * len(reads)
        except BaseException:  # KeyboardInterrupt & co: release the pins, then propagate
            with self._lock:
                self._index.unpin([r.key for r in reads if r.pinned])
            raise
        n = ok.index(False) if False in ok else len(ok)
        with self._lock:
            promote, retry = self._decider.finish_load(reads, ok, n, ns.tenant)
        if n < len(reads) and not retry:  # keep the tier in step with the index's drop
            failed = reads[n]
            self.tiers[failed.tier].delete([failed.key], ns.owner)
        if promote:
            self._promote([reads[i] for i in promote], [views[i] for i in promote], ns.owner)
        return n, retry

    def _read_blocks(self, reads: list[Read], views: list[Array], owner: str) -> list[bool]:
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

    def _promote(self, reads: list[Read], views: list[Array], owner: str) -> None:
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
                moves = self._decider.plan_fetch([r for r in reads if r.key in wanted], owner)
                todo = []
            for k, _ in todo:
                idx.begin_write(k, 0)
        self._submit("promote", moves)
        if not todo:
            return
        first = self.tiers[0]
        ok = [False] * len(todo)
        try:
            ok = self._engine.run_parallel(
                lambda part: first.put([k for k, _ in part], [v for _, v in part], owner), todo
            )
        except Exception:
            log.exception("promotion into %s failed", first.name)
        finally:
            with self._lock:
                idx.end_write([k for k, _ in todo], 0, ok)
                self._decider.counters.promotions += sum(ok)

    # -- layer-wise load (the logic lives in kvtier/layerload.py) ------------------------------
    def load_layers(self, tokens: Any, out: Any, tenant: str | None = None) -> LayerLoad:
        """Start loading the cached prefix of ``tokens`` into ``out`` one layer at a time.

        Same arguments as ``load``. Returns a ``LayerLoad`` at once: ``wait(i)`` blocks until
        layer ``i`` of the ``tokens`` streamed tokens is in ``out`` (UNVERIFIED bytes);
        ``verify()`` waits for the end, checks every block's checksum, unpins and returns the
        leading tokens verified -- the caller must call it and discard anything computed from
        later tokens. Falls back to a whole-block ``load`` (already verified) when a block's
        tier cannot read single layers.
        """
        return start_layer_load(self, tokens, out, tenant)

    def prefetch(self, tokens: Any, tenant: str | None = None) -> int:
        """Start bringing the cached prefix of ``tokens`` up into the first tier; return how
        many tokens' blocks were scheduled. Asynchronous: ``flush()`` waits for it."""
        self._check_open()
        toks = TokenIds(tokens)
        ns = self.namespace(tenant)
        limit = len(toks) // self.layout.block_tokens
        self._poll()
        with self._lock:
            reads = self._decider.readable_prefix(iter_keys(ns, toks), limit)
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
            moves = self._decider.plan_fetch(todo, ns.owner)
        self._submit("promote", moves)
        return sum(len(m.keys) for m in moves if m.dst == 0) * self.layout.block_tokens

    # -- prefetch / pin --------------------------------------------------------------------
    @contextlib.contextmanager
    def pin(self, tokens: Any, tenant: str | None = None) -> Iterator[int]:
        """Pin the cached prefix of ``tokens`` (no eviction while held); yields its length."""
        self._check_open()
        toks = TokenIds(tokens)
        ns = self.namespace(tenant)
        with self._lock:
            reads = self._decider.readable_prefix(iter_keys(ns, toks), len(toks))
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
            store = asdict(self._decider.counters)
            tenants = {t: asdict(c) for t, c in self._decider.tenants().items()}
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
