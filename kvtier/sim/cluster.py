"""Replay a trace on a cluster: engine nodes with tiers of their own, sharing the pool tiers.

What a one-node replay cannot show is what a cluster-shared tier is for: a prefix computed on
one node, read on another. Model (the one-node rules of ``kvtier.sim.replay`` otherwise):

* **Routing.** Request ``i`` goes to one of ``nodes`` nodes: ``rr`` sends it to node ``i mod
  nodes`` (a load balancer that ignores prefixes); ``prefix`` sends it by its first block, so
  requests that start alike (a system prompt, a document, a conversation) meet on one node (at
  the price of balance: see ``busy_s`` in the report); ``cache`` sends it to the node whose own
  tiers hold the longest leading run of its blocks (the least loaded of those), unless that
  node's load -- tokens it prefilled so far -- exceeds the least loaded node's by more than
  ``BALANCE`` of the mean load, then to the least loaded node (a cache-aware router with a
  balance guard, as serving routers do).
* **Node tiers.** The tiers before the first shared one (HBM, DRAM, NVMe) exist once per node,
  each node's an exclusive hierarchy of its own (``kvtier.sim.tierchain.TierChain``). This is
  the older model (whole chains inserted, the partial last block credited), not yet the
  store's own decisions that one-node replays run (``kvtier.sim.storemodel``): a cluster's
  numbers are the exclusive model's.
* **Shared tiers** (from ``shared_from`` on: the pool, object storage) exist once for the
  cluster and are *written through*: when any node has served a request, the shared tiers serve
  its chain too (missing blocks written, blocks found in a lower shared tier moved up, the whole
  chain an access to the first shared tier's policy), so every other node can hit them. A block
  can be in a node's tiers and in the shared ones at once.
* **Hits.** A request's leading run is over its node's tiers and the shared ones together; each
  block is credited to the node tier holding it, else to the shared tier. A block found only in
  the shared tiers is copied into the node's first tier.

Belady's MIN is not offered here: each node's future depends on the routing of every request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import takewhile

import numpy as np
import numpy.typing as npt

from kvtier.errors import ConfigError
from kvtier.policy.hints import output_class
from kvtier.sim.hierarchy import ROUTES
from kvtier.sim.replay import ReplayResult, TierSpec, build_policy
from kvtier.sim.tierchain import TierChain
from kvtier.sim.trace import Request, Trace

#: ``cache`` routing: how far above the least loaded node (a fraction of the mean load) a node
#: may be and still get a request for its cached prefix
BALANCE = 0.1
ROUTE_DESCRIPTIONS = {
    "rr": "round robin",
    "prefix": "by first block (requests that start alike meet on one node)",
    "cache": "to the node caching the longest prefix, unless its load is over the least "
    f"loaded node's by more than {BALANCE:.0%} of the mean",
}
#: a multiplicative hash of the first block id (ids of synthetic traces are small and dense)
_MIX = 0x9E3779B97F4A7C15


def route_of(trace: Trace, nodes: int, route: str) -> npt.NDArray[np.int64]:
    """The node of every request, for the routes that do not look at the caches (``rr``,
    ``prefix``)."""
    n_req = len(trace.requests)
    if route == "rr":
        return np.arange(n_req, dtype=np.int64) % nodes
    if route == "prefix":
        return (
            np.array(
                [
                    ((r.blocks[0] * _MIX) & (2**64 - 1)) >> 32 if r.blocks else i
                    for i, r in enumerate(trace.requests)
                ],
                dtype=np.int64,
            )
            % nodes
        )
    raise ConfigError(f"--route {route!r} is unknown; choose {' or '.join(ROUTES)}")


def replay_cluster(
    trace: Trace,
    tiers: Sequence[TierSpec],
    nodes: int,
    shared_from: int,
    route: str = "rr",
    hints: bool = True,
    progress: Callable[[int], None] | None = None,
) -> ReplayResult:
    """Replay ``trace`` on ``nodes`` nodes with ``tiers`` (fastest first): ``tiers[:shared_from]``
    per node, ``tiers[shared_from:]`` shared (module docstring). Counters are summed over the
    nodes; ``hints`` and ``progress`` as ``replay``."""
    specs = tuple(tiers)
    if nodes < 1:
        raise ConfigError(f"--nodes must be >= 1, got {nodes}")
    if not 1 <= shared_from <= len(specs):
        raise ConfigError(
            "a cluster needs a first tier of each node's own (hbm) before the shared ones"
        )
    if any(s.policy.lower() == "belady" for s in specs):
        raise ConfigError(
            "belady is not offered for a cluster (--nodes > 1): pick an online policy"
        )
    own = specs[:shared_from]
    # the shared tiers that hold anything (an empty pool passes the writes on to object storage)
    shared_at = [j for j in range(shared_from, len(specs)) if specs[j].capacity_blocks]
    shared_specs = [specs[j] for j in shared_at]

    def chain_of(tier_specs: Sequence[TierSpec]) -> TierChain:
        pols = [build_policy(s, None) for s in tier_specs]
        return TierChain(pols, [s.capacity_blocks for s in tier_specs])

    node_tiers = [chain_of(own) for _ in range(nodes)]
    shared = chain_of(shared_specs) if shared_specs else None
    by_cache = route == "cache"
    node_of = np.zeros(len(trace.requests), np.int64) if by_cache else route_of(trace, nodes, route)
    load = [0] * nodes  # tokens prefilled so far, per node (``cache`` routing)
    bt = trace.block_tokens
    n_req = len(trace.requests)
    hits = [[0] * n_req for _ in specs]
    cap0 = own[0].capacity_blocks
    scap = shared_specs[0].capacity_blocks if shared_specs else 0
    block_hits = 0
    for i, (req, n) in enumerate(zip(trace.requests, node_of.tolist(), strict=True)):
        blocks = req.blocks
        if by_cache:
            n = node_of[i] = _by_cache(node_tiers, blocks, load)
        node = node_tiers[n]
        located = node.locate(blocks)
        s_located = shared.locate(blocks) if shared is not None else []
        both = [
            t if t is not None or s is None else shared_at[s]
            for t, s in zip(located, s_located or [None] * len(blocks), strict=True)
        ]
        run = credit(both, req, bt, hits, i)
        block_hits += run
        if by_cache:
            load[n] += req.input_length - sum(h[i] for h in hits)
        hint = output_class(req.output_length, run > 0) if hints else None
        chain = blocks if len(blocks) <= cap0 else blocks[:cap0]
        node.serve(chain, located[: len(chain)], hint)
        if shared is not None:
            schain = blocks if len(blocks) <= scap else blocks[:scap]
            shared.serve(schain, s_located[: len(schain)], hint)
        if progress is not None and i & 255 == 255:
            progress(i + 1)
    if progress is not None:
        progress(n_req)

    def total(counts: Callable[[TierChain], list[int]]) -> list[int]:
        out = [sum(c) for c in zip(*(counts(x) for x in node_tiers), strict=True)]
        out += [0] * (len(specs) - shared_from)
        if shared is not None:
            for j, c in zip(shared_at, counts(shared), strict=True):
                out[j] = c
        return out

    return ReplayResult(
        tiers=specs,
        hit_tokens=np.array(hits, dtype=np.int64).reshape(len(specs), n_req),
        input_tokens=np.array([r.input_length for r in trace.requests], dtype=np.int64),
        promoted_blocks=total(lambda x: x.promoted),
        written_blocks=total(lambda x: x.written),
        evicted_blocks=total(lambda x: x.evicted),
        block_hits=block_hits,
        block_refs=trace.block_events,
        hints=hints,
        nodes=nodes,
        node_of=node_of,
        shared_from=shared_from,
        route=route,
    )


def _by_cache(node_tiers: Sequence[TierChain], blocks: Sequence[int], load: list[int]) -> int:
    """``cache`` routing (module docstring): the node holding the longest leading run of
    ``blocks`` in its own tiers, least loaded first among equals, unless it is overloaded."""
    best, pick = -1, 0
    for n, node in enumerate(node_tiers):
        run = sum(1 for _ in takewhile(node.where.__contains__, blocks))
        if run > best or (run == best and load[n] < load[pick]):
            best, pick = run, n
    least = min(range(len(load)), key=load.__getitem__)
    if load[pick] - load[least] > BALANCE * sum(load) / len(load):
        return least
    return pick


def credit(located: list[int | None], req: Request, bt: int, hits: list[list[int]], i: int) -> int:
    """Credit request ``i``'s cached tokens to the tiers holding its leading run of blocks
    (``located``: each block's tier before serving, None if absent) in ``hits[tier][i]``: each
    block ``bt`` tokens, the last block of a fully cached request what is left of its input.
    Returns the run's length in blocks."""
    n = len(located)
    run = located.index(None) if None in located else n
    if run:
        head = located[:run]
        first = head.count(0)
        hits[0][i] += bt * first
        if first < run:  # some of the run sits below the first tier
            for t in head:
                if t:
                    hits[t][i] += bt
        if run == n:
            hits[located[-1]][i] += req.input_length - bt * n  # type: ignore[index]
    return run
