"""``kvtier bench redis``: the Redis tier against the fastest bare redis-py client we found, and
the store's whole write-through and read path, same bytes, same run.

Steps per round (``kvtier.bench.remote`` interleaves them), each moving ``--blocks`` blocks of
``--block-mib`` MiB:

- ``raw_store:pipeline=P,conns=C`` / ``raw_load:...``: plain ``SET``/``GET`` of values of the
  tier's size through the tier's own client set-up (memoryview values go out without a copy;
  a default redis-py client copies ``bytes`` in its hiredis packer), in pipelines of ``P``
  commands on ``C`` connections at once (``P`` in ``--blocks`` and 8, ``C`` in 1 and 2); the
  reply stays in redis-py's ``bytes`` (the raw side does *less* work). The fastest is the limit;
- ``store`` / ``load``: the tier's ``put``/``get_into`` of the whole batch in one call, with the
  tier's default pipelines (``batch_bytes``) on one connection (sealing with the MAC by default,
  header + checksum + MAC verification, copy into the caller's buffer); with ``--auth-pair`` also
  ``store_noauth`` / ``load_noauth``, the same through a tier whose blocks are plain (a trusted
  pool): the MAC's cost in the same rounds;
- ``write_through`` / ``read_path`` (unless ``--no-whole-path``): ``TieredStore.store()`` until a
  second process sees every block, and that process's ``load()`` (``kvtier.bench.peer``).

Without ``--url``/``--cluster`` a ``redis-server`` is started on a free 127.0.0.1 port and
stopped (by PID) at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from itertools import pairwise
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
from kvtier.errors import ConfigError
from kvtier.keys import BlockKey
from kvtier.layout import KVLayout
from kvtier.tiers.redis import RedisOptions, RedisTier


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_round_arguments(parser, blocks=32, rounds=3)
    parser.add_argument("--url", default="", help="redis://host:port (default: start a server)")
    parser.add_argument("--cluster", default="", help="comma-separated host:port startup nodes")


def run(args: argparse.Namespace) -> dict[str, Any]:
    lay = bench_layout(args.block_mib)
    cluster = tuple(n for n in args.cluster.split(",") if n)
    if args.url or cluster:
        return _run(args, lay, args.url, cluster)
    with local_redis() as url:
        return _run(args, lay, url, ())


def peer_tier(layout: KVLayout, spec: dict[str, Any]) -> RedisTier:
    """The tier of one store process, from the plain-JSON ``spec`` both processes share."""
    opts = RedisOptions(url=spec["url"], cluster=tuple(spec["cluster"]), timeout=30.0)
    seal = SealSpec.from_json(spec["seal"])
    return RedisTier(layout, opts, prefix=spec["prefix"], sealer=seal.sealer(layout))


def _run(
    args: argparse.Namespace, lay: KVLayout, url: str, cluster: tuple[str, ...]
) -> dict[str, Any]:
    opts = RedisOptions(url=url or "redis://127.0.0.1:6379", cluster=cluster, timeout=30.0)
    prefix = "bench" + uuid.uuid4().hex[:8]
    variants = seal_variants(args)
    tiers = {
        name: RedisTier(lay, opts, prefix=f"{prefix}{name}", sealer=seal.sealer(lay))
        for name, seal in variants.items()
    }
    value_bytes = next(iter(tiers.values())).sealer.value_bytes
    raw = opts.connect()  # the tier's own client setup (values go out without a copy)
    conns = (1, 2)
    pool = ThreadPoolExecutor(max(conns), thread_name_prefix="bench-redis")
    n = args.blocks
    blocks = tier_buffers(random_blocks(lay, n), args.plain)
    outs = tier_buffers([np.empty(lay.block_shape, dtype=np.uint16) for _ in range(n)], args.plain)
    # the same bytes as memoryviews of page-touched buffers: the fastest way to hand redis-py
    # a value (bytes would be copied by its hiredis packer)
    raw_values = [np.ones(value_bytes, np.uint8).data for _ in range(n)]
    configs = sorted({(p, min(n, c)) for p in (n, min(n, 8)) for c in conns}, reverse=True)

    def batch(names: list[str], op: str, values: list[memoryview] | None, depth: int) -> bool:
        ok = True
        for lo in range(0, len(names), depth):
            pipe = raw.pipeline(transaction=False)
            for i in range(lo, min(lo + depth, len(names))):
                getattr(pipe, op)(names[i], *([values[i]] if values is not None else []))
            ok = all(r is not None for r in pipe.execute()) and ok
        return ok

    def spread(
        names: list[str], op: str, values: list[memoryview] | None, cfg: tuple[int, int]
    ) -> Callable[[], bool]:
        """The whole batch in pipelines of ``depth`` on ``conns`` connections at once."""
        depth, conns = cfg
        if conns == 1:
            return lambda: batch(names, op, values, depth)
        cuts = [len(names) * i // conns for i in range(conns + 1)]
        parts = [
            (names[lo:hi], None if values is None else values[lo:hi]) for lo, hi in pairwise(cuts)
        ]
        return lambda: all(pool.map(lambda p: batch(p[0], op, p[1], depth), parts))

    whole = None
    if not args.no_whole_path:
        seal = variants[""]  # as configured (by default with its MAC, as deployed)
        spec = {"url": opts.url, "cluster": list(cluster), "prefix": f"{prefix}wp",
                "seal": seal.json()}  # fmt: skip
        whole = WholePath(lay, "kvtier.bench.redis", lambda: peer_tier(lay, spec), spec, n)

    def make_round(r: int) -> Round:
        keys = [BlockKey(os.urandom(32)) for _ in range(n)]
        store, load = tier_steps(tiers, keys, blocks, outs)
        names: list[str] = []
        for depth, conns in configs:
            cfg = f"pipeline={depth},conns={conns}"
            mine = [f"{prefix}:raw:{r}:{cfg}:{i}" for i in range(n)]  # each its own keys
            names += mine
            store[f"raw_store:{cfg}"] = timed(
                spread(mine, "set", raw_values, (depth, conns)), "raw store"
            )
            load[f"raw_load:{cfg}"] = timed(spread(mine, "get", None, (depth, conns)), "raw load")
        done = None
        if whole is not None:
            ws, wl, done = whole.steps(r)
            store.update(ws)
            load.update(wl)

        def cleanup() -> None:
            for tier in tiers.values():
                tier.delete(keys)
            batch(names, "delete", None, len(names))
            if done is not None:
                done()

        return Round(store, load, lambda: same_bytes(outs, blocks), cleanup)

    try:
        out = interleaved(make_round, args.rounds, n * lay.block_bytes)
    finally:
        if whole is not None:
            whole.close()
        for tier in tiers.values():
            tier.close()
        pool.shutdown()
        raw.close()
    return {
        **out,
        "byte_identical": out["byte_identical"] and (whole is None or whole.loaded_ok),
        "block_bytes": lay.block_bytes,
        "blocks": n,
        "encrypted": bool(args.encrypt),
        "framed": not args.plain,
        "auth": variants[""].sealer(lay).mode,
        "auth_pair": bool(args.auth_pair),
    }
