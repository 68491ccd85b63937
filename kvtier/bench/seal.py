"""``kvtier bench seal``: what a shared tier's block sealing costs on the caller's thread, against
a memcpy of the same bytes in the same run.

Every remote tier (Redis/Valkey, Mooncake Store, S3) seals a block before it leaves
(``BlockSealer.seal``) and verifies it when it comes back (``BlockSealer.open_into``), one block
after another on the calling thread. Per mode (``plain``: a trusted pool's xxh3 checksum;
``mac``: the checksum the header keeps plus AES-GMAC, the default; ``aes-gcm``: encryption),
``--blocks`` blocks of the layout (``--model``, fp16, ``--block-tokens`` tokens):

- ``seal_{mode}``: sealing staging buffers framed as the store's are (``codec.framed_empty``:
  header and trailer written into their room, no copy of the payload);
- ``open_{mode}``: verifying the sealed values into contiguous buffers (a staging buffer);
- ``open_{mode}_strided``: the same into the block's slice of a caller's ``[layers, 2, tokens,
  ...]`` buffer (an engine's load).

The limit is ``memcpy`` (``np.copyto``, one thread) of the same bytes between the same buffers:
``memcpy_contiguous`` and ``memcpy_strided`` (the load direction). ``*_vs_memcpy`` divide a
step's rate by the matching copy's; the checksum pass alone is ``xxh3``. Rates are the best of
``--rounds`` (every step once per round, interleaved); every opened block is compared with what
was sealed.
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvtier import codec
from kvtier.errors import ConfigError
from kvtier.keys import BlockKey
from kvtier.layout import KVLayout, preset
from kvtier.tiers.base import Array
from kvtier.tiers.secure import BlockSealer

MODES = ("plain", "mac", "aes-gcm")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="Llama-3.1-8B", help="layout preset")
    p.add_argument("--block-tokens", type=int, default=32, help="tokens per block (default 32)")
    p.add_argument("--blocks", type=int, default=16, help="blocks per step (default 16)")
    p.add_argument("--rounds", type=int, default=5)


def _sealer(lay: KVLayout, mode: str) -> BlockSealer:
    if mode == "plain":
        return BlockSealer(lay, trusted=True)
    if mode == "mac":
        return BlockSealer(lay, secret=os.urandom(32))
    return BlockSealer(lay, os.urandom(32))


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.blocks < 1:
        raise ConfigError(f"--blocks must be >= 1, got {args.blocks}")
    lay = preset(args.model).layout("float16", args.block_tokens)
    n, bt, bb = args.blocks, lay.block_tokens, lay.block_bytes
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**16, lay.kv_shape(n * bt), dtype=np.uint16)
    kv = bits.view(np.float16)  # compared as bits: random halves include NaNs
    # one set of framed staging buffers per mode: a sealed value is a view of its buffer
    staged = {m: [codec.framed_empty(bb) for _ in range(n)] for m in MODES}
    for bufs in staged.values():
        for i, buf in enumerate(bufs):
            codec.copy_in(buf, kv[:, :, i * bt : (i + 1) * bt])
    keys = [BlockKey(os.urandom(32)) for _ in range(n)]
    flat_out = [np.empty(bb, np.uint8) for _ in range(n)]
    outs = [a.view(np.float16).reshape(lay.block_shape) for a in flat_out]
    big = np.empty_like(kv)
    strided = [big[:, :, i * bt : (i + 1) * bt] for i in range(n)]
    sealers = {m: _sealer(lay, m) for m in MODES}
    values: dict[str, list[memoryview]] = {}

    def seal(mode: str) -> None:
        s = sealers[mode]
        sealed = [s.seal(k, b, "bench") for k, b in zip(keys, staged[mode], strict=True)]
        if any(v is None for v in sealed):
            raise RuntimeError(f"{mode}: the sealer refused a block (no key for the tenant?)")
        values[mode] = [v for v in sealed if v is not None]

    def opener(mode: str, dsts: list[Array]) -> Callable[[], None]:
        def go() -> None:
            s = sealers[mode]
            for k, v, o in zip(keys, values[mode], dsts, strict=True):
                if not s.open_into(k, v, o, "bench"):
                    raise RuntimeError(f"{mode}: a sealed block failed to open")

        return go

    def copies(dsts: list[Array]) -> Callable[[], None]:
        def go() -> None:
            for b, o in zip(staged["plain"], dsts, strict=True):
                np.copyto(o, b.view(np.float16).reshape(lay.block_shape))

        return go

    def xxh3() -> None:
        for b in staged["plain"]:
            codec.checksum(b)

    for m in MODES:
        seal(m)
    steps: dict[str, Callable[[], None]] = {
        "memcpy_contiguous": copies(outs),
        "memcpy_strided": copies(strided),
        "xxh3": xxh3,
    }
    for m in MODES:
        steps[f"seal_{m}"] = functools.partial(seal, m)
        steps[f"open_{m}"] = opener(m, outs)
        steps[f"open_{m}_strided"] = opener(m, strided)
    best = dict.fromkeys(steps, float("inf"))
    for rnd in range(args.rounds + 1):  # round 0 warms up, unmeasured
        for name, fn in steps.items():
            t = time.perf_counter()
            fn()
            if rnd:
                best[name] = min(best[name], time.perf_counter() - t)
    for m in MODES:  # every mode's opened blocks, checked once more (untimed)
        for dsts in (outs, strided):
            for o in dsts:
                o.fill(0)
            opener(m, dsts)()
            for i, o in enumerate(dsts):
                if not np.array_equal(o.view(np.uint16), bits[:, :, i * bt : (i + 1) * bt]):
                    raise RuntimeError(f"{m}: an opened block differs from the one sealed")
    total = n * bb
    out: dict[str, Any] = {f"{k}_gbps": total / t / 1e9 for k, t in best.items()}
    for m in MODES:
        out[f"open_{m}_vs_memcpy"] = out[f"open_{m}_gbps"] / out["memcpy_contiguous_gbps"]
        out[f"open_{m}_strided_vs_memcpy"] = (
            out[f"open_{m}_strided_gbps"] / out["memcpy_strided_gbps"]
        )
        out[f"seal_{m}_vs_memcpy"] = out[f"seal_{m}_gbps"] / out["memcpy_contiguous_gbps"]
    out.update(block_bytes=bb, blocks=n, rounds=args.rounds)
    return out
