"""How robust the density policy's 10k-block figure is: one setting changed at a time.

Run: ``.venv/bin/python scripts/density_neighbours.py [TRACE] [CAPACITY]`` (defaults: the shared
Mooncake trace, 10,000 blocks). Prints the token hit ratio at the shipped settings, then with
each listed ``HitDensity`` class attribute changed on its own (docs/simulation.md quotes it).
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvtier.policy.density import HitDensity
from kvtier.sim.replay import TierSpec, replay
from kvtier.sim.trace import read_trace

TRACE = Path(__file__).resolve().parents[2] / "shared/data/traces/mooncake_synthetic.jsonl"
NEIGHBOURS = [
    ("prior_fraction", 0.002),
    ("prior_fraction", 0.005),
    ("tau_fraction", 1.5),
    ("tau_fraction", 3.0),
    ("width_fraction", 1 / 48),
    ("width_fraction", 1 / 96),
    ("horizon_fraction", 1.0),
    ("horizon_fraction", 4.0),
    ("ghost_factor", 2.0),
    ("refit_buckets", 4),
]


def main() -> None:
    trace = read_trace(sys.argv[1] if len(sys.argv) > 1 else TRACE)
    cap = int(sys.argv[2]) if len(sys.argv) > 2 else 10_000
    spec = [TierSpec("x", cap, "density")]
    print(f"shipped settings: {replay(trace, spec).token_hit_ratio:.4f}", flush=True)
    for name, value in NEIGHBOURS:
        old = getattr(HitDensity, name)
        setattr(HitDensity, name, value)
        try:
            ratio = replay(trace, spec).token_hit_ratio
        finally:
            setattr(HitDensity, name, old)
        print(f"{name} = {value:.4g}: {ratio:.4f}", flush=True)


if __name__ == "__main__":
    main()
