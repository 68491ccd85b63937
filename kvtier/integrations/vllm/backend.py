"""The seam between the vLLM connector and a kvtier store: the only module that calls the store.

The connector needs four operations, all keyed by a request's token ids and its scope (adapter,
cache salt): ``lookup`` (how far the cached prefix reaches), ``load`` from an offset (the engine
already holds the blocks before it), ``store`` from an offset (the blocks before it are cached)
and ``lease`` (hold a looked-up prefix until it is loaded). ``KVBackend`` names them;
``LocalBackend`` serves them from a ``TieredStore`` in this process. A node-local service can
serve the same connector from another process by implementing ``KVBackend`` over its own
transport, with nothing else in the connector changing.

Contracts (every implementation): token counts are absolute positions and multiples of the
store's ``block_tokens``; a fault (an I/O error, a corrupt or foreign block, an unreachable
tier) reads as a shorter prefix, never as an exception or as wrong bytes. ``load`` fills only
verified blocks and says how far it got.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

log = logging.getLogger("kvtier.vllm")


@dataclass(frozen=True, slots=True)
class Scope:
    """The per-request part of a block's identity: a LoRA adapter and a cache salt ("" = none)."""

    adapter: str = ""
    salt: str = ""


class Lease(Protocol):
    """A held prefix: its blocks are not evicted until ``release()`` (idempotent)."""

    @property
    def end(self) -> int: ...

    def release(self) -> None: ...


class KVBackend(Protocol):
    """What the connector asks of a store (see the module docstring for the contracts)."""

    @property
    def block_tokens(self) -> int: ...

    def lookup(self, tokens: np.ndarray[Any, Any], scope: Scope, start: int = 0) -> int:
        """Absolute end of the cached prefix of ``tokens`` (>= ``start`` when the blocks
        before ``start`` are known to be cached); no side effect on the cache."""
        ...

    def load(self, tokens: np.ndarray[Any, Any], out: Any, scope: Scope, start: int = 0) -> int:
        """Fill ``out[:, :, : n - start]`` with tokens ``[start, n)``; return ``n``. Mutates
        ``out`` only."""
        ...

    def store(self, tokens: np.ndarray[Any, Any], kv: Any, scope: Scope, start: int = 0) -> int:
        """Store the full blocks of ``kv`` (tokens ``[start, start + kv.shape[2])``) not yet
        cached; return the tokens written."""
        ...

    def lease(self, tokens: np.ndarray[Any, Any], scope: Scope, start: int = 0) -> Lease: ...

    def tier_hits(self) -> dict[str, int]:
        """Blocks served per tier since start (for reports)."""
        ...

    def close(self) -> None: ...


class LocalBackend:
    """``KVBackend`` over a ``TieredStore`` owned by this object (closed by ``close``).

    Thread-safe as the store is: the lookup server's thread and the model runner's thread call
    it concurrently.
    """

    def __init__(self, store: Any) -> None:
        self._store = store

    @property
    def block_tokens(self) -> int:
        return int(self._store.layout.block_tokens)

    @property
    def store_object(self) -> Any:
        """The wrapped ``TieredStore`` (for ``stats()``)."""
        return self._store

    @staticmethod
    def _kw(scope: Scope, start: int) -> dict[str, Any]:
        return {"adapter": scope.adapter or None, "salt": scope.salt or None, "start": start}

    def lookup(self, tokens: np.ndarray[Any, Any], scope: Scope, start: int = 0) -> int:
        return int(self._store.lookup(tokens, **self._kw(scope, start)))

    def load(self, tokens: np.ndarray[Any, Any], out: Any, scope: Scope, start: int = 0) -> int:
        return int(self._store.load(tokens, out, **self._kw(scope, start)))

    def store(self, tokens: np.ndarray[Any, Any], kv: Any, scope: Scope, start: int = 0) -> int:
        return int(self._store.store(tokens, kv, **self._kw(scope, start)))

    def lease(self, tokens: np.ndarray[Any, Any], scope: Scope, start: int = 0) -> Lease:
        lease: Lease = self._store.lease(tokens, **self._kw(scope, start))
        return lease

    def tier_hits(self) -> dict[str, int]:
        tiers = self._store.stats()["tiers"]
        return {name: int(t.get("hits", 0)) for name, t in tiers.items()}

    def close(self) -> None:
        self._store.close()


def open_local(config: Any, identity: Any) -> LocalBackend:
    """A ``LocalBackend`` over a new ``TieredStore`` for a ``StoreConfig`` and this rank's
    ``kvtier.identity.Identity``; closes the tiers if the store fails."""
    from kvtier.store import TieredStore
    from kvtier.tiers.registry import make_tiers

    tiers = make_tiers(config.layout, config.tiers, secret=config.secret)
    try:
        store = TieredStore(
            config.layout,
            tiers,
            tenant=config.tenant,
            policy=config.policy,
            workers=config.workers,
            secret=config.secret,
            share_groups=config.share_groups,
            demote_queue=config.demote_queue,
            metrics_port=config.metrics_port or None,
            identity=identity,
        )
    except BaseException:
        for t in tiers:
            t.close()
        raise
    return LocalBackend(store)


@contextlib.contextmanager
def released(lease: Lease) -> Iterator[Lease]:
    """Release ``lease`` when the block ends."""
    try:
        yield lease
    finally:
        lease.release()
