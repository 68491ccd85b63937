"""What the server-tier benchmarks (``redis``, ``s3``, ``mooncake``) share: the tier and the
store's whole path against the fastest bare-client configuration found, same bytes, same run.

A round has a write group and a read group of steps, each step one whole batch (``Round``):
several ``raw_*`` bare-client configurations (the bench module says which: pipeline depth and
connections, batch size and buffer registration, concurrency), the tier's ``store``/``load``
(its blocks MAC'd by default; with ``--auth-pair`` also ``store_noauth``/``load_noauth``, the
same through a tier with plain blocks, in the same rounds), and the store's
``write_through``/``read_path`` seen from a second process (``kvtier.bench.peer``;
``--no-whole-path`` skips them). After one unmeasured
warm-up round the order within each group rotates every round, so order effects and drift on a
shared machine hit every step alike (``interleaved`` says what is reported). A step that fails
aborts the benchmark: a throughput number for work that was not done would be a lie.

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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from kvtier import codec
from kvtier.errors import ConfigError
from kvtier.keys import BlockKey
from kvtier.layout import KVLayout
from kvtier.tiers.base import Array, Tier
from kvtier.tiers.secure import BlockSealer


def add_round_arguments(parser: argparse.ArgumentParser, blocks: int, rounds: int) -> None:
    """The options every server bench takes: block size, blocks and rounds, sealing, paths."""
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
        "--auth-pair",
        action="store_true",
        help="also run the tier with plain, unauthenticated blocks (trust_pool; steps "
        "store_noauth, load_noauth) in the same rounds as the tier with its MAC",
    )
    parser.add_argument(
        "--no-whole-path",
        action="store_true",
        help="skip the store's write-through and read path seen from a second process",
    )
    parser.add_argument(
        "--plain",
        action="store_true",
        help="the tier gets plain arrays instead of framed buffers (header room before the "
        "payload, as the store's staging buffers are)",
    )


@dataclass(frozen=True, slots=True)
class SealSpec:
    """How a bench tier seals its blocks: AES-GCM under ``encryption_key``, else a keyed MAC
    under ``secret`` (what a deployment runs), else plain in a pool trusted unauthenticated.
    Plain JSON both ways (``json`` / ``from_json``), so a second store process seals and opens
    the same way."""

    encryption_key: bytes = b""
    secret: bytes = b""

    def sealer(self, layout: KVLayout) -> BlockSealer:
        if self.encryption_key:
            return BlockSealer(layout, self.encryption_key)
        if self.secret:
            return BlockSealer(layout, secret=self.secret)
        return BlockSealer(layout, trusted=True)

    def json(self) -> dict[str, Any]:
        return {"encryption_key": self.encryption_key.hex(), "secret": self.secret.hex()}

    @classmethod
    def from_json(cls, spec: dict[str, Any]) -> SealSpec:
        return cls(bytes.fromhex(spec["encryption_key"]), bytes.fromhex(spec["secret"]))


def seal_variants(args: argparse.Namespace) -> dict[str, SealSpec]:
    """The tiers a bench runs side by side: ``""`` as configured (AES-GCM with ``--encrypt``,
    plain with ``--no-auth``, else a MAC under a fresh random secret) and, with ``--auth-pair``,
    ``"noauth"`` (plain, trusted pool) beside the MAC'd one: the MAC's cost in the same rounds.
    Their steps are ``store``/``load`` and ``store_noauth``/``load_noauth``."""
    if args.encrypt:
        return {"": SealSpec(encryption_key=os.urandom(32))}
    if args.no_auth:
        return {"": SealSpec()}
    out = {"": SealSpec(secret=os.urandom(32))}
    if args.auth_pair:
        out["noauth"] = SealSpec()
    return out


def step_suffix(variant: str) -> str:
    return f"_{variant}" if variant else ""


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


Step = Callable[[], float]
"""One batched step of a round: does the work, returns the seconds it took (raises
``RuntimeError`` if any item failed: a throughput number for work not done would be a lie)."""


def timed(fn: Callable[[], bool], what: str) -> Step:
    """A step timing ``fn`` (which returns True when every item succeeded) from the outside."""

    def step() -> float:
        t0 = time.perf_counter()
        ok = fn()
        dt = time.perf_counter() - t0
        if not ok:
            raise RuntimeError(f"benchmark: a {what} step failed (server full?)")
        return dt

    return step


def tier_steps(
    tiers: Mapping[str, Tier], keys: list[BlockKey], blocks: list[Array], outs: list[Array]
) -> tuple[dict[str, Step], dict[str, Step]]:
    """Each variant's ``store{suffix}`` (one ``put`` of the batch) and ``load{suffix}`` (one
    ``get_into``) steps."""
    store: dict[str, Step] = {}
    load: dict[str, Step] = {}
    for name, tier in tiers.items():
        sfx = step_suffix(name)
        store[f"store{sfx}"] = timed(partial(_put_all, tier, keys, blocks), "store")
        load[f"load{sfx}"] = timed(partial(_get_all, tier, keys, outs), "load")
    return store, load


def _put_all(tier: Tier, keys: list[BlockKey], blocks: list[Array]) -> bool:
    return all(tier.put(keys, blocks))


def _get_all(tier: Tier, keys: list[BlockKey], outs: list[Array]) -> bool:
    return all(tier.get_into(keys, outs))


@dataclass(frozen=True, slots=True)
class Round:
    """One round: the write steps (``store``), then the read steps (``load``), each a map of
    step name to ``Step``; names starting with ``raw`` are bare-client configurations, the
    others the tier's paths. ``identical`` checks the tier's loaded bytes; ``cleanup`` removes
    what the round wrote."""

    store: dict[str, Step]
    load: dict[str, Step]
    identical: Callable[[], bool]
    cleanup: Callable[[], None]


def interleaved(make_round: Callable[[int], Round], rounds: int, nbytes: int) -> dict[str, Any]:
    """Run round ``-1`` (warm-up) then ``0 .. rounds-1``; the summary below.

    Within each group (writes, then reads) the steps run back to back, their order rotated by
    one every round, so order effects and drift hit every step alike. ``nbytes`` is the payload
    one step moves. Reported: ``{step}_gbps`` (best round) for every step;
    ``raw_{store,load}_gbps`` the best bare-client configuration, named in
    ``raw_{store,load}_best``; for every tier step ``{step}_ratio`` (its best / the best raw)
    and ``{step}_ratio_median`` (median over rounds of the step against the fastest raw
    configuration *of the same round*: the steadier figure on a shared machine).
    """
    res: dict[str, list[float]] = {}
    groups: dict[str, list[str]] = {"store": [], "load": []}
    identical = True
    for r in range(-1, rounds):
        rd = make_round(r)
        try:
            for group, steps in (("store", rd.store), ("load", rd.load)):
                names = list(steps)
                groups[group] = names
                k = r % len(names) if names else 0
                for name in names[k:] + names[:k]:
                    gbps = nbytes / steps[name]() / 1e9
                    if r >= 0:
                        res.setdefault(name, []).append(gbps)
            identical = identical and rd.identical()
        finally:
            rd.cleanup()
    out: dict[str, Any] = {f"{s}_gbps": max(v) for s, v in res.items()}
    for group, names in groups.items():
        raws = [s for s in names if s.startswith("raw")]
        best = max(raws, key=lambda s: max(res[s]))
        out[f"raw_{group}_best"] = best
        out[f"raw_{group}_gbps"] = max(res[best])
        for s in names:
            if s.startswith("raw"):
                continue
            out[f"{s}_ratio"] = max(res[s]) / max(res[best])
            per_round = [res[s][i] / max(res[x][i] for x in raws) for i in range(len(res[s]))]
            out[f"{s}_ratio_median"] = float(np.median(per_round))
            out[f"{s}_ratio_rounds"] = per_round
    return {**out, "rounds": rounds, "byte_identical": identical}
