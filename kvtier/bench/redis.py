"""``kvtier bench redis``: the Redis tier against the bare redis-py client, same bytes, same run.

Both sides move ``--blocks`` blocks of ``--block-mib`` MiB in one pipeline per direction: the
tier through ``put``/``get_into`` (sealing, header + checksum verification, copy into the
caller's buffer), the raw client as plain ``SET``/``GET`` of byte strings of the same size (the
reply stays in redis-py's bytes: the raw side does *less* work). Rounds are interleaved as
``kvtier.bench.remote`` describes. Without ``--url``/``--cluster`` a ``redis-server`` is started
on a free 127.0.0.1 port and stopped (by PID) at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from kvtier.bench.remote import (
    Round,
    add_round_arguments,
    bench_layout,
    bench_sealer,
    free_port,
    interleaved,
    random_blocks,
    same_bytes,
    tier_buffers,
    wait_port,
)
from kvtier.errors import ConfigError
from kvtier.keys import BlockKey
from kvtier.layout import KVLayout
from kvtier.tiers.redis import RedisOptions, RedisTier


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_round_arguments(parser, blocks=32, rounds=3)
    parser.add_argument("--url", default="", help="redis://host:port (default: start a server)")
    parser.add_argument("--cluster", default="", help="comma-separated host:port startup nodes")


@contextmanager
def local_redis() -> Iterator[str]:
    """A throwaway redis-server on a free 127.0.0.1 port; yields its URL, stops it by PID."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise ConfigError("redis-server not found: install it (Debian: redis-server) or give --url")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-redis-") as workdir:
        argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", workdir]  # fmt: skip
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_port(port, proc, "redis-server")
            yield f"redis://127.0.0.1:{port}"
        finally:
            proc.terminate()
            proc.wait(10)


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
    sealer = bench_sealer(lay, args.encrypt, not args.no_auth)
    prefix = "bench" + uuid.uuid4().hex[:8]
    tier = RedisTier(lay, opts, prefix=prefix, sealer=sealer, batch_bytes=1 << 40)
    raw = opts.connect()  # the tier's own client setup (values go out without a copy)
    n = args.blocks
    blocks = tier_buffers(random_blocks(lay, n), args.plain)
    outs = tier_buffers([np.empty(lay.block_shape, dtype=np.uint16) for _ in range(n)], args.plain)
    # the same bytes as memoryviews of page-touched buffers: the fastest way to hand redis-py
    # a value (bytes would be copied by its hiredis packer)
    raw_values = [np.ones(sealer.value_bytes, np.uint8).data for _ in range(n)]

    def batch(names: list[str], op: str, *values: list[memoryview]) -> bool:
        pipe = raw.pipeline(transaction=False)
        for args_ in zip(names, *values, strict=True):
            getattr(pipe, op)(*args_)
        return all(r is not None for r in pipe.execute())

    def make_round(r: int) -> Round:
        keys = [BlockKey(os.urandom(32)) for _ in range(n)]
        names = [f"{prefix}:raw:{r}:{i}" for i in range(n)]

        def cleanup() -> None:
            tier.delete(keys)
            batch(names, "delete")

        return Round(
            raw_store=lambda: batch(names, "set", raw_values),
            store=lambda: all(tier.put(keys, blocks)),
            raw_load=lambda: batch(names, "get"),
            load=lambda: all(tier.get_into(keys, outs)),
            identical=lambda: same_bytes(outs, blocks),
            cleanup=cleanup,
        )

    try:
        out = interleaved(make_round, args.rounds, n * lay.block_bytes)
    finally:
        tier.close()
        raw.close()
    return {
        **out,
        "block_bytes": lay.block_bytes,
        "blocks": n,
        "encrypted": bool(args.encrypt),
        "auth": bench_sealer(lay, args.encrypt, not args.no_auth).mode,
        "framed": not args.plain,
    }
