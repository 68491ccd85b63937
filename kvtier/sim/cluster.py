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
* **Node tiers.** The tiers before the first shared one (HBM, DRAM, NVMe) exist once per node:
  each node is a store of its own, run by the store's own decisions as a one-node replay is
  (``kvtier.sim.storemodel``: inclusive hierarchy, full blocks only).
* **Shared tiers** (from ``shared_from`` on: the pool, object storage) exist once for the
  cluster (``kvtier.sim.sharedtier``): every node's store writes the blocks it stores through
  to each of them, and after the run its own tiers hold asks the first shared tier that holds
  any of the rest for its leading run, as ``TieredStore`` does. A shared tier evicts on its own
  (its policy, fed every node's writes and reads); a node learns of it only when a read fails.
  A victim of a node's first tier that the node wrote through is not demoted (a copy exists
  below): the store's inclusive rule, with the pool as the lower copy.
* **Hits.** A request's cached tokens are the blocks its node loaded, each credited to the
  tier it was read from; blocks read from a shared tier are promoted into the node's first.

Belady's MIN is not offered here: each node's future depends on the routing of every request.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import numpy as np
import numpy.typing as npt

from kvtier.errors import ConfigError
from kvtier.policy.hints import output_class
from kvtier.sim.hierarchy import ROUTES
from kvtier.sim.replay import ReplayResult, TierSpec, build_policy
from kvtier.sim.sharedtier import SharedTier
from kvtier.sim.storemodel import ModelStore
from kvtier.sim.trace import Trace

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
    nodes; ``hints`` and ``progress`` as ``replay``. Tiers of 0 blocks are left out (an empty
    pool passes the writes on to object storage); an empty first tier caches nothing."""
    specs = tuple(tiers)
    if nodes < 1:
        raise ConfigError(f"--nodes must be >= 1, got {nodes}")
    if not 1 <= shared_from <= len(specs):
        raise ConfigError(
            "a cluster needs a first tier of each node's own (hbm) before the shared ones"
        )
    if any(s.policy.lower() == "belady" for s in specs):
        raise ConfigError(
            "belady is not offered for a cluster (--nodes > 1) or a shared tier (pool, object): "
            "pick an online policy"
        )
    n_req = len(trace.requests)
    hits = np.zeros((len(specs), n_req), dtype=np.int64)
    # the tiers that hold anything, by their place in ``specs``
    own_at = [t for t in range(shared_from) if specs[t].capacity_blocks]
    shared_at = [t for t in range(shared_from, len(specs)) if specs[t].capacity_blocks]
    if not specs[0].capacity_blocks:
        own_at = shared_at = []
    at = own_at + shared_at  # a node store's tier t is specs[at[t]]
    shared = [SharedTier(specs[t].capacity_blocks, build_policy(specs[t], None)) for t in shared_at]
    stores = [
        ModelStore(
            [specs[t].capacity_blocks for t in own_at] or [0],
            lambda t, _cap: build_policy(specs[own_at[t]], None),
            shared,
        )
        for _ in range(nodes)
    ]
    by_cache = route == "cache"
    node_of = np.zeros(n_req, np.int64) if by_cache else route_of(trace, nodes, route)
    load = [0] * nodes  # tokens prefilled so far, per node (``cache`` routing)
    bt = trace.block_tokens
    block_hits = 0
    for i, (req, n) in enumerate(zip(trace.requests, node_of.tolist(), strict=True)):
        blocks = req.blocks[: req.input_length // bt]
        if by_cache:
            n = node_of[i] = _by_cache(stores, blocks, load)
        if own_at:
            out = req.output_length

            def hint(run: int, out: int = out) -> Hashable | None:
                return output_class(out, run > 0) if hints else None

            read = stores[n].serve(blocks, hint)
            block_hits += len(read)
            for t in set(read):
                hits[at[t], i] = bt * read.count(t)
            if by_cache:
                load[n] += req.input_length - bt * len(read)
        if progress is not None and i & 255 == 255:
            progress(i + 1)
    if progress is not None:
        progress(n_req)

    def total(counts: Callable[[ModelStore], list[int]]) -> list[int]:
        out = [0] * len(specs)
        for st in stores:
            for t, c in zip(at[: len(own_at)], counts(st), strict=False):
                out[t] += c
        return out

    written = total(lambda st: st.written)
    evicted = total(lambda st: st.evicted)
    for t, sh in zip(shared_at, shared, strict=True):
        written[t], evicted[t] = sh.written, sh.evicted
    promoted = [0] * len(specs)
    for st in stores:
        for t, c in enumerate(st.promoted[: len(at)]):
            promoted[at[t]] += c
    return ReplayResult(
        tiers=specs,
        hit_tokens=hits,
        input_tokens=np.array([r.input_length for r in trace.requests], dtype=np.int64),
        promoted_blocks=promoted,
        written_blocks=written,
        evicted_blocks=evicted,
        block_hits=block_hits,
        block_refs=trace.block_events,
        hints=hints,
        nodes=nodes,
        node_of=node_of,
        shared_from=shared_from,
        route=route,
    )


def _by_cache(stores: Sequence[ModelStore], blocks: Sequence[int], load: list[int]) -> int:
    """``cache`` routing (module docstring): the node holding the longest leading run of
    ``blocks`` in its own tiers, least loaded first among equals, unless it is overloaded."""
    best, pick = -1, 0
    for n, st in enumerate(stores):
        run = st.local_run(blocks)
        if run > best or (run == best and load[n] < load[pick]):
            best, pick = run, n
    least = min(range(len(load)), key=load.__getitem__)
    if load[pick] - load[least] > BALANCE * sum(load) / len(load):
        return least
    return pick
