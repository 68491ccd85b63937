"""``kvtier bench mooncake``: the Mooncake tier against the bare Mooncake client, same run.

Both sides move ``--blocks`` blocks of ``--block-mib`` MiB in one batched call per direction,
through the *same* ``MooncakeDistributedStore`` client (the tier's own): the tier through
``put``/``get_into`` (header, xxh3 checksum of the payload, verification on read), the raw side
as ``batch_put_from``/``batch_get_into`` of values of the same size, no framing and no
verification. Both sides move memory registered once with the transfer engine (the raw side
with ``register_buffer``, the tier's sources and destinations with ``MooncakeTier.register``, as
a deployment registers its host arena). Rounds alternate the order (raw then tier, tier then
raw, ...) after one unmeasured warm-up round; the best round of each and the median of the
per-round tier/raw ratios are reported, so drift on a shared machine hits both alike. Each
round's objects are removed after it.

Without ``--master`` a ``mooncake_master`` and a ``mooncake_client`` holding the pool memory
(``--pool-mib``) are started on 127.0.0.1 from the installed wheel and stopped by PID at the end:
the benchmarked client then reaches the pool over TCP, as a node reaches a remote memory pool.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.errors import ConfigError
from kvtier.keys import BlockKey
from kvtier.layout import KVLayout
from kvtier.tiers.mooncake import MooncakeTier, package_binary

MIB = 1 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--master", default="", help="host:port of mooncake_master (default: start one)"
    )
    parser.add_argument(
        "--protocol", default="tcp", choices=("tcp", "rdma"), help="transport (tcp)"
    )
    parser.add_argument("--local-hostname", default="127.0.0.1", help="this node's address")
    parser.add_argument("--block-mib", type=int, default=4, help="block size in MiB (4)")
    parser.add_argument("--blocks", type=int, default=16, help="blocks per round (16)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (7)")
    parser.add_argument(
        "--segment-mib",
        type=int,
        default=0,
        help="pool memory this client mounts itself (0: the pool is elsewhere)",
    )
    parser.add_argument(
        "--pool-mib", type=int, default=0, help="pool held by the started mooncake_client (auto)"
    )


def bench_layout(block_mib: int) -> KVLayout:
    """A layout whose block is exactly ``block_mib`` MiB (1 MiB per layer, 256 fp16 tokens)."""
    if block_mib < 1:
        raise ConfigError(f"--block-mib must be >= 1, got {block_mib}")
    return KVLayout(layers=block_mib, kv_heads=8, head_dim=128, dtype="float16", block_tokens=256)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, proc: subprocess.Popen[bytes], what: str, log: Path) -> None:
    for _ in range(300):
        if proc.poll() is not None:
            break
        try:
            with socket.create_connection(("127.0.0.1", port), 0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise ConfigError(f"{what} did not start: {log.read_text(errors='replace')[-1500:]}")


@contextmanager
def local_mooncake(pool_bytes: int) -> Iterator[str]:
    """A throwaway master plus a pool holder on 127.0.0.1; yields the master address."""
    master_bin, client_bin = package_binary("mooncake_master"), package_binary("mooncake_client")
    if master_bin is None or client_bin is None:
        raise ConfigError(
            "mooncake_master not found: pip install mooncake-transfer-engine-non-cuda"
        )
    tmp = tempfile.TemporaryDirectory(prefix="kvtier-bench-mooncake-")
    workdir = Path(tmp.name)
    port, holder_port = _free_port(), _free_port()
    procs: list[subprocess.Popen[bytes]] = []
    common = ["--logtostderr=true", "--minloglevel=1"]
    try:
        log = workdir / "master.log"
        with open(log, "ab") as f:
            procs.append(subprocess.Popen(
                [str(master_bin), f"--rpc_port={port}", "--rpc_address=127.0.0.1",
                 "--metrics_host=127.0.0.1", f"--metrics_port={_free_port()}", *common],
                stdout=f, stderr=subprocess.STDOUT,
            ))  # fmt: skip
        _wait_port(port, procs[-1], "mooncake_master", log)
        log = workdir / "pool.log"
        with open(log, "ab") as f:
            procs.append(subprocess.Popen(
                [str(client_bin), f"--global_segment_size={pool_bytes}",
                 f"--master_server_address=127.0.0.1:{port}", "--metadata_server=P2PHANDSHAKE",
                 "--host=127.0.0.1", f"--port={holder_port}", "--protocol=tcp", *common],
                stdout=f, stderr=subprocess.STDOUT,
            ))  # fmt: skip
        _wait_port(holder_port, procs[-1], "mooncake_client", log)
        yield f"127.0.0.1:{port}"
    finally:
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        tmp.cleanup()


def gbps(nbytes: int, fn: Callable[[], list[Any]], want: object) -> float:
    """Throughput of one batched call; raises if any of its per-item results is not ``want``."""
    t0 = time.perf_counter()
    results = fn()
    dt = time.perf_counter() - t0
    bad = [r for r in results if r != want]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(results)} transfers failed (e.g. {bad[0]!r})")
    return nbytes / dt / 1e9


def run(args: argparse.Namespace) -> dict[str, Any]:
    lay = bench_layout(args.block_mib)
    if args.master:
        return _run(args, lay, args.master)
    pool = args.pool_mib * MIB or 3 * args.blocks * (lay.block_bytes + MIB)
    with local_mooncake(pool) as master:
        return _run(args, lay, master)


def _run(args: argparse.Namespace, lay: KVLayout, master: str) -> dict[str, Any]:
    n = args.blocks
    tier = MooncakeTier(
        lay,
        master,
        protocol=args.protocol,
        local_hostname=args.local_hostname,
        segment_size=args.segment_mib * MIB,
        buffer_size=(n + 1) * (lay.block_bytes + MIB),
        prefix="bench" + uuid.uuid4().hex[:8],
    )
    try:
        client = tier.client
        if client is None:
            raise ConfigError(f"cannot reach mooncake_master at {master}")
        rng = np.random.default_rng(0)
        blocks = [rng.integers(0, 2**16, size=lay.block_shape, dtype=np.uint16) for _ in range(n)]
        outs = [np.ones(lay.block_shape, dtype=np.uint16) for _ in range(n)]
        value = tier.value_bytes  # the raw side moves values of the tier's size
        raw_src = [np.frombuffer(rng.bytes(value), np.uint8).copy() for _ in range(n)]
        raw_dst = [np.ones(value, np.uint8) for _ in range(n)]
        for a in raw_src + raw_dst:  # both sides move registered memory
            client.register_buffer(a.ctypes.data, a.nbytes)
        for b in blocks + outs:
            tier.register(b)
        src_ptrs = [a.ctypes.data for a in raw_src]
        dst_ptrs = [a.ctypes.data for a in raw_dst]
        nbytes = n * lay.block_bytes
        res: dict[str, list[float]] = {"store": [], "load": [], "raw_store": [], "raw_load": []}
        for r in range(-1, args.rounds):  # round -1 warms connections and registrations
            keys = [BlockKey(os.urandom(32)) for _ in range(n)]
            names = [f"{tier.prefix}/raw/{r}/{i}" for i in range(n)]
            sizes = [value] * n
            raw_put = partial(client.batch_put_from, names, src_ptrs, sizes)
            raw_get = partial(client.batch_get_into, names, dst_ptrs, sizes)
            steps = [
                [("raw_store", raw_put, 0), ("store", partial(tier.put, keys, blocks), True)],
                [("raw_load", raw_get, value), ("load", partial(tier.get_into, keys, outs), True)],
            ]
            for pair in steps:  # odd rounds run the tier first: order effects cancel out
                for name, fn, want in pair[:: 1 if r % 2 == 0 else -1]:
                    res[name].append(gbps(nbytes, fn, want))
            if not all(o.tobytes() == b.tobytes() for o, b in zip(outs, blocks, strict=True)):
                raise RuntimeError("tier get returned bytes that differ from what was put")
            client.batch_remove(names, True)
            tier.delete(keys)
            if r < 0:
                for v in res.values():
                    v.clear()
        for a in raw_src + raw_dst:
            client.unregister_buffer(a.ctypes.data)
    finally:
        tier.close()
    best = {f"{k}_gbps": max(v) for k, v in res.items()}
    return {
        "block_mib": args.block_mib,
        "blocks": n,
        "rounds": args.rounds,
        "protocol": args.protocol,
        **best,
        "store_ratio": best["store_gbps"] / best["raw_store_gbps"],
        "load_ratio": best["load_gbps"] / best["raw_load_gbps"],
        # each round's tier/raw pair ran back to back: their median ratio resists drift
        "store_ratio_median": _median_ratio(res["store"], res["raw_store"]),
        "load_ratio_median": _median_ratio(res["load"], res["raw_load"]),
    }


def _median_ratio(tier: list[float], raw: list[float]) -> float:
    return float(np.median([t / r for t, r in zip(tier, raw, strict=True)]))
