"""LRU stack distances: the hits of an LRU hierarchy of *any* sizes from one pass over a trace.

An exclusive hierarchy of LRU tiers that demotes victims one tier down is one LRU stack cut into
segments (tier 0 = the top ``c0`` blocks, tier 1 the next ``c1`` ...). So one pass over the trace
gives every block reference its stack position before its request is served
(:func:`lru_profile`), and the cached tokens per tier and request of any sizes follow with a few
numpy operations (:func:`estimate_hits`). A block is in its request's leading run at total
capacity ``C`` iff the largest stack position of its chain up to it is ``< C``. This is exact
for the simulator's LRU replay except when a request is longer than the first tier (the replay
keeps only its leading blocks); ``tests/test_sim_sizing.py`` checks it against the replay.
``kvtier plan`` screens candidate sizes with it (``kvtier.sim.sizing``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvtier.sim.trace import Trace

NEVER = 1 << 62
I64 = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class StackProfile:
    """LRU stack positions of every block reference of a trace (arrays indexed by reference).

    ``dist`` is the block's position in the LRU stack before its request is served (0 = most
    recent, ``NEVER`` = first reference); ``reach`` the largest ``dist`` of its chain up to it,
    so the block is in the leading run at total capacity ``C`` iff ``reach < C``. References are
    sorted by ``reach`` (so the hits at capacity ``C`` are a prefix).
    """

    req: I64
    dist: I64
    reach: I64
    tokens: npt.NDArray[np.float64]
    n_requests: int
    distinct: int


def lru_profile(trace: Trace) -> StackProfile:
    """One pass (Fenwick tree over access times, O(refs log refs)) over ``trace``."""
    req, dist, reach, tokens, distinct = stack_positions(trace)
    order = np.argsort(reach, kind="stable")
    return StackProfile(
        req=req[order],
        dist=dist[order],
        reach=reach[order],
        tokens=tokens[order],
        n_requests=len(trace.requests),
        distinct=distinct,
    )


def stack_positions(trace: Trace) -> tuple[I64, I64, I64, npt.NDArray[np.float64], int]:
    """Per block reference, in trace order: its request, its LRU stack position before the
    request is served (``NEVER``: first reference), the largest position of its chain up to it,
    its tokens; and the number of distinct blocks."""
    n_refs = trace.block_events
    size = n_refs + 1
    tree = [0] * (size + 1)
    last: dict[int, int] = {}
    dist: list[int] = []
    reach: list[int] = []
    tokens: list[int] = []
    req: list[int] = []
    bt = trace.block_tokens
    live = now = 0
    for i, r in enumerate(trace.requests):
        blocks = r.blocks
        run = -1
        for k in blocks:
            p = last.get(k)
            if p is None:
                d = NEVER
            else:
                s = 0
                j = p
                while j > 0:
                    s += tree[j]
                    j &= j - 1
                d = live - s  # keys touched after k's last access
            if d > run:
                run = d
            dist.append(d)
            reach.append(run)
        n = len(blocks)
        if n:
            tokens.extend([bt] * (n - 1))
            tokens.append(r.input_length - bt * (n - 1))
            req.extend([i] * n)
        for k in reversed(blocks):  # the replay refreshes a chain leaf first: the root ends on top
            p = last.get(k)
            if p is None:
                live += 1
            else:
                j = p
                while j <= size:
                    tree[j] -= 1
                    j += j & -j
            now += 1
            last[k] = now
            j = now
            while j <= size:
                tree[j] += 1
                j += j & -j
    return (
        np.array(req, dtype=np.int64),
        np.array(dist, dtype=np.int64),
        np.array(reach, dtype=np.int64),
        np.array(tokens, dtype=np.float64),
        len(last),
    )


def estimate_hits(prof: StackProfile, caps: tuple[int, ...]) -> npt.NDArray[np.float64]:
    """Cached tokens ``[tier, request]`` of an LRU hierarchy with ``caps`` blocks per tier."""
    n_t = len(caps)
    stop = int(np.searchsorted(prof.reach, sum(caps), side="left"))
    tier = np.searchsorted(np.cumsum(caps), prof.dist[:stop], side="right")
    idx = tier * prof.n_requests + prof.req[:stop]
    out = np.bincount(idx, weights=prof.tokens[:stop], minlength=n_t * prof.n_requests)
    return np.asarray(out, dtype=np.float64).reshape(n_t, prof.n_requests)
