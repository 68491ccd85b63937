"""``kvtier bench host``: store/load through the host DRAM tier against the best copy of the same
bytes the machine does with the same threads.

Layout Llama-3.1-8B (fp16, ``--block-tokens`` 256: 32 MiB blocks), ``--gib`` per round. The
tier's store and load run on the transfer engine's workers plus the caller
(``TransferEngine.parallelism`` threads) and include the xxh3 checksum of every byte. The limit
is the fastest of these copies of the same bytes, each with 1 .. that many threads
(``np.copyto``, i.e. glibc memcpy, on a thread pool plus the caller, the work split into
contiguous runs as the engine splits it):

- ``memcpy_blocks_{t}t``: block by block between the caller's strided ``[layers, 2, tokens, ...]``
  slices and a contiguous arena, the same copies the tier makes (store direction for the store,
  load direction for the load);
- ``memcpy_whole_{t}t``: the whole contiguous buffer in ``t`` pieces (glibc streams copies over
  its non-temporal threshold past the cache, which block-sized copies may not reach).

Not a limit but a diagnosis: ``copy_hash_blocks_{t}t`` / ``copy_hash_blocks_out_{t}t`` are the
block copies with the tier's checksum fused in (``kvtier.codec.copy_in`` / ``copy_out``, the
same calls the tier makes, without its index, pins or framing). ``store_vs_copy_hash`` /
``load_vs_copy_hash`` compare the tier with the best of those: what the tier's own bookkeeping
costs, apart from the checksum.

The caller's buffers (``kv``, ``out``) and the copies' arena start 64 bytes past a page
boundary, where torch's CPU allocator puts a large tensor (the engine integrations' staging
buffers) and where the tier's own arena starts (``kvtier.tiers.shm.DATA_OFFSET``): a copy runs
fastest between buffers at the same offset modulo 64. ``store_numpy_buffers_gbps`` /
``load_numpy_buffers_gbps`` are the tier again with arrays numpy allocated itself (16 bytes
past a page, glibc's ``malloc`` header), as a caller of the Python API may pass them.

After one unmeasured warm-up round, every round runs every copy and the tier's store and load
back to back (so drift on a shared machine hits all of them); ``*_gbps`` are the best of
``--rounds``, ``store_vs_best`` / ``load_vs_best`` the ratio of the tier's best to the best
copy's (named in ``store_baseline`` / ``load_baseline``), and ``*_vs_best_rounds`` the same
ratio within each round (its spread).

Also timed: ``lookup`` of a fully cached 128K-token prompt (numpy token array and Python list)
and a miss on the first block.

``--url URL`` benches the node-local service instead (``kvtier.bench.service``: the same
stores, loads and lookups in-process and through the service at ``URL``, in the same run, with
their ratios; ``--url auto`` starts a service of its own). ``kvtier bench service`` is that
bench with ``--url auto``.
"""

from __future__ import annotations

import argparse
import mmap
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from kvtier.codec import copy_in, copy_out
from kvtier.layout import KVLayout, preset
from kvtier.store import TieredStore
from kvtier.tiers.base import Array
from kvtier.tiers.host import HostTier
from kvtier.tiers.shm import DATA_OFFSET
from kvtier.transfer import TransferEngine


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvtier.bench.service import add_service_arguments

    p.add_argument("--gib", type=float, default=1.0, help="GiB moved per round (default 1)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", type=int, default=2, help="transfer engine workers")
    p.add_argument("--model", default="Llama-3.1-8B", help="layout preset")
    p.add_argument("--block-tokens", type=int, default=256, help="tokens per block (default 256)")
    p.add_argument(
        "--url",
        default=None,
        help="bench the kvtier service at this URL against in-process ('auto': start one)",
    )
    add_service_arguments(p)


