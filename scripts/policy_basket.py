"""The policy basket (``kvtier.sim.basket``): every policy's token hit ratio on every workload
and size, and how the default compares with the best of LRU and S3-FIFO and with Belady.

Run: ``.venv/bin/python scripts/policy_basket.py [--trace T] [--policies auto,lru,s3fifo,belady]
[--jobs 2] [--no-hints] [--seeds 0,1,2] [--requests 2000]`` (``--trace ""``: generators only).
Prints one line per point and a summary (docs/simulation.md).
"""

from __future__ import annotations

import argparse
import json

from kvtier.sim import basket

TRACE = "/work/shared/data/traces/mooncake_synthetic.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--policies", default="auto,lru,s3fifo,belady")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--hints", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--seeds", default=",".join(map(str, basket.SEEDS)), help="generator seeds")
    args = ap.parse_args()
    pols = args.policies.split(",")
    seeds = [int(x) for x in args.seeds.split(",")]
    srcs = basket.sources(args.trace or None, args.requests, seeds)
    pts = basket.points(srcs, pols, [args.hints])
    rows = basket.table(pts, basket.run(pts, args.jobs))
    for r in rows:
        h = r["hit"]
        print(r["trace"], r["fraction"], r["caps"], " ".join(f"{p}={v:.4f}" for p, v in h.items()))
    for p in pols:
        if p != "belady":
            print(json.dumps(basket.summary(rows, p)))


if __name__ == "__main__":
    main()
