"""Exact replays of one trace, several at once (``kvtier plan`` checks its candidate sizes so,
``kvtier simulate --sweep`` replays its capacities and policies so).

A replay is single-threaded Python, so ``jobs`` of them run in worker processes: each worker
gets the trace once, when it starts, and is then sent only what to replay (a hierarchy, a
capacity and policy); it sends back what is kept of the replay (a p90, a sweep row). Workers
start from a fork server (a clean process, so no thread or lock of the caller's is copied into
them; ``spawn`` where there is none). With ``jobs=1`` the replays run one after another in this
process. Results do not depend on ``jobs``: every replay is deterministic.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from types import TracebackType
from typing import Any, Generic, TypeVar

from kvtier.sim.trace import Trace

I = TypeVar("I")  # noqa: E741 -- what to replay
R = TypeVar("R")  # what is kept of a replay

_job: tuple[Trace, bool, Callable[[Trace, Any, bool], Any]] | None = None  # a worker's


def _start(trace: Trace, hints: bool, fn: Callable[[Trace, Any, bool], Any]) -> None:
    global _job
    _job = (trace, hints, fn)


def _run(item: object) -> object:
    assert _job is not None, "worker started without its trace"
    trace, hints, fn = _job
    return fn(trace, item, hints)


class ReplayPool(Generic[I, R]):
    """``run(items)``: ``fn(trace, item, hints)`` of each, in order, up to ``jobs`` at a time
    (``fn`` is a module-level function, so a worker can be sent it). Use as a context manager
    (the workers stop on exit)."""

    def __init__(
        self, trace: Trace, hints: bool, fn: Callable[[Trace, I, bool], R], jobs: int = 1
    ) -> None:
        self.trace, self.hints, self.fn = trace, hints, fn
        self.jobs = max(1, jobs)
        self._pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> ReplayPool[I, R]:
        if self.jobs > 1:
            self._pool = ProcessPoolExecutor(
                self.jobs,
                mp_context=multiprocessing.get_context(
                    "forkserver"
                    if "forkserver" in multiprocessing.get_all_start_methods()
                    else "spawn"
                ),
                initializer=_start,
                initargs=(self.trace, self.hints, self.fn),
            )
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None

    def run(self, items: Sequence[I], done: Callable[[int], None] | None = None) -> list[R]:
        """``fn`` of every item, in order; ``done(n)`` after each result (n results so far)."""
        results: Iterator[Any]
        if self._pool is None or len(items) < 2:
            results = (self.fn(self.trace, item, self.hints) for item in items)
        else:
            results = self._pool.map(_run, items)
        out: list[R] = []
        for r in results:
            out.append(r)
            if done is not None:
                done(len(out))
        return out
