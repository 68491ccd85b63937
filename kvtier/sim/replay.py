"""The replay engine: a trace through the store's own decisions, one request at a time.

Each request is served by ``kvtier.sim.storemodel.ModelStore``, which runs ``TieredStore``'s
``Decider`` (index, policies, promotion and demotion rules) with every move done at once: lookup,
load of the cached prefix (promoting blocks found below the first tier; the hierarchy is
inclusive), store of the prompt's full blocks. ``tests/test_sim_store.py`` replays a trace
through a real ``TieredStore`` and through this engine and requires the same token hits.

* **Hit definition.** A request's cached tokens are ``block_tokens`` times the leading run of its
  *full* blocks some tier holds before it is served (the store never caches a partial block).
  ``token_hit_ratio`` = cached tokens / all input tokens (partial blocks included).
* **Hints.** With ``hints`` each store is labelled with the request's reuse class
  (``kvtier.policy.hints.output_class``), as an engine storing at request end can label it.
* Keys are the trace's int block ids; policies are the registry's (``kvtier.policy``) plus the
  simulator's offline ``belady`` and the prefix-unaware ``s3fifo-block`` baseline.

The per-request hit tokens by tier are kept so the cost model (``kvtier.sim.cost``) can price
fetch-vs-recompute and TTFT without replaying again.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from kvtier.errors import ConfigError
from kvtier.policy import POLICIES, EvictionPolicy, make_policy
from kvtier.policy.hints import output_class
from kvtier.policy.s3fifo import BlockS3FIFO
from kvtier.sim.belady import Belady, FutureOracle
from kvtier.sim.storemodel import ModelStore
from kvtier.sim.trace import Trace

V = TypeVar("V")

#: offered by the simulator only: the offline ceiling and the prefix-unaware baseline
SIM_ONLY = ("belady", BlockS3FIFO.name)
SIM_POLICIES = (*sorted(POLICIES), *SIM_ONLY)


def check_policy(name: str, where: str = "") -> str:
    """``name`` if the simulator offers that policy, else a ``ConfigError`` that names it,
    prefixed by ``where`` (the flag or table it came from), and lists the choices."""
    if name.lower() not in SIM_POLICIES:
        raise ConfigError(
            f"{where}policy {name!r} is unknown; choose one of {', '.join(SIM_POLICIES)}"
        )
    return name


@dataclass(frozen=True, slots=True)
class TierSpec:
    """One simulated tier: a name (``hbm``, ``dram`` ...), its size in blocks, its policy."""

    name: str
    capacity_blocks: int
    policy: str

    def __post_init__(self) -> None:
        if self.capacity_blocks < 0:
            raise ConfigError(f"tier {self.name!r}: capacity must be >= 0 blocks")
        check_policy(self.policy, f"tier {self.name!r}: ")


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
    #: per tier, what its policy learned by the end (``EvictionPolicy.describe``: for ``auto``
    #: the ranking that evicts and each shadow's hits); empty for a cluster and for empty tiers
    policy_state: list[dict[str, Any]] = field(default_factory=list)

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

    ``hints``: label each store with the request's reuse class (module docstring).
    ``progress(i)`` is called every 256 requests with the number served so far.
    """
    if not tiers:
        raise ConfigError("simulate: give at least one tier")
    specs = tuple(tiers)
    n_tiers = len(specs)
    oracle = FutureOracle(trace) if any(s.policy.lower() == "belady" for s in specs) else None
    # a tier of 0 blocks holds nothing (the store's index reads 0 as "not bounded by us"):
    # it is left out, and an empty first tier caches nothing at all
    live = [t for t, s in enumerate(specs) if s.capacity_blocks] if specs[0].capacity_blocks else []
    store = ModelStore(
        [specs[t].capacity_blocks for t in live] or [0],
        lambda t, _cap: build_policy(specs[live[t]], oracle),
    )
    bt = trace.block_tokens
    n_req = len(trace.requests)
    hits = np.zeros((n_tiers, n_req), dtype=np.int64)
    block_hits = 0
    for i, req in enumerate(trace.requests):
        if oracle is not None:
            oracle.advance(i, req.blocks)
        out = req.output_length

        def hint(run: int, out: int = out) -> Hashable | None:
            return output_class(out, run > 0) if hints else None

        if not live:
            continue
        read = store.serve(req.blocks[: req.input_length // bt], hint)
        if read:
            block_hits += len(read)
            for t in set(read):
                hits[live[t], i] = bt * read.count(t)
        if progress is not None and i & 255 == 255:
            progress(i + 1)
    if progress is not None:
        progress(n_req)
    return ReplayResult(
        tiers=specs,
        hit_tokens=hits,
        input_tokens=np.array([r.input_length for r in trace.requests], dtype=np.int64),
        promoted_blocks=_spread(store.promoted, live, n_tiers, 0),
        written_blocks=_spread(store.written, live, n_tiers, 0),
        evicted_blocks=_spread(store.evicted, live, n_tiers, 0),
        block_hits=block_hits,
        block_refs=trace.block_events,
        hints=hints,
        policy_state=_spread(
            [p.describe() if p is not None else {} for p in store.index.policies], live, n_tiers, {}
        ),
    )


def _spread(values: list[V], live: list[int], n: int, empty: V) -> list[V]:
    """Values of the live tiers at their places among all ``n`` tiers (a copy of ``empty``
    elsewhere)."""
    out = [copy.copy(empty) for _ in range(n)]
    for t, v in zip(live, values, strict=False):
        out[t] = v
    return out
