"""``StoreCore``: the state every ``TieredStore`` path shares, and the small helpers they use.

The tiers (each wrapped in ``MeteredTier``), the ``Decider`` (index + policies), the transfer
engine, the staging pool, the one lock, the namespaces; plus polling completions, submitting
moves, making room in the first tier and asking shared tiers about unknown blocks. The public
API is split by concern: ``kvtier.readpath.ReadPath`` (load, prefetch, layer-wise load) and
``kvtier.store.TieredStore`` (lookup, store, pin, stats, lifecycle).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from itertools import islice

from kvtier.config import DEFAULT_DEMOTE_QUEUE, DEFAULT_WORKERS
from kvtier.decider import Decider, Read
from kvtier.errors import ConfigError, LayoutError
from kvtier.identity import Identity, Scope, check_share_groups, check_tenant
from kvtier.index import PolicySource
from kvtier.keys import BlockKey, Namespace, TokenIds, iter_keys
from kvtier.layout import KVLayout
from kvtier.metrics import MeteredTier, enable_prometheus
from kvtier.moves import Move, StagingPool, run_moves
from kvtier.policy import DEFAULT_POLICY
from kvtier.tiers.base import Array, Tier
from kvtier.transfer import Completion, Job, TransferEngine

log = logging.getLogger(__name__)
_NAMESPACE_CACHE = 4096  # namespaces kept: a bound, so per-request salts cannot grow it


def _check_count(what: str, value: object, most: int | None = None) -> None:
    """Raise ``ConfigError`` unless ``value`` is a whole number from 1 to ``most`` (the bounds
    ``StoreConfig`` enforces on the same keys)."""
    span = f"1..{most}" if most is not None else ">= 1"
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < 1
        or (most is not None and value > most)
    ):
        raise ConfigError(f"TieredStore {what} must be a whole number {span}, got {value!r}")


class StoreCore:
    """Shared state and helpers of ``TieredStore``. Not used on its own."""

    def __init__(
        self,
        layout: KVLayout,
        tiers: Sequence[Tier],
        *,
        identity: Identity | None = None,
        model_id: str = "",
        revision: str = "",
        tenant: str = "default",
        policy: PolicySource = DEFAULT_POLICY,
        workers: int = DEFAULT_WORKERS,
        secret: bytes = b"",
        share_groups: Mapping[str, str] | None = None,
        demote_queue: int = DEFAULT_DEMOTE_QUEUE,
        metrics_port: int | None = None,
        persist_on_close: bool = True,
    ) -> None:
        """``identity`` says whose KV the blocks are (``kvtier.identity``); ``model_id`` and
        ``revision`` are the short form for a single-rank engine
        (``Identity(model_id, revision)``). One of them is required.
        ``tenant`` is the default tenant of calls that name none; ``share_groups`` maps tenants
        to groups whose members share blocks (``{"alice": "team", "bob": "team"}``); every
        other tenant is private. ``secret`` keys the namespace roots (no key can be computed
        outside the deployment) and is the default MAC key of shared tiers built from config.
        """
        if identity is None:
            if not model_id:
                raise ConfigError(
                    "TieredStore needs the identity of the weights its KV comes from: pass "
                    "model_id='<name of the checkpoint>' (and revision=) or "
                    "identity=kvtier.identity.Identity(...); [store] model_id in a config file"
                )
            identity = Identity(model_id, revision=revision)
        elif model_id or revision:
            raise ConfigError("give either identity= or model_id=/revision=, not both")
        if not isinstance(identity, Identity):
            raise ConfigError(f"identity: expected a kvtier Identity, got {identity!r}")
        if not tiers:
            raise ConfigError("TieredStore needs at least one tier (e.g. a host tier)")
        for t in tiers:
            if t.layout != layout:
                raise LayoutError(
                    f"tier {t.name} was built for {t.layout}, the store uses {layout}"
                )
        if tiers[0].shared:
            raise ConfigError("the first tier must be local (host or device), not a shared tier")
        if len({id(t) for t in tiers}) < len(tiers):
            twice = next(t for i, t in enumerate(tiers) if any(t is u for u in tiers[:i]))
            raise ConfigError(
                f"tier {twice.name} is passed twice in tiers; give each tier object once "
                f"(build a second tier for a second level)"
            )
        _check_count("workers", workers, 1024)
        _check_count("demote_queue", demote_queue)
        if not isinstance(secret, bytes):
            raise ConfigError(f"secret: expected bytes, got {type(secret).__name__}")
        self.layout = layout
        self.tenant = check_tenant(tenant)
        self.identity = identity
        self._secret = secret
        self._share_groups = check_share_groups(share_groups or {})
        self.tiers = [MeteredTier(t) for t in tiers]
        self._decider = Decider(self.tiers, policy, layout.block_tokens)
        self._index = self._decider.index
        self._shared = self._decider.shared
        self._local_mask = sum(1 << i for i in self._decider.local)
        self._engine = TransferEngine(workers, demote_queue)
        self._staging = StagingPool(layout.block_bytes, keep=2 * workers * 4)
        self._lock = threading.RLock()
        self._namespaces: dict[tuple[str, str | None, str | bytes | None], Namespace] = {}
        self._closed = False
        self._persist_on_close = persist_on_close
        if metrics_port is not None:
            enable_prometheus(metrics_port)
        for i in self._decider.local:
            if self.tiers[i].persistent:
                self._index.add_present(list(self.tiers[i].keys()), i)

    # -- helpers ---------------------------------------------------------------------------
    def namespace(
        self,
        tenant: str | None = None,
        adapter: str | None = None,
        salt: str | bytes | None = None,
    ) -> Namespace:
        """The key namespace of a request: ``tenant`` (the store's default when ``None``; an
        empty or non-string tenant raises ``ConfigError``), LoRA ``adapter``, cache ``salt``.
        Namespaces are cached (bounded: per-request salts are many)."""
        name = self.tenant if tenant is None else tenant
        memo = (name, adapter, salt)
        hashable = (
            isinstance(name, str)
            and isinstance(adapter, str | None)
            and isinstance(salt, str | bytes | None)
        )
        ns = self._namespaces.get(memo) if hashable else None
        if ns is None:
            ns = Namespace(
                self.identity,
                self.layout,
                Scope(name, adapter, salt),
                self._share_groups.get(name),
                self._secret,
            )
            if len(self._namespaces) >= _NAMESPACE_CACHE:
                self._namespaces.clear()
            self._namespaces[memo] = ns
        return ns

    def _first_block(self, start: object, toks: TokenIds) -> int:
        """The block index of a call's ``start`` offset (tokens the engine already holds).
        ``LayoutError`` unless it is a whole number, a multiple of ``block_tokens``, within
        the tokens given."""
        bt = self.layout.block_tokens
        if isinstance(start, bool) or not isinstance(start, int) or start < 0 or start % bt:
            raise LayoutError(
                f"start must be a non-negative multiple of block_tokens ({bt}), got {start!r}"
            )
        if start > len(toks):
            raise LayoutError(f"start {start} is past the {len(toks)} tokens given")
        return start // bt

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
        for, not answered with more evictions. Victims to drop (nothing to copy) are dropped
        here, under the lock, not on the transfer engine: a thread hand-off per store for a
        table update.
        Pinned blocks limit how many can fit."""
        idx, dec = self._index, self._decider
        while True:
            moves: list[Move] = []
            coming = dec.evicting[0]
            if idx.free(0) + coming < n:
                fit, victims = idx.plan_room_up_to(0, n - coming)
                # never more than asked: with other stores' writes pending, free can be
                # negative and ``fit`` (clamped at 0) would otherwise add room no one made
                n = min(n, fit + coming)
                if victims:
                    dec.plan_eviction(0, victims, moves)
            drops = [m for m in moves if m.src == 0 and m.dst is None]
            if drops:  # victims with nothing to copy: dropped here, so their room is there now
                moves = [m for m in moves if not (m.src == 0 and m.dst is None)]
                # under the lock (a table update per key): a store that came in meanwhile
                # would count them as room coming and wait for an engine job that is not there
                run_moves(self.tiers, drops, self._staging)
                dec.apply([Completion(Job("demote", lambda: None, drops))])
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
        """Blocks after the first ``have`` found in shared tiers (one round trip per tier). A
        tier that raises (breaking its contract) answers none: a miss, not an exception."""
        if not self._shared or have >= limit:
            return []
        rest = list(islice(iter_keys(ns, toks), have, limit))
        for i in self._shared:
            tier = self.tiers[i]
            try:
                n = tier.contains_prefix(rest, ns.owner)
            except Exception:
                log.exception("%s: contains_prefix raised; serving a miss", tier.name)
                n = 0
            if n:
                return [Read(k, i, False) for k in rest[:n]]
        return []

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("TieredStore is closed")
