"""``kvtier demo`` through vLLM: multi-turn sessions served by ``vllm.LLM`` with kvtier as its
KV connector, against the same engine without it.

The sessions, prompts and options are the real-model demo's (``kvtier.cli.demo_model``): a
shared system prompt, one document per session, turns taken round-robin, every prompt the
whole conversation so far plus a new message. Two engines run side by side over the same
model: vLLM alone and vLLM + kvtier (the embedded default: host DRAM over a local NVMe
directory). Before every turn both engines' own prefix caches are reset -- as if the engine had
evicted the conversation, which is what happens to an idle session on a busy server -- so the
engine alone recomputes the prompt and the kvtier engine loads what kvtier holds. Each turn
prints both times to first token (each request timed once both engines are idle,
``kvtier.bench.vllm.quiesce``), how many tokens kvtier served and from which tier, and
whether the generated tokens were identical. Then (unless ``--no-service``) the other mode: two
engines sharing one node service, against the same engine alone (``kvtier.cli.demo_service``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from kvtier.cli import demo_model, demo_service
from kvtier.errors import ConfigError

#: the page size vLLM's CPU backend is run with here; kvtier blocks are whole pages
PAGE_TOKENS = 128


def _model_dir(args: argparse.Namespace, work: Path) -> Path:
    if args.model:
        path = Path(args.model)
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"--model {args.model} is not a checkpoint directory (no config.json)"
            )
        return path
    from kvtier.integrations.models import ModelSpec, random_model

    spec = ModelSpec(layers=8, hidden=256, heads=4, kv_heads=2, intermediate=704, vocab=4096)
    path = work / "model"
    random_model(spec, dtype="bfloat16", attn="sdpa").save_pretrained(path)
    return path


def _block_bytes(model: Path, block_tokens: int) -> int:
    cfg = json.loads((model / "config.json").read_text())
    heads = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    return int(cfg["num_hidden_layers"]) * 2 * heads * dim * 2 * block_tokens  # bf16


def engine(model: Path, kv: dict[str, Any] | None, max_len: int) -> Any:
    from vllm import LLM

    from kvtier.integrations.vllm import transfer_config

    kw: dict[str, Any] = {}
    if kv is not None:
        kw["kv_transfer_config"] = transfer_config(kv)
    return LLM(
        model=str(model),
        skip_tokenizer_init=True,
        enforce_eager=True,
        block_size=PAGE_TOKENS,
        kv_cache_memory_bytes=256 << 20,
        max_model_len=max_len,
        dtype="bfloat16",
        seed=0,
        **kw,
    )


def timed_turn(llm: Any, prompt: list[int], new_tokens: int) -> tuple[float, list[int], int]:
    """(wall seconds of a one-token request = TTFT, the turn's tokens, cached prompt tokens).
    Timed once every engine is idle (``kvtier.bench.vllm.quiesce``)."""
    from vllm import SamplingParams

    from kvtier.bench.vllm import quiesce

    def gen(n: int) -> Any:
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
        return llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]

    llm.reset_prefix_cache()
    quiesce()
    t0 = time.perf_counter()
    first = gen(1)
    ttft = time.perf_counter() - t0
    full = gen(new_tokens)  # the rest of the turn (its prefix is in vLLM's cache now)
    return ttft, list(full.outputs[0].token_ids), int(first.num_cached_tokens or 0)


def _tier_hits(llm: Any) -> dict[str, int]:
    from kvtier.integrations.vllm.lookup_rpc import LookupClient

    client = LookupClient(str(llm.llm_engine.vllm_config.kv_transfer_config.engine_id), 1, 5.0)
    try:
        return dict(client.stats()[0].get("tier_hits", {}))
    finally:
        client.close()


def run(console: Console, args: argparse.Namespace) -> int:
    """Run the sessions through vLLM; 0 if every turn's tokens were identical, else 1. The
    directory ``<--dir>/vllm`` is wiped at the start and removed at the end."""
    block_tokens = args.block_tokens
    demo_model.resolve(args)
    if args.attn != demo_model.DEFAULTS["attn"]:
        raise ConfigError("--attn applies to --engine hf only (vLLM uses its own attention)")
    block_tokens = block_tokens or 2 * PAGE_TOKENS
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    work = Path(args.dir) / "vllm"
    shutil.rmtree(work, ignore_errors=True)
    try:
        work.mkdir(parents=True)
    except OSError as exc:
        raise ConfigError(f"--dir {args.dir}: cannot create {work}: {exc.strerror}") from None
    try:
        return _sessions(console, args, work, block_tokens)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _sessions(console: Console, args: argparse.Namespace, work: Path, block_tokens: int) -> int:
    model = _model_dir(args, work)
    bb = _block_bytes(model, block_tokens)
    kv = {
        "store": {"block_tokens": block_tokens, "model_id": str(args.model or "random-llama")},
        "tiers": [
            {"kind": "host", "capacity": args.host_blocks * bb},
            {"kind": "nvme", "capacity": args.nvme_blocks * bb, "paths": [str(work / "nvme")]},
        ],
    }
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    rng = np.random.default_rng(args.seed)
    system = rng.integers(0, vocab, 192).tolist()
    convs = [
        system + rng.integers(0, vocab, args.doc_tokens + int(rng.integers(0, 64))).tolist()
        for _ in range(args.sessions)
    ]
    turns = args.turns + (2 if args.service else 0)  # the service part: 2 more per session
    max_len = max(len(c) for c in convs) + turns * (90 + args.new_tokens) + 8
    console.print(
        f"[bold]kvtier demo[/] (vLLM): {args.sessions} sessions x {args.turns} turns, model "
        f"{args.model or 'random Llama 8L/256'}; kvtier host {args.host_blocks} blocks over NVMe "
        f"{work / 'nvme'}, blocks of {block_tokens} tokens; both engines' prefix caches are "
        "reset before every turn"
    )
    plain = llm = None
    n_same = n_turns = 0
    t_kv = t_plain = 0.0
    reused = prompt_total = 0
    try:
        plain, llm = engine(model, None, max_len), engine(model, kv, max_len)
        for e in (plain, llm):  # warm-up: first-call set-up is nobody's TTFT
            timed_turn(e, system, 1)
        hits = _tier_hits(llm)
        for turn in range(args.turns):
            for s in range(args.sessions):
                conv = convs[s]
                conv += rng.integers(0, vocab, int(rng.integers(40, 90))).tolist()
                order = [(plain, False), (llm, True)][:: 1 if (turn + s) % 2 else -1]
                res = {kv_on: timed_turn(e, conv, args.new_tokens) for e, kv_on in order}
                (tk, got, cached), (tp, ref, _) = res[True], res[False]
                now = _tier_hits(llm)
                src = {k: v - hits.get(k, 0) for k, v in now.items() if v - hits.get(k, 0)}
                hits = now
                same = got == ref
                n_same += same
                n_turns += 1
                t_kv, t_plain = t_kv + tk, t_plain + tp
                reused, prompt_total = reused + cached, prompt_total + len(conv)
                where = " ".join(f"{k}x{v}" for k, v in src.items()) or "miss"
                console.print(
                    f"session {s} turn {turn}: {len(conv):5d} tokens, {cached:5d} from kvtier "
                    f"({where}); TTFT {tk * 1e3:.0f} ms vs {tp * 1e3:.0f} ms without kvtier; "
                    + ("identical" if same else "[red]DIFFERENT[/]")
                )
                conv += got
    finally:
        for e in (llm,) if args.service else (plain, llm):  # --service: vLLM alone goes on
            if e is not None:
                e.llm_engine.engine_core.shutdown()
        gc.collect()
    summary = Table(title="summary")
    for col in ("prompt tokens", "from kvtier", "TTFT kvtier (sum)", "TTFT vLLM alone (sum)",
                "speedup", "all identical"):  # fmt: skip
        summary.add_column(col, justify="right")
    summary.add_row(
        f"{prompt_total:,}",
        f"{reused:,} ({reused / max(1, prompt_total):.0%})",
        f"{t_kv:.2f} s",
        f"{t_plain:.2f} s",
        f"{t_plain / t_kv:.1f}x" if t_kv else "-",
        "yes" if n_same == n_turns else "[red]NO[/]",
    )
    console.print(summary)
    if n_same < n_turns:
        console.print(f"[red]{n_turns - n_same} of {n_turns} turns differed from vLLM alone[/]")
    else:
        console.print(f"all {n_turns} turns identical to vLLM alone", soft_wrap=True)
    rc = int(n_same < n_turns)
    if args.service and plain is not None:  # the other mode, against the same vLLM alone
        try:
            rc |= demo_service.run(console, args, model, plain, convs, rng, block_tokens, max_len)
        finally:
            plain.llm_engine.engine_core.shutdown()
            gc.collect()
    return rc
