"""``kvtier stats --url unix:///path.sock [--json]``: a running service's counters.

Per session (client process): identity, tenant, pool, leases held, calls, tokens, bytes and
mean service time per operation; per tenant: the store's hit and lookup counters; with more
than one pool (``kvtier.service.pools``), per pool its layout, tiers and tenants. ``--json``:
the default pool's stats at the top level, every pool's under ``pools``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="the service, unix:///path/kvtier.sock")
    parser.add_argument("--json", action="store_true", help="print the whole stats object")
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds to wait")


def _table(stats: dict[str, Any]) -> str:
    lines = []
    for sid, s in stats.get("service", {}).get("sessions", {}).items():
        ident = s["identity"]
        lines.append(
            f"client {sid} pid {s['pid']} {s['name'] or '-'} tenant {s['tenant']} "
            f"model {ident['model_id']} tp {ident['tp_rank']}/{ident['tp_size']} "
            f"pool {s.get('pool', 'default')} leases {s['leases']}"
        )
        for op, o in sorted(s["ops"].items()):
            lines.append(
                f"  {op:9s} calls {o['calls']:8d} tokens {o['tokens']:10d} "
                f"bytes {o['bytes']:13d} mean {o['mean_us']:9.1f} us"
            )
    pools = stats.get("pools") or {stats.get("pool", "default"): stats}  # an older service
    for name, p in pools.items():
        if len(pools) > 1:
            lay = p.get("layout", {})
            lines.append(
                f"pool {name}: layers {lay.get('layers')} kv_heads {lay.get('kv_heads')} "
                f"head_dim {lay.get('head_dim')} kv_factor {lay.get('kv_factor')} "
                f"{lay.get('dtype')} block_tokens {lay.get('block_tokens')}"
            )
            for tier, t in p.get("tiers", {}).items():
                lines.append(
                    f"  tier {tier}: used {t['used_blocks']}/{t['capacity_blocks']} blocks "
                    f"hits {t['hits']} misses {t['misses']} puts {t['puts']}"
                )
        for tenant, c in p.get("tenants", {}).items():
            lines.append(
                f"{'  ' if len(pools) > 1 else ''}tenant {tenant}: hit {c['hit_tokens']} miss "
                f"{c['miss_tokens']} stored {c['stored_tokens']} lookup_hit_ratio "
                f"{c['lookup_hit_ratio']:.3f}"
            )
    return "\n".join(lines) or "no clients"


def run(args: argparse.Namespace) -> int:
    from kvtier.errors import ConfigError
    from kvtier.service.client import connect

    with connect(args.url, timeout=args.timeout, name="kvtier-stats") as client:
        stats = client.stats()
    if "store" not in stats:
        raise ConfigError(f"the kvtier service at {args.url} did not answer")
    print(json.dumps(stats, indent=1, default=str) if args.json else _table(stats))
    return 0
