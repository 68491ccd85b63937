"""Where a policy falls below LRU: the shared trace on a fine grid of cache sizes.

Run: ``.venv/bin/python scripts/policy_grid.py [--points 48] [--lo 20] [--hi 60000]
[--step N] [--hierarchies] [--policies density,density-always,s3fifo] [--no-hints]`` (under a
minute with the compiled build; ``--step``: a linear grid; ``--hierarchies``: the docs' nine
hierarchies instead of single tiers). Prints, for every size of a log-spaced grid, each
policy's token hit ratio and its ratio to LRU's, then the sizes where a policy is below LRU.
docs/simulation.md quotes it: the sweep's ten sizes hide the small caches where a learned policy
is noisy (``density-always``; the default ``density`` is LRU in a tier that fills with too few
requests to learn from).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from kvtier.sim.replay import TierSpec, replay
from kvtier.sim.trace import read_trace

TRACE = Path(__file__).resolve().parents[2] / "shared/data/traces/mooncake_synthetic.jsonl"
#: the hierarchies docs/simulation.md compares (blocks per tier, fastest first)
HIERARCHIES = [
    (500, 10_000),
    (1_000, 20_000),
    (2_000, 20_000),
    (2_328, 11_920),
    (1_000, 5_000),
    (3_000, 3_000),
    (500, 20_000),
    (5_000, 5_000, 10_000),
    (300, 3_000, 20_000),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--points", type=int, default=48)
    ap.add_argument("--lo", type=int, default=20)
    ap.add_argument("--hi", type=int, default=60_000)
    ap.add_argument("--step", type=int, default=0, help="a linear grid with this step instead")
    ap.add_argument("--hierarchies", action="store_true", help="the docs' nine hierarchies")
    ap.add_argument("--policies", default="density,density-always,s3fifo")
    ap.add_argument("--no-hints", dest="hints", action="store_false")
    args = ap.parse_args()
    trace = read_trace(args.trace)
    policies = args.policies.split(",")
    if args.hierarchies:
        setups = HIERARCHIES
    elif args.step:
        setups = [(c,) for c in range(args.lo, args.hi + 1, args.step)]
    else:
        grid = np.geomspace(args.lo, args.hi, args.points)
        setups = [(c,) for c in sorted({round(float(x)) for x in grid})]
    below: dict[str, list[str]] = {p: [] for p in policies}
    for caps in setups:
        name = " + ".join(map(str, caps))

        def ratio(policy: str, caps: tuple[int, ...] = caps) -> float:
            tiers = [TierSpec(f"t{i}", c, policy) for i, c in enumerate(caps)]
            return replay(trace, tiers, hints=args.hints).token_hit_ratio

        lru = ratio("lru")
        cells = [f"{name:>6} lru {lru:.4f}"]
        for p in policies:
            r = ratio(p)
            q = r / lru if lru else 1.0
            cells.append(f"{p} {r:.4f} ({q:.3f})")
            if r < lru:
                below[p].append(f"{name} ({q:.4f})")
        print("  ".join(cells), flush=True)
    for p, setups_below in below.items():
        print(f"{p} below LRU at {len(setups_below)} of {len(setups)}: {', '.join(setups_below)}")


if __name__ == "__main__":
    main()
