"""The sizing search behind ``kvtier plan --trace FILE --slo-ttft-p90 S`` (its options and
output: ``kvtier.cli.plan_trace``): the cheapest tier sizes whose TTFT p90 meets S.

The search, in two stages:

1. **Screen with one pass.** The LRU stack distances of ``kvtier.sim.lrustack`` give the hits
   per tier of an LRU hierarchy of *any* sizes from one pass over the trace (exact for LRU when
   the first tier holds the longest request, which the search ensures).
2. **Verify by replay.** The largest configuration is replayed first with the chosen policy
   (``kvtier.sim.replay``). Then candidate sizes (a geometric grid per tier, 0 included below the
   first) are walked cheapest first; one whose estimated p90 is within ``--screen-margin`` of the
   SLO is replayed exactly and priced (``kvtier.sim.cost``); the first that meets the SLO is the
   answer so far, so the result always comes from a real replay. The margin lets a policy better
   than LRU (the default) pass configurations LRU would miss. Once an answer is found, the walk
   goes on over the admitted configurations cheaper than it, most promising (lowest estimate)
   first: a cheaper one that meets the SLO becomes the answer, and the walk starts again below it.
   (Walked cheapest first, the budget would go on the sizes least likely to meet the SLO.) When no
   admitted configuration cheaper than the answer is left, the margin doubles (or grows to the most
   the policy has beaten the estimate by in the replays so far, if that is more), up to
   ``REFINE_MARGIN``, and the walk goes on. (A policy that beats the LRU estimate by more than the
   margin meets the SLO at sizes the first walk did not replay; docs/simulation.md has a case.) For
   LRU the estimate is exact, so its margin stays 0 and the first answer is the cheapest. When no
   admitted candidate meets the SLO but the largest configuration does, the margin doubles the same
   way, and the largest configuration is the answer of last resort. (A policy other than LRU is not
   always better with more capacity, so a miss at the largest size does not end the walk.) A looser
   SLO admits a superset of candidates, so it never costs more (exactly so for LRU, whose estimate
   is exact and margin 0; for other policies the margins make it a strong tendency, not a
   guarantee). The next ``--jobs`` candidates of a walk are replayed at once, in worker processes
   (``kvtier.sim.replaypool``); the answer and the replays counted do not depend on it.

Costs are ``capacity x $/GB/month`` per tier (GPU rental excluded); the tiers searched are HBM
(at most what ``--gpus`` x ``--gpu-memory`` leave after weights and a 10% reserve), then
``--dram``, ``--nvme``, ``--pool`` (each an upper bound; 0 leaves the tier out). With
``--nodes N`` the sizes are a cluster's (``kvtier.sim.cluster``): HBM, DRAM and NVMe bought once
per node, the pool once; the screen is then ``kvtier.sim.clusterstack``'s profile (an exclusive-LRU
estimate, as the one-node screen is; ``cache`` routing is screened as ``prefix``) and the
replays, which decide, are cluster replays (the store's model on every node).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.policy import POLICIES
from kvtier.sim.cluster import replay_cluster
from kvtier.sim.clusterstack import cluster_profile, estimate_cluster_hits
from kvtier.sim.cost import price
from kvtier.sim.hierarchy import Hierarchy
from kvtier.sim.lrustack import StackProfile, estimate_hits, lru_profile
from kvtier.sim.replay import replay
from kvtier.sim.replaypool import ReplayPool
from kvtier.sim.report import summarize
from kvtier.sim.trace import Trace

#: screening margin for policies other than LRU (their hits differ from the LRU estimate)
DEFAULT_MARGIN = 0.01
#: the screen widens (doubling) up to this margin while no admitted candidate meets the SLO
MAX_MARGIN = 0.64
#: once one does, up to this margin to look for a cheaper answer (wider finds more and costs
#: more replays; docs/simulation.md, "Speed and sizing")
REFINE_MARGIN = 0.32
I64 = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class SizingResult:
    """Outcome of :func:`search`: the chosen sizes (bytes, per tier), or None if even the
    largest configuration misses the SLO."""

    caps_bytes: tuple[int, ...] | None
    replays: int
    estimated: int
    candidates: int
    best_p90_s: float  # exact p90 of the chosen sizes, or the lowest replayed when none met it
    #: when none met the SLO: the sizes (bytes) that reached ``best_p90_s``
    best_bytes: tuple[int, ...] = ()
    #: the replay budget ran out: a cheaper configuration (or, when none met the SLO, one that
    #: meets it) may exist untried; a feasible answer is the cheapest replayed that met it (the
    #: largest configuration if no other did)
    exhausted: bool = False
    #: ``kvtier.sim.report.summarize`` of the replay of the chosen sizes (or of ``best_bytes``)
    summary: dict[str, Any] = field(default_factory=dict)


def _p90(hits: npt.NDArray[np.float64], inp: I64, hier: Hierarchy) -> float:
    t = price(hits, inp, [x.cost for x in hier.tiers], hier.compute, hier.gpu)  # type: ignore[arg-type]
    return float(np.percentile(t.ttft_s, 90))


def sized(hier: Hierarchy, caps_bytes: tuple[int, ...]) -> Hierarchy:
    """``hier`` with these sizes, zero-sized tiers left out (an empty first tier caches nothing)."""
    tiers = [
        replace(t, capacity_bytes=c) for t, c in zip(hier.tiers, caps_bytes, strict=True) if c > 0
    ]
    if caps_bytes[0] == 0:
        tiers = [replace(hier.tiers[0], capacity_bytes=0)]
    return hier.with_tiers(tiers)


def exact_p90(trace: Trace, hier: Hierarchy, hints: bool = True) -> tuple[float, Any]:
    """Replay ``hier`` (sizes as given; ``hints`` as ``replay``) and return (TTFT p90 in s, the
    replay result)."""
    if hier.clustered:
        specs = hier.specs()
        res = replay_cluster(trace, specs, hier.nodes, hier.shared_from, hier.route, hints)
    else:
        res = replay(trace, hier.specs(), hints=hints)
    return _p90(res.hit_tokens.astype(np.float64), res.input_tokens, hier), res


def replay_p90(trace: Trace, hier: Hierarchy, hints: bool) -> tuple[float, dict[str, Any]]:
    """``exact_p90``'s p90 and the replay's summary (what a worker of ``ReplayPool`` sends
    back: the report of the chosen sizes needs no replay of its own)."""
    p90, res = exact_p90(trace, hier, hints)
    return p90, summarize(trace, hier, res)


#: the per-tier alternatives ``lower_policy_check`` replays below the first tier
LOWER_ALTERNATIVES = ("lru", "s3fifo")


def lower_policy_check(trace: Trace, hier: Hierarchy, hints: bool = True) -> list[dict[str, Any]]:
    """Replay ``hier`` (an answer's sizes) again with every tier below the first run by each
    of ``LOWER_ALTERNATIVES`` not already running all of them: ``{"lower_policy", "ttft_p90_s",
    "token_hit_ratio"}`` each. ``auto`` judges a lower tier on the lookups that reach it, not on
    what the tier is given, and can choose the worse ranking there (docs/simulation.md); the
    answer's sizes with a per-tier ``policy`` may do better. Empty for one tier, and when the
    first tier runs a simulator-only policy (``belady``: a reference, not a configuration)."""
    if len(hier.tiers) < 2 or hier.tiers[0].policy.lower() not in POLICIES:
        return []
    out = []
    for pol in LOWER_ALTERNATIVES:
        if all(t.policy.lower() == pol for t in hier.tiers[1:]):
            continue
        alt = hier.with_tiers([hier.tiers[0], *(replace(t, policy=pol) for t in hier.tiers[1:])])
        p90, res = exact_p90(trace, alt, hints)
        out.append({"lower_policy": pol, "ttft_p90_s": p90, "token_hit_ratio": res.token_hit_ratio})
    return out


def grid(max_blocks: int, points: int, lo: int = 1) -> list[int]:
    """Sizes in blocks: 0 (tier absent), then ``points`` geometric steps from ``max(lo,
    max_blocks / 64)`` up to ``max_blocks``."""
    if max_blocks < max(lo, 1):
        return [0]
    lo = max(lo, 1, max_blocks // 64)
    steps = np.geomspace(lo, max_blocks, points) if points > 1 else np.array([max_blocks])
    return [0, *sorted({int(s) for s in np.rint(steps)})]


def search(
    trace: Trace,
    hier: Hierarchy,
    max_blocks: list[int],
    slo_s: float,
    points: int = 8,
    margin: float = 0.0,
    max_replays: int = 40,
    prof: StackProfile | None = None,
    hints: bool = True,
    jobs: int = 1,
) -> SizingResult:
    """Cheapest sizes of the tiers (each <= ``max_blocks``) whose replayed p90 <= ``slo_s``.
    Up to ``jobs`` candidates are replayed at once (the next ones of the walk, in worker
    processes); the answer and the replays counted are those of one at a time (a candidate
    after the one that met the SLO was replayed for nothing and is not counted)."""
    bb = hier.block_bytes
    shared = hier.shared_from if hier.nodes > 1 else len(hier.tiers)
    estimate: Callable[[tuple[int, ...]], npt.NDArray[np.float64]]
    if hier.nodes > 1:
        # cache routing has no static profile: requests that start alike tend to meet on the
        # node that cached them, so routing by first block is its screen (the replay decides)
        screen = "prefix" if hier.route == "cache" else hier.route
        cprof = cluster_profile(trace, hier.nodes, screen)
        ws = cprof.distinct

        def estimate(caps: tuple[int, ...]) -> npt.NDArray[np.float64]:
            return estimate_cluster_hits(cprof, caps, shared)
    else:
        lprof = prof or lru_profile(trace)
        ws = lprof.distinct

        def estimate(caps: tuple[int, ...]) -> npt.NDArray[np.float64]:
            return estimate_hits(lprof, caps)

    # the first tier holds at least the longest request (the one being served lives there),
    # which also keeps the LRU estimate exact (the replay truncates longer chains); so does a
    # cluster's first shared tier (every request is written through to it)
    longest = max(len(r.blocks) for r in trace.requests)
    grids = [
        grid(min(m, ws), points, longest if i in (0, shared) else 1)
        for i, m in enumerate(max_blocks)
    ]
    # a node's own tiers are bought once per node
    price_gb = [
        t.cost.usd_per_gb_month * bb / 1e9 * (hier.nodes if i < shared else 1)
        for i, t in enumerate(hier.tiers)
    ]
    configs = []
    for caps in itertools.product(*grids):
        if caps[0] == 0 and any(caps[1:]):
            continue  # every block enters through the first tier
        # a tier below others that already hold the whole working set only adds cost
        if any(c and sum(caps[:i]) >= ws for i, c in enumerate(caps) if i):
            continue
        configs.append((sum(c * p for c, p in zip(caps, price_gb, strict=True)), caps))
    configs.sort()
    inp = np.array([r.input_length for r in trace.requests], dtype=np.int64)
    top = tuple(max(g) for g in grids)
    with ReplayPool(trace, hints, replay_p90, jobs) as pool:
        return _walk(pool, hier, configs, slo_s, margin, max_replays, top, estimate, inp)


def _walk(
    pool: ReplayPool[Hierarchy, tuple[float, dict[str, Any]]],
    hier: Hierarchy,
    configs: list[tuple[float, tuple[int, ...]]],
    slo_s: float,
    margin: float,
    max_replays: int,
    top: tuple[int, ...],
    estimate_hits: Callable[[tuple[int, ...]], npt.NDArray[np.float64]],
    inp: I64,
) -> SizingResult:
    """``search``'s walk over ``configs`` (cost, sizes in blocks; cheapest first), ``top`` the
    largest configuration (module docstring)."""
    bb = hier.block_bytes
    top_bytes = tuple(c * bb for c in top)
    ((top_p90, top_summary),) = pool.run([sized(hier, top_bytes)])
    summaries = {top_bytes: top_summary}  # of the sizes replayed (bytes)
    replays = 1
    best = (top_p90, top_bytes)  # the lowest p90 replayed
    estimates: dict[tuple[int, ...], float] = {}

    def result(
        caps_bytes: tuple[int, ...] | None,
        p90: float,
        best_bytes: tuple[int, ...] = (),
        exhausted: bool = False,
    ) -> SizingResult:
        summary = summaries[caps_bytes or best_bytes]
        n = len(estimates)
        return SizingResult(
            caps_bytes, replays, n, len(configs), p90, best_bytes, exhausted, summary
        )

    def estimate(caps: tuple[int, ...]) -> float:
        est = estimates.get(caps)
        if est is None:
            est = estimates[caps] = _p90(estimate_hits(caps), inp, hier)
        return est

    # how far the policy has beaten the LRU estimate in the replays so far (0 for LRU itself)
    lead = _lead(estimate(top), top_p90)
    tried = {top}
    found: tuple[float, tuple[int, ...], float] | None = None  # cost, sizes (bytes), p90
    m = margin

    def admitted() -> Iterator[tuple[float, tuple[int, ...], float]]:
        """This walk's candidates: cheapest first until there is an answer; then those cheaper
        than it, most promising (lowest estimate) first."""
        if found is not None:
            bound = found[0]
            cheaper = itertools.takewhile(lambda c: c[0] < bound, configs)
            yield from sorted(
                (
                    (cost, caps, est)
                    for cost, caps in cheaper
                    if (est := estimate(caps)) <= slo_s * (1 + m) and caps not in tried
                ),
                key=lambda c: (c[2], c[0]),
            )
            return
        for cost, caps in configs:
            est = estimate(caps)
            if est <= slo_s * (1 + m) and caps not in tried:
                yield cost, caps, est

    while True:
        walk, answer = admitted(), found
        while found is answer:  # replay the walk's candidates in batches, until one meets it
            batch = list(itertools.islice(walk, max(0, min(pool.jobs, max_replays - replays))))
            if not batch:
                if next(walk, None) is None:
                    break  # the walk is done
                if found is not None:  # the budget ran out
                    return result(found[1], found[2], exhausted=True)
                if top_p90 <= slo_s:
                    return result(top_bytes, top_p90, exhausted=True)
                return result(None, best[0], best[1], exhausted=True)
            done = pool.run([sized(hier, tuple(c * bb for c in caps)) for _, caps, _ in batch])
            for (cost, caps, est), (p90, summary) in zip(batch, done, strict=True):
                replays += 1
                tried.add(caps)
                cb = tuple(c * bb for c in caps)
                summaries[cb] = summary
                lead = max(lead, _lead(est, p90))
                if p90 <= slo_s:
                    found = (cost, cb, p90)
                    break
                best = min(best, (p90, cb))
        if found is not None:
            if found is not answer:  # a cheaper answer: walk what is cheaper still, same screen
                continue
            # cheaper sizes whose estimate misses the SLO by a little may meet it with a policy
            # better than LRU: walk them with a wider screen (LRU's estimate is exact: no need)
            wider = min(REFINE_MARGIN, max(lead, 2 * m))
            if wider <= m:
                return result(found[1], found[2])
            m = wider
            continue
        # widen only when the largest configuration shows the SLO can be met (the policy may
        # beat the LRU estimate by more than the margin); else one walk is enough
        if top_p90 > slo_s or m >= MAX_MARGIN:
            break
        m = min(MAX_MARGIN, max(2 * m, DEFAULT_MARGIN))
    if top_p90 <= slo_s:
        return result(top_bytes, top_p90)
    return result(None, best[0], best[1])


def _lead(estimate: float, replayed: float) -> float:
    """How much lower the replayed p90 is than the LRU estimate, as a fraction of it (0 when it
    is not lower)."""
    return max(0.0, estimate / replayed - 1) if replayed > 0 else MAX_MARGIN
