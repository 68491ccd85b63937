"""The transfer engine: worker threads that move bytes, apart from the code that decides.

The decider (``TieredStore`` under its lock) prepares a move -- marks destinations pending and
sources pinned -- and hands the engine a ``Job``: a plain callable that does the I/O and returns
per-block outcomes. The engine runs it on a worker thread and posts a ``Completion`` (the job,
its result, or the exception it raised) to a queue; the decider drains that queue with
``poll()`` and commits or rolls back. Workers never die silently: an exception is a completion
with ``error`` set, logged once.

Two ways in:

- ``run_parallel(fn, items)`` -- synchronous batch split across the workers *and the calling
  thread* (numpy copies release the GIL), for the latency-critical load/store paths.
- ``submit(job)`` -- asynchronous (demotion, write-through, prefetch). At most ``max_pending``
  jobs are in flight; ``submit`` blocks beyond that (backpressure instead of unbounded memory).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


@dataclass(slots=True)
class Job:
    """One asynchronous move. ``run`` does the I/O; ``context`` is the decider's bookkeeping."""

    kind: str
    run: Callable[[], Any]
    context: Any = None


@dataclass(slots=True)
class Completion:
    job: Job
    result: Any = None
    error: BaseException | None = None


@dataclass(slots=True)
class _Counter:
    pending: int = 0
    done: threading.Condition = field(default_factory=threading.Condition)


class TransferEngine:
    """A fixed pool of worker threads with a completion queue. Thread-safe."""

    def __init__(self, workers: int = 2, max_pending: int = 64) -> None:
        self.workers = max(1, workers)
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="kvtier-xfer")
        self._completions: queue.SimpleQueue[Completion] = queue.SimpleQueue()
        self._slots = threading.BoundedSemaphore(max_pending)
        self._inflight = _Counter()
        self._closed = False

    # -- synchronous batches ---------------------------------------------------------------
    @property
    def parallelism(self) -> int:
        """Threads a ``run_parallel`` batch uses at most: every worker plus the caller."""
        return self.workers + 1

    def run_parallel(self, fn: Callable[[Sequence[T]], list[R]], items: Sequence[T]) -> list[R]:
        """``fn`` over ``items`` split into contiguous chunks, one per worker plus the caller.

        Results are concatenated in order. An exception in any chunk is re-raised here, after
        every chunk has finished.
        """
        n = len(items)
        if n == 0:
            return []
        parts = min(n, self.parallelism)
        if parts == 1 or self._closed:
            return fn(items)
        bounds = [n * i // parts for i in range(parts + 1)]
        futures: list[Future[list[R]]] = [
            self._pool.submit(fn, items[bounds[i] : bounds[i + 1]]) for i in range(1, parts)
        ]
        try:
            out = list(fn(items[bounds[0] : bounds[1]]))
        finally:  # never return (or raise) while a worker still writes the caller's buffers
            wait(futures)
        for f in futures:
            out.extend(f.result())
        return out

    # -- asynchronous jobs -----------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Queue ``job``; blocks while ``max_pending`` jobs are in flight."""
        if self._closed:
            raise RuntimeError("transfer engine is closed")
        self._slots.acquire()
        with self._inflight.done:
            self._inflight.pending += 1
        self._pool.submit(self._execute, job)

    def _execute(self, job: Job) -> None:
        try:
            done = Completion(job, result=job.run())
        except BaseException as exc:  # reported, never swallowed
            log.error("transfer job %s failed: %r", job.kind, exc)
            done = Completion(job, error=exc)
        self._completions.put(done)
        self._slots.release()
        with self._inflight.done:
            self._inflight.pending -= 1
            self._inflight.done.notify_all()

    def poll(self) -> list[Completion]:
        """Completions posted since the last poll (non-blocking)."""
        out = []
        while True:
            try:
                out.append(self._completions.get_nowait())
            except queue.Empty:
                return out

    @property
    def pending(self) -> int:
        return self._inflight.pending

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no job is in flight; False on timeout."""
        with self._inflight.done:
            return self._inflight.done.wait_for(lambda: self._inflight.pending == 0, timeout)

    def wait_any(self, timeout: float = 1.0) -> None:
        """Block until some job finishes (or ``timeout``)."""
        with self._inflight.done:
            if self._inflight.pending:
                self._inflight.done.wait(timeout)

    def close(self) -> None:
        if not self._closed:
            self.wait_idle()
            self._closed = True
            self._pool.shutdown(wait=True)
