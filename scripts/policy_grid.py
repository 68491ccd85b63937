"""Where a policy falls below LRU: the shared trace on a fine grid of cache sizes.

Run: ``.venv/bin/python scripts/policy_grid.py [--points 48] [--lo 20] [--hi 60000]
[--policies density,density-always,s3fifo] [--no-hints]`` (under a minute with the compiled
build). Prints, for every size of a log-spaced grid, each policy's token hit ratio and its ratio
to LRU's, then the sizes where a policy is below LRU. docs/simulation.md quotes it: the sweep's
ten sizes hide the small caches where a learned policy is noisy (``density-always``; the default
``density`` is LRU in a tier that fills with fewer than 128 requests).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from kvtier.sim.replay import TierSpec, replay
from kvtier.sim.trace import read_trace

TRACE = Path(__file__).resolve().parents[2] / "shared/data/traces/mooncake_synthetic.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--points", type=int, default=48)
    ap.add_argument("--lo", type=int, default=20)
    ap.add_argument("--hi", type=int, default=60_000)
    ap.add_argument("--policies", default="density,density-always,s3fifo")
    ap.add_argument("--no-hints", dest="hints", action="store_false")
    args = ap.parse_args()
    trace = read_trace(args.trace)
    policies = args.policies.split(",")
    sizes = sorted({round(float(x)) for x in np.geomspace(args.lo, args.hi, args.points)})
    below: dict[str, list[str]] = {p: [] for p in policies}
    for c in sizes:
        lru = replay(trace, [TierSpec("x", c, "lru")], hints=args.hints).token_hit_ratio
        cells = [f"{c:>6} lru {lru:.4f}"]
        for p in policies:
            r = replay(trace, [TierSpec("x", c, p)], hints=args.hints).token_hit_ratio
            q = r / lru if lru else 1.0
            cells.append(f"{p} {r:.4f} ({q:.3f})")
            if r < lru:
                below[p].append(f"{c} ({q:.3f})")
        print("  ".join(cells), flush=True)
    for p, sizes_below in below.items():
        print(f"{p} below LRU at {len(sizes_below)} of {len(sizes)}: {', '.join(sizes_below)}")


if __name__ == "__main__":
    main()
