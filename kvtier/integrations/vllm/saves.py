"""Saves off the forward path: gathered blocks are stored by a background thread.

The model runner's thread only starts each save's copy (``movers.PageMover.start_gather``) and
hands it here; one thread waits for the copy, then calls the store, in submission order. The
pinned buffers of pending saves are bounded by ``limit_bytes``: a save that would exceed it is
dropped (counted), which is a later miss, never a stall of the forward. A store that fails is
logged and counted, never raised.

Thread-safety: ``submit``, ``flush`` and ``close`` from one thread (the model runner's);
counters are plain ints read from any thread.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from kvtier.integrations.vllm.metadata import PageOp
from kvtier.integrations.vllm.movers import Gathered

log = logging.getLogger("kvtier.vllm")

StoreFn = Callable[[PageOp, Any], int]


class SaveQueue:
    """Stores ``(op, gathered)`` pairs on one background thread (see the module docstring)."""

    def __init__(self, store: StoreFn, limit_bytes: int) -> None:
        self._store = store
        self._limit = limit_bytes
        self._q: queue.Queue[tuple[PageOp, Gathered] | None] = queue.Queue()
        self._cond = threading.Condition()
        self.pending_bytes = 0
        self.saved_tokens = 0
        self.failures = 0
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="kvtier-saves", daemon=True)
        self._thread.start()

    def reserve(self, nbytes: int) -> bool:
        """Room for a save of ``nbytes`` (then ``submit`` it); False (counted as dropped) when
        it would exceed the byte limit while others are pending."""
        with self._cond:
            if self.pending_bytes and self.pending_bytes + nbytes > self._limit:
                self.dropped += 1
                return False
            self.pending_bytes += nbytes
        return True

    def submit(self, op: PageOp, gathered: Gathered) -> None:
        """Queue a save whose ``gathered.buf.nbytes`` were ``reserve``d."""
        self._q.put((op, gathered))

    def cancel(self, nbytes: int) -> None:
        """Give back a reservation that was not submitted."""
        with self._cond:
            self.pending_bytes -= nbytes
            self._cond.notify_all()

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            op, gathered = item
            try:
                gathered.wait()
                self.saved_tokens += self._store(op, gathered.buf)
            except Exception as exc:  # a failed save is a later miss
                self.failures += 1
                log.warning("kvtier save for %s failed: %s", op.req_id, exc)
            finally:
                with self._cond:
                    self.pending_bytes -= gathered.buf.nbytes
                    self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued save was stored (or failed); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self.pending_bytes == 0, timeout)

    def close(self, timeout: float = 60.0) -> None:
        """Store what is queued, then stop the thread (idempotent)."""
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join(timeout)
