"""A worker rank's ``KVBackend`` over the node service (``kvtier serve``): service mode.

With a ``[service] url`` in the connector's config every worker rank connects to the service
with its own ``Identity`` (derived as in-process from vLLM's config and the rank) and the
kvtier layout of its pages, instead of opening a store of its own. The service derives every
key from that identity, so ranks, models and page formats never meet, as in-process.

Data path: the rank's page mover gathers into (and scatters from) its own host buffers, as
in-process, and the client moves them with one copy each way: straight into and out of the
service's shared host arena with the service's default ``data = "arena"`` (on this process's
threads, with the host tier's fused copy + checksum), or through the session's staging region
with ``data = "staging"`` (a second copy, by the service). The staging region's own buffer
(``ServiceClient.buffer``) is not used for pages: the worker holds several loads' and saves'
buffers at once (a step's loads are scattered together; async saves queue), and the region
holds one transfer.

Failure: the client's calls are bounded by ``[service] timeout``; a service that is down,
restarting or stalled makes loads misses (vLLM recomputes) and saves no-ops, never a failed
request. The client reconnects by itself when the service is back. A service that serves no
pool of the pages' layout (``[store]`` or a ``[[pools]]`` table of ``kvtier serve``'s config)
refuses the engine at start with a ``ConfigError`` naming the lines the service needs.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from kvtier.errors import ConfigError, LayoutError
from kvtier.identity import Identity
from kvtier.integrations.vllm.backend import Lease, Scope
from kvtier.layout import KVLayout

log = logging.getLogger("kvtier.vllm")


def layout_hint(layout: KVLayout) -> str:
    """The ``[store]`` lines of a service that stores ``layout`` (for error messages)."""
    return layout.toml_keys()


def connect_rank(
    url: str,
    identity: Identity,
    layout: KVLayout,
    *,
    timeout: float,
    name: str,
    tenant: str = "",
    direct: bool = True,
) -> Any:
    """A ``ServiceClient`` registered as ``identity`` that expects ``layout`` (``direct``:
    whether it maps the service's host arena, which only a client moving KV needs).

    A service that is down is not an error (the client serves misses until it answers); one
    that stores another layout is a ``ConfigError`` that names the ``[store]`` keys to set."""
    from kvtier.service.client import connect

    try:
        return connect(
            url,
            identity,
            layout=layout,
            timeout=timeout,
            name=name,
            tenant=tenant or None,
            direct=direct,
        )
    except LayoutError as exc:
        raise ConfigError(
            f"{exc}. This vLLM engine's pages need a service whose config has [store] "
            f"{layout_hint(layout)}, or a [[pools]] table with those keys in [pools.store] "
            "(or drop [service] url to run kvtier in-process)"
        ) from None


class ServiceBackend:
    """``KVBackend`` over one rank's ``ServiceClient`` (owned: closed by ``close``).

    Thread-safe as the client is (its calls are serialised): the model runner's thread loads
    and saves, the rank's lookup server thread asks for stats."""

    def __init__(self, client: Any) -> None:
        self.client = client

    @property
    def block_tokens(self) -> int:
        return int(self.client.layout.block_tokens)

    @staticmethod
    def _kw(scope: Scope, start: int) -> dict[str, Any]:
        return {"adapter": scope.adapter or None, "salt": scope.salt or None, "start": start}

    def lookup(self, tokens: np.ndarray[Any, Any], scope: Scope, start: int = 0) -> int:
        return int(self.client.lookup(tokens, **self._kw(scope, start)))

    def load(self, tokens: np.ndarray[Any, Any], out: Any, scope: Scope, start: int = 0) -> int:
        return int(self.client.load(tokens, out, **self._kw(scope, start)))

    def store(self, tokens: np.ndarray[Any, Any], kv: Any, scope: Scope, start: int = 0) -> int:
        return int(self.client.store(tokens, kv, **self._kw(scope, start)))

    def lease(self, tokens: np.ndarray[Any, Any], scope: Scope, start: int = 0) -> Lease:
        lease: Lease = self.client.lease(tokens, **self._kw(scope, start))
        return lease

    def tier_hits(self) -> dict[str, int]:
        """The service's blocks served per tier (all its clients'; ``{}`` when unreachable)."""
        tiers = self.client.stats().get("tiers", {})
        return {name: int(t.get("hits", 0)) for name, t in tiers.items()}

    def close(self) -> None:
        self.client.close()


def open_service(
    url: str,
    identity: Identity,
    layout: KVLayout,
    *,
    timeout: float,
    name: str,
    tenant: str = "",
    direct: bool = True,
) -> ServiceBackend:
    """One rank's backend over the service at ``url`` (see the module; ``direct=False``:
    never map the service's arena, every transfer through the staging region)."""
    return ServiceBackend(
        connect_rank(
            url, identity, layout, timeout=timeout, name=name, tenant=tenant, direct=direct
        )
    )
