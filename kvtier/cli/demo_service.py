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
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from kvtier.errors import ConfigError
from kvtier.layout import KVLayout

_START_S = 60.0  # how long `kvtier serve` may take to start (a busy machine imports slowly)


def page_layout(model: Path, block_tokens: int) -> KVLayout:
    """The kvtier layout of vLLM's CPU pages of ``model``: per token and KV head, K and V
    side by side (``kv_factor`` 1, ``head_dim`` twice the model's), bf16."""
    cfg = json.loads((model / "config.json").read_text())
    heads = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    return KVLayout(int(cfg["num_hidden_layers"]), heads, 2 * dim, "bfloat16", 1, block_tokens)


class DemoService:
    """A ``kvtier serve`` process for the demo (stopped, and its files removed, by ``stop``)."""

    def __init__(self, layout: KVLayout, model_id: str, host: int, nvme: int, staging: int) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvtier-demo-"))  # short: a socket path <= 107
        self.url = f"unix://{self.dir / 'kvtier.sock'}"
        self.config = self.dir / "kvtier.toml"
        self.config.write_text(
            f'[store]\nmodel_id = "{model_id}"\nlayers = {layout.layers}\n'
            f"kv_heads = {layout.kv_heads}\nhead_dim = {layout.head_dim}\n"
            f'kv_factor = {layout.kv_factor}\ndtype = "{layout.dtype}"\n'
            f"block_tokens = {layout.block_tokens}\n"
            f'[[tiers]]\nkind = "host"\ncapacity = {host}\n'
            f'[[tiers]]\nkind = "nvme"\ncapacity = {nvme}\npaths = ["{self.dir / "nvme"}"]\n'
            f'[service]\nurl = "{self.url}"\nstaging = {staging}\n'
        )
        self.log = self.dir / "serve.log"
        self.layout = layout
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start ``kvtier serve`` and wait until it serves (``ConfigError`` if it does not)."""
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvtier.cli.main", "serve", "--config", str(self.config)],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + _START_S
        while b"serving" not in self.log.read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text(errors="replace")[-2000:]
                raise ConfigError(f"kvtier serve did not start: {tail}")
            time.sleep(0.05)

    def tier_hits(self) -> dict[str, int]:
        """Blocks the service served per tier since it started ({} if it does not answer)."""
        from kvtier.service.client import connect

        with connect(self.url, timeout=5.0, layout=self.layout, name="kvtier-demo") as c:
            tiers = c.stats().get("tiers", {})
        return {name: int(t.get("hits", 0)) for name, t in tiers.items()}

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


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

    layout = page_layout(model, block_tokens)
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    model_id = str(args.model or "random-llama")
    staging = -(-max_len * layout.bytes_per_token // (1 << 20)) << 20  # a prompt: zero-copy
    service = DemoService(
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
