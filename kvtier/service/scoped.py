"""``ServiceStore``: the store a service runs -- calls under the identity of the calling client.

The service serves many engines, each with its own ``Identity`` (model, revision, rank, engine
layout): a request's namespace is derived from the identity its *session* registered, never from
anything the request says. ``using(identity)`` sets that identity for the calling thread (a
context variable), and ``namespace`` -- the one place every store path derives its keys from --
reads it. Outside ``using`` the store's own identity applies (the ``[store]`` model_id).

``ServiceStore.for_service`` builds it from one pool's config (``kvtier.service.pools``) with,
in arena mode, the first host tier's arena in named shared memory (``kvtier.service.direct``),
and -- when no tier is shared -- the index's presence map in named shared memory too
(``kvtier.service.presence``), so clients answer first-block misses themselves.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

from kvtier.config import StoreConfig
from kvtier.identity import Identity, Scope
from kvtier.keys import Namespace
from kvtier.service.direct import DirectStore
from kvtier.service.presence import PresenceEntries, PresenceMap, slots_for
from kvtier.tiers.host import HostTier

_CALLER: ContextVar[Identity | None] = ContextVar("kvtier_service_identity", default=None)
_NAMESPACES = 4096  # bound on the cache (per-request salts are many)


class ServiceStore(DirectStore):
    """A ``TieredStore`` that derives keys from the calling session's identity. Thread-safe."""

    @classmethod
    def for_service(
        cls,
        cfg: StoreConfig,
        arena_path: str | None,
        gid: int | None,
        label: str = "",
        presence_path: str | None = None,
    ) -> ServiceStore:
        """The store of ``cfg``; with an ``arena_path`` (arena mode) a first ``host`` tier's
        arena is named shared memory there (``gid``'s group). ``label``: a pool's name, the
        prefix of its tiers' Prometheus ``tier`` label (``<label>/host``). ``presence_path``:
        where to name its presence map (none without; none with a shared tier)."""
        first = None
        spec = cfg.tiers[0] if cfg.tiers else {}
        if arena_path is not None and spec.get("kind") == "host":
            rest = {k: v for k, v in spec.items() if k != "kind"}
            first = HostTier.from_config(cfg.layout, rest, shm_path=arena_path, shm_gid=gid)
        store = cls.from_config(cfg, first=first)
        assert isinstance(store, ServiceStore)
        if label:
            for tier in store.tiers:
                tier.label = f"{label}/{tier.name}"
        if presence_path is not None and not store._shared:
            try:
                store._watch(presence_path, gid)
            except BaseException:  # e.g. /dev/shm full: the store's arena goes with it
                store.close()
                raise
        return store

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._scoped: dict[tuple[Identity, str, str | None, str | bytes | None], Namespace] = {}
        self._scoped_lock = threading.Lock()
        self.presence: PresenceMap | None = None

    def _watch(self, path: str, gid: int | None) -> None:
        """Keep a presence map of the index at ``path`` (every key it holds now counts)."""
        blocks = sum(t.capacity_blocks for t in self.tiers)
        pmap = PresenceMap.create(path, slots_for(blocks), gid)
        with self._lock:
            self._index.entries = PresenceEntries(pmap, self._index.entries.items())
        self.presence = pmap

    def count_misses(
        self, tenant: str, lookups: int, lookup_tokens: int, loads: int, load_tokens: int
    ) -> None:
        """Misses a client answered itself from the presence map, counted as the store's own
        lookups and loads would have been (``tenant``: the one the client's namespace has)."""
        with self._lock:
            for cnt in self._decider.counted(tenant):
                cnt.lookups += lookups
                cnt.lookup_tokens += lookup_tokens
                cnt.loads += loads
                cnt.miss_tokens += load_tokens

    def close(self) -> None:
        super().close()
        if self.presence is not None:
            self.presence.unlink()
            self.presence.close()
            self.presence = None

    @staticmethod
    @contextlib.contextmanager
    def using(identity: Identity) -> Iterator[None]:
        """Run the enclosed calls (this thread only) under ``identity``."""
        token = _CALLER.set(identity)
        try:
            yield
        finally:
            _CALLER.reset(token)

    def namespace(
        self,
        tenant: str | None = None,
        adapter: str | None = None,
        salt: str | bytes | None = None,
    ) -> Namespace:
        """As ``TieredStore.namespace``, under the caller's identity when one is set."""
        identity = _CALLER.get()
        if identity is None:
            return super().namespace(tenant, adapter, salt)
        name = self.tenant if tenant is None else tenant
        memo = (identity, name, adapter, salt)
        with self._scoped_lock:
            ns = self._scoped.get(memo)
        if ns is None:
            ns = Namespace(
                identity,
                self.layout,
                Scope(name, adapter, salt),
                self._share_groups.get(name),
                self._secret,
            )
            with self._scoped_lock:
                if len(self._scoped) >= _NAMESPACES:
                    self._scoped.clear()
                self._scoped[memo] = ns
        return ns
