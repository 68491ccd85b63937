"""``kvtier plan --trace FILE --slo-ttft-p90 S``: the options, the search space they describe,
and the answer printed (``kvtier.sim.sizing`` is the search itself)."""

from __future__ import annotations

import argparse
import json
import math

from kvtier.config import parse_size
from kvtier.errors import ConfigError
from kvtier.layout import KVLayout, canonical_dtype, preset
from kvtier.plan import make_plan
from kvtier.policy import DEFAULT_POLICY
from kvtier.sim.cost import GPU, ComputeModel, tier_cost
from kvtier.sim.hierarchy import DEFAULT_MODEL, ROUTES, Hierarchy, SimTier
from kvtier.sim.options import (
    add_block_arguments,
    add_hints_argument,
    add_jobs_argument,
    block_kwargs,
    jobs_from,
)
from kvtier.sim.replay import check_policy
from kvtier.sim.report import lower_check_lines, render
from kvtier.sim.sizing import DEFAULT_MARGIN, lower_policy_check, search, sized
from kvtier.sim.trace import Trace, read_trace


def add_trace_arguments(p: argparse.ArgumentParser) -> None:
    """The trace-driven options of ``kvtier plan`` (``--model``, ``--dtype``, ``--gpu-memory``,
    ``--dram``, ``--nvme``, ``--pool``, ``--weights-*`` and ``--json`` are plan's own)."""
    g = p.add_argument_group("trace-driven sizing (kvtier plan --trace FILE --slo-ttft-p90 S)")
    g.add_argument("--trace", help="Mooncake-format JSONL trace: find the cheapest tier sizes")
    add_block_arguments(g)
    g.add_argument("--slo-ttft-p90", type=float, metavar="SECONDS", help="TTFT p90 target")
    g.add_argument("--gpus", type=int, default=8, help="GPUs prefilling, HBM source (default 8)")
    g.add_argument("--policy", default=DEFAULT_POLICY, help=f"eviction policy ({DEFAULT_POLICY})")
    g.add_argument("--grid-points", type=int, default=8, help="sizes tried per tier (default 8)")
    g.add_argument(
        "--screen-margin",
        type=float,
        default=None,
        help="replay candidates whose LRU-estimated p90 is within this fraction of the SLO "
        "(default 0 for lru, where the estimate is exact, else 0.01)",
    )
    g.add_argument("--max-replays", type=int, default=40, help="exact replays at most")
    add_jobs_argument(g, "replays")
    g.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="size a cluster of this many nodes: hbm/dram/nvme per node, the pool shared "
        "(kvtier simulate --nodes; default 1)",
    )
    g.add_argument(
        "--route",
        choices=ROUTES,
        default="rr",
        help="how the cluster's requests reach nodes: round robin, by first block, or to the "
        "node caching the longest prefix (screened as by first block) (rr)",
    )
    add_hints_argument(g)


