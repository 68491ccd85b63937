"""``kvtier bench service [--url unix:///...]``: the node-local service vs an in-process store.

Same run, same machine, same layout and host-tier size: ``store``/``load`` of ``--mib`` MiB per
call through a ``TieredStore`` in this process, then through ``kvtier serve`` (a subprocess the
bench starts, or the one at ``--url``) from a client process. The service is timed two ways:
from an ordinary numpy array (the client copies through its shared staging region: one extra
memcpy) and from ``client.buffer()`` (the engine gathers straight into the region: the same
copies as in-process). Then ``lookup`` of a cached 128K-token prompt and of a first-block miss
(a 4K-token prompt and the 128K one), in-process and as a service round trip, and ``--clients``
client processes storing and loading at once (aggregate GB/s) vs one. Best of ``--rounds``.

Without ``--url`` two services are started: one with the data layout (fp16, 8 layers x 4 KV
heads x 128, 256-token blocks = 4 MiB) and one with a small layout for the 128K-token lookups
(keys cost per block, not per byte).
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.layout import KVLayout
from kvtier.store import TieredStore
from kvtier.tiers.host import HostTier

_DATA = KVLayout(layers=8, kv_heads=4, head_dim=128, dtype="float16", block_tokens=256)
_KEYS = KVLayout(layers=1, kv_heads=1, head_dim=8, dtype="float16", block_tokens=256)
_LONG = 128 * 1024
_SEEDS = itertools.count((os.getpid() % 4096) << 19)  # fresh prompts; ids < 2**32


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help="bench this running service instead of our own")
    p.add_argument("--mib", type=int, default=64, help="MiB per store/load call (default 64)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--clients", type=int, default=4, help="client processes at once (default 4)")
    p.add_argument("--host-mib", type=int, default=768, help="host tier MiB (ours and theirs)")


@contextmanager
def _serve(layout: KVLayout, host_mib: int, staging_mib: int) -> Iterator[str]:
    """A ``kvtier serve`` subprocess with ``layout`` and one host tier; yields its URL."""
    d = tempfile.mkdtemp(prefix="kvb", dir="/tmp")
    url = f"unix://{d}/kv.sock"
    cfg = Path(d) / "kvtier.toml"
    cfg.write_text(
        f'[store]\nmodel_id = "bench"\nlayers = {layout.layers}\nkv_heads = {layout.kv_heads}\n'
        f"head_dim = {layout.head_dim}\nblock_tokens = {layout.block_tokens}\ndtype = "
        f'"{layout.dtype}"\n[[tiers]]\nkind = "host"\ncapacity = "{host_mib}MiB"\n'
        f'[service]\nurl = "{url}"\nstaging = "{staging_mib}MiB"\ntimeout = 30\n'
        "lease_ttl = 60\n"
    )
    log = Path(d) / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier.cli.main", "serve", "--config", str(cfg)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while b"serving" not in log.read_bytes():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kvtier serve did not start: {log.read_text()}")
            time.sleep(0.05)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(d, ignore_errors=True)


def _best(fn: Callable[[], object], rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _data(cases: dict[str, tuple[Any, Any, Any]], n: int, rounds: int) -> dict[str, float]:
    """Best store and load seconds of ``n`` tokens for each ``name: (store, src, out)``.

    The cases take turns, round by round, so a spell of load from other work on the machine
    hits them alike; every store is of a new prompt (none is skipped as cached)."""
    best = {f"{name}_{op}": float("inf") for name in cases for op in ("store", "load")}
    last: dict[str, Any] = {}
    for _ in range(rounds):
        for name, (store, src, _) in cases.items():
            toks = np.full(n, next(_SEEDS), np.int64)
            t0 = time.perf_counter()
            stored = store.store(toks, src)
            best[f"{name}_store"] = min(best[f"{name}_store"], time.perf_counter() - t0)
            if stored != n:
                raise RuntimeError(f"bench: {name} stored {stored} of {n} tokens")
            last[name] = toks
    for _ in range(rounds):
        for name, (store, _, out) in cases.items():
            t0 = time.perf_counter()
            got = store.load(last[name], out)
            best[f"{name}_load"] = min(best[f"{name}_load"], time.perf_counter() - t0)
            if got != n:
                raise RuntimeError(f"bench: {name} loaded {got} of {n} tokens")
    return best


def _lookups(store: Any, rounds: int) -> dict[str, float]:
    toks = np.random.default_rng(1).integers(0, 128_000, _LONG, dtype=np.int64)
    lay: KVLayout = store.layout
    if store.lookup(toks) != _LONG:
        store.store(toks, np.zeros(lay.kv_shape(_LONG), lay.storage_dtype))
    miss = toks.copy()
    miss[0] += 1
    short = miss[:4096].copy()
    reps = 20
    return {
        "lookup_128k_ms": 1e3
        * _best(lambda: [store.lookup(toks) for _ in range(reps)], rounds)
        / reps,
        "miss_4k_us": 1e6 * _best(lambda: [store.lookup(short) for _ in range(500)], rounds) / 500,
        "miss_128k_us": 1e6 * _best(lambda: [store.lookup(miss) for _ in range(50)], rounds) / 50,
    }


def _client_worker(url: str, n: int, rounds: int, start_at: float, q: Any) -> None:
    from kvtier.service.client import connect

    with connect(url, timeout=60.0) as c:
        buf = c.buffer(n)
        buf[...] = 1
        time.sleep(max(0.0, start_at - time.time()))
        t0 = time.time()
        moved = 0
        for r in range(rounds):
            toks = np.full(n, ((os.getpid() % 4096) << 19) + (1 << 31) + r, np.int64)
            moved += c.store(toks, buf) * c.layout.bytes_per_token
            moved += c.load(toks, buf) * c.layout.bytes_per_token
        q.put((t0, time.time(), moved))


def _aggregate(url: str, clients: int, n: int, rounds: int) -> float:
    """GB/s of ``clients`` processes each storing and loading ``rounds`` x ``n`` tokens."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    start_at = time.time() + 3.0 + clients  # all connected and warm before the clock starts
    procs = [
        ctx.Process(target=_client_worker, args=(url, n, rounds, start_at, q))
        for _ in range(clients)
    ]
    for p in procs:
        p.start()
    got = [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(30)
    t0 = min(g[0] for g in got)
    t1 = max(g[1] for g in got)
    return float(sum(g[2] for g in got) / (t1 - t0) / 1e9)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvtier.service.client import connect

    staging = args.mib + 16
    res: dict[str, Any] = {"mib_per_call": args.mib, "clients": args.clients}
    with _serve(_DATA, args.host_mib, staging) if args.url is None else _given(args.url) as url:
        client = connect(url, timeout=60.0)
        lay = client.layout
        n = max(1, (args.mib << 20) // lay.block_bytes) * lay.block_tokens
        nbytes = n * lay.bytes_per_token
        kv = np.ones(lay.kv_shape(n), lay.storage_dtype)
        out = np.zeros_like(kv)
        buf = client.buffer(n)
        buf[...] = kv
        with TieredStore(
            lay, [HostTier(lay, args.host_mib << 20)], model_id="bench-in-process"
        ) as local:
            best = _data(
                {
                    "in_process": (local, kv, out),
                    "service": (client, kv, out),
                    "service_buffer": (client, buf, buf),
                },
                n,
                args.rounds,
            )
        for name in ("in_process", "service", "service_buffer"):
            res[f"{name}_store_gbps"] = nbytes / best[f"{name}_store"] / 1e9
            res[f"{name}_load_gbps"] = nbytes / best[f"{name}_load"] / 1e9
        for kind in ("store", "load"):
            base = res[f"in_process_{kind}_gbps"]
            res[f"service_{kind}_vs_in_process"] = res[f"service_{kind}_gbps"] / base
            res[f"service_buffer_{kind}_vs_in_process"] = res[f"service_buffer_{kind}_gbps"] / base
        per = max(2, args.rounds)
        one = many = 0.0
        for _ in range(2):  # alternated, best of each: a busy spell hits both alike
            one = max(one, _aggregate(url, 1, n, per))
            many = max(many, _aggregate(url, args.clients, n, per))
        res["one_client_gbps"] = one
        res[f"{args.clients}_clients_gbps"] = many
        res["clients_vs_one"] = res[f"{args.clients}_clients_gbps"] / res["one_client_gbps"]
        client.close()
    keys_url = _serve(_KEYS, 64, 16) if args.url is None else _given(args.url)
    with keys_url as url:
        with TieredStore(_KEYS, [HostTier(_KEYS, 64 << 20)], model_id="bench-in-process") as local:
            for k, v in _lookups(local, args.rounds).items():
                res[f"in_process_{k}"] = v
        with connect(url, timeout=60.0) as client:
            for k, v in _lookups(client, args.rounds).items():
                res[f"service_{k}"] = v
            pings = 500
            res["service_ping_us"] = (
                1e6 * _best(lambda: [client.ping() for _ in range(pings)], args.rounds) / pings
            )
        res["service_lookup_128k_minus_in_process_ms"] = (
            res["service_lookup_128k_ms"] - res["in_process_lookup_128k_ms"]
        )
    return res


@contextmanager
def _given(url: str) -> Iterator[str]:
    yield url
