"""Where policies win and lose: token hits by the document's earlier uses and the gap since its
last use.

Run: ``.venv/bin/python scripts/hits_by_reuse.py [CAPACITY] [POLICY ...]`` (defaults: 10,000
blocks; s3fifo, density, lru, belady). A request's *document* is its first block; each request
for a known document is counted under (uses before it: 1, 2, 3+; requests since the last one),
with the tokens each policy served it from cache (single tier, the shared Mooncake trace,
hints on). docs/simulation.md quotes it.
"""

from __future__ import annotations

import sys
from collections import Counter, defaultdict
from pathlib import Path

from kvtier.sim.replay import TierSpec, replay
from kvtier.sim.trace import read_trace

TRACE = Path(__file__).resolve().parents[2] / "shared/data/traces/mooncake_synthetic.jsonl"
GAPS = (100, 300, 600, 1200)


def gap_bucket(gap: int) -> str:
    for g in GAPS:
        if gap < g:
            return f"<{g}"
    return f">={GAPS[-1]}"


def main() -> None:
    cap = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000
    policies = sys.argv[2:] or ["s3fifo", "density", "lru", "belady"]
    trace = read_trace(TRACE)
    hits = {p: replay(trace, [TierSpec("x", cap, p)]).hit_tokens.sum(axis=0) for p in policies}
    last: dict[int, int] = {}
    uses: Counter[int] = Counter()
    rows: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0] * (len(policies) + 1))
    for i, req in enumerate(trace.requests):
        doc = req.blocks[0]
        if doc in last:
            key = (str(min(uses[doc], 3)).replace("3", "3+"), gap_bucket(i - last[doc]))
            row = rows[key]
            row[0] += 1
            for j, p in enumerate(policies, 1):
                row[j] += float(hits[p][i])
        last[doc] = i
        uses[doc] += 1
    print("uses  gap     requests  " + "  ".join(f"{p:>8}" for p in policies) + "  (k tokens)")
    order = {f"<{g}": n for n, g in enumerate(GAPS)} | {f">={GAPS[-1]}": len(GAPS)}
    for (u, g), row in sorted(rows.items(), key=lambda kv: (kv[0][0], order[kv[0][1]])):
        cells = "  ".join(f"{v / 1000:8.0f}" for v in row[1:])
        print(f"{u:<5} {g:<7} {int(row[0]):8d}  {cells}")


if __name__ == "__main__":
    main()
