"""``kvtier bench sim``: simulator speed, block events per second, against the floor of the same
loop doing only the dict lookups every event needs (measured in the same run).

Targets: >= 1M block events/s; the shared Mooncake trace (4k requests) end to end <= 2 s.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from kvtier.policy import DEFAULT_POLICY

TRACE = "/work/shared/data/traces/mooncake_synthetic.jsonl"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", default=TRACE, help="Mooncake JSONL trace")
    p.add_argument("--capacity-blocks", type=int, default=10_000)
    p.add_argument("--policy", default=DEFAULT_POLICY)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvtier.sim.replay import TierSpec, replay
    from kvtier.sim.trace import read_trace

    t0 = time.perf_counter()
    trace = read_trace(args.trace)
    t1 = time.perf_counter()
    res = replay(trace, [TierSpec("hbm", args.capacity_blocks, args.policy)])
    t2 = time.perf_counter()
    seen: dict[int, int] = {}  # floor: one dict probe + one store per event, nothing else
    for r in trace.requests:
        for k in r.blocks:
            seen[k] = seen.get(k, 0) + 1
    t3 = time.perf_counter()
    events = trace.block_events
    return {
        "requests": len(trace),
        "block_events": events,
        "policy": args.policy,
        "token_hit_ratio": res.token_hit_ratio,
        "parse_s": t1 - t0,
        "replay_s": t2 - t1,
        "end_to_end_s": t2 - t0,
        "events_per_s": events / (t2 - t1),
        "floor_events_per_s": events / (t3 - t2),
        "ratio_to_floor": (t3 - t2) / (t2 - t1),
    }
