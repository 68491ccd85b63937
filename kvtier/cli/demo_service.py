"""``kvtier demo --service``: two vLLM engines sharing one node service (``kvtier serve``).

Runs after the in-process turns of the vLLM demo (``kvtier.cli.demo_vllm``), over the same model
and conversations. The demo starts ``kvtier serve`` as a process of its own (host DRAM over an
NVMe directory, a unix socket in a private temporary directory) and two engines with kvtier in
service mode, each its own set of processes: for every session, engine A takes a turn
(computing the conversation, whose blocks land in the service), then engine B -- another engine,
as another replica behind a load balancer would be -- takes the next turn. B finds the
conversation in the service, computed by A. Each B turn prints its time to first token against
vLLM alone, how many tokens the service served and from which tier, and whether the tokens were
identical to vLLM alone.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from kvtier.cli.serve_process import ServeProcess, vllm_page_layout


def run(
    console: Console,
    args: argparse.Namespace,
    model: Path,
    plain: Any,
    convs: list[list[int]],
    rng: np.random.Generator,
    block_tokens: int,
    max_len: int,
) -> int:
    """Serve one more turn per session on engine A, the next on engine B, both over one new
    service; 0 if every B turn was identical to ``plain`` (vLLM alone), else 1. Appends the
    turns to ``convs``."""
    from kvtier.cli import demo_vllm

    layout = vllm_page_layout(model, block_tokens)
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    model_id = str(args.model or "random-llama")
    staging = -(-max_len * layout.bytes_per_token // (1 << 20)) << 20  # a prompt: zero-copy
    service = ServeProcess(
        layout,
        model_id,
        args.host_blocks * layout.block_bytes,
        args.nvme_blocks * layout.block_bytes,
        staging,
    )
    kv = {
        "store": {"block_tokens": block_tokens, "model_id": model_id},
        "service": {"url": service.url},
    }
    a = b = None
    n_same = 0
    t_kv = t_plain = 0.0
    served = total = 0
    try:
        service.start()
        pid = service.proc.pid if service.proc is not None else "?"
        console.print(
            f"\n[bold]two engines, one kvtier service[/]: kvtier serve (pid {pid}) on "
            f"{service.url}; engines A and B each run in their own processes"
        )
        a, b = demo_vllm.engine(model, kv, max_len), demo_vllm.engine(model, kv, max_len)
        # warm-up through the service (A stores, B loads): first-call set-up is nobody's TTFT
        warm = rng.integers(0, vocab, 2 * block_tokens + 1).tolist()
        for e in (a, b):
            demo_vllm.timed_turn(e, warm, 1)
        hits = service.tier_hits()
        for s, conv in enumerate(convs):
            conv += rng.integers(0, vocab, int(rng.integers(40, 90))).tolist()
            _, got_a, _ = demo_vllm.timed_turn(a, conv, args.new_tokens)  # A: into the service
            conv += got_a + rng.integers(0, vocab, int(rng.integers(40, 90))).tolist()
            order = [(plain, False), (b, True)][:: 1 if s % 2 else -1]
            res = {kv_on: demo_vllm.timed_turn(e, conv, args.new_tokens) for e, kv_on in order}
            (tk, got, cached), (tp, ref, _) = res[True], res[False]
            now = service.tier_hits()
            src = {k: v - hits.get(k, 0) for k, v in now.items() if v - hits.get(k, 0)}
            hits = now
            same = got == ref
            n_same += same
            t_kv, t_plain = t_kv + tk, t_plain + tp
            served, total = served + cached, total + len(conv)
            where = " ".join(f"{k}x{v}" for k, v in src.items()) or "miss"
            console.print(
                f"session {s}, engine B: {len(conv):5d} tokens, {cached:5d} from the service "
                f"(computed by engine A; {where}); TTFT {tk * 1e3:.0f} ms vs {tp * 1e3:.0f} ms "
                "without kvtier; " + ("identical" if same else "[red]DIFFERENT[/]")
            )
            conv += got
    finally:
        for e in (a, b):
            if e is not None:
                e.llm_engine.engine_core.shutdown()
        service.stop()
    n = len(convs)
    speed = f"{t_plain / t_kv:.1f}x" if t_kv else "-"
    console.print(
        f"engine B was served {served:,} of {total:,} prompt tokens ({served / max(1, total):.0%}) "
        f"by the service, computed by engine A: TTFT {t_kv:.2f} s vs {t_plain:.2f} s without "
        f"kvtier ({speed})"
    )
    if n_same < n:
        console.print(f"[red]{n - n_same} of {n} engine B turns differed from vLLM alone[/]")
        return 1
    console.print(f"all {n} engine B turns identical to vLLM alone", soft_wrap=True)
    return 0
