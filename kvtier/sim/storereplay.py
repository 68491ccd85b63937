"""A trace through a real ``TieredStore``: the measurement the simulator must agree with.

``replay_store(trace, host_blocks, nvme_blocks=0, nvme_dir=...)`` builds a store with a host
tier of ``host_blocks`` blocks (and, with ``nvme_blocks``, an NVMe tier of that many slots
below it) and serves every request the way a sequential engine does:

1. ``lookup`` the prompt (full blocks only: the store never caches a partial block);
2. ``load`` the prefix it found (hits below the host tier are promoted into it);
3. ``store`` every full block of the prompt (the store skips the ones it holds), with the
   request's reuse class when ``hints`` (``kvtier.policy.hints.output_class``);

with ``flush()`` after the load and the store, so each call's background moves (promotion,
demotion) finish before the next request: the run is deterministic, and it is the schedule the
simulator models (``kvtier.sim.replay``). A block of the trace's id ``h`` holds ``block_tokens``
copies of token ``h``; ids are chained, so two requests share store keys exactly as far as they
share ids. The KV is one float16 element per token (a 1 KiB block): the run measures decisions,
not bandwidth.

Used by ``tests/test_sim_store.py`` (the simulator's token hits equal the store's) and by
``kvtier bench sim --store`` (how far they are apart on a whole trace).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvtier.layout import KVLayout
from kvtier.policy import DEFAULT_POLICY
from kvtier.policy.hints import output_class
from kvtier.sim.trace import Trace
from kvtier.store import TieredStore
from kvtier.tiers.base import Tier
from kvtier.tiers.host import HostTier


@dataclass(frozen=True, slots=True)
class StoreRun:
    """What the store served over a trace. Tokens are full-block tokens."""

    hit_tokens: int  # tokens the loads returned (verified)
    input_tokens: int  # every prompt token of the trace (partial blocks included)
    by_tier: tuple[int, ...]  # hit tokens served from each tier (fastest first)

    @property
    def token_hit_ratio(self) -> float:
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0


def trace_layout(block_tokens: int) -> KVLayout:
    """The smallest layout with the trace's block size (one float16 per token)."""
    return KVLayout(
        layers=1, kv_heads=1, head_dim=1, dtype="float16", kv_factor=1, block_tokens=block_tokens
    )


def replay_store(
    trace: Trace,
    host_blocks: int,
    nvme_blocks: int = 0,
    nvme_dir: str | Path | None = None,
    policy: str = DEFAULT_POLICY,
    hints: bool = True,
    shared: Callable[[KVLayout], Tier] | None = None,
    nodes: int = 1,
) -> StoreRun:
    """Serve ``trace`` through a real store (module docstring). ``nvme_dir`` (an empty
    directory) is needed with ``nvme_blocks``. ``shared(layout)`` builds a shared tier (one
    client per node, all on the same service) below the local ones; ``nodes`` stores take the
    requests round robin (``kvtier.sim.cluster``'s ``rr``). Builds and closes its own stores."""
    layout = trace_layout(trace.block_tokens)

    def node_tiers(n: int) -> list[Tier]:
        tiers: list[Tier] = [HostTier(layout, host_blocks * layout.block_bytes, pin_memory="never")]
        if nvme_blocks:
            from kvtier.tiers.nvme import NVMeTier
            from kvtier.tiers.nvme_index import slot_bytes_for

            assert nvme_dir is not None, "an NVMe tier needs a directory"
            root = Path(nvme_dir) / f"node{n}"
            root.mkdir(parents=True, exist_ok=True)
            tiers.append(
                NVMeTier(
                    layout,
                    [root],
                    nvme_blocks * slot_bytes_for(layout.block_bytes),
                    warm_restart=False,
                    o_direct="never",
                    workers=1,
                )
            )
        if shared is not None:
            tiers.append(shared(layout))
        return tiers

    bt = trace.block_tokens
    longest = max((r.input_length for r in trace.requests), default=0)
    kv = np.zeros(layout.kv_shape(longest // bt * bt), dtype=layout.storage_dtype)
    out = np.empty_like(kv)
    hit = 0
    with ExitStack() as stack:
        stores = [
            stack.enter_context(
                TieredStore(
                    layout,
                    node_tiers(n),
                    model_id="trace",
                    policy=policy,
                    workers=1,
                    persist_on_close=False,
                )
            )
            for n in range(nodes)
        ]
        names = [t.name for t in stores[0].tiers]
        by_tier = dict.fromkeys(names, 0)
        for i, req in enumerate(trace.requests):
            st = stores[i % nodes]
            tokens = np.repeat(np.asarray(req.blocks, dtype=np.int64), bt)[: req.input_length]
            full = req.input_length // bt * bt
            found = st.lookup(tokens)
            for name in st.locate(tokens[:found]):
                by_tier[name] += bt
            got = st.load(tokens[:found], out) if found else 0
            st.flush()
            hint = output_class(req.output_length, got > 0) if hints else None
            st.store(tokens, kv[:, :, :full], reuse_class=hint)
            st.flush()
            hit += got
    return StoreRun(hit, trace.input_tokens, tuple(by_tier[n] for n in names))
