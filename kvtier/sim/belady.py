"""Belady's MIN: the offline-optimal eviction policy, the ceiling every online policy is measured
against.

It evicts the resident block whose next reference lies farthest in the future (never-again blocks
first); among equals, the deepest block of its chain first, so a parent is never dropped while its
child stays (a child's next use is never earlier than its parent's, since a request holding the
child holds the parent). It knows the future through a :class:`FutureOracle` that the replay
engine advances request by request; it obeys the same insertion model as the online policies
(every block of a served request is inserted), so under that model its block hits are an upper
bound on theirs.

Implemented as an ``EvictionPolicy`` so the replay engine drives it exactly like LRU; a lazy
max-heap keyed by (next use, depth) makes ``evict`` O(log n) amortised.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Collection, Hashable, Sequence

from kvtier.policy.base import EvictionPolicy
from kvtier.sim.trace import Trace

NEVER = 1 << 62


class FutureOracle:
    """Next-use times of the blocks of a trace, advanced one request at a time.

    ``next_use[k]`` / ``depth[k]`` hold, for every block seen so far, the index of the next request
    that references it (``NEVER`` if none) and its position in its chain. Mutated only by
    :meth:`advance`; policies read it.
    """

    __slots__ = ("_nxt", "depth", "next_use")

    def __init__(self, trace: Trace) -> None:
        last: dict[int, int] = {}
        nxt: list[list[int]] = [[] for _ in trace.requests]
        for i in range(len(trace.requests) - 1, -1, -1):
            blocks = trace.requests[i].blocks
            nxt[i] = [last.get(k, NEVER) for k in blocks]
            for k in blocks:
                last[k] = i
        self._nxt = nxt
        self.next_use: dict[int, int] = {}
        self.depth: dict[int, int] = {}

    def advance(self, i: int, blocks: Sequence[int]) -> None:
        """Request ``i`` (with these ``blocks``) is being served: move their next uses on."""
        nu = self.next_use
        dp = self.depth
        for j, (k, n) in enumerate(zip(blocks, self._nxt[i], strict=True)):
            nu[k] = n
            dp[k] = j


class Belady(EvictionPolicy[int]):
    """Offline MIN for int block ids; needs the replayed trace's :class:`FutureOracle`."""

    name = "belady"

    def __init__(self, capacity: int, oracle: FutureOracle | None = None) -> None:
        super().__init__(capacity)
        if oracle is None:
            raise ValueError("Belady needs the trace's FutureOracle (it is an offline policy)")
        self._oracle = oracle
        self._resident: dict[int, int] = {}  # key -> next use recorded in its live heap entry
        self._heap: list[tuple[int, int, int]] = []  # (-next_use, -depth, key)

    def _push(self, keys: Sequence[int]) -> None:
        nu = self._oracle.next_use
        dp = self._oracle.depth
        res = self._resident
        heap = self._heap
        for k in keys:
            n = nu.get(k, NEVER)
            if res.get(k) != n:
                res[k] = n
                heapq.heappush(heap, (-n, -dp.get(k, 0), k))
        if len(heap) > 4 * len(res) + 64:  # drop stale entries now and then
            self._heap = [e for e in heap if res.get(e[2]) == -e[0]]
            heapq.heapify(self._heap)

    def insert(self, keys: Sequence[int], hint: Hashable | None = None) -> None:
        self._push(keys)

    def access(self, keys: Sequence[int]) -> None:
        self._push([k for k in keys if k in self._resident])

    def remove(self, key: int) -> None:
        self._resident.pop(key, None)

    def evict(self, n: int, evictable: Callable[[int], bool]) -> list[int] | None:
        if n <= 0:
            return []
        if n > len(self._resident):
            return None
        heap = self._heap
        res = self._resident
        victims: list[int] = []
        skipped: list[tuple[int, int, int]] = []
        while heap and len(victims) < n:
            entry = heapq.heappop(heap)
            k = entry[2]
            if res.get(k) != -entry[0]:
                continue  # stale
            if not evictable(k):
                skipped.append(entry)
                continue
            victims.append(k)
            del res[k]
        for e in skipped:
            heapq.heappush(heap, e)
        if len(victims) < n:  # all-or-nothing: put the chosen ones back
            for k in victims:
                res[k] = self._oracle.next_use.get(k, NEVER)
                heapq.heappush(heap, (-res[k], -self._oracle.depth.get(k, 0), k))
            return None
        return victims

    def resident(self) -> Collection[object]:
        return self._resident