def best_time(fn: Any, rounds: int) -> float:
    """The fastest of ``rounds`` calls of ``fn`` (seconds)."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


LONG_PROMPT = 128 * 1024


def lookup_times(store: Any, rounds: int, *, as_list: bool = False) -> dict[str, float]:
    """Best per-call times of ``store.lookup`` (a ``TieredStore`` or a service client, any
    layout: keys cost per block, not per byte): a cached 128K-token prompt (stored here first
    if it is not), the same as a Python list (``as_list``), and a miss on the first block of
    a 128K-token and of a 4K-token prompt."""
    toks = np.random.default_rng(1).integers(0, 128_000, LONG_PROMPT, dtype=np.int64)
    lay: KVLayout = store.layout
    if store.lookup(toks) != LONG_PROMPT:
        store.store(toks, np.zeros(lay.kv_shape(LONG_PROMPT), lay.storage_dtype))
    if store.lookup(toks) != LONG_PROMPT:
        raise RuntimeError("bench: the 128K-token prompt did not stay cached; raise the host tier")
    miss = toks.copy()
    miss[0] += 1
    short = miss[:4096].copy()
    reps = 20
    out = {
        "lookup_128k_ms": 1e3
        * best_time(lambda: [store.lookup(toks) for _ in range(reps)], rounds)
        / reps,
        "lookup_miss_us": 1e6
        * best_time(lambda: [store.lookup(miss) for _ in range(200)], rounds)
        / 200,
        "lookup_miss_4k_us": 1e6
        * best_time(lambda: [store.lookup(short) for _ in range(500)], rounds)
        / 500,
    }
    if as_list:
        listed = toks.tolist()
        out["lookup_128k_list_ms"] = (
            1e3 * best_time(lambda: [store.lookup(listed) for _ in range(reps)], rounds) / reps
        )
    return out


def _lookup_times(rounds: int) -> dict[str, float]:
    lay = KVLayout(layers=1, kv_heads=1, head_dim=8, dtype="float16")  # keys don't care
    tier = HostTier(lay, (LONG_PROMPT // 256 + 8) * lay.block_bytes)
    with TieredStore(lay, [tier], workers=1, model_id="bench") as st:
        return lookup_times(st, rounds, as_list=True)


class _Copies:
    """The reference copies, each a callable over ``threads`` threads (caller included)."""

    def __init__(self, lay: KVLayout, kv: Array, arena: Array, out: Array, threads: int) -> None:
        self.lay, self.kv, self.arena, self.out = lay, kv, arena, out
        self.blocks = arena.nbytes // lay.block_bytes
        self.pool = ThreadPoolExecutor(max(1, threads - 1), thread_name_prefix="bench-copy")

    def _split(self, fn: Callable[[int, int], None], n: int, threads: int) -> None:
        """``fn(lo, hi)`` over ``range(n)`` in ``threads`` contiguous parts, one on the caller."""
        parts = min(n, threads)
        bounds = [n * i // parts for i in range(parts + 1)]
        futs = [self.pool.submit(fn, bounds[i], bounds[i + 1]) for i in range(1, parts)]
        fn(bounds[0], bounds[1])
        for f in futs:
            f.result()

    def _block_views(self, i: int) -> tuple[Array, Array, Array]:
        lay, bb, bt = self.lay, self.lay.block_bytes, self.lay.block_tokens
        slot = self.arena[i * bb : (i + 1) * bb].view(lay.storage_dtype).reshape(lay.block_shape)
        return slot, self.kv[:, :, i * bt : (i + 1) * bt], self.out[:, :, i * bt : (i + 1) * bt]

    def block_copies(
        self, copy: Callable[[Array, Array], object], into_arena: bool
    ) -> Callable[[int], None]:
        """Block by block between the caller's slices and the arena with ``copy(dst, src)``
        (``np.copyto``, or the tier's fused ``codec.copy_in`` / ``copy_out``), over the
        ``threads`` the returned callable is given."""

        def run(threads: int) -> None:
            def part(lo: int, hi: int) -> None:
                for i in range(lo, hi):
                    slot, src, dst = self._block_views(i)
                    if into_arena:
                        copy(slot, src)
                    else:
                        copy(dst, slot)

            self._split(part, self.blocks, threads)

        return run

    def whole(self, threads: int) -> None:
        src = self.kv.reshape(-1).view(np.uint8)
        step = -(-src.size // threads)

        def part(lo: int, hi: int) -> None:
            for k in range(lo, hi):
                np.copyto(self.arena[k * step : (k + 1) * step], src[k * step : (k + 1) * step])

        self._split(part, threads, threads)


def _past_page(nbytes: int) -> Array:
    """``nbytes`` of uint8 starting ``DATA_OFFSET`` bytes past a page boundary."""
    raw = np.empty(nbytes + 2 * mmap.PAGESIZE, dtype=np.uint8)
    skip = (DATA_OFFSET - raw.ctypes.data) % mmap.PAGESIZE
    return raw[skip : skip + nbytes]


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.url:
        from kvtier.bench.service import run as run_service

        return run_service(args)
    lay = preset(args.model).layout("float16", args.block_tokens)
    blocks = max(1, int(args.gib * 2**30) // lay.block_bytes)
    n_tok = blocks * lay.block_tokens
    nbytes = blocks * lay.block_bytes
    rng = np.random.default_rng(0)
    # the caller's buffers where an engine's are (module docstring); numpy's own, 16 bytes past
    # a page, for the tier's second pair of numbers
    kv_numpy = rng.integers(0, 2**16, size=lay.kv_shape(n_tok), dtype=np.uint16).view(np.float16)
    kv = _past_page(kv_numpy.nbytes).view(np.float16).reshape(kv_numpy.shape)
    kv[...] = kv_numpy
    out = _past_page(kv.nbytes).view(np.float16).reshape(kv.shape)
    out_numpy = np.empty_like(kv_numpy)
    arena = _past_page(nbytes)
    for a in (out, out_numpy, arena):
        a.fill(0)  # touch every page now: a first touch would land on whichever copy ran first
    threads = TransferEngine(args.workers).parallelism  # what the store's batches use
    copies = _Copies(lay, kv, arena, out, threads)
    ts = range(1, threads + 1)
    blocks_in, blocks_out = (
        copies.block_copies(np.copyto, True),
        copies.block_copies(np.copyto, False),
    )
    store_refs = {f"memcpy_blocks_{t}t": (blocks_in, t) for t in ts}
    load_refs = {f"memcpy_blocks_out_{t}t": (blocks_out, t) for t in ts}
    whole_refs = {f"memcpy_whole_{t}t": (copies.whole, t) for t in ts}
    hashed_in, hashed_out = copies.block_copies(copy_in, True), copies.block_copies(copy_out, False)
    hashed = {  # the diagnosis, not the limit (module docstring)
        "store": {f"copy_hash_blocks_{t}t": (hashed_in, t) for t in ts},
        "load": {f"copy_hash_blocks_out_{t}t": (hashed_out, t) for t in ts},
    }
    refs = {**store_refs, **load_refs, **whole_refs, **hashed["store"], **hashed["load"]}
    times: dict[str, list[float]] = {
        name: [] for name in [*refs, "store", "load", "store_numpy_buffers", "load_numpy_buffers"]
    }

    warm = [True]

    def timed(name: str, fn: Callable[..., Any], *fn_args: Any) -> Any:
        t0 = time.perf_counter()
        got = fn(*fn_args)
        if not warm[0]:
            times[name].append(time.perf_counter() - t0)
        return got

    identical = True
    counter = iter(range(1, 1 << 30))
    tier = HostTier(lay, (blocks + 1) * lay.block_bytes)
    try:
        with TieredStore(lay, [tier], workers=args.workers, model_id="bench") as st:
            for r in range(-1, args.rounds):  # round -1 warms threads, pages and caches
                warm[0] = r < 0
                for name, (fn, t) in refs.items():
                    timed(name, fn, t)
                for suffix, src, dst in (("", kv, out), ("_numpy_buffers", kv_numpy, out_numpy)):
                    toks = np.full(n_tok, next(counter), dtype=np.int64)
                    if timed(f"store{suffix}", st.store, toks, src) != n_tok:
                        raise RuntimeError("bench: the tier's store did not cover every block")
                    dst.fill(0)
                    if timed(f"load{suffix}", st.load, toks, dst) != n_tok:
                        raise RuntimeError("bench: the tier's load did not cover every block")
                    identical = identical and bool(
                        np.array_equal(dst.view(np.uint16), src.view(np.uint16))
                    )
    finally:
        copies.pool.shutdown()
    gbps = {name: nbytes / min(ts) / 1e9 for name, ts in times.items()}
    result: dict[str, Any] = {
        "layout": f"{args.model} fp16, {lay.block_tokens}-token blocks",
        "block_bytes": lay.block_bytes,
        "bytes": nbytes,
        "workers": args.workers,
        "tier_threads": threads,
        "rounds": args.rounds,
        "store_gbps": gbps["store"],
        "load_gbps": gbps["load"],
        "store_numpy_buffers_gbps": gbps["store_numpy_buffers"],
        "load_numpy_buffers_gbps": gbps["load_numpy_buffers"],
        **{f"{name}_gbps": gbps[name] for name in refs},
        "identical": identical,
    }
    for side, own in (("store", store_refs), ("load", load_refs)):
        names = [*own, *whole_refs]
        best = max(names, key=lambda k: gbps[k])
        result[f"{side}_baseline"] = best
        result[f"{side}_vs_best"] = gbps[side] / gbps[best]
        result[f"{side}_vs_best_rounds"] = [  # within each round: tier against that round's best
            min(times[k][r] for k in names) / times[side][r] for r in range(args.rounds)
        ]
        fused = max(hashed[side], key=lambda k: gbps[k])
        result[f"{side}_copy_hash_baseline"] = fused
        result[f"{side}_vs_copy_hash"] = gbps[side] / gbps[fused]
    result.update(_lookup_times(args.rounds))
    return result
