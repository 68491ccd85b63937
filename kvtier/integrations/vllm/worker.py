"""The connector's worker side: one rank's store, its lookup server, and the page moves.

Runs in a vLLM worker process. ``start`` builds the rank's store (identity from vLLM's config
and this rank's place, layout from the registered KV caches) behind the ``KVBackend`` seam and
starts the rank's lookup server. Per step, on the model runner's thread:

- ``load`` (before the forward): each load reads kvtier blocks into a staging buffer and
  scatters the pages vLLM does not hold yet. A page the store could not fill (a block evicted,
  corrupt or unreachable since the lookup) is reported by ``take_load_errors``; vLLM then
  recomputes from it. Nothing unverified reaches a page.
- ``save`` (after the forward): each save gathers its pages and stores them from its offset.
  A failed save is logged and dropped: a later miss, never an error in the step.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import numpy as np

from kvtier.integrations.vllm.backend import KVBackend, Lease, Scope
from kvtier.integrations.vllm.lookup_rpc import LookupServer
from kvtier.integrations.vllm.metadata import KvtierMetadata, PageOp
from kvtier.integrations.vllm.pages import PageMover

log = logging.getLogger("kvtier.vllm")


class WorkerSide:
    """One rank's transfers. ``load``/``save``/``finished`` run on the model runner's thread;
    ``lease`` on the lookup server's (the lease table is locked, the backend is thread-safe)."""

    def __init__(self, backend: KVBackend, mover: PageMover) -> None:
        self.backend = backend
        self.mover = mover
        self._server: LookupServer | None = None
        self._leases: dict[str, Lease] = {}
        self._lease_lock = threading.Lock()
        self._errors: set[int] = set()
        self.loaded_tokens = 0
        self.failed_pages = 0
        self.saved_tokens = 0
        self.save_failures = 0
        self.load_s = 0.0  # wall time in load / save (the connector's share of each step)
        self.save_s = 0.0

    def serve(self, server: LookupServer) -> None:
        """Own ``server`` (closed with this object)."""
        self._server = server

    def lease(self, req_id: str, tokens: np.ndarray[Any, Any], scope: Scope, start: int) -> int:
        """Pin the prefix of ``tokens`` for ``req_id`` until its load (or ``finished``)."""
        lease = self.backend.lease(tokens, scope, start)
        with self._lease_lock:
            old = self._leases.pop(req_id, None)
            self._leases[req_id] = lease
        if old is not None:
            old.release()
        return lease.end

    def _release(self, req_id: str) -> None:
        with self._lease_lock:
            lease = self._leases.pop(req_id, None)
        if lease is not None:
            lease.release()

    def finished(self, req_ids: set[str]) -> None:
        """Requests that ended (an aborted one may never have loaded): drop their leases."""
        for r in req_ids:
            self._release(r)

    def load(self, meta: KvtierMetadata) -> None:
        t0 = time.perf_counter()
        for op in meta.loads:
            try:
                self._load_one(op)
            finally:
                self._release(op.req_id)
        self.load_s += time.perf_counter() - t0

    def _load_one(self, op: PageOp) -> None:
        bs = self.mover.layout.page_tokens
        n_pages = len(op.page_ids)
        try:
            buf = self.mover.buffer(n_pages)
            end = self.backend.load(op.tokens, self.mover.as_kv(buf), op.scope, start=op.start)
            got = max(0, min(n_pages, (end - op.start) // bs))
            if got > op.keep_pages:
                self.mover.scatter(
                    buf[:, op.keep_pages : got], list(op.page_ids[op.keep_pages : got])
                )
        except Exception as exc:  # a fault is a miss: vLLM recomputes what was not loaded
            log.warning("kvtier load for %s failed: %s", op.req_id, exc)
            got = 0
        self.loaded_tokens += max(0, got - op.keep_pages) * bs
        missing = op.page_ids[max(got, op.keep_pages) :]
        if missing:
            self.failed_pages += len(missing)
            self._errors.update(missing)

    def save(self, meta: KvtierMetadata) -> None:
        t0 = time.perf_counter()
        self._save(meta)
        self.save_s += time.perf_counter() - t0

    def _save(self, meta: KvtierMetadata) -> None:
        for op in meta.saves:
            try:
                kv = self.mover.as_kv(self.mover.gather(list(op.page_ids)))
                self.saved_tokens += self.backend.store(op.tokens, kv, op.scope, start=op.start)
            except Exception as exc:
                self.save_failures += 1
                log.warning("kvtier save for %s failed: %s", op.req_id, exc)

    def take_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self.finished(set(self._leases))
        self.backend.close()

    def stats(self) -> dict[str, Any]:
        """Counters since start (read from the lookup server's thread: plain reads of ints)."""
        return {
            "loaded_tokens": self.loaded_tokens,
            "failed_pages": self.failed_pages,
            "saved_tokens": self.saved_tokens,
            "save_failures": self.save_failures,
            "load_s": round(self.load_s, 4),
            "save_s": round(self.save_s, 4),
            "tier_hits": self.backend.tier_hits(),
        }
