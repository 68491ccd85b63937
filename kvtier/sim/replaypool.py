"""Exact replays of one trace, several at once (``kvtier plan`` checks its candidate sizes so).

A replay is single-threaded Python, so ``jobs`` of them run in worker processes: each worker
gets the trace once, when it starts, and is then sent only the hierarchy to replay; it sends back
the one number asked for. Workers start from a fork server (a clean process, so no thread or
lock of the caller's is copied into them; ``spawn`` where there is none). With ``jobs=1`` the
replays run one after another in this process. Results do not depend on ``jobs``: every replay
is deterministic.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from types import TracebackType

from kvtier.sim.hierarchy import Hierarchy
from kvtier.sim.trace import Trace

#: ``fn(trace, hierarchy, hints)``: the replay and what is kept of it (a picklable function)
ReplayFn = Callable[[Trace, Hierarchy, bool], float]

_job: tuple[Trace, bool, ReplayFn] | None = None  # a worker's trace, hints and function


def _start(trace: Trace, hints: bool, fn: ReplayFn) -> None:
    global _job
    _job = (trace, hints, fn)


def _run(hier: Hierarchy) -> float:
    assert _job is not None, "worker started without its trace"
    trace, hints, fn = _job
    return fn(trace, hier, hints)


def default_jobs() -> int:
    """The CPUs this process may use, at most 8 (each worker is one replay at a time)."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        n = os.cpu_count() or 1
    return max(1, min(n, 8))


class ReplayPool:
    """``run(hierarchies)``: ``fn`` of each, in order, up to ``jobs`` at a time. Use as a
    context manager (the workers stop on exit)."""

    def __init__(self, trace: Trace, hints: bool, fn: ReplayFn, jobs: int = 1) -> None:
        self.trace, self.hints, self.fn = trace, hints, fn
        self.jobs = max(1, jobs)
        self._pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> ReplayPool:
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

    def run(self, hiers: Sequence[Hierarchy]) -> list[float]:
        if self._pool is None or len(hiers) < 2:
            return [self.fn(self.trace, h, self.hints) for h in hiers]
        return list(self._pool.map(_run, hiers))