def search_space(args: argparse.Namespace, trace: Trace) -> tuple[Hierarchy, list[int], int]:
    """Tiers to search (hbm, then dram/nvme/pool with a non-zero bound), their bounds in blocks."""
    p = preset(args.model or DEFAULT_MODEL)
    dtype = canonical_dtype(args.dtype)
    layout = p.layout(dtype, trace.block_tokens)
    if args.gpus < 1:
        raise ConfigError("--gpus must be >= 1")
    if args.weights_bytes is not None:
        weights = parse_size(args.weights_bytes, "--weights-bytes")
    else:
        weights = (
            p.params * KVLayout(1, 1, 1, canonical_dtype(args.weights_dtype)).bytes_per_element
        )
    hbm = make_plan(
        layout,
        context_tokens=0,
        tp=args.gpus,
        gpu_memory_bytes=parse_size(args.gpu_memory, "--gpu-memory"),
        weights_bytes=weights,
    ).hbm_kv_budget_bytes
    longest = max(len(r.blocks) for r in trace.requests) * layout.block_bytes
    if hbm < longest:
        raise ConfigError(
            f"{p.name} on {args.gpus} GPU(s) of {args.gpu_memory} leaves {hbm / 1e9:,.1f} GB of "
            f"HBM for KV, less than the longest request's {longest / 1e9:,.1f} GB; raise --gpus or "
            "--gpu-memory"
        )
    pol = check_policy(args.policy, "--").lower()
    bounds = [("hbm", hbm)]
    for name in ("dram", "nvme", "pool"):
        size = parse_size(getattr(args, name), f"--{name}")
        if size >= layout.block_bytes:
            bounds.append((name, size))
    tiers = tuple(SimTier(n, b, pol, tier_cost(n)) for n, b in bounds)
    gpu = GPU(count=args.gpus)
    if args.nodes < 1:
        raise ConfigError(f"--nodes must be >= 1, got {args.nodes}")
    compute = ComputeModel.from_preset(p, layout.bytes_per_token)
    hier = Hierarchy(p.name, layout, compute, gpu, tiers, args.nodes, args.route)
    return hier, [b // layout.block_bytes for _, b in bounds], hbm


def run_trace_plan(args: argparse.Namespace) -> int:
    """Print the cheapest sizes meeting ``--slo-ttft-p90`` (table or one JSON object).

    Exit status 0 when a configuration meets the SLO, 1 when none does (the output says so and
    gives the best p90 the largest configuration reaches).
    """
    slo_arg = args.slo_ttft_p90
    if slo_arg is None or not math.isfinite(slo_arg) or slo_arg <= 0:
        raise ConfigError(
            "kvtier plan --trace needs --slo-ttft-p90 SECONDS (a positive, finite number), "
            f"got {slo_arg}"
        )
    margin = args.screen_margin
    if margin is None:
        exact = args.policy.lower() == "lru" and args.route != "cache"
        margin = 0.0 if exact else DEFAULT_MARGIN
    if args.grid_points < 1 or args.max_replays < 1 or not 0 <= margin < math.inf:
        raise ConfigError(
            "--grid-points and --max-replays must be >= 1, --screen-margin a number >= 0"
        )
    jobs = jobs_from(args)
    trace = read_trace(args.trace, **block_kwargs(args))
    hier, max_blocks, hbm_budget = search_space(args, trace)
    slo = float(args.slo_ttft_p90)
    found = search(
        trace,
        hier,
        max_blocks,
        slo,
        args.grid_points,
        margin,
        args.max_replays,
        hints=args.hints,
        jobs=jobs,
    )
    caps = found.caps_bytes or tuple(0 for _ in hier.tiers)
    # infeasible: the output describes the best configuration replayed (best_bytes)
    summary = found.summary
    feasible = found.caps_bytes is not None
    summary.update(
        {
            "slo_ttft_p90_s": slo,
            "feasible": feasible,
            "chosen_bytes": {t.name: c for t, c in zip(hier.tiers, caps, strict=True)},
            "search": {
                "policy": args.policy,
                "nodes": args.nodes,
                "route": args.route,
                "tiers_searched": {t.name: t.capacity_bytes for t in hier.tiers},
                "hbm_kv_budget_bytes": hbm_budget,
                "grid_points_per_tier": args.grid_points,
                "configurations": found.candidates,
                "estimated": found.estimated,
                "replayed": found.replays,
                "jobs": jobs,
                "screen_margin": margin,
                "method": "cheapest-first walk over a geometric grid; LRU stack-distance "
                "estimate screens, an exact replay with the policy decides",
            },
        }
    )

    def sizes(caps_bytes: tuple[int, ...]) -> str:
        return ", ".join(
            f"{t.name}={c / 1e9:,.0f}GB" for t, c in zip(hier.tiers, caps_bytes, strict=True) if c
        )

    if not feasible:
        best = f"the best of {found.replays} replayed ({sizes(found.best_bytes)}) reaches "
        summary["message"] = (
            f"no configuration found within {args.max_replays} replays meeting TTFT p90 <= "
            f"{slo:g} s (raise --max-replays); {best}{found.best_p90_s:.3f} s"
            if found.exhausted
            else f"no configuration meets TTFT p90 <= {slo:g} s: {best}{found.best_p90_s:.3f} s "
            "(larger tiers are searched with a larger --dram, --nvme or --pool, more HBM with "
            "--gpus or --gpu-memory)"
        )
        summary["best_bytes"] = dict(
            zip([t.name for t in hier.tiers], found.best_bytes, strict=True)
        )
    elif found.exhausted:
        summary["message"] = (
            f"cheapest found meeting TTFT p90 <= {slo:g} s: {sizes(caps)} ({found.replays} "
            "replays, the budget; cheaper configurations the policy might meet were left "
            "untried: --max-replays checks more)"
        )
    checks = lower_policy_check(trace, sized(hier, caps), args.hints) if feasible else []
    summary["lower_policy_check"] = checks
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        head = (
            f"cheapest tiers meeting TTFT p90 <= {slo:g} s ({found.replays} replays, "
            f"{found.estimated}/{found.candidates} configurations estimated):"
        )
        print(summary.get("message", head))
        if feasible:
            print(render(summary, title="kvtier plan"))
        for line in lower_check_lines(checks, summary):
            print(line)
    return 0 if feasible else 1
