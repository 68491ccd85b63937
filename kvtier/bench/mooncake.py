"""``kvtier bench mooncake``: the Mooncake tier against the bare Mooncake client, same run.

Both sides move ``--blocks`` blocks of ``--block-mib`` MiB in one batched call per direction,
through the *same* ``MooncakeDistributedStore`` client (the tier's own): the tier through
``put``/``get_into`` (header, xxh3 checksum of the payload, verification on read), the raw side
as ``batch_put_from``/``batch_get_into`` of values of the same size, no framing and no
verification. Both sides move memory registered once with the transfer engine (the raw side
with ``register_buffer``, the tier's sources and destinations with ``MooncakeTier.register``, as
a deployment registers its host arena). The tier's blocks are framed (``codec.framed_empty``,
as the store's staging buffers are), so each value moves as one buffer; ``--plain`` measures
plain arrays, whose header moves as a second buffer. Rounds are interleaved as
``kvtier.bench.remote`` describes; each round's objects are removed after it.

Without ``--master`` a ``mooncake_master`` and a ``mooncake_client`` holding the pool memory
(``--pool-mib``) are started on 127.0.0.1 from the installed wheel and stopped by PID at the end:
the benchmarked client then reaches the pool over TCP, as a node reaches a remote memory pool.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
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
        sealer=bench_sealer(lay, args.encrypt, not args.no_auth),
    )
    try:
        client = tier.client
        if client is None:
            raise ConfigError(f"cannot reach mooncake_master at {master}")
        rng = np.random.default_rng(1)
        blocks = tier_buffers(random_blocks(lay, n), args.plain)
        outs = tier_buffers(
            [np.ones(lay.block_shape, dtype=np.uint16) for _ in range(n)], args.plain
        )
        value = tier.value_bytes  # the raw side moves values of the tier's size
        raw_src = [np.frombuffer(rng.bytes(value), np.uint8).copy() for _ in range(n)]
        raw_dst = [np.ones(value, np.uint8) for _ in range(n)]
        for a in raw_src + raw_dst:  # both sides move registered memory
            client.register_buffer(a.ctypes.data, a.nbytes)
        for b in blocks + outs:  # the whole frame when framed
            tier.register(whole_buffer(b))
        src_ptrs = [a.ctypes.data for a in raw_src]
        dst_ptrs = [a.ctypes.data for a in raw_dst]
        sizes = [value] * n

        def make_round(r: int) -> Round:
            keys = [BlockKey(os.urandom(32)) for _ in range(n)]
            names = [f"{tier.prefix}/raw/{r}/{i}" for i in range(n)]

            def cleanup() -> None:
                client.batch_remove(names, True)
                tier.delete(keys)

            return Round(
                raw_store=lambda: all(
                    c == 0 for c in client.batch_put_from(names, src_ptrs, sizes)
                ),
                store=lambda: all(tier.put(keys, blocks)),
                raw_load=lambda: all(
                    c == value for c in client.batch_get_into(names, dst_ptrs, sizes)
                ),
                load=lambda: all(tier.get_into(keys, outs)),
                identical=lambda: same_bytes(outs, blocks),
                cleanup=cleanup,
            )

        out = interleaved(make_round, args.rounds, n * lay.block_bytes)
        for a in raw_src + raw_dst:
            client.unregister_buffer(a.ctypes.data)
    finally:
        tier.close()
    return {
        **out,
        "block_bytes": lay.block_bytes,
        "blocks": n,
        "protocol": args.protocol,
        "encrypted": bool(args.encrypt),
        "auth": bench_sealer(lay, args.encrypt, not args.no_auth).mode,
        "framed": not args.plain,
    }
