"""``kvtier bench disk``: NVMe tier store/load against ``fio`` on the same filesystem, same bytes.

Moves ``--size`` bytes (default 2 GiB) of Llama-3.1-8B blocks (256 tokens = 32 MiB) in one run,
on one filesystem (``--dir``):

- the raw limit: ``fio`` (``ioengine=libaio``, ``direct=1``, sequential, ``bs`` = the tier's slot
  size, the same number of slots, ``end_fsync=1`` on writes) run for every ``numjobs`` x
  ``iodepth`` in ``--jobs`` x ``--depths`` (powers of two up to the tier's ``--workers``) with at
  most ``--inflight`` requests in flight (default ``--workers``: the tier's I/O threads each have
  one synchronous request out, so that is its queue depth); ``raw_write_gbps`` /
  ``raw_read_gbps`` are the best, with their settings in ``raw_write_best`` / ``raw_read_best``
  and every configuration's figure in ``fio_write`` / ``fio_read``;
- ``store_gbps`` / ``load_gbps``: ``NVMeTier.put`` / ``get_into`` of the same number of blocks in
  batches of ``--batch``, including the fused copy+checksum into and out of caller arrays, the
  header, the data ``fdatasync`` and the index record (a put returns only once durable), and on
  load the header and checksum verification. ``store_latency_ms`` / ``load_latency_ms``: p50 and
  p99 of a block's latency, i.e. of the put / get call that carried it.

Rounds are interleaved (every fio write, the tier's store, every fio read, the tier's load);
each figure is the best of ``--repeat`` rounds and ``*_vs_raw_rounds`` the tier against the best
fio of the same round. Without ``fio`` on ``PATH`` the tier is still measured, ``raw_limit``
says fio is missing and the ratios are ``None``. All figures are payload GB/s (1e9 bytes). Where
the filesystem refuses ``O_DIRECT`` (``o_direct: false``) the tier falls back to buffered I/O,
its file's page cache is dropped before each load, and fio runs buffered too.

``reopen_100k_s`` (named for the default ``--reopen-blocks``): seconds to reopen a tier whose
index holds that many blocks (a small layout, so building it is quick), i.e. warm-restart cost.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.config import parse_size
from kvtier.keys import BlockKey
from kvtier.layout import KVLayout, preset
from kvtier.tiers.nvme import NVMeTier
from kvtier.tiers.nvme_index import SLOTS_FILE, slot_bytes_for

log = logging.getLogger(__name__)
FIO_MISSING = "fio not found: install it (Debian: apt-get install fio); no raw limit measured"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", default="2GiB", help="bytes to move each way (default 2GiB)")
    parser.add_argument("--dir", default=".kvtier/bench", help="scratch directory (emptied)")
    parser.add_argument("--batch", type=int, default=8, help="blocks per put/get call")
    parser.add_argument("--workers", type=int, default=4, help="tier I/O threads")
    parser.add_argument("--model", default="Llama-3.1-8B", help="layout preset")
    parser.add_argument("--repeat", type=int, default=3, help="rounds; best of each is reported")
    parser.add_argument("--jobs", default="", help="fio numjobs to try (default: 1,2,4..workers)")
    parser.add_argument("--depths", default="", help="fio iodepths to try (default: as --jobs)")
    parser.add_argument(
        "--inflight", type=int, default=0, help="most fio requests in flight (default --workers)"
    )
    parser.add_argument(
        "--reopen-blocks", type=int, default=100_000, help="blocks indexed for the reopen test"
    )


def _powers(limit: int) -> list[int]:
    out = [1]
    while out[-1] * 2 <= limit:
        out.append(out[-1] * 2)
    return out if out[-1] == limit else [*out, limit]


def _ints(text: str, default: list[int]) -> list[int]:
    return sorted({int(x) for x in text.split(",") if x.strip()}) or default


def run(args: argparse.Namespace) -> dict[str, Any]:
    layout = preset(args.model).layout()
    bb, sb = layout.block_bytes, slot_bytes_for(layout.block_bytes)
    n = max(args.batch, parse_size(args.size, "--size") // bb)
    base = Path(args.dir)
    shutil.rmtree(base, ignore_errors=True)
    (base / "raw").mkdir(parents=True)
    jobs = _ints(args.jobs, _powers(max(1, args.workers)))
    depths = _ints(args.depths, _powers(max(1, args.workers)))
    fio = shutil.which("fio")
    if fio is None:
        log.warning("%s", FIO_MISSING)
    result: dict[str, Any] = {
        "model": args.model,
        "block_bytes": bb,
        "io_bytes": sb,
        "blocks": n,
        "bytes": n * bb,
        "batch": args.batch,
        "workers": args.workers,
        "repeat": args.repeat,
        "raw_limit": f"fio {_fio_version(fio)}, libaio, O_DIRECT" if fio else FIO_MISSING,
    }
    inflight = args.inflight or args.workers
    configs = [(j, d) for j in jobs for d in depths if n // j > 0 and j * d <= inflight]
    result["fio_inflight_max"] = inflight
    fio_runs: dict[str, dict[str, list[float]]] = {"write": {}, "read": {}}
    tier_times: dict[str, list[float]] = {"store": [], "load": []}
    lat: dict[str, list[float]] = {"store": [], "load": []}
    try:
        bench = _TierBench(layout, base / "tier", n, args.batch, args.workers)
        direct = bench.tier.o_direct
        try:
            for _ in range(args.repeat):  # interleaved: drift hits both sides
                for rw, step in (("write", "store"), ("read", "load")):
                    for j, d in configs if fio else ():
                        gbps = _fio(fio or "", base / "raw" / SLOTS_FILE, rw, sb, n, j, d, direct)
                        fio_runs[rw].setdefault(f"numjobs={j} iodepth={d}", []).append(gbps)
                    t, calls = bench.store() if step == "store" else bench.load()
                    tier_times[step].append(t)
                    lat[step] += calls
                bench.clear()
            result["o_direct"] = direct
        finally:
            bench.tier.close()
        result["store_gbps"] = n * bb / min(tier_times["store"]) / 1e9
        result["load_gbps"] = n * bb / min(tier_times["load"]) / 1e9
        for step in ("store", "load"):
            ms = np.array(lat[step]) * 1e3
            result[f"{step}_latency_ms"] = {
                "p50": float(np.percentile(ms, 50)),
                "p99": float(np.percentile(ms, 99)),
            }
        for rw, step in (("write", "store"), ("read", "load")):
            runs = fio_runs[rw]
            result[f"fio_{rw}"] = {k: max(v) for k, v in runs.items()}
            if not runs:
                result[f"raw_{rw}_gbps"] = result[f"raw_{rw}_best"] = None
                result[f"{step}_vs_raw"] = None
                continue
            best = max(runs, key=lambda k: max(runs[k]))
            result[f"raw_{rw}_best"] = best
            result[f"raw_{rw}_gbps"] = max(runs[best])
            result[f"{step}_vs_raw"] = result[f"{step}_gbps"] / result[f"raw_{rw}_gbps"]
            result[f"{step}_vs_raw_rounds"] = [  # the tier against the same round's best fio
                n * bb / tier_times[step][r] / 1e9 / max(v[r] for v in runs.values())
                for r in range(args.repeat)
            ]
        if args.reopen_blocks > 0:
            shutil.rmtree(base / "tier")
            key = "reopen_100k_s" if args.reopen_blocks == 100_000 else "reopen_s"
            result["reopen_blocks"] = args.reopen_blocks
            result[key] = _reopen(base / "reopen", args.reopen_blocks)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return result


def _fio_version(fio: str | None) -> str:
    if fio is None:
        return ""
    done = subprocess.run([fio, "--version"], capture_output=True, text=True, check=False)
    return done.stdout.strip()


def _fio(
    fio: str, path: Path, rw: str, bs: int, n: int, jobs: int, depth: int, direct: bool
) -> float:
    """One sequential fio run over ``n`` slots of ``bs`` bytes split over ``jobs`` (each its
    own contiguous region of one file) at ``depth``; payload GB/s as fio measured it."""
    per_job = (n // jobs) * bs
    argv = [
        fio, "--name=raw", f"--filename={path}", f"--rw={rw}", f"--bs={bs}", f"--size={per_job}",
        f"--offset_increment={per_job}", f"--numjobs={jobs}", f"--iodepth={depth}",
        "--ioengine=libaio", f"--direct={int(direct)}", "--group_reporting",
        "--output-format=json", *(["--end_fsync=1"] if rw == "write" else []),
    ]  # fmt: skip
    if not direct and rw == "read":
        _drop_cache(path)
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"bench: fio failed ({' '.join(argv)}): {done.stderr[-500:]}")
    stats = json.loads(done.stdout)["jobs"][0][rw]
    return float(stats["bw_bytes"]) / 1e9


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class _TierBench:
    """Put and get_into n blocks through an NVMe tier, in batches."""

    def __init__(self, layout: KVLayout, d: Path, n: int, batch: int, workers: int) -> None:
        sb = slot_bytes_for(layout.block_bytes)
        rng = np.random.default_rng(0)
        self.sources = [
            rng.integers(0, 2**16, size=layout.block_shape, dtype=np.uint16).view(
                layout.storage_dtype
            )
            for _ in range(4)
        ]
        self.outs = [np.zeros(layout.block_shape, layout.storage_dtype) for _ in range(batch)]
        self.n, self.batch, self.dir = n, batch, d
        self.keys: list[BlockKey] = []
        self.tier = NVMeTier(
            layout, [d], n * sb, warm_restart=False, workers=workers, staging_bytes=workers * sb
        )

    def store(self) -> tuple[float, list[float]]:
        """Seconds for every put, and each block's latency (its put call's seconds)."""
        self.keys = [BlockKey(os.urandom(32)) for _ in range(self.n)]
        calls: list[float] = []
        t0 = time.perf_counter()
        for i in range(0, self.n, self.batch):
            ks = self.keys[i : i + self.batch]
            t1 = time.perf_counter()
            if not all(self.tier.put(ks, [self.sources[j % 4] for j in range(i, i + len(ks))])):
                raise RuntimeError("bench: put failed (see the log); is the disk full?")
            calls += [time.perf_counter() - t1] * len(ks)
        return time.perf_counter() - t0, calls

    def load(self) -> tuple[float, list[float]]:
        """Seconds for every get, and each block's latency (its get call's seconds)."""
        if not self.tier.o_direct:
            _drop_cache(self.dir / SLOTS_FILE)
        calls: list[float] = []
        t0 = time.perf_counter()
        for i in range(0, self.n, self.batch):
            ks = self.keys[i : i + self.batch]
            t1 = time.perf_counter()
            if not all(self.tier.get_into(ks, self.outs[: len(ks)])):
                raise RuntimeError("bench: a stored block did not load back")
            calls += [time.perf_counter() - t1] * len(ks)
            for j, o in enumerate(self.outs[: len(ks)]):
                if o[0, 0, 0].tobytes() != self.sources[(i + j) % 4][0, 0, 0].tobytes():
                    raise RuntimeError("bench: loaded bytes differ from stored bytes")
        return time.perf_counter() - t0, calls

    def clear(self) -> None:
        self.tier.delete(self.keys[::-1])  # so the next round reuses slots in ascending order


def _reopen(d: Path, blocks: int) -> float:
    """Seconds to reopen a tier whose index holds ``blocks`` blocks (tiny layout)."""
    small = KVLayout(layers=1, kv_heads=1, head_dim=8, block_tokens=16)
    cap = blocks * slot_bytes_for(small.block_bytes)
    block = np.zeros(small.block_shape, small.storage_dtype)
    tier = NVMeTier(small, [d], cap, warm_restart=False)
    try:
        step = 2048
        for i in range(0, blocks, step):
            m = min(step, blocks - i)
            tier.put([BlockKey(os.urandom(32)) for _ in range(m)], [block] * m)
    finally:
        tier.close()
    t0 = time.perf_counter()
    again = NVMeTier(small, [d], cap)
    elapsed = time.perf_counter() - t0
    held = again.usage().used_blocks
    again.close()
    if held != blocks:
        raise RuntimeError(f"bench: reopened tier holds {held} blocks, expected {blocks}")
    return elapsed
