"""``kvtier bench s3``: the S3 tier against the bare boto3 client, same bytes, same run.

Both sides move ``--blocks`` objects of ``--block-mib`` MiB with the same boto3 client settings
and the same number of concurrent requests (``--workers``): the tier through ``put``/``get_into``
(sealing, conditional PUT, header + checksum verification, copy into the caller's buffer), the
raw client as plain ``put_object``/``get_object(...).read()``. Rounds are interleaved as
``kvtier.bench.remote`` describes. Without ``--endpoint`` a moto S3 server is started on a free
127.0.0.1 port and stopped (by PID) at the end; moto is a Python server, so absolute numbers
say little -- the ratio is the point.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
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
from kvtier.keys import BlockKey
from kvtier.tiers.s3 import S3Options, S3Tier


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_round_arguments(parser, blocks=16, rounds=3)
    parser.add_argument("--endpoint", default="", help="S3 endpoint URL (default: start moto)")
    parser.add_argument("--bucket", default="kvtier-bench", help="bucket (created if missing)")
    parser.add_argument("--workers", type=int, default=4, help="concurrent requests (4)")


@contextmanager
def local_moto() -> Iterator[str]:
    """A throwaway moto S3 server on a free 127.0.0.1 port; yields its URL, stops it by PID."""
    port = free_port()
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    argv = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(port, proc, "moto.server")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.endpoint:
        return _run(args, args.endpoint)
    with local_moto() as url:
        return _run(args, url)


def _run(args: argparse.Namespace, endpoint: str) -> dict[str, Any]:
    lay = bench_layout(args.block_mib)
    opts = S3Options(bucket=args.bucket, endpoint_url=endpoint, timeout=60.0, workers=args.workers)
    sealer = bench_sealer(lay, args.encrypt, not args.no_auth)
    prefix = "bench" + uuid.uuid4().hex[:8]
    tier = S3Tier(lay, opts, prefix=prefix, create_bucket=True, sealer=sealer)
    tier.client()  # connect and create the bucket outside the timed part
    raw = opts.connect()
    pool = ThreadPoolExecutor(args.workers)
    n = args.blocks
    blocks = tier_buffers(random_blocks(lay, n), args.plain)
    outs = tier_buffers([np.empty(lay.block_shape, dtype=np.uint16) for _ in range(n)], args.plain)
    raw_value = bytes(sealer.value_bytes)

    def raw_put_one(name: str) -> bool:
        raw.put_object(Bucket=args.bucket, Key=name, Body=raw_value)
        return True

    def raw_get_one(name: str) -> bool:
        return len(raw.get_object(Bucket=args.bucket, Key=name)["Body"].read()) == len(raw_value)

    def each(fn: Callable[[str], bool], names: list[str]) -> bool:
        return all(pool.map(fn, names))

    def make_round(r: int) -> Round:
        keys = [BlockKey(os.urandom(32)) for _ in range(n)]
        names = [f"{prefix}/raw/{r}/{i}" for i in range(n)]

        def cleanup() -> None:
            tier.delete(keys)
            objs = [{"Key": name} for name in names]
            raw.delete_objects(Bucket=args.bucket, Delete={"Objects": objs, "Quiet": True})

        return Round(
            raw_store=lambda: each(raw_put_one, names),
            store=lambda: all(tier.put(keys, blocks)),
            raw_load=lambda: each(raw_get_one, names),
            load=lambda: all(tier.get_into(keys, outs)),
            identical=lambda: same_bytes(outs, blocks),
            cleanup=cleanup,
        )

    try:
        out = interleaved(make_round, args.rounds, n * lay.block_bytes)
    finally:
        pool.shutdown()
        tier.close()
        raw.close()
    return {
        **out,
        "block_bytes": lay.block_bytes,
        "blocks": n,
        "workers": args.workers,
        "encrypted": bool(args.encrypt),
        "auth": bench_sealer(lay, args.encrypt, not args.no_auth).mode,
        "framed": not args.plain,
    }
