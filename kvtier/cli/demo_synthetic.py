"""``kvtier demo --synthetic``: a large mixed workload through the store, synthetic KV.

The embedded default is host DRAM + local NVMe (a directory under ``--dir``), no servers. Every
request looks its prompt up, loads the cached prefix, *checks it against a recomputation*, then
"prefills" the rest (synthetic KV, see ``kvtier.workload``) and stores the new blocks. The final
table shows per-tier hits, tokens saved, bytes moved and GB/s.
"""

from __future__ import annotations

import argparse
import math
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import track
from rich.table import Table

from kvtier.cli.report import tier_table
from kvtier.config import parse_size
from kvtier.errors import ConfigError
from kvtier.layout import KVLayout
from kvtier.store import TieredStore
from kvtier.tiers.registry import TIER_KINDS
from kvtier.workload import mixed_workload, synthetic_kv

# A small GQA shape (4 KiB/token, 1 MiB per 256-token block) keeps the demo quick on a laptop;
# --layers/--kv-heads/--head-dim make it any model.
DEMO_LAYOUT = KVLayout(layers=8, kv_heads=2, head_dim=64, dtype="float16")


#: the synthetic demo's options and their defaults (None on the command line = not given)
DEFAULTS: dict[str, object] = {
    "host": "48MiB",
    "nvme": "512MiB",
    "warm": False,
    "scale": 1.0,
    "layers": DEMO_LAYOUT.layers,
    "kv_heads": DEMO_LAYOUT.kv_heads,
    "head_dim": DEMO_LAYOUT.head_dim,
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of the synthetic workload (``--dir`` and ``--seed`` are ``kvtier demo``'s)."""
    d = DEFAULTS
    p.add_argument("--host", default=None, help=f"synthetic: host DRAM tier size ({d['host']})")
    p.add_argument("--nvme", default=None, help=f"synthetic: NVMe tier size ({d['nvme']}), 0: none")
    p.add_argument(
        "--warm", action="store_const", const=True, help="synthetic: keep a previous run's blocks"
    )
    p.add_argument("--scale", type=float, default=None, help="synthetic: workload multiplier (1)")
    for flag in ("--layers", "--kv-heads", "--head-dim"):
        default = d[flag[2:].replace("-", "_")]
        p.add_argument(flag, type=int, default=None, help=f"synthetic layout ({default})")


def resolve(args: argparse.Namespace) -> None:
    """Fill the options not given with their defaults (in place) and check them; raise
    ``ConfigError`` naming the first bad one."""
    for name, default in DEFAULTS.items():
        if getattr(args, name, None) is None:
            setattr(args, name, default)
    if getattr(args, "seed", 0) < 0:
        raise ConfigError(f"--seed must be >= 0, got {args.seed}")
    if not (math.isfinite(args.scale) and args.scale > 0):
        raise ConfigError(f"--scale must be a finite number > 0, got {args.scale}")
    for name in ("layers", "kv_heads", "head_dim"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    parse_size(args.host, "--host")
    parse_size(args.nvme, "--nvme")


def build_store(args: argparse.Namespace, layout: KVLayout) -> TieredStore:
    tiers: list[dict[str, Any]] = [{"kind": "host", "capacity": args.host}]
    if "nvme" in TIER_KINDS and parse_size(args.nvme, "--nvme"):
        tiers.append(
            {
                "kind": "nvme",
                "capacity": args.nvme,
                "paths": [str(Path(args.dir) / "synthetic")],
                "warm_restart": args.warm,
            }
        )
    cfg = {
        "store": {
            "layers": layout.layers,
            "kv_heads": layout.kv_heads,
            "head_dim": layout.head_dim,
            "dtype": layout.dtype,
            "model_id": "kvtier-demo",
        },
        "tiers": tiers,
    }
    return TieredStore.from_config(cfg)


def run(console: Console, args: argparse.Namespace) -> int:
    """Serve the workload; 0 if every cached prefix matched a recomputation."""
    resolve(args)
    layout = KVLayout(args.layers, args.kv_heads, args.head_dim, "float16")
    requests = list(mixed_workload(args.seed, args.scale))
    prompt_tokens = sum(len(r.tokens) for r in requests)
    console.print(
        f"[bold]kvtier demo[/]: {len(requests)} requests ({prompt_tokens:,} prompt tokens): "
        f"chat sessions, document QA, agents, one-offs; {layout.bytes_per_token:,} B/token"
    )
    buf = np.empty(layout.kv_shape(max(len(r.tokens) for r in requests)), layout.storage_dtype)
    hits_by_tier: Counter[str] = Counter()
    saved_by_kind: Counter[str] = Counter()
    tokens_by_kind: Counter[str] = Counter()
    wrong = 0
    t0 = time.perf_counter()
    with build_store(args, layout) as store:
        console.print("tiers: " + ", ".join(repr(t.inner) for t in store.tiers))
        for req in track(requests, description="serving", console=console):
            toks = req.tokens
            where = store.locate(toks)
            out = buf[:, :, : len(toks)]
            n = store.load(toks, out)
            hits_by_tier.update(where[: n // layout.block_tokens])
            if n and not np.array_equal(out[:, :, :n], synthetic_kv(toks[:n], layout)):
                wrong += 1
            out[:, :, n:] = synthetic_kv(toks, layout, start=n)  # "prefill" the rest
            store.store(toks, out)
            saved_by_kind[req.kind] += n
            tokens_by_kind[req.kind] += len(toks)
        store.flush()
        stats = store.stats()
    elapsed = time.perf_counter() - t0
    _report(console, stats, hits_by_tier, saved_by_kind, tokens_by_kind, layout, elapsed)
    if wrong:
        console.print(f"[red]{wrong} loads returned KV that differs from a recomputation[/]")
        return 1
    console.print("every cached prefix matched a recomputation byte for byte")
    return 0


def _report(
    console: Console,
    stats: dict[str, Any],
    hits: Counter[str],
    saved: Counter[str],
    total: Counter[str],
    layout: KVLayout,
    elapsed: float,
) -> None:
    console.print(tier_table(stats, hits))
    k = Table(title="tokens saved (prefill skipped)")
    for col in ("traffic", "prompt tokens", "from cache", "share"):
        k.add_column(col, justify="right")
    for kind in sorted(total):
        k.add_row(kind, f"{total[kind]:,}", f"{saved[kind]:,}", f"{saved[kind] / total[kind]:.1%}")
    all_t, all_s = sum(total.values()), sum(saved.values())
    k.add_row("all", f"{all_t:,}", f"{all_s:,}", f"{all_s / all_t:.1%}")
    console.print(k)
    s = stats["store"]
    console.print(
        f"{elapsed:.1f}s; KV bytes not recomputed: {all_s * layout.bytes_per_token / 2**30:.2f} "
        f"GiB; demotions {s['demotions']}, promotions {s['promotions']}, "
        f"invalid blocks {s['invalid_blocks']}"
    )
