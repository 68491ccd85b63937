"""``kvtier bench s3``: the S3 tier and the store's whole path against the fastest bare boto3
configuration found, same bytes, same run.

Every step moves ``--blocks`` objects of ``--block-mib`` MiB with the same boto3 client settings
(``kvtier.bench.remote`` interleaves them):

- ``raw_store:concurrency=C`` / ``raw_load:...``: plain ``put_object`` /
  ``get_object(...).read()`` with ``C`` requests in flight (powers of two up to the tier's
  ``--workers``). The fastest is the limit;
- ``store`` / ``load``: the tier's ``put``/``get_into`` with ``--workers`` requests in flight
  (sealing, conditional PUT, header + checksum verification, copy into the caller's buffer);
  MAC'd by default; with ``--auth-pair`` also ``store_noauth`` / ``load_noauth`` (plain blocks);
- ``write_through`` / ``read_path`` (unless ``--no-whole-path``): ``TieredStore.store()`` until a
  second process sees every block, and that process's ``load()`` (``kvtier.bench.peer``).

Without ``--endpoint`` a moto S3 server is started on a free 127.0.0.1 port and stopped (by PID)
at the end; moto is a Python server, so absolute numbers say little -- the ratio is the point.
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
from functools import partial
from typing import Any

import numpy as np

from kvtier.bench.peer import WholePath
from kvtier.bench.remote import (
    Round,
    SealSpec,
    add_round_arguments,
    bench_layout,
    free_port,
    interleaved,
    random_blocks,
    same_bytes,
    seal_variants,
    tier_buffers,
    tier_steps,
    timed,
    wait_port,
)
from kvtier.keys import BlockKey
from kvtier.layout import KVLayout
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


def peer_tier(layout: KVLayout, spec: dict[str, Any]) -> S3Tier:
    """The tier of one store process, from the plain-JSON ``spec`` both processes share."""
    opts = S3Options(
        bucket=spec["bucket"], endpoint_url=spec["endpoint"], timeout=60.0,
        workers=int(spec["workers"]),
    )  # fmt: skip
    seal = SealSpec.from_json(spec["seal"])
    return S3Tier(layout, opts, prefix=spec["prefix"], create_bucket=True,
                  sealer=seal.sealer(layout))  # fmt: skip


def _run(args: argparse.Namespace, endpoint: str) -> dict[str, Any]:
    lay = bench_layout(args.block_mib)
    opts = S3Options(bucket=args.bucket, endpoint_url=endpoint, timeout=60.0, workers=args.workers)
    prefix = "bench" + uuid.uuid4().hex[:8]
    variants = seal_variants(args)
    tiers = {
        name: S3Tier(
            lay, opts, prefix=f"{prefix}{name}", create_bucket=True, sealer=seal.sealer(lay)
        )
        for name, seal in variants.items()
    }
    for tier in tiers.values():
        tier.client()  # connect and create the bucket outside the timed part
    raw = opts.connect()
    pool = ThreadPoolExecutor(args.workers)
    n = args.blocks
    blocks = tier_buffers(random_blocks(lay, n), args.plain)
    outs = tier_buffers([np.empty(lay.block_shape, dtype=np.uint16) for _ in range(n)], args.plain)
    raw_value = bytes(tiers[""].sealer.value_bytes)
    concurrency = [c for c in (1, 2, 4, 8, 16) if c < args.workers] + [args.workers]

    def raw_put_one(name: str) -> bool:
        raw.put_object(Bucket=args.bucket, Key=name, Body=raw_value)
        return True

    def raw_get_one(name: str) -> bool:
        return len(raw.get_object(Bucket=args.bucket, Key=name)["Body"].read()) == len(raw_value)

    def each(fn: Callable[[str], bool], names: list[str], conc: int) -> bool:
        """``fn`` over ``names`` with ``conc`` requests in flight."""
        if conc == 1:
            return all([fn(x) for x in names])
        return all(pool.map(lambda part: all([fn(x) for x in part]),
                            [names[i::conc] for i in range(conc)]))  # fmt: skip

    whole = None
    if not args.no_whole_path:
        seal = variants[""]  # as configured (by default with its MAC, as deployed)
        spec = {"bucket": args.bucket, "endpoint": endpoint, "workers": args.workers,
                "prefix": f"{prefix}wp", "seal": seal.json()}  # fmt: skip
        whole = WholePath(lay, "kvtier.bench.s3", partial(peer_tier, lay, spec), spec, n)

    def make_round(r: int) -> Round:
        keys = [BlockKey(os.urandom(32)) for _ in range(n)]
        store, load = tier_steps(tiers, keys, blocks, outs)
        names: list[str] = []
        for conc in concurrency:
            mine = [f"{prefix}/raw/{r}/{conc}/{i}" for i in range(n)]  # each its own objects
            names += mine
            store[f"raw_store:concurrency={conc}"] = timed(
                partial(each, raw_put_one, mine, conc), "raw store"
            )
            load[f"raw_load:concurrency={conc}"] = timed(
                partial(each, raw_get_one, mine, conc), "raw load"
            )
        done = None
        if whole is not None:
            ws, wl, done = whole.steps(r)
            store.update(ws)
            load.update(wl)

        def cleanup() -> None:
            for tier in tiers.values():
                tier.delete(keys)
            objs = [{"Key": name} for name in names]
            raw.delete_objects(Bucket=args.bucket, Delete={"Objects": objs, "Quiet": True})
            if done is not None:
                done()

        return Round(store, load, lambda: same_bytes(outs, blocks), cleanup)

    try:
        out = interleaved(make_round, args.rounds, n * lay.block_bytes)
    finally:
        if whole is not None:
            whole.close()
        pool.shutdown()
        for tier in tiers.values():
            tier.close()
        raw.close()
    return {
        **out,
        "byte_identical": out["byte_identical"] and (whole is None or whole.loaded_ok),
        "block_bytes": lay.block_bytes,
        "blocks": n,
        "workers": args.workers,
        "encrypted": bool(args.encrypt),
        "framed": not args.plain,
        "auth": variants[""].sealer(lay).mode,
        "auth_pair": bool(args.auth_pair),
    }
