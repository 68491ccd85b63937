"""Capacity sweeps: token hit ratio and TTFT against capacity, per policy (Belady included)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvtier.errors import ConfigError
from kvtier.sim.cost import price
from kvtier.sim.hierarchy import Hierarchy
from kvtier.sim.replay import TierSpec, replay
from kvtier.sim.replaypool import ReplayPool
from kvtier.sim.trace import Trace


def default_capacities(trace: Trace, points: int = 10) -> list[int]:
    """Geometric capacities (blocks) from 1% to 100% of the trace's distinct blocks."""
    distinct = max(1, len({k for r in trace.requests for k in r.blocks}))  # 0: empty requests
    caps = np.geomspace(max(1, distinct // 100), distinct, points)
    return sorted({int(c) for c in caps})


def parse_capacities(text: str, flag: str = "--capacities") -> list[int]:
    """``"1000,10000,5000"`` -> ``[1000, 5000, 10000]``: block counts >= 1, sorted, each once.

    Raises ``ConfigError`` naming ``flag`` and the bad item (empty, not an integer, below 1).
    """
    if not text.strip():
        raise ConfigError(f"{flag} is empty; give block counts, e.g. {flag} 1000,10000")
    caps: set[int] = set()
    for item in text.split(","):
        word = item.strip()
        try:
            n = int(word)
        except ValueError:
            what = "an empty item" if not word else repr(word)
            raise ConfigError(
                f"{flag} {text!r}: {what} is not a whole number of blocks; write e.g. "
                f"{flag} 1000,10000"
            ) from None
        if n < 1:
            raise ConfigError(f"{flag} {text!r}: capacities are blocks >= 1, got {n}")
        caps.add(n)
    return sorted(caps)


def sweep(
    trace: Trace,
    hier: Hierarchy,
    policies: Sequence[str],
    capacities: Sequence[int],
    progress: Callable[[int], None] | None = None,
    hints: bool = True,
    jobs: int = 1,
) -> list[dict[str, Any]]:
    """One single-tier replay per (policy, capacity); the tier is priced like ``hier``'s first.

    Rows come in the order given (``parse_capacities`` sorts). ``progress(i)`` is called after
    each replay with the number done. ``jobs`` replays run at once, in worker processes
    (``kvtier.sim.replaypool``); the rows do not depend on it.
    """
    items = [(hier, pol, cap) for pol in policies for cap in capacities]
    with ReplayPool(trace, hints, sweep_row, jobs) as pool:
        return pool.run(items, progress)


def sweep_row(trace: Trace, item: tuple[Hierarchy, str, int], hints: bool) -> dict[str, Any]:
    """The sweep's row of one (hierarchy, policy, capacity): a replay of one tier of that many
    blocks, priced like the hierarchy's first tier."""
    hier, pol, cap = item
    res = replay(trace, [TierSpec(hier.tiers[0].name, cap, pol)], hints=hints)
    t = price(res.hit_tokens, res.input_tokens, [hier.tiers[0].cost], hier.compute, hier.gpu)
    return {
        "policy": pol,
        "capacity_blocks": cap,
        "capacity_bytes": cap * hier.block_bytes,
        "token_hit_ratio": res.token_hit_ratio,
        "block_hits": res.block_hits,
        "ttft_p90_s": float(np.percentile(t.ttft_s, 90)),
    }
