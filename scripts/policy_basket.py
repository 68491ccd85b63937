"""The policy basket (``kvtier.sim.basket``): every policy's token hit ratio on every workload
and size, and how the default compares with the best of LRU and S3-FIFO and with Belady.

Run: ``.venv/bin/python scripts/policy_basket.py [--trace T] [--policies lru,s3fifo,belady]
[--jobs 2] [--no-hints]``. Prints one line per point and a summary (docs/simulation.md).
"""

from __future__ import annotations

import argparse
import statistics

from kvtier.policy import DEFAULT_POLICY
from kvtier.sim import basket

TRACE = "/work/shared/data/traces/mooncake_synthetic.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--policies", default="lru,s3fifo,belady")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--hints", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args()
    pols = args.policies.split(",")
    pts = basket.points(basket.sources(args.trace, args.requests), pols, [args.hints])
    rows = basket.table(pts, basket.run(pts, args.jobs))
    below, to_best, to_belady = 0, [], []
    for r in rows:
        h = r["hit"]
        print(r["trace"], r["fraction"], r["caps"], " ".join(f"{p}={v:.4f}" for p, v in h.items()))
        best = max(h.get("lru", 0.0), h.get("s3fifo", 0.0))
        if best:
            to_best.append(h[DEFAULT_POLICY] / best)
            below += h[DEFAULT_POLICY] < 0.99 * best
        if h.get("belady"):
            to_belady.append(h[DEFAULT_POLICY] / h["belady"])
    print(f"points {len(rows)}; default below max(lru, s3fifo) - 1%: {below}")
    if to_best:
        print(
            f"default / max(lru, s3fifo): min {min(to_best):.3f} "
            f"mean {statistics.mean(to_best):.3f}"
        )
    if to_belady:
        print(f"default / belady: mean {statistics.mean(to_belady):.3f} min {min(to_belady):.3f}")


if __name__ == "__main__":
    main()
