"""The connector's worker side: one rank's store, its lookup server, and the page moves.

Runs in a vLLM worker process. ``start`` builds the rank's store (identity from vLLM's config
and this rank's place, layout from the registered KV caches) behind the ``KVBackend`` seam and
starts the rank's lookup server. Per step, on the model runner's thread:

- ``load`` (before the forward): each load reads kvtier blocks into a staging buffer and
  scatters the pages vLLM does not hold yet (on CUDA: enqueued on the mover's side stream; the
  forward waits per layer, ``wait_layer``, or once, ``wait_all``). A page the store could not
  fill (a block evicted, corrupt or unreachable since the lookup) is reported by
  ``take_load_errors``; vLLM then recomputes from it. Nothing unverified reaches a page.
- ``save`` (after the forward): each save gathers its pages and stores them from its offset.
  Synchronous by default; with ``async_save`` the gather is only started (on CUDA, a
  device->host copy on the side stream) and a background thread (``saves.SaveQueue``) stores
  it once the copy is done. vLLM must not reuse those pages before the copy finished: a
  finished request with async saves is reported by ``finished`` (vLLM's ``get_finished``:
  its blocks are freed then) only after its copies completed, and ``preempted`` waits for
  the copies of requests whose pages this step's forward may overwrite. A failed save is
  logged and dropped: a later miss, never an error in the step.
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
from kvtier.integrations.vllm.movers import Gathered, PageMover
from kvtier.integrations.vllm.saves import SaveQueue

log = logging.getLogger("kvtier.vllm")


class WorkerSide:
    """One rank's transfers. ``load``/``save``/``finished`` run on the model runner's thread;
    ``lease`` on the lookup server's (the lease table is locked, the backend is thread-safe)."""

    def __init__(
        self,
        backend: KVBackend,
        mover: PageMover,
        *,
        async_save: bool = False,
        save_queue_bytes: int = 1 << 30,
        layerwise: bool = False,
    ) -> None:
        self.backend = backend
        self.mover = mover
        self.layerwise = layerwise  # the forward calls wait_layer for every layer it reads
        self._saves = SaveQueue(self._store_op, save_queue_bytes) if async_save else None
        self._copies: dict[str, list[Gathered]] = {}  # async saves' copies not seen complete
        self._async_reqs: set[str] = set()  # requests with async saves (vLLM delays their free)
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

    def finished(self, req_ids: set[str]) -> set[str]:
        """Requests that ended (an aborted one may never have loaded): drop their leases;
        return those with async saves, once their copies completed (vLLM frees their pages
        then). The copies were started at least one step earlier, so this rarely waits."""
        done: set[str] = set()
        for r in req_ids:
            self._release(r)
            if r in self._async_reqs:
                self._wait_copies(r)
                self._async_reqs.discard(r)
                done.add(r)
        return done

    def preempted(self, req_ids: set[str]) -> None:
        """vLLM freed these requests' pages for this step's forward: finish their copies."""
        for r in req_ids:
            self._wait_copies(r)

    def _wait_copies(self, req_id: str) -> None:
        for g in self._copies.pop(req_id, ()):
            g.wait()

    def load(self, meta: KvtierMetadata) -> None:
        """Read this step's loads and start their copies into vLLM's pages; unless
        ``layerwise``, the forward waits for all of them (``wait_layer`` otherwise)."""
        t0 = time.perf_counter()
        parts: list[tuple[Any, list[int]]] = []
        for op in meta.loads:
            try:
                part = self._read_one(op)
            finally:
                self._release(op.req_id)
            if part is not None:
                parts.append(part)
        try:
            self.mover.start_scatter(parts)
        except Exception as exc:  # nothing reached vLLM's pages reliably: recompute them all
            log.warning("kvtier load copy failed: %s", exc)
            for _, ids in parts:
                self.failed_pages += len(ids)
                self._errors.update(ids)
                self.loaded_tokens -= len(ids) * self.mover.layout.page_tokens
        if not self.layerwise:
            self.mover.wait_all()
        self.load_s += time.perf_counter() - t0

    def wait_layer(self, layer: int) -> None:
        """The forward is about to read ``layer``: make it wait for that layer's loads."""
        self.mover.wait_layer(layer)

    def _read_one(self, op: PageOp) -> tuple[Any, list[int]] | None:
        """Read ``op``'s blocks from the store into a staging buffer; the part to scatter."""
        bs = self.mover.layout.page_tokens
        n_pages = len(op.page_ids)
        part = None
        try:
            buf = self.mover.buffer(n_pages)
            end = self.backend.load(op.tokens, self.mover.as_kv(buf), op.scope, start=op.start)
            got = max(0, min(n_pages, (end - op.start) // bs))
            if got > op.keep_pages:
                part = (buf[:, op.keep_pages : got], list(op.page_ids[op.keep_pages : got]))
        except Exception as exc:  # a fault is a miss: vLLM recomputes what was not loaded
            log.warning("kvtier load for %s failed: %s", op.req_id, exc)
            got = 0
        self.loaded_tokens += max(0, got - op.keep_pages) * bs
        missing = op.page_ids[max(got, op.keep_pages) :]
        if missing:
            self.failed_pages += len(missing)
            self._errors.update(missing)
        return part

    def save(self, meta: KvtierMetadata) -> None:
        t0 = time.perf_counter()
        self._save(meta)
        self.save_s += time.perf_counter() - t0

    def _store_op(self, op: PageOp, buf: Any) -> int:
        return self.backend.store(op.tokens, self.mover.as_kv(buf), op.scope, start=op.start)

    def _save(self, meta: KvtierMetadata) -> None:
        lay = self.mover.layout
        for op in meta.saves:
            q = self._saves
            if q is not None:
                self._async_reqs.add(op.req_id)  # before anything can fail: vLLM waits for it
                nbytes = lay.layers * len(op.page_ids) * lay.page_bytes
                if not q.reserve(nbytes):
                    continue  # too much pending already: a later miss
            try:
                gathered = self.mover.start_gather(op.page_ids)
            except Exception as exc:
                if q is not None:
                    q.cancel(nbytes)
                self.save_failures += 1
                log.warning("kvtier save for %s failed: %s", op.req_id, exc)
                continue
            if q is None:
                try:
                    gathered.wait()
                    self.saved_tokens += self._store_op(op, gathered.buf)
                except Exception as exc:
                    self.save_failures += 1
                    log.warning("kvtier save for %s failed: %s", op.req_id, exc)
            else:
                q.submit(op, gathered)
                copies = [g for g in self._copies.get(op.req_id, ()) if not g.ready()]
                self._copies[op.req_id] = [*copies, gathered]

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the async saves queued so far were stored; False on timeout."""
        return self._saves.flush(timeout) if self._saves is not None else True

    def take_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._saves is not None:
            self._saves.close()
        self.finished(set(self._leases))
        self.backend.close()

    def stats(self) -> dict[str, Any]:
        """Counters since start (read from the lookup server's thread: plain reads of ints)."""
        q = self._saves
        return {
            "loaded_tokens": self.loaded_tokens,
            "failed_pages": self.failed_pages,
            "saved_tokens": self.saved_tokens + (q.saved_tokens if q else 0),
            "save_failures": self.save_failures + (q.failures if q else 0),
            "save_dropped": q.dropped if q else 0,
            "save_pending_bytes": q.pending_bytes if q else 0,
            "load_s": round(self.load_s, 4),
            "save_s": round(self.save_s, 4),
            "tier_hits": self.backend.tier_hits(),
        }
