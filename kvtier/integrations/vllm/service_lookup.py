"""Service mode, scheduler side: lookups and leases asked of the node service directly.

In-process, the scheduler asks every worker rank (``lookup_rpc``), because each rank owns its
store. With a node service every rank's blocks live in the service, so the scheduler's process
asks it itself, with one client per rank registered under that rank's identity (received from
the rank in vLLM's handshake, ``RankHandshake``: the exact identity and layout the rank
registered, never re-derived here): a lookup is the minimum over ranks, as before, and one hop
shorter (scheduler -> service, not scheduler -> rank -> service).

Leases: the scheduler takes them when vLLM commits a load (``lease``), so they belong to this
process's service sessions. They are released when every rank reported the load done
(``LoadedRequests``, through vLLM's per-step worker metadata), when the request finishes, or --
if this process dies -- by the service when the sessions go silent (``[service] lease_ttl``).

Failure is a miss: a service that is down, slow (each call waits at most the connector's
``lookup_timeout_ms``) or not reached yet answers 0 tokens; a lease it cannot take holds
nothing, so the worker's load finds what is still there and vLLM recomputes the rest. Not
thread-safe: the scheduler calls it from its one thread.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from kvtier.errors import KVTierError
from kvtier.integrations.vllm.backend import Lease, Scope
from kvtier.integrations.vllm.metadata import RankHandshake
from kvtier.integrations.vllm.service_backend import connect_rank

log = logging.getLogger("kvtier.vllm")


class ServiceLookup:
    """The scheduler's view of the service: one client per rank (see the module docstring)."""

    def __init__(self, url: str, timeout_s: float, *, name: str, tenant: str = "") -> None:
        self.url = url
        self._timeout = timeout_s
        self._name = name
        self._tenant = tenant
        self._clients: list[Any] = []
        self._leases: dict[str, list[Lease]] = {}
        self.failures = 0
        self._warned = False

    @property
    def ranks(self) -> int:
        return len(self._clients)

    def attach(self, ranks: Mapping[Any, Any]) -> None:
        """Connect once per rank from vLLM's handshake (``{(pp_rank, tp_rank): RankHandshake}``).
        A rank that sent no ``RankHandshake`` leaves every lookup a miss (its blocks cannot be
        named); a service that stores another layout is a ``ConfigError``."""
        self.close()
        for key in sorted(ranks):
            shake = ranks[key]
            if not isinstance(shake, RankHandshake):
                log.warning("kvtier: rank %s sent no service identity; lookups miss", key)
                self.close()
                return
            self._clients.append(
                connect_rank(
                    self.url,
                    shake.identity,
                    shake.layout,
                    timeout=self._timeout,
                    name=f"{self._name}-pp{key[0]}-tp{key[1]}",
                    tenant=self._tenant,
                    direct=False,  # lookups and leases only: no need to map the arena
                )
            )

    @staticmethod
    def _kw(scope: Scope, start: int) -> dict[str, Any]:
        return {"adapter": scope.adapter or None, "salt": scope.salt or None, "start": start}

    def lookup(self, tokens: np.ndarray[Any, Any], scope: Scope, start: int = 0) -> int:
        """The end of the prefix every rank holds (``start``.. when none is reachable)."""
        if not self._clients:
            if not self._warned:  # vLLM never passed the ranks' identities: nothing to name
                self._warned = True
                log.warning("kvtier: no rank identities from vLLM's handshake; lookups miss")
            return 0
        end = len(tokens)
        try:
            for client in self._clients:
                end = min(end, int(client.lookup(tokens, **self._kw(scope, start))))
                if end <= start:
                    break  # a rank without the first block: the others cannot help
        except KVTierError as exc:  # e.g. tokens the service refuses: a miss, not a crash
            self.failures += 1
            log.warning("kvtier service lookup failed: %s", exc)
            return 0
        return end

    def lease(self, req_id: str, tokens: np.ndarray[Any, Any], scope: Scope, start: int) -> int:
        """Hold the prefix on every rank's blocks for ``req_id`` (replacing a lease it had);
        the end every rank holds."""
        self.release((req_id,))
        held: list[Lease] = []
        end = len(tokens)
        try:
            for client in self._clients:
                lease = client.lease(tokens, **self._kw(scope, start))
                held.append(lease)
                end = min(end, int(lease.end))
        except KVTierError as exc:
            self.failures += 1
            log.warning("kvtier service lease failed: %s", exc)
            end = start
        self._leases[req_id] = held
        return end if self._clients else start

    def release(self, req_ids: Iterable[str]) -> None:
        """Drop the leases of ``req_ids`` (loaded, or finished); unknown ids are ignored."""
        for req_id in req_ids:
            for lease in self._leases.pop(req_id, ()):
                with contextlib.suppress(Exception):  # a lost session: the service drops it
                    lease.release()

    @property
    def held(self) -> int:
        """Requests holding leases (for tests and stats)."""
        return len(self._leases)

    def close(self) -> None:
        """Release every lease and close the clients (their sessions end). Idempotent."""
        self.release(list(self._leases))
        clients, self._clients = self._clients, []
        for client in clients:
            client.close()
