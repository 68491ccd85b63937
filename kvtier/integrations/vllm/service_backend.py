"""A worker rank's ``KVBackend`` over the node service (``kvtier serve``): service mode.

With a ``[service] url`` in the connector's config every worker rank connects to the service
with its own ``Identity`` (derived as in-process from vLLM's config and the rank) and the
kvtier layout of its pages, instead of opening a store of its own. The service derives every
key from that identity, so ranks, models and page formats never meet, as in-process.

Data path: one copy each way between the pages' gather/scatter buffer and the service's host
tier, as in-process. With the service's arena data path (``data = "arena"``, its default) the
buffer is the rank's own and the client copies straight between it and the shared arena, on
this process's threads; with the staging path (``data = "staging"``, or a client that does not
map the arena) ``StagingPageMover`` gathers a save's pages straight into the client's shared
staging region (``ServiceClient.buffer``) and a load lands there, so the service makes the one
copy and nothing is copied twice. A transfer larger than the region, or one made while the
service is unreachable, uses a private buffer (the client then copies through the region in
chunks, or serves a miss).

Failure: the client's calls are bounded by ``[service] timeout``; a service that is down,
restarting or stalled makes loads misses (vLLM recomputes) and saves no-ops, never a failed
request. The client reconnects by itself when the service is back. A service that stores
another layout (``[store]`` of ``kvtier serve``'s config) refuses the engine at start with a
``ConfigError`` naming the ``[store]`` lines the service needs.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from kvtier.errors import ConfigError, LayoutError
from kvtier.identity import Identity
from kvtier.integrations.vllm.backend import Lease, Scope
from kvtier.integrations.vllm.pages import PageLayout, PageMover
from kvtier.layout import KVLayout

log = logging.getLogger("kvtier.vllm")


def layout_hint(layout: KVLayout) -> str:
    """The ``[store]`` lines of a service that stores ``layout`` (for error messages)."""
    return (
        f"layers = {layout.layers}, kv_heads = {layout.kv_heads}, head_dim = {layout.head_dim}, "
        f'kv_factor = {layout.kv_factor}, dtype = "{layout.dtype}", '
        f"block_tokens = {layout.block_tokens}"
    )


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
            f"{layout_hint(layout)} (or drop [service] url to run kvtier in-process)"
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


class StagingPageMover(PageMover):
    """A ``PageMover`` whose buffers are views of the client's shared staging region when the
    session moves KV through it (so the service reads a gathered save, and fills a load, in
    place), and private when the client copies to the arena itself. Not thread-safe (the model
    runner's thread only), like ``PageMover``; a buffer is valid until the next transfer."""

    def __init__(self, kv_caches: list[torch.Tensor], layout: PageLayout, client: Any) -> None:
        super().__init__(kv_caches, layout)
        self._client = client

    def buffer(self, n_pages: int) -> torch.Tensor:
        """``n_pages`` pages of every layer: in the shared region on the staging data path
        (a private buffer on the arena path, when the service is unreachable, or when the
        region is too small for them)."""
        lay = self.layout
        if self._client.data_path == "arena":  # the client copies straight to the arena
            return super().buffer(n_pages)
        try:
            arr = self._client.buffer(n_pages * lay.page_tokens)
        except ConfigError:
            return super().buffer(n_pages)
        t = torch.from_numpy(arr)
        if t.dtype != lay.dtype:  # bf16 / fp8 travel as same-width integer carriers
            t = t.view(lay.dtype)
        return t.view(lay.layers, n_pages, *lay.page_shape)


def open_service(
    url: str,
    identity: Identity,
    layout: KVLayout,
    kv_caches: list[torch.Tensor],
    pages: PageLayout,
    *,
    timeout: float,
    name: str,
    tenant: str = "",
    direct: bool = True,
) -> tuple[ServiceBackend, StagingPageMover]:
    """One rank's backend over the service at ``url`` and its page mover (see the module;
    ``direct=False``: never map the service's arena, every transfer through staging)."""
    client = connect_rank(
        url, identity, layout, timeout=timeout, name=name, tenant=tenant, direct=direct
    )
    return ServiceBackend(client), StagingPageMover(kv_caches, pages, client)
