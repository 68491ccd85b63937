"""LRU stack positions on a cluster: the hits of any tier sizes on N nodes from one pass.

With a static routing (``rr`` or ``prefix``: a request's node does not depend on the caches), a
node's own tiers see exactly its own requests, so they are one LRU stack over that subsequence
cut into segments (``kvtier.sim.lrustack``); the shared tiers, written through by every node,
are one LRU stack over the whole trace. So every block reference gets two stack positions, its
node's and the cluster's, and for any sizes a block is present iff its node position is within
the node's tiers or its cluster position within the shared ones; the leading run and the tier
credited (the node's first) follow with numpy. That is an exclusive LRU hierarchy with whole
chains written through, not the store's model that the cluster replay runs
(``kvtier.sim.cluster``): like the one-node profile it is the sizing walk's screen, and the
replay decides. ``cache`` routing depends on the caches: no profile.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvtier.errors import ConfigError
from kvtier.sim.cluster import route_of
from kvtier.sim.lrustack import I64, stack_positions
from kvtier.sim.trace import Trace


@dataclass(frozen=True, slots=True)
class ClusterProfile:
    """Per block reference, in trace order: request, tokens, LRU stack position in its node's
    own stack and in the cluster's (shared) stack; ``start[i]`` the first reference of request
    ``i`` (``start[-1]`` = the number of references)."""

    req: I64
    tokens: npt.NDArray[np.float64]
    node_dist: I64
    shared_dist: I64
    start: I64
    n_requests: int
    distinct: int


def cluster_profile(trace: Trace, nodes: int, route: str) -> ClusterProfile:
    """Both stack positions of every reference of ``trace`` on ``nodes`` nodes (``route``)."""
    if route == "cache":
        raise ConfigError(
            "sizing a cluster needs a routing that does not depend on the caches: rr or prefix"
        )
    req, shared_dist, _, tokens, distinct = stack_positions(trace)
    node_dist = np.empty_like(shared_dist)
    lengths = np.array([len(r.blocks) for r in trace.requests], dtype=np.int64)
    start = np.concatenate(([0], np.cumsum(lengths)))
    node_of = route_of(trace, nodes, route)
    for n in range(nodes):
        mine = np.flatnonzero(node_of == n)
        if not len(mine):
            continue
        sub = Trace(
            tuple(trace.requests[i] for i in mine), trace.block_tokens, trace.name, trace.id_tokens
        )
        _, dist, _, _, _ = stack_positions(sub)
        # the references of node n's requests, in trace order (= the subtrace's order)
        refs = np.concatenate([np.arange(start[i], start[i + 1]) for i in mine])
        node_dist[refs] = dist
    return ClusterProfile(req, tokens, node_dist, shared_dist, start, len(trace.requests), distinct)


def estimate_cluster_hits(
    prof: ClusterProfile, caps: tuple[int, ...], shared_from: int
) -> npt.NDArray[np.float64]:
    """Cached tokens ``[tier, request]`` of LRU tiers of ``caps`` blocks: ``caps[:shared_from]``
    each node's own, the rest shared (the cluster replay's model, ``kvtier.sim.cluster``)."""
    own = np.cumsum(caps[:shared_from])
    shared = np.cumsum(caps[shared_from:])
    in_own = prof.node_dist < (own[-1] if len(own) else 0)
    present = in_own | (prof.shared_dist < (shared[-1] if len(shared) else 0))
    # a reference is in its request's leading run iff no reference before it in the request
    # (itself included) is absent: count the absent ones so far, per request
    absent = np.cumsum(~present)
    before = np.concatenate(([0], absent))[prof.start[:-1]]
    counts = np.diff(prof.start)
    run = absent - np.repeat(before, counts) == 0
    tier = np.where(
        in_own,
        np.searchsorted(own, prof.node_dist, side="right"),
        shared_from + np.searchsorted(shared, prof.shared_dist, side="right"),
    )
    n_t = len(caps)
    idx = tier[run] * prof.n_requests + prof.req[run]
    out = np.bincount(idx, weights=prof.tokens[run], minlength=n_t * prof.n_requests)
    return np.asarray(out, dtype=np.float64).reshape(n_t, prof.n_requests)
