"""The policy basket (``kvtier.sim.basket``): every policy's token hit ratio on every workload
and size, and how the default compares with the best of LRU and S3-FIFO and with Belady.

Run: ``.venv/bin/python scripts/policy_basket.py [--trace T] [--policies auto,lru,s3fifo,belady]
[--jobs 2] [--no-hints] [--seeds 0,1,2] [--requests 2000] [--host-share 0.25] [--lower P]
[--hierarchy-only] [--blocks 300,500] [--block-tokens N] [--trace-block-tokens N]``
(``--trace ""``: generators only; ``--blocks``: sizes in blocks instead of the basket's
fractions; ``--lower P``: the tiers below the first run policy ``P`` whatever the row's
policy, to compare per-tier choices; the block options apply to ``--trace``, as in ``kvtier
simulate``).
Prints one line per point and a summary (docs/simulation.md).
"""

from __future__ import annotations

import argparse
import json

from kvtier.sim import basket
from kvtier.sim.options import add_block_arguments, block_kwargs

TRACE = "/work/shared/data/traces/mooncake_synthetic.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=TRACE, help='Mooncake JSONL trace ("": generators only)')
    ap.add_argument("--requests", type=int, default=2000, help="requests per generated trace")
    ap.add_argument(
        "--policies",
        default="auto,lru,s3fifo,belady",
        help="policies to replay; the summary compares each with the better of lru and s3fifo",
    )
    ap.add_argument("--jobs", type=int, default=2, help="worker processes")
    ap.add_argument(
        "--hints",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="pass reuse-class hints to the policies (none reads them)",
    )
    ap.add_argument("--seeds", default=",".join(map(str, basket.SEEDS)), help="generator seeds")
    ap.add_argument(
        "--host-share",
        type=float,
        default=basket.HOST_SHARE,
        help="host tier as a share of the NVMe tier (host + NVMe points)",
    )
    ap.add_argument("--lower", default="", help="policy of the tiers below the first")
    ap.add_argument(
        "--blocks",
        default="",
        help="sizes in blocks instead of the basket's fractions, e.g. 300,500,800 (held-out sizes)",
    )
    ap.add_argument("--hierarchy-only", action="store_true", help="host + NVMe points only")
    add_block_arguments(ap)
    args = ap.parse_args()
    pols = args.policies.split(",")
    seeds = [int(x) for x in args.seeds.split(",") if x]  # "": the trace only
    srcs = basket.sources(args.trace or None, args.requests, seeds, **block_kwargs(args))
    blocks = [int(x) for x in args.blocks.split(",") if x]
    pts = basket.points(srcs, pols, [args.hints], args.host_share, args.lower, blocks)
    if args.hierarchy_only:
        pts = [p for p in pts if len(p.caps) > 1]
    rows = basket.table(pts, basket.run(pts, args.jobs))
    for r in rows:
        h = r["hit"]
        print(r["trace"], r["fraction"], r["caps"], " ".join(f"{p}={v:.4f}" for p, v in h.items()))
    for p in pols:
        if p != "belady":
            print(json.dumps(basket.summary(rows, p)))


if __name__ == "__main__":
    main()
