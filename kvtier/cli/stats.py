"""``kvtier stats --url unix:///path.sock [--json]``: a running service's counters.

Per session (client process): identity, tenant, leases held, calls, tokens, bytes and mean
service time per operation; per tenant: the store's hit and lookup counters.
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
            f"leases {s['leases']}"
        )
        for op, o in sorted(s["ops"].items()):
            lines.append(
                f"  {op:9s} calls {o['calls']:8d} tokens {o['tokens']:10d} "
                f"bytes {o['bytes']:13d} mean {o['mean_us']:9.1f} us"
            )
    for tenant, c in stats.get("tenants", {}).items():
        lines.append(
            f"tenant {tenant}: hit {c['hit_tokens']} miss {c['miss_tokens']} stored "
            f"{c['stored_tokens']} lookup_hit_ratio {c['lookup_hit_ratio']:.3f}"
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
