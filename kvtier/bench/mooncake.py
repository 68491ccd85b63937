"""``kvtier bench mooncake``: the Mooncake tier and the store's whole path against the fastest
bare Mooncake client configuration found, same bytes, same run.

Every step moves ``--blocks`` blocks of ``--block-mib`` MiB (``kvtier.bench.remote`` interleaves
them), through the *same* ``MooncakeDistributedStore`` client (the tier's own):

- ``raw_store:batch=B,registered`` / ``raw_load:...``: ``batch_put_from`` / ``batch_get_into``
  of values of the tier's size in calls of ``B`` (``--blocks`` and 4), from and into memory
  registered once with ``register_buffer``; no framing, no verification. The fastest is the
  limit;
- ``store`` / ``load``: the tier's ``put``/``get_into`` (header, xxh3 checksum of the payload,
  verification on read), its sources and destinations registered with ``MooncakeTier.register``
  as a deployment registers its host arena; MAC'd by default (with ``--auth-pair`` also
  ``store_noauth`` / ``load_noauth``, plain blocks in a trusted pool). The blocks are framed
  (``codec.framed_empty``, as the store's staging buffers are), so each value moves as one
  buffer; ``--plain`` measures plain arrays, whose header moves as a second buffer;
- ``write_through`` / ``read_path`` (unless ``--no-whole-path``): ``TieredStore.store()`` until a
  second process sees every block, and that process's ``load()`` (``kvtier.bench.peer``).

Each round's objects are removed after it. Without ``--master`` a ``mooncake_master`` and a
``mooncake_client`` holding the pool memory (``--pool-mib``) are started on 127.0.0.1 from the
installed wheel and stopped by PID at the end: the benchmarked client then reaches the pool over
TCP, as a node reaches a remote memory pool.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
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
    whole_buffer,
)
from kvtier.errors import ConfigError
from kvtier.keys import BlockKey
from kvtier.layout import KVLayout
from kvtier.tiers.mooncake import MooncakeTier, package_binary

MIB = 1 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_round_arguments(parser, blocks=16, rounds=7)
    parser.add_argument(
        "--master", default="", help="host:port of mooncake_master (default: start one)"
    )
    parser.add_argument(
        "--protocol", default="tcp", choices=("tcp", "rdma"), help="transport (tcp)"
    )
    parser.add_argument("--local-hostname", default="127.0.0.1", help="this node's address")
    parser.add_argument(
        "--segment-mib",
        type=int,
        default=0,
        help="pool memory this client mounts itself (0: the pool is elsewhere)",
    )
    parser.add_argument(
        "--pool-mib", type=int, default=0, help="pool held by the started mooncake_client (auto)"
    )


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
    port, holder_port = free_port(), free_port()
    procs: list[subprocess.Popen[bytes]] = []
    common = ["--logtostderr=true", "--minloglevel=1"]
    try:
        log = workdir / "master.log"
        with open(log, "ab") as f:
            procs.append(subprocess.Popen(
                [str(master_bin), f"--rpc_port={port}", "--rpc_address=127.0.0.1",
                 "--metrics_host=127.0.0.1", f"--metrics_port={free_port()}", *common],
                stdout=f, stderr=subprocess.STDOUT,
            ))  # fmt: skip
        wait_port(port, procs[-1], "mooncake_master", log)
        log = workdir / "pool.log"
        with open(log, "ab") as f:
            procs.append(subprocess.Popen(
                [str(client_bin), f"--global_segment_size={pool_bytes}",
                 f"--master_server_address=127.0.0.1:{port}", "--metadata_server=P2PHANDSHAKE",
                 "--host=127.0.0.1", f"--port={holder_port}", "--protocol=tcp", *common],
                stdout=f, stderr=subprocess.STDOUT,
            ))  # fmt: skip
        wait_port(holder_port, procs[-1], "mooncake_client", log)
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


def run(args: argparse.Namespace) -> dict[str, Any]:
    lay = bench_layout(args.block_mib)
    if args.master:
        return _run(args, lay, args.master)
    # every variant's round, the raw round and the whole path's, with room to spare
    copies = 2 * (len(seal_variants(args)) + 2)
    pool = args.pool_mib * MIB or copies * args.blocks * (lay.block_bytes + MIB)
    with local_mooncake(pool) as master:
        return _run(args, lay, master)


def peer_tier(layout: KVLayout, spec: dict[str, Any]) -> MooncakeTier:
    """The tier of one store process, from the plain-JSON ``spec`` both processes share."""
    return MooncakeTier(
        layout,
        spec["master"],
        protocol=spec["protocol"],
        local_hostname=spec["local_hostname"],
        segment_size=0,
        buffer_size=int(spec["buffer_size"]),
        prefix=spec["prefix"],
        sealer=SealSpec.from_json(spec["seal"]).sealer(layout),
    )


def _run(args: argparse.Namespace, lay: KVLayout, master: str) -> dict[str, Any]:
    n = args.blocks
    prefix = "bench" + uuid.uuid4().hex[:8]
    variants = seal_variants(args)
    buffer_size = (n + 1) * (lay.block_bytes + MIB)
    tiers: dict[str, MooncakeTier] = {}
    whole: WholePath | None = None
    try:
        for name, seal in variants.items():
            tiers[name] = MooncakeTier(
                lay,
                master,
                protocol=args.protocol,
                local_hostname=args.local_hostname,
                segment_size=args.segment_mib * MIB,
                buffer_size=buffer_size,
                prefix=f"{prefix}{name}",
                sealer=seal.sealer(lay),
            )
        first = tiers[""]
        client = first.client
        if client is None:
            raise ConfigError(f"cannot reach mooncake_master at {master}")
        rng = np.random.default_rng(1)
        blocks = tier_buffers(random_blocks(lay, n), args.plain)
        outs = tier_buffers(
            [np.ones(lay.block_shape, dtype=np.uint16) for _ in range(n)], args.plain
        )
        value = first.value_bytes  # the raw side moves values of the tier's size
        raw_src = [np.frombuffer(rng.bytes(value), np.uint8).copy() for _ in range(n)]
        raw_dst = [np.ones(value, np.uint8) for _ in range(n)]
        for a in raw_src + raw_dst:  # both sides move registered memory
            client.register_buffer(a.ctypes.data, a.nbytes)
        for tier in tiers.values():
            for b in blocks + outs:  # the whole frame when framed
                tier.register(whole_buffer(b))
        src_ptrs = [a.ctypes.data for a in raw_src]
        dst_ptrs = [a.ctypes.data for a in raw_dst]
        batches = sorted({n, min(n, 4)}, reverse=True)

        def raw_put(names: list[str], size: int) -> bool:
            return all(
                c == 0
                for lo in range(0, n, size)
                for c in client.batch_put_from(
                    names[lo : lo + size],
                    src_ptrs[lo : lo + size],
                    [value] * len(names[lo : lo + size]),
                )
            )

        def raw_get(names: list[str], size: int) -> bool:
            return all(
                c == value
                for lo in range(0, n, size)
                for c in client.batch_get_into(
                    names[lo : lo + size],
                    dst_ptrs[lo : lo + size],
                    [value] * len(names[lo : lo + size]),
                )
            )

        if not args.no_whole_path:
            seal = variants[""]  # as configured (by default with its MAC, as deployed)
            spec = {"master": master, "protocol": args.protocol,
                    "local_hostname": args.local_hostname, "buffer_size": buffer_size,
                    "prefix": f"{prefix}wp", "seal": seal.json()}  # fmt: skip
            whole = WholePath(lay, "kvtier.bench.mooncake", partial(peer_tier, lay, spec), spec, n)

        def make_round(r: int) -> Round:
            keys = [BlockKey(os.urandom(32)) for _ in range(n)]
            # each configuration its own objects: a put over an existing object is refused
            names = {s: [f"{prefix}/raw/{r}/{s}/{i}" for i in range(n)] for s in batches}
            store, load = tier_steps(tiers, keys, blocks, outs)
            for size in batches:
                cfg = f"batch={size},registered"
                store[f"raw_store:{cfg}"] = timed(partial(raw_put, names[size], size), "raw store")
                load[f"raw_load:{cfg}"] = timed(partial(raw_get, names[size], size), "raw load")
            done = None
            if whole is not None:
                ws, wl, done = whole.steps(r)
                store.update(ws)
                load.update(wl)

            def cleanup() -> None:
                client.batch_remove([x for ns in names.values() for x in ns], True)
                for tier in tiers.values():
                    tier.delete(keys)
                if done is not None:
                    done()

            return Round(store, load, lambda: same_bytes(outs, blocks), cleanup)

        out = interleaved(make_round, args.rounds, n * lay.block_bytes)
        for a in raw_src + raw_dst:
            client.unregister_buffer(a.ctypes.data)
    finally:
        if whole is not None:
            whole.close()
        for tier in tiers.values():
            tier.close()
    return {
        **out,
        "byte_identical": out["byte_identical"] and (whole is None or whole.loaded_ok),
        "block_bytes": lay.block_bytes,
        "blocks": n,
        "protocol": args.protocol,
        "encrypted": bool(args.encrypt),
        "framed": not args.plain,
        "auth": variants[""].sealer(lay).mode,
        "auth_pair": bool(args.auth_pair),
    }
