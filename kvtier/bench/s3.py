"""``kvtier bench s3``: the S3 tier against the bare boto3 client, same bytes, same run.

Both sides move ``--blocks`` objects of ``--block-mib`` MiB with the same boto3 client settings
and the same number of concurrent requests (``--workers``): the tier through ``put``/``get_into``
(sealing, conditional PUT, header + checksum verification, copy into the caller's buffer), the
raw client as plain ``put_object``/``get_object(...).read()``. Rounds are interleaved and the
best of each side is reported. Without ``--endpoint`` a moto S3 server is started on a free
127.0.0.1 port and stopped (by PID) at the end; moto is a Python server, so absolute numbers
say little -- the ratio is the point.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import numpy as np

from kvtier.bench.redis import bench_layout, best_gbps, ok_all
from kvtier.keys import BlockKey
from kvtier.tiers.s3 import S3Options, S3Tier
from kvtier.tiers.secure import BlockSealer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--endpoint", default="", help="S3 endpoint URL (default: start moto)")
    parser.add_argument("--bucket", default="kvtier-bench", help="bucket (created if missing)")
    parser.add_argument("--block-mib", type=int, default=4, help="block size in MiB (4)")
    parser.add_argument("--blocks", type=int, default=16, help="blocks per round (16)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (3)")
    parser.add_argument("--workers", type=int, default=4, help="concurrent requests (4)")
    parser.add_argument("--encrypt", action="store_true", help="AES-GCM seal the tier's blocks")


@contextmanager
def local_moto() -> Iterator[str]:
    """A throwaway moto S3 server on a free 127.0.0.1 port; yields its URL, stops it by PID."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    argv = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(400):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.05)
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
    sealer = BlockSealer(lay, os.urandom(32) if args.encrypt else b"")
    prefix = "bench" + uuid.uuid4().hex[:8]
    tier = S3Tier(lay, opts, prefix=prefix, create_bucket=True, sealer=sealer)
    tier.client()  # connect and create the bucket outside the timed part
    raw = opts.connect()
    pool = ThreadPoolExecutor(args.workers)
    rng = np.random.default_rng(0)
    blocks = [
        rng.integers(0, 2**16, size=lay.block_shape, dtype=np.uint16) for _ in range(args.blocks)
    ]
    outs = [np.empty(lay.block_shape, dtype=np.uint16) for _ in range(args.blocks)]
    raw_value = bytes(sealer.value_bytes)
    nbytes = args.blocks * lay.block_bytes
    res: dict[str, list[float]] = {"store": [], "load": [], "raw_store": [], "raw_load": []}
    ok = True

    def raw_put_one(name: str) -> None:
        raw.put_object(Bucket=args.bucket, Key=name, Body=raw_value)

    def raw_get_one(name: str) -> None:
        raw.get_object(Bucket=args.bucket, Key=name)["Body"].read()

    try:
        for r in range(args.rounds):
            keys = [BlockKey(os.urandom(32)) for _ in range(args.blocks)]
            names = [f"{prefix}/raw/{r}/{i}" for i in range(args.blocks)]

            def raw_put(names: list[str] = names) -> None:
                list(pool.map(raw_put_one, names))

            def raw_get(names: list[str] = names) -> None:
                list(pool.map(raw_get_one, names))

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
            raw.delete_objects(
                Bucket=args.bucket, Delete={"Objects": [{"Key": n} for n in names], "Quiet": True}
            )
    finally:
        pool.shutdown()
        tier.close()
        raw.close()
    out: dict[str, Any] = {k + "_gbps": max(v) for k, v in res.items()}
    out["store_ratio"] = out["store_gbps"] / out["raw_store_gbps"]
    out["load_ratio"] = out["load_gbps"] / out["raw_load_gbps"]
    out.update(
        block_bytes=lay.block_bytes,
        blocks=args.blocks,
        rounds=args.rounds,
        workers=args.workers,
        encrypted=bool(args.encrypt),
        byte_identical=ok,
    )
    return out
