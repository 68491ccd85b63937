"""``kvtier bench host``: store/load through the host DRAM tier vs memcpy of the same bytes.

Layout Llama-3.1-8B (fp16, 256-token blocks = 32 MiB), >= 1 GiB per round. ``memcpy_gbps`` is
one thread copying the same block slices (``np.copyto``, i.e. memcpy) from the same source
array into a same-sized destination, measured in the same run; ``memcpy_whole_gbps`` is one
single copy of the whole buffer, for reference. The store path also checksums every block
(xxh3) and runs on the transfer engine's workers plus the caller. Best of ``--rounds``.

Also timed: ``lookup`` of a fully cached 128K-token prompt (numpy token array and Python list)
and a miss on the first block.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from kvtier.layout import KVLayout, preset
from kvtier.store import TieredStore
from kvtier.tiers.host import HostTier


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gib", type=float, default=1.0, help="GiB moved per round (default 1)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", type=int, default=2, help="transfer engine workers")


def _best(fn: Any, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _lookup_times(rounds: int) -> dict[str, float]:
    lay = KVLayout(layers=1, kv_heads=1, head_dim=8, dtype="float16")  # keys don't care
    n = 128 * 1024
    toks = np.random.default_rng(1).integers(0, 128_000, n, dtype=np.int64)
    tier = HostTier(lay, (n // 256 + 8) * lay.block_bytes)
    with TieredStore(lay, [tier], workers=1, model_id="bench") as st:
        st.store(toks, np.zeros(lay.kv_shape(n), lay.storage_dtype))
        assert st.lookup(toks) == n
        as_list = toks.tolist()
        miss = toks.copy()
        miss[0] += 1
        reps = 20
        full = _best(lambda: [st.lookup(toks) for _ in range(reps)], rounds) / reps
        full_list = _best(lambda: [st.lookup(as_list) for _ in range(reps)], rounds) / reps
        first = _best(lambda: [st.lookup(miss) for _ in range(1000)], rounds) / 1000
    return {
        "lookup_128k_ms": full * 1e3,
        "lookup_128k_list_ms": full_list * 1e3,
        "lookup_miss_us": first * 1e6,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    lay = preset("Llama-3.1-8B").layout("float16", 256)
    blocks = max(1, int(args.gib * 2**30) // lay.block_bytes)
    n_tok = blocks * lay.block_tokens
    nbytes = blocks * lay.block_bytes
    rng = np.random.default_rng(0)
    kv = rng.integers(0, 2**16, size=lay.kv_shape(n_tok), dtype=np.uint16).view(np.float16)
    out = np.zeros_like(kv)
    dst = np.zeros(nbytes, dtype=np.uint8)
    bt = lay.block_tokens

    def memcpy_blocks() -> None:
        for i in range(blocks):
            part = dst[i * lay.block_bytes : (i + 1) * lay.block_bytes]
            np.copyto(
                part.view(np.float16).reshape(lay.block_shape), kv[:, :, i * bt : (i + 1) * bt]
            )

    flat = kv.reshape(-1).view(np.uint8)
    t_memcpy = _best(memcpy_blocks, args.rounds)
    t_whole = _best(lambda: np.copyto(dst, flat), args.rounds)

    tier = HostTier(lay, (blocks + 1) * lay.block_bytes)
    counter = iter(range(1, 1 << 30))
    with TieredStore(lay, [tier], workers=args.workers, model_id="bench") as st:
        state: dict[str, Any] = {}
        t_store = float("inf")
        for _ in range(args.rounds):
            toks = np.full(n_tok, next(counter), dtype=np.int64)
            t0 = time.perf_counter()
            stored = st.store(toks, kv)
            t_store = min(t_store, time.perf_counter() - t0)
            assert stored == n_tok
            state["toks"] = toks
        toks = state["toks"]
        t_load = _best(lambda: st.load(toks, out), args.rounds)
        identical = bool(np.array_equal(out.view(np.uint16), kv.view(np.uint16)))
    result: dict[str, Any] = {
        "layout": "Llama-3.1-8B fp16, 256-token blocks",
        "block_bytes": lay.block_bytes,
        "bytes": nbytes,
        "workers": args.workers,
        "store_gbps": nbytes / t_store / 1e9,
        "load_gbps": nbytes / t_load / 1e9,
        "memcpy_gbps": nbytes / t_memcpy / 1e9,
        "memcpy_whole_gbps": nbytes / t_whole / 1e9,
        "identical": identical,
    }
    result["store_vs_memcpy"] = result["store_gbps"] / result["memcpy_gbps"]
    result["load_vs_memcpy"] = result["load_gbps"] / result["memcpy_gbps"]
    result.update(_lookup_times(args.rounds))
    return result
