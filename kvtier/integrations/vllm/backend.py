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
import inspect
import logging
from collections.abc import Iterator, Mapping
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

    def close(self) -> None: ...


@dataclass(slots=True)
class _PinLease:
    """A lease over ``TieredStore.pin`` (a context manager held open until ``release``)."""

    end: int
    _ctx: contextlib.AbstractContextManager[int] | None

    def release(self) -> None:
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            with contextlib.suppress(Exception):
                ctx.__exit__(None, None, None)


class LocalBackend:
    """``KVBackend`` over a ``TieredStore`` owned by this object (closed by ``close``).

    Thread-safe as the store is: the lookup server's thread and the model runner's thread call
    it concurrently.
    """

    def __init__(self, store: Any) -> None:
        self._store = store
        # The per-call scope and offset keywords arrive with the store's identity API; until
        # then the scope is folded into the tenant and offsets are emulated (see _compat).
        self._native = "start" in inspect.signature(store.load).parameters

    @property
    def block_tokens(self) -> int:
        return int(self._store.layout.block_tokens)

    @property
    def store_object(self) -> Any:
        """The wrapped ``TieredStore`` (for ``stats()``)."""
        return self._store

    def _kw(self, scope: Scope) -> dict[str, Any]:
        if self._native:
            return {"adapter": scope.adapter or None, "salt": scope.salt or None}
        if scope.adapter or scope.salt:
            return {"tenant": f"{self._store.tenant}|a={scope.adapter}|s={scope.salt}"}
        return {}

    def lookup(self, tokens: np.ndarray[Any, Any], scope: Scope, start: int = 0) -> int:
        if self._native:
            return int(self._store.lookup(tokens, start=start, **self._kw(scope)))
        return int(self._store.lookup(tokens, **self._kw(scope)))

    def load(self, tokens: np.ndarray[Any, Any], out: Any, scope: Scope, start: int = 0) -> int:
        if self._native:
            return int(self._store.load(tokens, out, start=start, **self._kw(scope)))
        return self._compat_load(tokens, out, scope, start)

    def store(self, tokens: np.ndarray[Any, Any], kv: Any, scope: Scope, start: int = 0) -> int:
        if self._native:
            return int(self._store.store(tokens, kv, start=start, **self._kw(scope)))
        return self._compat_store(tokens, kv, scope, start)

    def lease(self, tokens: np.ndarray[Any, Any], scope: Scope, start: int = 0) -> Lease:
        if self._native:
            lease: Lease = self._store.lease(tokens, start=start, **self._kw(scope))
            return lease
        ctx = self._store.pin(tokens, **self._kw(scope))
        end = int(ctx.__enter__())
        return _PinLease(end, ctx)

    def close(self) -> None:
        self._store.close()

    # -- emulation of the offset keywords on a store without them (removed once they land) --
    def _compat_load(self, tokens: np.ndarray[Any, Any], out: Any, scope: Scope, start: int) -> int:
        import torch

        n_out = int(out.shape[2])
        full = torch.empty(
            (out.shape[0], out.shape[1], start + n_out, *out.shape[3:]), dtype=out.dtype
        )
        n = int(self._store.load(tokens[: start + n_out], full, **self._kw(scope)))
        if n > start:
            out[:, :, : n - start].copy_(full[:, :, start:n])
        return max(n, start)

    def _compat_store(self, tokens: np.ndarray[Any, Any], kv: Any, scope: Scope, start: int) -> int:
        import torch

        if start == 0:
            return int(self._store.store(tokens, kv, **self._kw(scope)))
        # the prefix must be held (pinned) so the store skips it: its bytes are not given
        with self._store.pin(tokens[:start], **self._kw(scope)) as held:
            if held < start:
                return 0
            full = torch.zeros(
                (kv.shape[0], kv.shape[1], start + kv.shape[2], *kv.shape[3:]), dtype=kv.dtype
            )
            full[:, :, start:] = kv
            written = int(self._store.store(tokens, full, **self._kw(scope)))
        return written


def open_local(config: Any, identity: Mapping[str, Any]) -> LocalBackend:
    """A ``LocalBackend`` over a new ``TieredStore`` for a ``StoreConfig`` and the identity's
    store keywords (``EngineIdentity.store_kwargs()``); closes the tiers if the store fails."""
    from kvtier.store import TieredStore
    from kvtier.tiers.registry import make_tiers

    tiers = make_tiers(config.layout, config.tiers)
    try:
        store = TieredStore(
            config.layout,
            tiers,
            tenant=config.tenant,
            policy=config.policy,
            workers=config.workers,
            secret=config.secret,
            share_group=config.share_group,
            demote_queue=config.demote_queue,
            metrics_port=config.metrics_port or None,
            **identity,
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
