"""``kvtier plan``: KV bytes per token, what fits in HBM, what spills to which tier.

With ``--trace FILE`` the simulator's sizing search answers "the cheapest tier sizes that meet a
TTFT SLO" instead (see ``kvtier.sim``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json

from rich.console import Console
from rich.table import Table

from kvtier.config import parse_size
from kvtier.errors import ConfigError
from kvtier.layout import KVLayout, canonical_dtype, preset
from kvtier.plan import SpillTier, make_plan

GiB = 2**30


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="a preset name, e.g. Llama-3.1-8B (see --list-models)")
    p.add_argument("--list-models", action="store_true", help="print the presets and exit")
    p.add_argument("--layers", type=int)
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--head-dim", type=int)
    p.add_argument("--kv-factor", type=int, default=None, help="2 for K+V (default), 1 for MLA")
    p.add_argument("--dtype", default="bf16", help="fp32|fp16|bf16|fp8 (default bf16)")
    p.add_argument("--context-tokens", type=int, default=32768)
    p.add_argument("--requests", type=int, default=1, help="concurrent sequences")
    p.add_argument("--gpu-memory", default="80GB", help="HBM per GPU (default 80GB)")
    p.add_argument("--weights-bytes", default=None, help="model weights (default: from preset)")
    p.add_argument("--weights-dtype", default="bf16", help="for weights from the preset")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs")
    p.add_argument("--dram", default="1TB", help="host DRAM available for KV")
    p.add_argument("--nvme", default="16TB", help="local NVMe available for KV")
    p.add_argument("--pool", default="0", help="cluster-shared pool available for KV")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    with contextlib.suppress(ImportError):  # the simulator is optional
        importlib.import_module("kvtier.cli.plan_trace").add_trace_arguments(p)


def _layout(args: argparse.Namespace) -> tuple[KVLayout, int, str]:
    dtype = canonical_dtype(args.dtype)
    manual = [args.layers, args.kv_heads, args.head_dim]
    if args.model and not any(v is not None for v in manual):
        pr = preset(args.model)
        lay = pr.layout(dtype)
        if args.kv_factor is not None:
            lay = KVLayout(lay.layers, lay.kv_heads, lay.head_dim, dtype, args.kv_factor)
        return lay, pr.params, pr.name
    if any(v is None for v in manual):
        raise ConfigError("give --model NAME, or all of --layers, --kv-heads and --head-dim")
    lay = KVLayout(args.layers, args.kv_heads, args.head_dim, dtype, args.kv_factor or 2)
    return lay, 0, args.model or "custom"


def run(args: argparse.Namespace) -> int:
    if args.list_models:
        from kvtier.layout import load_presets

        for name, pr in load_presets().items():
            print(
                f"{name:18} layers={pr.layers:3} kv_heads={pr.kv_heads:3} "
                f"head_dim={pr.head_dim:3} kv_factor={pr.kv_factor}"
            )
        return 0
    if getattr(args, "trace", None):
        rc: int = importlib.import_module("kvtier.cli.plan_trace").run_trace_plan(args)
        return rc
    layout, params, name = _layout(args)
    if args.weights_bytes is not None:
        weights = parse_size(args.weights_bytes, "--weights-bytes")
    else:
        weights = params * KVLayout(1, 1, 1, canonical_dtype(args.weights_dtype)).bytes_per_element
    tiers = [
        SpillTier("dram", parse_size(args.dram, "--dram")),
        SpillTier("nvme", parse_size(args.nvme, "--nvme")),
        SpillTier("pool", parse_size(args.pool, "--pool")),
    ]
    plan = make_plan(
        layout,
        context_tokens=args.context_tokens,
        requests=args.requests,
        tp=args.tp,
        gpu_memory_bytes=parse_size(args.gpu_memory, "--gpu-memory"),
        weights_bytes=weights,
        params=params,
        spill_tiers=[t for t in tiers if t.capacity_bytes],
    )
    if args.json:
        d = plan.as_dict()
        d["model"] = name
        print(json.dumps(d))
        return 0
    t = Table(title=f"kvtier plan: {name}, {layout.dtype}, tp={args.tp}")
    t.add_column("quantity")
    t.add_column("value", justify="right")
    rows = [
        (
            "KV bytes / token",
            f"{plan.kv_bytes_per_token:,} B ({plan.kv_bytes_per_token / 2**20:.3f} MiB)",
        ),
        ("KV bytes / token / GPU", f"{plan.kv_bytes_per_token_per_gpu:,} B"),
        ("context x requests", f"{args.context_tokens:,} x {args.requests}"),
        ("KV total", f"{plan.kv_bytes_total / GiB:,.2f} GiB"),
        ("HBM total", f"{plan.hbm_bytes_total / GiB:,.2f} GiB"),
        ("weights", f"{plan.weights_bytes / GiB:,.2f} GiB"),
        ("HBM left for KV (10% reserve)", f"{plan.hbm_kv_budget_bytes / GiB:,.2f} GiB"),
        ("tokens that fit in HBM", f"{plan.hbm_kv_tokens:,}"),
        ("requests that fit in HBM", f"{plan.requests_fit_in_hbm:,} of {args.requests}"),
        ("spills below HBM", f"{plan.spill_bytes / GiB:,.2f} GiB"),
    ]
    if not plan.weights_fit:
        rows.insert(
            6,
            (
                "WEIGHTS DO NOT FIT",
                f"{plan.weights_bytes / GiB:,.2f} GiB > the HBM less the reserve; "
                f"needs tp >= {plan.min_tp_for_weights}",
            ),
        )
    rows += [(f"  -> {k}", f"{v / GiB:,.2f} GiB") for k, v in plan.placement.items()]
    if plan.unplaced_bytes:
        rows.append(("  -> does not fit anywhere", f"{plan.unplaced_bytes / GiB:,.2f} GiB"))
    if plan.wrong_formula_bytes:
        rows.append(
            (
                "(params x 2 x 2 x ctx x req: WRONG)",
                f"{plan.wrong_formula_bytes / GiB:,.0f} GiB -- KV does not scale with params",
            )
        )
    for k, v in rows:
        t.add_row(k, v)
    Console().print(t)
    return 0
