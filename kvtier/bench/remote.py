"""What the server-tier benchmarks (``redis``, ``s3``, ``mooncake``) share: a tier against its
bare client, moving the same bytes in the same run.

Each round times four steps -- ``raw_store``, ``store``, ``raw_load``, ``load`` -- each a whole
batch. Rounds alternate the order within each pair (raw then tier, tier then raw, ...) after one
unmeasured warm-up round, so order effects and drift on a shared machine hit both sides alike.
Reported: the best round of each step (``*_gbps``), the ratio of the bests (``store_ratio``,
``load_ratio``) and the median of the per-round ratios (``*_ratio_median``: each round's pair ran
back to back, so it resists drift best). A step that reports failure aborts the benchmark: a
throughput number for work that was not done would be a lie.

The tier side moves framed buffers (header room before each payload) as the store's staging
buffers are; ``--plain`` gives it plain arrays instead. Also here: the block layout every server
bench uses and a free-port / wait-for-port pair for the benches that start their own server.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvtier import codec
from kvtier.errors import ConfigError
from kvtier.layout import KVLayout
from kvtier.tiers.base import Array
from kvtier.tiers.secure import BlockSealer

STEPS = ("raw_store", "store", "raw_load", "load")


def add_round_arguments(parser: argparse.ArgumentParser, blocks: int, rounds: int) -> None:
    """The options every server bench takes: block size, blocks and rounds, encryption."""
    parser.add_argument("--block-mib", type=int, default=4, help="block size in MiB (4)")
    parser.add_argument("--blocks", type=int, default=blocks, help=f"blocks per round ({blocks})")
    parser.add_argument("--rounds", type=int, default=rounds, help=f"interleaved rounds ({rounds})")
    parser.add_argument("--encrypt", action="store_true", help="AES-GCM seal the tier's blocks")
    parser.add_argument(
        "--no-auth",
        action="store_true",
        help="plain blocks (trust_pool): measure the tier without its MAC",
    )
    parser.add_argument(
        "--plain",
        action="store_true",
        help="the tier gets plain arrays instead of framed buffers (header room before the "
        "payload, as the store's staging buffers are)",
    )


def bench_sealer(layout: KVLayout, encrypt: bool, auth: bool = True) -> BlockSealer:
    """The tier's sealer: AES-GCM under a fresh random master key, a MAC under a fresh random
    secret (the default: what a deployment runs), or plain (``auth`` off: a trusted pool)."""
    if encrypt:
        return BlockSealer(layout, os.urandom(32))
    if auth:
        return BlockSealer(layout, secret=os.urandom(32))
    return BlockSealer(layout, trusted=True)


def bench_layout(block_mib: int) -> KVLayout:
    """A layout whose block is exactly ``block_mib`` MiB (1 MiB per layer, 256 fp16 tokens)."""
    if block_mib < 1:
        raise ConfigError(f"--block-mib must be >= 1, got {block_mib}")
    return KVLayout(layers=block_mib, kv_heads=8, head_dim=128, dtype="float16", block_tokens=256)


def random_blocks(layout: KVLayout, n: int, seed: int = 0) -> list[Array]:
    """``n`` blocks of random 16-bit words (incompressible, all distinct)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 2**16, size=layout.block_shape, dtype=np.uint16) for _ in range(n)]


def tier_buffers(blocks: Sequence[Array], plain: bool) -> list[Array]:
    """The tier side's blocks: framed copies (``codec.framed_empty``, what the store's moves
    hand a tier), or ``blocks`` themselves with ``plain``."""
    if plain:
        return list(blocks)
    out = []
    for b in blocks:
        f = codec.framed_empty(b.nbytes).view(b.dtype).reshape(b.shape)
        f[...] = b
        out.append(f)
    return out


def whole_buffer(a: Array) -> Array:
    """The buffer to register for ``a``: its whole frame when framed, else ``a``."""
    room = codec.header_room(a)
    return a if room is None else np.asarray(room.base)


def same_bytes(outs: Sequence[Array], blocks: Sequence[Array]) -> bool:
    """Whether every ``outs[i]`` holds exactly the bytes of ``blocks[i]``."""
    return all(o.tobytes() == b.tobytes() for o, b in zip(outs, blocks, strict=True))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, proc: subprocess.Popen[bytes], what: str, log: Path | None = None) -> None:
    """Wait (up to ~20 s) until 127.0.0.1:``port`` accepts; ``ConfigError`` with the log if not."""
    for _ in range(400):
        if proc.poll() is not None:
            break
        try:
            with socket.create_connection(("127.0.0.1", port), 0.2):
                return
        except OSError:
            time.sleep(0.05)
    tail = log.read_text(errors="replace")[-1500:] if log is not None and log.exists() else ""
    raise ConfigError(f"{what} did not start on 127.0.0.1:{port} {tail}")


@dataclass(frozen=True, slots=True)
class Round:
    """One round's four batched steps (each returns True when every item succeeded), the
    check that the tier's loaded bytes are what was stored, and the round's cleanup."""

    raw_store: Callable[[], bool]
    store: Callable[[], bool]
    raw_load: Callable[[], bool]
    load: Callable[[], bool]
    identical: Callable[[], bool]
    cleanup: Callable[[], None]


def interleaved(make_round: Callable[[int], Round], rounds: int, nbytes: int) -> dict[str, Any]:
    """Run round ``-1`` (warm-up) then ``0 .. rounds-1``; the summary described above.

    ``nbytes`` is the payload one step moves. Raises ``RuntimeError`` if a step fails.
    """
    res: dict[str, list[float]] = {s: [] for s in STEPS}
    identical = True
    for r in range(-1, rounds):
        rd = make_round(r)
        try:
            for pair in (("raw_store", "store"), ("raw_load", "load")):
                for step in pair if r % 2 == 0 else pair[::-1]:
                    t0 = time.perf_counter()
                    ok = getattr(rd, step)()
                    dt = time.perf_counter() - t0
                    if not ok:
                        raise RuntimeError(f"benchmark: a {step} step failed (server full?)")
                    res[step].append(nbytes / dt / 1e9)
            identical = identical and rd.identical()
        finally:
            rd.cleanup()
        if r < 0:
            for v in res.values():
                v.clear()
    best = {f"{s}_gbps": max(res[s]) for s in STEPS}
    return {
        **best,
        "store_ratio": best["store_gbps"] / best["raw_store_gbps"],
        "load_ratio": best["load_gbps"] / best["raw_load_gbps"],
        "store_ratio_median": _median_ratio(res["store"], res["raw_store"]),
        "load_ratio_median": _median_ratio(res["load"], res["raw_load"]),
        "rounds": rounds,
        "byte_identical": identical,
    }


def _median_ratio(tier: list[float], raw: list[float]) -> float:
    return float(np.median([t / r for t, r in zip(tier, raw, strict=True)]))
