"""``kvtier bench host --url URL`` (and ``kvtier bench service``, the same with ``--url auto``):
the node-local service against an in-process store, in the same run.

Same machine, same layout and host-tier size: ``store``/``load`` of ``--mib`` MiB per call
through a ``TieredStore`` in this process, then through ``kvtier serve`` (the one at ``--url``,
or with ``auto`` a subprocess the bench starts) from this process, three ways:

- ``service``: from and into ordinary numpy arrays -- in arena mode the client copies straight
  into and out of the shared host arena (one copy per direction, as in-process);
- ``service_staging``: the same through the staging region (``data = "staging"``'s path: the
  client's copy into the region, the service's into the arena);
- ``service_buffer``: from and into ``client.buffer()`` (the engine gathers into the staging
  region; the service makes the one copy).

Rounds are interleaved, best of ``--rounds``; every store is of a new prompt. Then ``lookup`` of
a cached 128K-token prompt and of a first-block miss (a 128K-token and a 4K-token prompt),
in-process and through the service, beside an empty round trip (``ping``: the transport's floor,
timed in the same rounds as the misses) and the service's own time per miss lookup (its
per-session counters), so the miss splits into transport, service and client; and
``--clients`` client processes storing and loading numpy arrays at once (aggregate GB/s)
against one.

With ``auto`` two services are started: one with the data layout (fp16, 8 layers x 4 KV heads x
128, 256-token blocks = 4 MiB) and one with a small layout for the 128K-token lookups (keys cost
per block, not per byte). A service at ``--url`` is used for both.
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
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.bench.host import best_time, lookup_times
from kvtier.layout import KVLayout
from kvtier.store import TieredStore
from kvtier.tiers.host import HostTier

_DATA = KVLayout(layers=8, kv_heads=4, head_dim=128, dtype="float16", block_tokens=256)
_KEYS = KVLayout(layers=1, kv_heads=1, head_dim=8, dtype="float16", block_tokens=256)
_SEEDS = itertools.count((os.getpid() % 4096) << 19)  # fresh prompts; ids < 2**32


def add_service_arguments(p: argparse.ArgumentParser) -> None:
    """The options of the service comparison besides ``--url`` and ``--rounds``."""
    p.add_argument("--mib", type=int, default=64, help="service: MiB per store/load call")
    p.add_argument("--clients", type=int, default=4, help="service: client processes at once")
    p.add_argument("--host-mib", type=int, default=768, help="service: host tier MiB (both)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="auto", help="the service to bench ('auto': start one)")
    p.add_argument("--rounds", type=int, default=5)
    add_service_arguments(p)


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
        while b"kvtier serve: serving" not in log.read_bytes():
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


def _client_worker(url: str, n: int, rounds: int, ready: Any, q: Any) -> None:
    from kvtier.service.client import connect

    with connect(url, timeout=60.0) as c:
        buf = np.ones(c.layout.kv_shape(n), c.layout.storage_dtype)
        ready.wait()  # every client connected (its arena mapped) and warm: the clock starts
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
    ready = ctx.Barrier(clients, timeout=300)
    procs = [
        ctx.Process(target=_client_worker, args=(url, n, rounds, ready, q)) for _ in range(clients)
    ]
    for p in procs:
        p.start()
    got = [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(30)
    t0 = min(g[0] for g in got)
    t1 = max(g[1] for g in got)
    return float(sum(g[2] for g in got) / (t1 - t0) / 1e9)


def _ratios(res: dict[str, Any], nbytes: int, best: dict[str, float], cases: list[str]) -> None:
    for name in cases:
        res[f"{name}_store_gbps"] = nbytes / best[f"{name}_store"] / 1e9
        res[f"{name}_load_gbps"] = nbytes / best[f"{name}_load"] / 1e9
    for name in cases[1:]:
        for kind in ("store", "load"):
            base = res[f"in_process_{kind}_gbps"]
            res[f"{name}_{kind}_vs_in_process"] = res[f"{name}_{kind}_gbps"] / base


def _transfers(res: dict[str, Any], url: str, args: argparse.Namespace) -> None:
    from kvtier.service.client import connect

    with connect(url, timeout=60.0) as client, connect(url, timeout=60.0, direct=False) as staged:
        lay = client.layout
        res["data_path"] = client.data_path
        n = max(1, (args.mib << 20) // lay.block_bytes) * lay.block_tokens
        kv = np.ones(lay.kv_shape(n), lay.storage_dtype)
        out = np.zeros_like(kv)
        buf = client.buffer(n)
        buf[...] = kv
        local = TieredStore(lay, [HostTier(lay, args.host_mib << 20)], model_id="bench-local")
        with local:
            cases = {
                "in_process": (local, kv, out),
                "service": (client, kv, out),
                "service_staging": (staged, kv, out),
                "service_buffer": (client, buf, buf),
            }
            best = _data(cases, n, args.rounds)
        _ratios(res, n * lay.bytes_per_token, best, list(cases))
        per = max(2, args.rounds)
        one = many = 0.0
        for _ in range(2):  # alternated, best of each: a busy spell hits both alike
            one = max(one, _aggregate(url, 1, n, per))
            many = max(many, _aggregate(url, args.clients, n, per))
        res["one_client_gbps"] = one
        res[f"{args.clients}_clients_gbps"] = many
        res["clients_vs_one"] = many / one


def _lookups(res: dict[str, Any], url: str, args: argparse.Namespace) -> None:
    from kvtier.service.client import connect

    with TieredStore(_KEYS, [HostTier(_KEYS, 64 << 20)], model_id="bench-local") as local:
        for k, v in lookup_times(local, args.rounds).items():
            res[f"in_process_{k}"] = v
    with connect(url, timeout=60.0) as client:
        for k, v in lookup_times(client, args.rounds).items():
            res[f"service_{k}"] = v
    res["service_lookup_128k_minus_in_process_ms"] = (
        res["service_lookup_128k_ms"] - res["in_process_lookup_128k_ms"]
    )
    # a first-block miss the service answers (a client without the presence map): the
    # transport's floor (an empty round trip, timed in the same rounds as the misses, so a
    # slow spell hits both; and a bare ZeroMQ echo's), the service's own time per call (the
    # counters of a session that did nothing else) and the rest (the client, and the
    # request's token ids on the wire); all in the same run
    with connect(url, timeout=60.0, name="bench-miss", presence=False) as probe:
        toks = np.random.default_rng(2).integers(0, 128_000, 4096, dtype=np.int64)
        calls = 500
        ping = miss = float("inf")
        for _ in range(args.rounds):
            ping = min(ping, best_time(lambda: [probe.ping() for _ in range(calls)], 1))
            miss = min(miss, best_time(lambda: [probe.lookup(toks) for _ in range(calls)], 1))
        mine = [
            s for s in probe.stats()["service"]["sessions"].values() if s["name"] == "bench-miss"
        ]
        served = float(mine[0]["ops"]["lookup"]["mean_us"]) if mine else float("nan")
    res["service_ping_us"] = 1e6 * ping / calls
    res["zmq_echo_us"] = _zmq_echo_us(args.rounds)
    res["service_ping_vs_zmq_echo"] = res["service_ping_us"] / res["zmq_echo_us"]
    res["service_miss_4k_asked_us"] = 1e6 * miss / calls
    res["service_miss_4k_in_service_us"] = served
    res["service_miss_4k_rest_us"] = (
        res["service_miss_4k_asked_us"] - served - res["service_ping_us"]
    )


def _echo(endpoint: str) -> None:
    """A bare ZeroMQ ROUTER echoing every message (the bench's transport baseline)."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(endpoint)
    while True:
        frames = sock.recv_multipart()
        sock.send_multipart(frames)
        if frames[-1] == b"stop":
            break
    sock.close(0)
    ctx.term()


def _zmq_echo_us(rounds: int) -> float:
    """Best mean round trip of a DEALER to a bare ROUTER echo in another process, on a unix
    socket, one small message at a time (what the service's ``ping`` costs at best)."""
    import zmq

    d = tempfile.mkdtemp(prefix="kvz", dir="/tmp")
    endpoint = f"ipc://{d}/echo.sock"
    proc = mp.get_context("spawn").Process(target=_echo, args=(endpoint,), daemon=True)
    proc.start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send(b"hello")  # waits for the echo to bind and answer
        sock.recv()
        calls = 500

        def echoes() -> None:
            for _ in range(calls):
                sock.send(b"x" * 64)
                sock.recv()

        return 1e6 * best_time(echoes, rounds) / calls
    finally:
        sock.send(b"stop")
        proc.join(10)
        sock.close(0)
        ctx.term()
        shutil.rmtree(d, ignore_errors=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    auto = args.url in (None, "auto")
    res: dict[str, Any] = {"mib_per_call": args.mib, "clients": args.clients, "rounds": args.rounds}
    with _serve(_DATA, args.host_mib, args.mib + 16) if auto else _given(args.url) as url:
        _transfers(res, url, args)
    with _serve(_KEYS, 64, 16) if auto else _given(args.url) as url:
        _lookups(res, url, args)
    return res


@contextmanager
def _given(url: str) -> Iterator[str]:
    yield url
