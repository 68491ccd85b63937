"""Real ``kvtier serve`` processes and client processes for the service tests and bench.

``ServiceProc`` writes a config (``add_pool``: a further layout it serves) and runs
``python -m kvtier.cli.main serve`` in a subprocess;
``prompt(i, n)`` is a deterministic prompt and its KV, so any process can check bytes it loads.
``tests/service_client.py`` is the client process these tests start and kill.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.layout import KVLayout

LAYOUT = KVLayout(layers=2, kv_heads=2, head_dim=16, block_tokens=16)
HF_BLOCK_TOKENS = 16
ROOT = Path(__file__).resolve().parent.parent
CLIENT = Path(__file__).resolve().parent / "service_client.py"


def env() -> dict[str, str]:
    out = dict(os.environ)
    out["PYTHONPATH"] = str(ROOT) + os.pathsep + out.get("PYTHONPATH", "")
    return out


def prompt(
    i: int, n: int, layout: KVLayout = LAYOUT
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Prompt ``i``: ``n`` token ids and their KV (both a pure function of ``i`` and ``n``)."""
    rng = np.random.default_rng(1000 + i)
    tokens = rng.integers(0, 50_000, n).astype(np.int64)
    kv = rng.standard_normal(layout.kv_shape(n)).astype(np.float16)
    return tokens, kv


class ServiceProc:
    """A ``kvtier serve`` subprocess on a short socket path under a private temp directory."""

    def __init__(
        self,
        *,
        host: str = "1MiB",
        nvme: str | None = None,
        lease_ttl: float = 3.0,
        timeout: float = 2.0,
        staging: str = "64KiB",
        layout: KVLayout = LAYOUT,
        root: str | None = None,
        group: str = "",
        data: str = "arena",
    ) -> None:
        self.dir = root or tempfile.mkdtemp(prefix="kvt", dir="/tmp")
        self.sock = os.path.join(self.dir, "kv.sock")
        self.url = "unix://" + self.sock
        self.timeout = timeout
        tiers = f'[[tiers]]\nkind = "host"\ncapacity = "{host}"\n'
        if nvme:
            tiers += (
                f'[[tiers]]\nkind = "nvme"\ncapacity = "{nvme}"\n'
                f'paths = ["{self.dir}/nvme"]\no_direct = "never"\n'
            )
        self.config = os.path.join(self.dir, "kvtier.toml")
        Path(self.config).write_text(
            f'[store]\nmodel_id = "test/model"\nlayers = {layout.layers}\n'
            f"kv_heads = {layout.kv_heads}\nhead_dim = {layout.head_dim}\n"
            f'block_tokens = {layout.block_tokens}\ndtype = "{layout.dtype}"\n'
            f"kv_factor = {layout.kv_factor}\n"
            f'{tiers}[service]\nurl = "{self.url}"\nstaging = "{staging}"\n'
            f'lease_ttl = {lease_ttl}\ntimeout = {timeout}\ndata = "{data}"\n'
            + (f'group = "{group}"\n' if group else "")
        )
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = os.path.join(self.dir, "serve.log")
        self.pools = 0

    def add_pool(
        self,
        layout: KVLayout,
        *,
        name: str = "",
        host: str | None = "1MiB",
        nvme: str | None = None,
        nvme_dir: str = "",
        model_id: str = "test/model",
    ) -> None:
        """Add a ``[[pools]]`` table of ``layout`` to the config (before ``start``): a host
        tier of ``host`` bytes (``None``: no tiers at all), an NVMe tier of ``nvme`` bytes in
        ``nvme_dir`` (default: a directory of its own)."""
        self.pools += 1
        table = "[[pools]]\n" + (f'name = "{name}"\n' if name else "")
        table += (
            f'[pools.store]\nmodel_id = "{model_id}"\nlayers = {layout.layers}\n'
            f"kv_heads = {layout.kv_heads}\nhead_dim = {layout.head_dim}\n"
            f'block_tokens = {layout.block_tokens}\ndtype = "{layout.dtype}"\n'
            f"kv_factor = {layout.kv_factor}\n"
        )
        if host is not None:
            table += f'[[pools.tiers]]\nkind = "host"\ncapacity = "{host}"\n'
        if nvme:
            where = nvme_dir or f"{self.dir}/nvme-pool{self.pools}"
            table += (
                f'[[pools.tiers]]\nkind = "nvme"\ncapacity = "{nvme}"\n'
                f'paths = ["{where}"]\no_direct = "never"\n'
            )
        with open(self.config, "a") as f:
            f.write(table)

    def start(self, wait: bool = True) -> subprocess.Popen[bytes]:
        """Start the service; with ``wait``, until it serves (``RuntimeError`` if it exits)."""
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvtier.cli.main", "serve", "--config", self.config],
                env=env(),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        if wait:
            deadline = time.monotonic() + 30
            while b"kvtier serve: serving" not in Path(self.log).read_bytes():
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"kvtier serve did not start: {self.output()}")
                time.sleep(0.05)
        return self.proc

    def output(self) -> str:
        return Path(self.log).read_text(errors="replace")

    def kill(self) -> None:
        """``kill -9`` (the socket file is left behind, as after a crash)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


SPAWNED: list[subprocess.Popen[str]] = []  # client processes, killed by ``kill_spawned``


def client_proc(*args: object) -> subprocess.Popen[str]:
    """A ``tests/service_client.py`` process; its stdout lines report progress."""
    proc = subprocess.Popen(
        [sys.executable, str(CLIENT), *map(str, args)],
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    SPAWNED.append(proc)
    return proc


def kill_spawned() -> None:
    """Kill every client process still running (a failed test leaves none behind)."""
    while SPAWNED:
        kill9(SPAWNED.pop())


def until(cond: Callable[[], bool], timeout: float = 20.0, every: float = 0.05) -> bool:
    """Poll ``cond`` until it holds or ``timeout`` seconds pass; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(every)
    return cond()


def wait_line(proc: subprocess.Popen[str], word: str, timeout: float = 30.0) -> str:
    """Read ``proc``'s stdout until a line starting with ``word``; ``RuntimeError`` if it ends."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            err = proc.stderr.read() if proc.stderr else ""
            raise RuntimeError(f"client exited ({proc.wait()}) before {word!r}: {err}")
        if line.startswith(word):
            return line.strip()
    raise RuntimeError(f"no {word!r} from the client in {timeout} s")


def kill9(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    for f in (proc.stdout, proc.stderr):
        if f is not None:
            f.close()
