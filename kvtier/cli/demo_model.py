"""``kvtier demo``: multi-turn chat sessions through a real transformers forward pass.

Several sessions share a system prompt, each has its own document, and they take turns round-robin;
every turn's prompt is the whole conversation so far plus a new message. The store is the embedded
default (a small host DRAM tier over a local NVMe directory), so a session that comes back after
the others finds its earlier turns demoted to NVMe. Each turn prints the time to first token with
kvtier and without it (a plain forward over the whole prompt), where the reused prefix came from,
and whether the logits were bit-identical; a summary table follows.

The model is a seeded random Llama-architecture model (nothing is downloaded), or a local
checkpoint with ``--model PATH`` (its tokenizer, if any, turns canned messages into tokens).
"""

from __future__ import annotations

import argparse
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from kvtier.cli.report import tier_table


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of the real-model demo (``--dir`` and ``--seed`` are ``kvtier demo``'s)."""
    p.add_argument("--model", default=None, help="local checkpoint directory (default: random)")
    p.add_argument("--sessions", type=int, default=3)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--doc-tokens", type=int, default=1024, help="each session's document")
    p.add_argument("--new-tokens", type=int, default=8, help="tokens generated per turn")
    p.add_argument("--block-tokens", type=int, default=64)
    p.add_argument("--host-blocks", type=int, default=24, help="host tier size in blocks")
    p.add_argument("--nvme-blocks", type=int, default=1024, help="NVMe tier size in blocks")
    p.add_argument("--attn", default="kvtier_exact", choices=["kvtier_exact", "sdpa", "eager"])


def _build(args: argparse.Namespace) -> tuple[Any, Any]:
    from kvtier.integrations.models import ModelSpec, load_model, load_tokenizer, random_model

    if args.model:
        return load_model(args.model, attn=args.attn), load_tokenizer(args.model)
    spec = ModelSpec(layers=8, hidden=256, heads=4, kv_heads=2, intermediate=704, vocab=4096)
    return random_model(spec, attn=args.attn), None


def _messages(tok: Any, vocab: int, rng: np.random.Generator, n: int, text: str) -> list[int]:
    if tok is not None:
        return list(tok.encode(text, add_special_tokens=False))
    return [int(x) for x in rng.integers(0, vocab, n)]


def run(console: Console, args: argparse.Namespace) -> int:
    """Run the sessions; return 0 if every turn was bit-identical, else 1."""
    import torch

    from kvtier.integrations import hf, hf_cache
    from kvtier.store import TieredStore
    from kvtier.tiers.host import HostTier
    from kvtier.tiers.nvme import NVMeTier

    model, tok = _build(args)
    vocab = int(model.config.vocab_size)
    layout = hf_cache.model_layout(model, args.block_tokens)
    rng = np.random.default_rng(args.seed)
    d = Path(args.dir) / "hf"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    system = _messages(tok, vocab, rng, 192, "You are a careful assistant. " * 12)
    convs = [
        system
        + _messages(tok, vocab, rng, args.doc_tokens + int(rng.integers(0, 64)), f"Doc {s}: " * 99)
        for s in range(args.sessions)
    ]
    console.print(
        f"[bold]kvtier demo[/] (real model): {args.sessions} sessions x {args.turns} turns, "
        f"{layout.layers} layers, {layout.kv_heads} KV heads, {layout.bytes_per_token:,} B/token, "
        f"blocks of {layout.block_tokens}; host {args.host_blocks} blocks over NVMe {d}"
    )
    totals: Counter[str] = Counter()
    t_cached = t_plain = 0.0
    all_same = True
    tiers = [
        HostTier(layout, args.host_blocks * layout.block_bytes),
        NVMeTier(layout, [d], args.nvme_blocks * layout.block_bytes, warm_restart=False),
    ]
    with TieredStore(layout, tiers, model_id=str(args.model or "random-llama")) as store:
        for turn in range(args.turns):
            for s in range(args.sessions):
                conv = convs[s]
                conv += _messages(tok, vocab, rng, int(rng.integers(40, 90)), f"Question {turn}?")
                got = hf.generate_with_cache(model, store, conv, args.new_tokens)
                ref = hf.generate_reference(model, conv, args.new_tokens)
                same = got.tokens == ref.tokens and bool(torch.equal(got.logits, ref.logits))
                all_same = all_same and same
                src = Counter(got.sources)
                totals.update(src)
                totals["reused"] += got.n_reused
                totals["prompt"] += len(conv)
                t_cached += got.ttft_s
                t_plain += ref.ttft_s
                where = " ".join(f"{k}x{v}" for k, v in src.items()) or "miss"
                console.print(
                    f"session {s} turn {turn}: {len(conv):5d} tokens, {got.n_reused:5d} reused "
                    f"({where}); TTFT {got.ttft_s * 1e3:.0f} ms vs {ref.ttft_s * 1e3:.0f} ms "
                    f"without kvtier; "
                    + ("identical" if same else "[red]DIFFERENT[/]")
                    + ("" if tok is None else f": {tok.decode(got.tokens)!r}")
                )
                conv += got.tokens
        store.flush()
        stats = store.stats()
    console.print(tier_table(stats, {"host": totals["host"], "nvme": totals["nvme"]}))
    summary = Table(title="summary")
    for col in (
        "prompt tokens",
        "reused",
        "blocks from host",
        "blocks from NVMe",
        "TTFT kvtier (sum)",
        "TTFT plain (sum)",
        "speedup",
        "all identical",
    ):
        summary.add_column(col, justify="right")
    summary.add_row(
        f"{totals['prompt']:,}",
        f"{totals['reused']:,} ({totals['reused'] / totals['prompt']:.0%})",
        str(totals["host"]),
        str(totals["nvme"]),
        f"{t_cached:.2f} s",
        f"{t_plain:.2f} s",
        f"{t_plain / t_cached:.1f}x",
        "yes" if all_same else "[red]NO[/]",
    )
    console.print(summary)
    shutil.rmtree(d, ignore_errors=True)
    return 0 if all_same else 1
