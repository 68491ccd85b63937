"""How robust the density policy's 10k-block figure is: one setting changed at a time.

Run: ``.venv/bin/python scripts/density_neighbours.py [--trace T] [--capacity N] [--band]``
(defaults: the shared Mooncake trace, 10,000 blocks). Prints the token hit ratio at the shipped
settings, then with each listed ``HitDensity`` class attribute changed on its own
(docs/simulation.md quotes it); about 10 s.

``--band`` also replays every setting at 0.9x, 0.95x, 1.05x and 1.1x the capacity and prints the
mean of the five: one capacity's figure moves by +-0.005 with small changes (which blocks happen
to be kept feeds back into what is learned), so the band mean is the steadier measure. It prints
S3-FIFO's band first, for reference; about a minute.

It sets ``HitDensity``'s class attributes, which a compiled class does not allow, so it runs the
pure-Python policies (``KVTIER_PURE=1``, ``kvtier/_native.py``).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ["KVTIER_PURE"] = "1"  # before kvtier is imported

from kvtier.policy.density import HitDensity
from kvtier.sim.replay import TierSpec, replay
from kvtier.sim.trace import Trace, read_trace

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
    ("mean_pull", 0.5),
    ("mean_pull", 0.9),
    ("mean_window", 32.0),
    ("mean_window", 128.0),
    ("refit_buckets", 4),
    ("refit_buckets", 16),
]
BAND = (0.9, 0.95, 1.0, 1.05, 1.1)


def _ratios(trace: Trace, caps: list[int], policy: str) -> list[float]:
    return [replay(trace, [TierSpec("x", c, policy)]).token_hit_ratio for c in caps]


def _line(label: str, ratios: list[float], band: bool) -> str:
    if not band:
        return f"{label}: {ratios[0]:.4f}"
    mid = ratios[BAND.index(1.0)]
    cells = " ".join(f"{r:.4f}" for r in ratios)
    return f"{label}: {mid:.4f}  band mean {sum(ratios) / len(ratios):.4f}  ({cells})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--capacity", type=int, default=10_000)
    ap.add_argument("--band", action="store_true", help="also 0.9x-1.1x the capacity")
    args = ap.parse_args()
    trace = read_trace(args.trace)
    caps = [round(args.capacity * f) for f in BAND] if args.band else [args.capacity]
    if args.band:
        print(_line("s3fifo", _ratios(trace, caps, "s3fifo"), True), flush=True)
    print(_line("shipped settings", _ratios(trace, caps, "density"), args.band), flush=True)
    for name, value in NEIGHBOURS:
        old = getattr(HitDensity, name)
        setattr(HitDensity, name, value)
        try:
            ratios = _ratios(trace, caps, "density")
        finally:
            setattr(HitDensity, name, old)
        print(_line(f"{name} = {value:.4g}", ratios, args.band), flush=True)


if __name__ == "__main__":
    main()
