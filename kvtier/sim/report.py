"""Turn a replay plus the cost model into the numbers users read: a dict (``--json``) and a table.

Hit definition (also printed): a request's cached tokens are those of the leading run of its
blocks present before it is served; each hit block counts ``block_tokens`` tokens except the
request's last block, which counts ``input_length - block_tokens * (n - 1)``; after serving, all its
blocks are inserted. ``token_hit_ratio`` = sum cached tokens / sum input tokens.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvtier.sim.cluster import ROUTE_DESCRIPTIONS
from kvtier.sim.cost import price
from kvtier.sim.hierarchy import Hierarchy
from kvtier.sim.replay import ReplayResult
from kvtier.sim.trace import Trace

HIT_DEFINITION = (
    "cached tokens = block_tokens x the leading run of a request's full blocks some tier holds "
    "before it is served (the store's lookup; a partial block is never cached); then its full "
    "blocks are stored as a TieredStore stores them (inclusive tiers); token_hit_ratio = sum "
    "cached tokens / sum input tokens"
)


#: what the simulated engine tells the store about each request (``replay(hints=True)``)
REUSE_HINTS = (
    "output length (25-token buckets) and whether the request extended a cached prefix, "
    "given at store time (the registry's policies ignore it)"
)


def summarize(trace: Trace, hier: Hierarchy, res: ReplayResult) -> dict[str, Any]:
    """All outputs of one simulation as a JSON-ready dict."""
    costs = [t.cost for t in hier.tiers]
    timing = price(res.hit_tokens, res.input_tokens, costs, hier.compute, hier.gpu)
    input_tokens = int(res.input_tokens.sum())
    nodes = res.nodes
    shared_from = len(hier.tiers) if res.shared_from is None else res.shared_from
    # each node prefills its own requests back to back; the trace is done when the last is
    node_of = res.node_of if res.node_of is not None else np.zeros(len(timing.ttft_s), np.int64)
    busy_by_node = np.bincount(node_of, weights=timing.ttft_s, minlength=nodes)
    busy = float(busy_by_node.sum())
    makespan = float(busy_by_node.max()) if nodes else 0.0
    bb = hier.block_bytes
    bpt = hier.layout.bytes_per_token
    tiers = []
    node_watts = shared_watts = 0.0  # of one node's own tiers; of the shared tiers
    monthly = 0.0
    for t, (tier, spec) in enumerate(zip(hier.tiers, res.tiers, strict=True)):
        copies = nodes if t < shared_from else 1
        gb = tier.capacity_bytes / 1e9
        usd = gb * tier.cost.usd_per_gb_month * copies
        watts = gb * tier.cost.watts_per_gb
        monthly += usd
        if t < shared_from:
            node_watts += watts
        else:
            shared_watts += watts
        tiers.append(
            {
                "name": tier.name,
                "policy": spec.policy,
                "policy_state": res.policy_state[t] if res.policy_state else {},
                "capacity_bytes": tier.capacity_bytes,
                "capacity_blocks": spec.capacity_blocks,
                "copies": copies,
                "token_hit_ratio": res.tier_hit_ratio(t),
                "hit_tokens": int(res.hit_tokens[t].sum()),
                "loaded_tokens": int(timing.loaded_tokens[t]),
                "recomputed_hit_tokens": int(timing.recomputed_hit_tokens[t]),
                "bytes_read": int(timing.loaded_tokens[t]) * bpt,
                "bytes_written": res.written_blocks[t] * bb,
                "evicted_blocks": res.evicted_blocks[t],
                "bandwidth_bytes_per_s": tier.cost.bandwidth,
                "latency_s": tier.cost.latency_s,
                "usd_per_gb_month": tier.cost.usd_per_gb_month,
                "monthly_cost_usd": usd,
                "watts": watts * copies,
            }
        )
    gpu = hier.gpu
    energy = (gpu.watts * gpu.count + node_watts) * busy + shared_watts * makespan
    p50, p90, p99 = (float(x) for x in np.percentile(timing.ttft_s, [50, 90, 99]))
    return {
        "trace": trace.name,
        "requests": len(trace),
        "input_tokens": input_tokens,
        "block_events": res.block_refs,
        "block_hits": res.block_hits,
        "token_hit_ratio": res.token_hit_ratio,
        "hit_definition": HIT_DEFINITION,
        "tiers": tiers,
        "ttft_s": {"p50": p50, "p90": p90, "p99": p99, "mean": float(timing.ttft_s.mean())},
        "throughput_tokens_per_s": input_tokens / makespan if makespan else 0.0,
        "tokens_per_joule": input_tokens / energy if energy else 0.0,
        "monthly_cost_usd": monthly,
        "nodes": nodes,
        "busy_s": [float(b) for b in busy_by_node],
        "assumptions": {
            "model": hier.model_name,
            "dtype": hier.layout.dtype,
            "kv_bytes_per_token": bpt,
            "block_tokens": hier.layout.block_tokens,
            "trace_block_tokens": trace.trace_block_tokens,
            "block_bytes": bb,
            "params": hier.compute.params,
            "gpu": gpu.name,
            "gpus": gpu.count,
            "gpu_flops": gpu.flops,
            "mfu": gpu.mfu,
            "gpu_watts": gpu.watts,
            "reuse_hints": REUSE_HINTS if res.hints else "none (unlabelled inserts)",
            "ttft": "fetch (latency + bytes/bandwidth per tier) + prefill compute, no overlap, "
            "no queueing; a tier is read only when faster than recomputing its tokens",
            "throughput": "input tokens / sum of TTFTs (one instance prefilling back to back)"
            if nodes == 1
            else "input tokens / the busiest node's sum of TTFTs (each node prefills its "
            "requests back to back; the trace is done when the busiest one is)",
            "energy": "(GPU watts x GPUs + tier watts/GB x GB) x busy time"
            if nodes == 1
            else "per node (GPU watts x GPUs + its tiers' watts) x its busy time, plus the "
            "shared tiers' watts x the busiest node's busy time",
            "monthly_cost": "tier capacity x $/GB/month (GPU rental excluded)"
            + ("" if nodes == 1 else "; a node's own tiers once per node"),
            **({} if nodes == 1 else {"cluster": _cluster(res, hier, shared_from)}),
        },
    }


def _cluster(res: ReplayResult, hier: Hierarchy, shared_from: int) -> str:
    own = ", ".join(t.name for t in hier.tiers[:shared_from])
    shared = ", ".join(t.name for t in hier.tiers[shared_from:]) or "none"
    how = ROUTE_DESCRIPTIONS.get(res.route, res.route)
    return (
        f"{res.nodes} nodes with {hier.gpu.count} GPUs and their own {own} each; shared "
        f"(written through by every node): {shared}; requests routed {how}"
    )


def render(summary: dict[str, Any], title: str = "kvtier simulate") -> str:
    """A readable table (rich) of ``summary``, headed ``title: trace (n requests)``."""
    from io import StringIO

    from rich.console import Console
    from rich.table import Table

    n = summary["requests"]
    nodes = f", {summary['nodes']} nodes" if summary.get("nodes", 1) > 1 else ""
    table = Table(title=f"{title}: {summary['trace']} ({n} request{'s' if n != 1 else ''}{nodes})")
    for col in ("tier", "policy", "capacity", "blocks", "hit ratio", "read", "written", "$/month"):
        table.add_column(col, justify="right")
    for t in summary["tiers"]:
        ranking = t.get("policy_state", {}).get("ranking")
        table.add_row(
            t["name"],
            t["policy"] + (f" ({ranking})" if ranking else ""),
            (f"{t['copies']}x " if t["copies"] > 1 else "") + _gb(t["capacity_bytes"]),
            str(t["capacity_blocks"]),
            f"{t['token_hit_ratio']:.3f}",
            _gb(t["bytes_read"]),
            _gb(t["bytes_written"]),
            f"{t['monthly_cost_usd']:,.0f}",
        )
    ttft = summary["ttft_s"]
    a = summary["assumptions"]
    buf = StringIO()
    console = Console(file=buf, width=110)
    console.print(table)
    console.print(
        f"token hit ratio {summary['token_hit_ratio']:.4f}   TTFT p50/p90/p99 "
        f"{ttft['p50']:.3f}/{ttft['p90']:.3f}/{ttft['p99']:.3f} s   "
        f"{summary['throughput_tokens_per_s']:,.0f} tokens/s   "
        f"{summary['tokens_per_joule']:.2f} tokens/J   ${summary['monthly_cost_usd']:,.0f}/month"
    )
    if nodes:
        busy = ", ".join(f"{b:,.0f}" for b in summary["busy_s"])
        console.print(f"busy time per node: {busy} s")
    console.print(f"hit definition: {summary['hit_definition']}")
    console.print("assumptions: " + "; ".join(f"{k}={v}" for k, v in a.items()))
    return buf.getvalue()


def lower_check_lines(checks: list[dict[str, Any]], summary: dict[str, Any]) -> list[str]:
    """One line per row of ``kvtier.sim.sizing.lower_policy_check``, set against ``summary``
    (the configuration as given)."""
    return [
        f"the same sizes with policy = {c['lower_policy']!r} below the first tier: TTFT p90 "
        f"{c['ttft_p90_s']:.3f} s (here {summary['ttft_s']['p90']:.3f}), token hit ratio "
        f"{c['token_hit_ratio']:.4f} (here {summary['token_hit_ratio']:.4f})"
        for c in checks
    ]


def _gb(n: float) -> str:
    return f"{n / 1e12:.2f} TB" if n >= 1e12 else f"{n / 1e9:.1f} GB"
