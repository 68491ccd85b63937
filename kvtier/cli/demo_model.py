"""``kvtier demo``: multi-turn chat sessions through a real transformers forward pass.

Several sessions share a system prompt, each has its own document, and they take turns round-robin;
every turn's prompt is the whole conversation so far plus a new message. The store is the embedded
default (a small host DRAM tier over a local NVMe directory), so a session that comes back after
the others finds its earlier turns demoted to NVMe. Each turn prints the time to first token with
kvtier and without it (a plain forward over the whole prompt), where the reused prefix came from,
and whether the logits were bit-identical; a summary table follows. One untimed forward warms the
model up first, and the two runs of a turn alternate which goes first, so neither pays for
first-call set-up or for the other's cache misses.

The model is a seeded random Llama-architecture model (nothing is downloaded), or a local
checkpoint with ``--model PATH`` (its tokenizer, if any, turns canned messages into tokens).
"""

from __future__ import annotations

import argparse
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from kvtier.cli.report import tier_table
from kvtier.errors import ConfigError
from kvtier.layout import KVLayout

#: the real-model demo's options and their defaults (None on the command line = not given)
DEFAULTS: dict[str, object] = {
    "model": None,
    "sessions": 3,
    "turns": 3,
    "doc_tokens": 1024,
    "new_tokens": 8,
    "block_tokens": 64,
    "host_blocks": 24,
    "nvme_blocks": 1024,
    "attn": "kvtier_exact",
}
_AT_LEAST = {"doc_tokens": 0}  # every other whole-number option is >= 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of the real-model demo (``--dir`` and ``--seed`` are ``kvtier demo``'s)."""
    d = DEFAULTS
    p.add_argument("--model", default=None, help="local checkpoint directory (default: random)")
    p.add_argument("--sessions", type=int, default=None, help=f"default {d['sessions']}")
    p.add_argument("--turns", type=int, default=None, help=f"default {d['turns']}")
    p.add_argument(
        "--doc-tokens", type=int, default=None, help=f"each session's document ({d['doc_tokens']})"
    )
    p.add_argument(
        "--new-tokens",
        type=int,
        default=None,
        help=f"tokens generated per turn ({d['new_tokens']})",
    )
    p.add_argument("--block-tokens", type=int, default=None, help=f"default {d['block_tokens']}")
    p.add_argument(
        "--host-blocks", type=int, default=None, help=f"host tier in blocks ({d['host_blocks']})"
    )
    p.add_argument(
        "--nvme-blocks", type=int, default=None, help=f"NVMe tier in blocks ({d['nvme_blocks']})"
    )
    p.add_argument("--attn", default=None, choices=["kvtier_exact", "sdpa", "eager"])


def resolve(args: argparse.Namespace) -> None:
    """Fill the options not given with their defaults (in place) and check them; raise
    ``ConfigError`` naming the first bad one."""
    for name, default in DEFAULTS.items():
        if getattr(args, name, None) is None:
            setattr(args, name, default)
        value, low = getattr(args, name), _AT_LEAST.get(name, 1)
        if isinstance(default, int) and value < low:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} must be >= {low}, got {value}")
    if getattr(args, "seed", 0) < 0:
        raise ConfigError(f"--seed must be >= 0, got {args.seed}")


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
    """Run the sessions; return 0 if every turn was bit-identical, else 1. The NVMe directory
    ``<--dir>/hf`` is wiped at the start and removed at the end, also when the run fails."""
    resolve(args)
    from kvtier.integrations import hf_cache

    model, tok = _build(args)
    layout = hf_cache.model_layout(model, args.block_tokens)
    d = Path(args.dir) / "hf"
    shutil.rmtree(d, ignore_errors=True)
    try:
        d.mkdir(parents=True)
    except OSError as exc:
        raise ConfigError(f"--dir {args.dir}: cannot create {d}: {exc.strerror}") from None
    try:
        return _sessions(console, args, model, tok, layout, d)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _sessions(
    console: Console, args: argparse.Namespace, model: Any, tok: Any, layout: KVLayout, d: Path
) -> int:
    import torch

    from kvtier.integrations import hf
    from kvtier.store import TieredStore
    from kvtier.tiers.host import HostTier
    from kvtier.tiers.nvme import NVMeTier

    vocab = int(model.config.vocab_size)
    rng = np.random.default_rng(args.seed)
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
    t0 = time.perf_counter()
    hf.generate_reference(model, convs[0], 1)  # warm-up: first-call set-up is nobody's TTFT
    console.print(
        f"warm-up forward ({len(convs[0])} tokens, untimed): {time.perf_counter() - t0:.1f} s"
    )
    totals: Counter[str] = Counter()
    t_cached = t_plain = 0.0
    n_same = 0
    tiers = [
        HostTier(layout, args.host_blocks * layout.block_bytes),
        NVMeTier(layout, [d], args.nvme_blocks * layout.block_bytes, warm_restart=False),
    ]
    from kvtier.integrations import hf_cache

    identity = hf_cache.model_identity(model, str(args.model or "random-llama"))
    with TieredStore(layout, tiers, identity=identity) as store:
        for turn in range(args.turns):
            for s in range(args.sessions):
                conv = convs[s]
                conv += _messages(tok, vocab, rng, int(rng.integers(40, 90)), f"Question {turn}?")
                if (turn + s) % 2:  # alternate which run goes first
                    ref = hf.generate_reference(model, conv, args.new_tokens)
                    got = hf.generate_with_cache(model, store, conv, args.new_tokens)
                else:
                    got = hf.generate_with_cache(model, store, conv, args.new_tokens)
                    ref = hf.generate_reference(model, conv, args.new_tokens)
                same = got.tokens == ref.tokens and bool(torch.equal(got.logits, ref.logits))
                n_same += same
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
    n_turns = args.sessions * args.turns
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
        "yes" if n_same == n_turns else "[red]NO[/]",
    )
    console.print(summary)
    if n_same < n_turns:
        console.print(f"[red]{n_turns - n_same} of {n_turns} turns differed from a plain run[/]")
        return 1
    console.print(f"all {n_turns} turns bit-identical to a plain run", soft_wrap=True)
    return 0
