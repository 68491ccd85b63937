"""``kvtier bench redis``: the Redis tier against the bare redis-py client, same bytes, same run.

Both sides move ``--blocks`` blocks of ``--block-mib`` MiB in one pipeline per direction: the
tier through ``put``/``get_into`` (sealing, header + checksum verification, copy into the
caller's buffer), the raw client as plain ``SET``/``GET`` of byte strings of the same size (the
reply stays in redis-py's bytes: the raw side does *less* work). Rounds are interleaved
(raw, tier, raw, tier ...) and the best round of each is reported, so drift on a shared machine
hits both alike. Without ``--url``/``--cluster`` a ``redis-server`` is started on a free
127.0.0.1 port and stopped (by PID) at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import redis

from kvtier.errors import ConfigError
from kvtier.keys import BlockKey
from kvtier.layout import KVLayout
from kvtier.tiers.redis import RedisOptions, RedisTier
from kvtier.tiers.secure import BlockSealer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="", help="redis://host:port (default: start a server)")
    parser.add_argument("--cluster", default="", help="comma-separated host:port startup nodes")
    parser.add_argument("--block-mib", type=int, default=4, help="block size in MiB (4)")
    parser.add_argument("--blocks", type=int, default=32, help="blocks per round (32)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (3)")
    parser.add_argument("--encrypt", action="store_true", help="AES-GCM seal the tier's blocks")


def bench_layout(block_mib: int) -> KVLayout:
    """A layout whose block is exactly ``block_mib`` MiB (1 MiB per layer, 256 fp16 tokens)."""
    if block_mib < 1:
        raise ConfigError(f"--block-mib must be >= 1, got {block_mib}")
    return KVLayout(layers=block_mib, kv_heads=8, head_dim=128, dtype="float16", block_tokens=256)


@contextmanager
def local_redis() -> Iterator[str]:
    """A throwaway redis-server on a free 127.0.0.1 port; yields its URL, stops it by PID."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise ConfigError("redis-server not found: install it (Debian: redis-server) or give --url")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="kvtier-bench-redis-")
    argv = [
        binary,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        workdir,
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}"
    try:
        client = redis.Redis.from_url(url)
        for _ in range(200):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        client.close()
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def best_gbps(nbytes: int, fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return nbytes / (time.perf_counter() - t0) / 1e9


def run(args: argparse.Namespace) -> dict[str, Any]:
    lay = bench_layout(args.block_mib)
    cluster = tuple(n for n in args.cluster.split(",") if n)
    if args.url or cluster:
        return _run(args, lay, args.url, cluster)
    with local_redis() as url:
        return _run(args, lay, url, ())


def _run(
    args: argparse.Namespace, lay: KVLayout, url: str, cluster: tuple[str, ...]
) -> dict[str, Any]:
    opts = RedisOptions(url=url or "redis://127.0.0.1:6379", cluster=cluster, timeout=30.0)
    sealer = BlockSealer(lay, os.urandom(32) if args.encrypt else b"")
    prefix = "bench" + uuid.uuid4().hex[:8]
    tier = RedisTier(lay, opts, prefix=prefix, sealer=sealer, batch_bytes=1 << 40)
    raw = redis.Redis.from_url(url) if not cluster else opts.connect()
    rng = np.random.default_rng(0)
    blocks = [
        rng.integers(0, 2**16, size=lay.block_shape, dtype=np.uint16) for _ in range(args.blocks)
    ]
    outs = [np.empty(lay.block_shape, dtype=np.uint16) for _ in range(args.blocks)]
    raw_values = [bytes(sealer.value_bytes) for _ in range(args.blocks)]
    nbytes = args.blocks * lay.block_bytes
    res: dict[str, list[float]] = {"store": [], "load": [], "raw_store": [], "raw_load": []}
    ok = True
    try:
        for r in range(args.rounds):
            keys = [BlockKey(os.urandom(32)) for _ in range(args.blocks)]
            names = [f"{prefix}:raw:{r}:{i}" for i in range(args.blocks)]

            def raw_put(names: list[str] = names) -> None:
                pipe = raw.pipeline(transaction=False)
                for n, v in zip(names, raw_values, strict=True):
                    pipe.set(n, v)
                pipe.execute()

            def raw_get(names: list[str] = names) -> None:
                pipe = raw.pipeline(transaction=False)
                for n in names:
                    pipe.get(n)
                pipe.execute()

            def put(keys: list[BlockKey] = keys) -> None:
                ok_all(tier.put(keys, blocks))

            def get(keys: list[BlockKey] = keys) -> None:
                ok_all(tier.get_into(keys, outs))

            res["raw_store"].append(best_gbps(nbytes, raw_put))
            res["store"].append(best_gbps(nbytes, put))
            res["raw_load"].append(best_gbps(nbytes, raw_get))
            res["load"].append(best_gbps(nbytes, get))
            ok = ok and all(o.tobytes() == b.tobytes() for o, b in zip(outs, blocks, strict=True))
            tier.delete(keys)
            for n in names:
                raw.delete(n)
    finally:
        tier.close()
        raw.close()
    out: dict[str, Any] = {k + "_gbps": max(v) for k, v in res.items()}
    out["store_ratio"] = out["store_gbps"] / out["raw_store_gbps"]
    out["load_ratio"] = out["load_gbps"] / out["raw_load_gbps"]
    out.update(
        block_bytes=lay.block_bytes,
        blocks=args.blocks,
        rounds=args.rounds,
        encrypted=bool(args.encrypt),
        byte_identical=ok,
    )
    return out


def ok_all(results: list[bool]) -> None:
    if not all(results):
        raise RuntimeError(f"benchmark: {results.count(False)} blocks failed (server full?)")
