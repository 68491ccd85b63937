"""The replay engine: a trace through a hierarchy of tiers, driving the store's own policy classes.

Model (the same decisions ``TieredStore`` makes, with counters in place of a data mover):

* Tiers are ordered fastest first and *exclusive*: a block lives in one tier at a time.
* **Hit definition.** A request's cached tokens are those of the *leading run* of its blocks
  present (in any tier) before it is served; each hit block counts ``block_tokens`` tokens except
  the request's last block, which counts ``input_length - block_tokens * (n - 1)``.
  ``token_hit_ratio`` = sum of cached tokens / sum of input tokens.
* **After serving**, all of the request's blocks are resident in the first tier: blocks found in a
  lower tier are promoted (moved up), missing ones are computed, and the policy gets
  ``insert(chain)`` with the request's whole chain in prefix order (already-resident blocks count
  as an access -- the policy contract allows it). A request longer than the first tier keeps only
  its leading ``capacity`` blocks.
* **Eviction** makes room first: ``evict(need, evictable)`` on the tier's policy with the served
  request's blocks pinned (as the store pins in-flight blocks); victims are demoted to the next
  tier (in prefix order), whose policy makes room the same way with ``always``; the last tier drops.
  A demotion larger than the next tier passes its excess on down (an empty tier passes all).
  For LRU this makes the hierarchy one LRU stack cut into segments (``kvtier.sim.sizing``).
  The tiers' state and these moves are ``kvtier.sim.tierchain.TierChain``.

Keys are the trace's int block ids; policies are the generic ``kvtier.policy`` classes (plus the
offline ``belady``). A single tier is replayed by its own loop, which reads residency from the
policy (``EvictionPolicy.resident``) instead of keeping a key -> tier map; it makes the same
decisions (``tests/test_sim.py`` checks it against the general loop). The per-request hit
tokens by tier are kept so the cost model can price fetch-vs-recompute and TTFT without
replaying again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvtier.errors import ConfigError
from kvtier.policy import POLICIES, EvictionPolicy, make_policy
from kvtier.policy.admission import output_class
from kvtier.policy.base import always
from kvtier.policy.fallback import tier_ranking
from kvtier.policy.s3fifo import BlockS3FIFO
from kvtier.sim.belady import Belady, FutureOracle
from kvtier.sim.tierchain import TierChain, not_in
from kvtier.sim.trace import Request, Trace

#: offered by the simulator only: the offline ceiling and the prefix-unaware baseline
SIM_ONLY = ("belady", BlockS3FIFO.name)
SIM_POLICIES = (*sorted(POLICIES), *SIM_ONLY)


@dataclass(frozen=True, slots=True)
class TierSpec:
    """One simulated tier: a name (``hbm``, ``dram`` ...), its size in blocks, its policy."""

    name: str
    capacity_blocks: int
    policy: str

    def __post_init__(self) -> None:
        if self.capacity_blocks < 0:
            raise ConfigError(f"tier {self.name!r}: capacity must be >= 0 blocks")
        if self.policy.lower() not in SIM_POLICIES:
            raise ConfigError(
                f"unknown policy {self.policy!r}; choose one of {', '.join(SIM_POLICIES)}"
            )


@dataclass(slots=True)
class ReplayResult:
    """Counters of one replay. Arrays are indexed ``[tier, request]``; blocks are counts."""

    tiers: tuple[TierSpec, ...]
    hit_tokens: npt.NDArray[np.int64]  # [tier, request] cached tokens served from that tier
    input_tokens: npt.NDArray[np.int64]  # [request]
    promoted_blocks: list[int] = field(default_factory=list)  # read out of tier t (t > 0)
    written_blocks: list[int] = field(default_factory=list)  # inserted or demoted into tier t
    evicted_blocks: list[int] = field(default_factory=list)  # evicted out of tier t
    block_hits: int = 0  # leading-run hit blocks, all tiers
    block_refs: int = 0  # block references in the trace
    hints: bool = False  # the first tier's policy got each request's reuse class
    #: a cluster replay (``kvtier.sim.cluster``): nodes, each request's node, the first tier
    #: shared by all nodes (the ones before it exist once per node; counters are summed), routing
    nodes: int = 1
    node_of: npt.NDArray[np.int64] | None = None
    shared_from: int | None = None
    route: str = ""
    #: what each tier's policy ranked by at the end (``kvtier.policy.fallback.tier_ranking``:
    #: the default is LRU in a tier that filled with too few requests to learn from)
    rankings: tuple[str | None, ...] = ()

    @property
    def token_hit_ratio(self) -> float:
        total = int(self.input_tokens.sum())
        return float(self.hit_tokens.sum()) / total if total else 0.0

    def tier_hit_ratio(self, t: int) -> float:
        total = int(self.input_tokens.sum())
        return float(self.hit_tokens[t].sum()) / total if total else 0.0


def build_policy(spec: TierSpec, oracle: FutureOracle | None) -> EvictionPolicy[int]:
    """A fresh policy for ``spec`` (``belady`` needs the trace's ``oracle``)."""
    if spec.policy.lower() == "belady":
        assert oracle is not None
        return Belady(spec.capacity_blocks, oracle)
    if spec.policy.lower() == BlockS3FIFO.name:
        return BlockS3FIFO(spec.capacity_blocks)
    pol: EvictionPolicy[int] = make_policy(spec.policy, spec.capacity_blocks)  # type: ignore[assignment]
    return pol


def replay(
    trace: Trace,
    tiers: Sequence[TierSpec],
    progress: Callable[[int], None] | None = None,
    hints: bool = True,
) -> ReplayResult:
    """Replay ``trace`` through ``tiers`` (fastest first). Pure: builds fresh policies each call.

    With ``hints`` the first tier's policy gets each request's reuse class, as an engine that
    stores a request's blocks when it ends can pass it (``kvtier.policy.admission.output_class``:
    the output length and whether the request extended a cached prefix); without, inserts are
    unlabelled.
    ``progress(i)`` is called every 256 requests with the number served so far.
    """
    if not tiers:
        raise ConfigError("simulate: give at least one tier")
    specs = tuple(tiers)
    n_tiers = len(specs)
    oracle = FutureOracle(trace) if any(s.policy.lower() == "belady" for s in specs) else None
    held = TierChain([build_policy(s, oracle) for s in specs], [s.capacity_blocks for s in specs])
    bt = trace.block_tokens
    n_req = len(trace.requests)
    hits = [[0] * n_req for _ in range(n_tiers)]
    block_hits = 0
    cap0 = specs[0].capacity_blocks
    requests = _served(trace, cap0, oracle, progress)
    if n_tiers == 1:  # the common case: no tier below, residency read from the policy
        block_hits = _serve_one_tier(
            requests, bt, held.pols[0], cap0, hits[0], held.written, held.evicted, hints
        )
    else:
        for i, req, chain in requests:
            located = held.locate(req.blocks)  # (blocks past the chain: counted, not kept)
            run = credit(located, req, bt, hits, i)
            block_hits += run
            hint = output_class(req.output_length, run > 0) if hints else None
            held.serve(chain, located[: len(chain)], hint)
    if progress is not None:
        progress(n_req)
    return ReplayResult(
        tiers=specs,
        hit_tokens=np.array(hits, dtype=np.int64).reshape(n_tiers, n_req),
        input_tokens=np.array([r.input_length for r in trace.requests], dtype=np.int64),
        promoted_blocks=held.promoted,
        written_blocks=held.written,
        evicted_blocks=held.evicted,
        block_hits=block_hits,
        block_refs=trace.block_events,
        hints=hints,
        rankings=tuple(tier_ranking([p]) for p in held.pols),
    )


def _served(
    trace: Trace, cap: int, oracle: FutureOracle | None, progress: Callable[[int], None] | None
) -> Iterator[tuple[int, Request, tuple[int, ...]]]:
    """The trace's requests in order, each with its index and the chain the first tier keeps
    (its leading ``cap`` blocks). Advances ``oracle`` before a request is served and reports
    ``progress`` every 256 served."""
    for i, req in enumerate(trace.requests):
        if oracle is not None:
            oracle.advance(i, req.blocks)
        yield i, req, req.blocks if len(req.blocks) <= cap else req.blocks[:cap]
        if progress is not None and i & 255 == 255:
            progress(i + 1)


def _serve_one_tier(
    requests: Iterator[tuple[int, Request, tuple[int, ...]]],
    bt: int,
    pol: EvictionPolicy[int],
    cap: int,
    hits: list[int],
    written: list[int],
    evicted: list[int],
    hints: bool,
) -> int:
    """``replay``'s loop for a single tier: the same decisions, with residency read from the
    policy itself (``EvictionPolicy.resident``) instead of a key -> tier map. Fills ``hits``
    (by request), ``written[0]`` and ``evicted[0]``; returns the block hits."""
    resident = pol.resident()
    is_resident = resident.__contains__
    insert, evict = pol.insert, pol.evict
    block_hits = n_written = n_evicted = 0
    for i, req, chain in requests:
        blocks = req.blocks
        n = len(blocks)
        # residency of the chain's blocks, read in one C-level pass: the leading run of
        # resident blocks, and the new blocks (the missing ones, all after the run)
        present = list(map(is_resident, chain))
        n_new = present.count(False)
        if n_new:
            run = present.index(False)
        else:
            run = n_chain = len(chain)
            for k in blocks[n_chain:]:  # beyond the tier's size: counted, not kept
                if k not in resident:
                    break
                run += 1
        hits[i] = bt * run + (req.input_length - bt * n if run == n and n else 0)
        block_hits += run
        hint = output_class(req.output_length, run > 0) if hints else None
        if n_new:
            need = len(pol) + n_new - cap
            if need > 0:
                victims = evict(need, not_in(chain) if n_new < len(chain) else always)
                assert victims is not None, "policy refused to evict unpinned blocks"
                n_evicted += len(victims)
            n_written += n_new
        insert(chain, hint)
    written[0] += n_written
    evicted[0] += n_evicted
    return block_hits


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
