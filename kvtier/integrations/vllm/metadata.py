"""What the scheduler side tells the worker side each step (pickled by vLLM to every rank)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvtier.integrations.vllm.backend import Scope


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
