"""Tables the CLI prints from ``TieredStore.stats()``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.table import Table


def tier_table(stats: Mapping[str, Any], hits: Mapping[str, int]) -> Table:
    """Per tier: blocks hit by requests, bytes read/written (hits, demotions, promotions
    included), throughput of those calls, occupancy."""
    t = Table(title="per tier")
    for col in ("tier", "hit blocks", "read", "read GB/s", "written", "write GB/s", "used/cap"):
        t.add_column(col, justify="right")
    for name, s in stats["tiers"].items():
        t.add_row(
            name,
            f"{hits.get(name, 0):,}",
            f"{s['bytes_read'] / 2**20:,.1f} MiB",
            f"{s['read_gbps']:.2f}",
            f"{s['bytes_written'] / 2**20:,.1f} MiB",
            f"{s['write_gbps']:.2f}",
            f"{s['used_blocks']}/{s['capacity_blocks'] or '-'}",
        )
    return t
