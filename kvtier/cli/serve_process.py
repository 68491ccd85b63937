"""``ServeProcess``: a ``kvtier serve`` child process, for the demo and the benches.

It writes a config (``[store]`` with a layout, a host tier over an NVMe directory, ``[service]``
on a unix socket in a private temporary directory), starts ``python -m kvtier.cli.main serve``
and waits until it serves; ``stop`` sends SIGTERM (the service closes its store) and removes
the directory. ``vllm_page_layout`` is the layout a service needs for vLLM engines.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvtier.errors import ConfigError
from kvtier.layout import KVLayout

_START_S = 60.0  # how long `kvtier serve` may take to start (a busy machine imports slowly)


def vllm_page_layout(model: Path, block_tokens: int) -> KVLayout:
    """The kvtier layout of vLLM's CPU pages of ``model``: per token and KV head, K and V
    side by side (``kv_factor`` 1, ``head_dim`` twice the model's), bf16."""
    cfg = json.loads((model / "config.json").read_text())
    heads = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    return KVLayout(int(cfg["num_hidden_layers"]), heads, 2 * dim, "bfloat16", 1, block_tokens)


class ServeProcess:
    """A ``kvtier serve`` child process (stopped, and its files removed, by ``stop``)."""

    def __init__(self, layout: KVLayout, model_id: str, host: int, nvme: int, staging: int) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvtier-serve-"))  # short: a socket path <= 107
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

        with connect(self.url, timeout=5.0, layout=self.layout, name="kvtier-serve-process") as c:
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
