"""What the connector's sides tell each other (pickled by vLLM between its processes).

- ``KvtierMetadata``: scheduler -> every rank, each step (the loads and saves).
- service mode only: ``RankHandshake``, rank -> scheduler once at start (the identity and layout
  the rank registered with the service, so the scheduler looks up under exactly those), and
  ``LoadedRequests``, ranks -> scheduler each step (whose loads are done: their leases go).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvtier.identity import Identity
from kvtier.integrations.vllm.backend import Scope
from kvtier.layout import KVLayout


@dataclass(frozen=True, slots=True)
class PageOp:
    """Move tokens ``[start, end)`` of one request between kvtier and vLLM pages ``page_ids``.

    ``tokens`` are the request's ids ``[0, end)`` (kvtier keys chain from the first token);
    ``start`` and ``end`` are multiples of kvtier's ``block_tokens``; ``page_ids`` are the vLLM
    pages of ``[start, end)`` in order. ``keep_pages`` leading pages are already valid in vLLM
    (its own prefix cache) and are not written by a load.
    """

    req_id: str
    tokens: np.ndarray[Any, Any]
    start: int
    end: int
    page_ids: tuple[int, ...]
    scope: Scope
    keep_pages: int = 0


@dataclass
class KvtierMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's loads (before the forward) and saves (after it), and the requests vLLM
    preempted this step (their blocks are reused by this step's forward)."""

    loads: list[PageOp] = field(default_factory=list)
    saves: list[PageOp] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class RankHandshake(KVConnectorHandshakeMetadata):  # type: ignore[misc]
    """Service mode: one rank's registration with the service (its ``Identity`` and layout)."""

    identity: Identity
    layout: KVLayout


@dataclass(frozen=True)
class LoadedRequests(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """Service mode: requests whose loads a step ran (on every rank, once vLLM aggregated
    the step's outputs), so the scheduler can release their leases."""

    req_ids: frozenset[str] = frozenset()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, LoadedRequests):
            return self
        return LoadedRequests(self.req_ids | other.req_ids)
