"""Local NVMe tier (G3): preallocated slot files, O_DIRECT, striped over directories.

Each directory (one per device) holds one preallocated file of fixed-size slots; global slot
``g`` lives in directory ``g % D`` at local slot ``g // D``, so consecutive puts alternate
devices. A slot is a 64-byte ``codec`` header (key, layout fingerprint, payload checksum) plus
the payload, padded to 4096 bytes, so reads and writes are whole aligned slots and go through
``O_DIRECT`` where the filesystem allows it (probed at open; where it does not, e.g. tmpfs, one
warning line and buffered I/O). Bytes move through page-aligned ``mmap`` staging buffers with the
fused ``codec.copy_in``/``copy_out`` copy+checksum, on a small pool of worker threads
(``preadv``/``pwritev`` release the GIL), one task per block of a batch.

Persistence and crash safety are described in ``kvtier.tiers.nvme_index``: a put is reported
``True`` only after its bytes are durable *and* its index record is written; a reopen (warm
restart, the default) rebuilds the key map from the persisted index in well under a second for
100k blocks; ``warm_restart=False`` starts empty. A persisted index that cannot be trusted (a
damaged or missing snapshot, a damaged journal, a meta that does not parse) costs a scan, not
the cache: the directory's index is rebuilt from the slot headers, keeping every block of this
layout whose payload verifies (``nvme_recover``; one warning line). Every read verifies the slot
header and the payload checksum, so a torn, stale or foreign slot is a miss and is dropped.

Faults. A directory that cannot be opened (a regular file, under one, not writable, too small
for its slot file, an I/O error) is a configuration mistake: the constructor raises
``ConfigError`` naming it and the reason, after releasing what it opened and undoing what it
did in *every* directory (files and directories it created removed, a slot file it grew shrunk
back, files that were there kept). After a successful open nothing raises. A full disk (ENOSPC
or EDQUOT from the index journal, a snapshot or the slot file) is not a fault: the put that hit
it is reported False, one warning line, and that directory refuses puts while every block it
already holds stays readable; every ``FULL_RETRY_S`` seconds puts may try again, and the first
one that is journaled makes it take puts again. A snapshot that does not fit on close leaves
the previous one and the journal, so a reopen recovers everything. Any other fault (EIO,
EACCES, the directory removed underneath, a directory fsync failing after a snapshot rename, a
read error while rebuilding an untrusted index at open) marks that directory degraded: one
error log line, its blocks become misses, and puts go to the remaining directories, sticky
for the life of the tier (reopen to retry). ``healthy`` means "a put can succeed now": True
while at least one directory takes puts, so the store keeps demoting to the directories with
room, and False once every directory is full (until its retry time) or degraded. Caller
mistakes raise (``LayoutError``, ``ConfigError``, and ``TierLockedError`` when another
process owns a directory).

Thread-safety: all data methods may be called concurrently; ``close`` must not race them.

Modules: this one moves bytes; ``nvme_device`` opens and tracks the directories,
``nvme_index`` is the on-disk format and persisted index, ``nvme_check`` the slot scanner and
integrity checker, ``nvme_recover`` the index rebuild from the slot headers.
"""

from __future__ import annotations

import logging
import mmap
import queue
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import numpy as np

from kvtier import codec
from kvtier.config import check_keys, parse_bool, parse_int, parse_size
from kvtier.errors import ConfigError, LayoutError
from kvtier.keys import BlockKey, key_hex
from kvtier.layout import KVLayout
from kvtier.tiers import nvme_device
from kvtier.tiers.base import Array
from kvtier.tiers.memory import require_memory
from kvtier.tiers.nvme_device import Device, ODirectMode
from kvtier.tiers.nvme_index import (
    ALIGN,
    DirIndex,
    DirMeta,
    SlotIO,
    is_full,
    slot_bytes_for,
)
from kvtier.tiers.slots import SLOT_TABLE_BYTES, SlotTable, SlotTier

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_HB = codec.HEADER_BYTES
#: memory one slot takes once it holds a block: its ``SlotTable`` slot, its checksum, and its
#: entry in the persisted index's map (``DirIndex.entries``, measured as the table's is)
_INDEX_BYTES_PER_SLOT = SLOT_TABLE_BYTES + 8 + 184


class _Buf:
    """A page-aligned staging buffer of one slot (anonymous mmap), as bytes and as an array."""

    __slots__ = ("arr", "mv")

    def __init__(self, nbytes: int) -> None:
        self.mv = memoryview(mmap.mmap(-1, nbytes))
        self.arr: Array = np.frombuffer(self.mv, dtype=np.uint8)
        self.arr.fill(0)  # fault the pages in now, not on the first put


class _Job(NamedTuple):
    i: int  # position in the caller's batch
    key: BlockKey
    data: Array  # the caller's block (put) or destination (get)
    slot: int  # global slot
    dev: Device


class NVMeTier(SlotTier):
    """Blocks in preallocated slot files over ``paths`` (one directory per device)."""

    name = "nvme"
    persistent = True
    layer_reads = True

    def __init__(
        self,
        layout: KVLayout,
        paths: Sequence[str | Path],
        capacity_bytes: int,
        *,
        warm_restart: bool = True,
        o_direct: ODirectMode = "auto",
        workers: int = 4,
        staging_bytes: int = 512 << 20,
        io: SlotIO | None = None,
    ) -> None:
        super().__init__(layout)
        if not paths:
            raise ConfigError("nvme tier needs at least one directory in paths")
        if o_direct not in ("auto", "always", "never"):
            raise ConfigError(f"nvme tier o_direct must be auto/always/never, got {o_direct!r}")
        self.slot_bytes = slot_bytes_for(self.block_bytes)
        n = capacity_bytes // self.slot_bytes
        if n < len(paths):
            raise ConfigError(
                f"nvme tier capacity {capacity_bytes} bytes holds {n} slots of {self.slot_bytes} "
                f"bytes, fewer than the {len(paths)} directories; raise capacity"
            )
        # the in-memory index must fit, then the directories' space, before anything is taken
        require_memory("nvme tier capacity", capacity_bytes, n * _INDEX_BYTES_PER_SLOT)
        self._io = io or SlotIO()
        self._fp = layout.fingerprint
        self._closed = False
        nd = len(paths)
        self._devs = [Device(d, Path(p), len(range(d, n, nd))) for d, p in enumerate(paths)]
        for dev in self._devs:  # before the table below is allocated
            dev.check_space(self.slot_bytes)
        self._table = SlotTable(n)
        self._checksums = np.zeros(n, dtype=np.uint64)
        nw = max(1, min(workers, staging_bytes // self.slot_bytes))
        self._staging: queue.SimpleQueue[_Buf] = queue.SimpleQueue()
        for _ in range(nw):
            self._staging.put(_Buf(self.slot_bytes))
        self._pool = ThreadPoolExecutor(max_workers=nw, thread_name_prefix="kvtier-nvme")
        # layer reads: the aligned range covering one layer is at most its size plus one page
        # on each side (O_DIRECT offsets and lengths are multiples of ALIGN)
        self._layer_staging: queue.SimpleQueue[_Buf] = queue.SimpleQueue()
        cover = -(-layout.layer_block_bytes // ALIGN) * ALIGN + 2 * ALIGN
        for _ in range(nw):
            self._layer_staging.put(_Buf(min(cover, self.slot_bytes)))
        meta = DirMeta(self._fp.hex(), self.block_bytes, self.slot_bytes, 0)
        try:
            restored: dict[BlockKey, int] = {}
            for dev in self._devs:
                dev.open(meta, warm_restart, o_direct, self._io)
                if dev.failed:  # opened degraded (its index could not be rebuilt)
                    continue
                for local, (key, csum) in self._index(dev).entries.items():
                    g = local * nd + dev.index
                    restored[BlockKey(key)] = g
                    self._checksums[g] = csum
            self._table.restore(restored)
            for dev in self._devs:
                if dev.failed:
                    self._table.purge(self._on(dev))
        except BaseException:
            # leave every directory as this open found it, not just the one that failed
            self._closed = True
            self._pool.shutdown(wait=True)
            for dev in self._devs:
                dev.abandon()
            raise
        buffered = [str(d.path) for d in self._devs if not d.direct]
        if buffered and o_direct == "auto":
            log.warning("nvme tier: O_DIRECT unsupported on %s; using buffered I/O", buffered)

    @classmethod
    def from_config(cls, layout: KVLayout, spec: Mapping[str, Any]) -> NVMeTier:
        """``{"paths": [...], "capacity": "200GiB", "warm_restart": true, "o_direct": "auto",
        "workers": 4}``; ``paths`` and ``capacity`` are required (the files are preallocated)."""
        check_keys("tiers.nvme", spec, {"paths", "capacity", "warm_restart", "o_direct", "workers"})
        paths = spec.get("paths")
        if isinstance(paths, str | Path):
            paths = [paths]
        if not paths:
            raise ConfigError('tiers.nvme needs paths, e.g. paths = ["/mnt/nvme0/kvtier"]')
        if not isinstance(paths, list | tuple) or not all(
            isinstance(p, str | Path) and str(p) for p in paths
        ):
            raise ConfigError(f"tiers.nvme paths must be a list of directories, got {paths!r}")
        if "capacity" not in spec:
            raise ConfigError('tiers.nvme needs a capacity, e.g. capacity = "200GiB"')
        mode = str(spec.get("o_direct", "auto"))
        if mode not in ("auto", "always", "never"):
            raise ConfigError(f"tiers.nvme o_direct must be auto/always/never, got {mode!r}")
        return cls(
            layout,
            [str(p) for p in paths],
            parse_size(spec["capacity"], "tiers.nvme capacity"),
            warm_restart=parse_bool(spec.get("warm_restart", True), "tiers.nvme warm_restart"),
            o_direct=mode,  # type: ignore[arg-type]
            workers=parse_int(spec.get("workers", 4), "tiers.nvme workers", 1, 1024),
        )

    # -- queries -----------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        """A put can succeed now: some directory is neither degraded nor full (or its retry
        time has come). One full or degraded directory of several does not stop puts (they go
        to the others), so it does not make the tier unhealthy."""
        now = time.monotonic()
        return any(d.accepting(now) for d in self._devs)

    @property
    def o_direct(self) -> bool:
        """True if every healthy directory uses O_DIRECT."""
        return all(d.direct for d in self._devs if not d.failed)

    # -- data --------------------------------------------------------------------------------
    def put(
        self, keys: Sequence[BlockKey], blocks: Sequence[Array], tenant: str = ""
    ) -> list[bool]:
        self.check_buffers(blocks, keys)
        now = time.monotonic()
        for dev in self._devs:  # a full directory due to retry gets its parked slots back
            self._table.restock(dev.unpark(now))
        result = [False] * len(keys)
        jobs: list[_Job] = []
        for i, (key, block) in enumerate(zip(keys, blocks, strict=True)):
            slot = self._reserve(key)
            if slot == -1:
                result[i] = True
            elif slot is not None:
                jobs.append(_Job(i, key, block, slot, self._dev(slot)))
        if not jobs:
            return result
        try:
            # a slot freed since the last sync is overwritten only once its DEL is durable
            ready = {
                d.index
                for d in self._ready(jobs)
                if self._guard(d, "journal sync", self._index(d).sync_dels)
            }
            jobs_ready = [j for j in jobs if j.dev.index in ready]
            sums = self._run([partial(self._write_one, j) for j in jobs_ready])
            done = [(j, s) for j, s in zip(jobs_ready, sums, strict=True) if s is not None]
            devs = list({j.dev.index: j.dev for j, _ in done}.values())
            synced = self._run(
                [
                    partial(self._guard, d, "fdatasync", partial(self._io.fdatasync, d.fd))
                    for d in devs
                ]
            )
            nd = len(self._devs)
            recorded = set()
            for dev, ok in zip(devs, synced, strict=True):
                items = [(j.slot // nd, bytes(j.key), s) for j, s in done if j.dev is dev]
                record = partial(self._index(dev).record_put, items)
                if ok and not dev.failed and self._guard(dev, "index write", record):
                    recorded.add(dev.index)
                    if dev.full:
                        log.warning("nvme tier: %s has room again; taking puts", dev.path)
                        self._table.restock(dev.clear_full())
            for j, s in done:
                if j.dev.index in recorded:
                    self._checksums[j.slot] = s
                    self._table.publish(j.key, j.slot)
                    result[j.i] = True
        finally:
            for j in jobs:
                if not result[j.i]:
                    (self._table.retire if j.dev.failed else self._table.abort)(j.key, j.slot)
        return result

    def get_into(
        self, keys: Sequence[BlockKey], outs: Sequence[Array], tenant: str = ""
    ) -> list[bool]:
        self.check_buffers(outs, keys)
        result = [False] * len(keys)
        jobs, got = self._read_pinned(keys, outs, self._read_one)
        bad = []
        for j, ok in zip(jobs, got, strict=True):
            result[j.i] = ok is True
            if ok is False:
                log.warning(
                    "nvme tier: block %s in %s failed verification; dropped",
                    key_hex(j.key),
                    j.dev.path,
                )
                bad.append(j.key)
        if bad:
            self.delete(bad)
        return result

    def _read_pinned(
        self, keys: Sequence[BlockKey], outs: Sequence[Array], read: Callable[[_Job], _T]
    ) -> tuple[list[_Job], list[_T]]:
        """Pin the present keys' slots, run ``read`` for those on healthy directories on the
        I/O threads, unpin; return the jobs run and their results, in order."""
        pinned: list[_Job] = []
        try:
            for i, (key, out) in enumerate(zip(keys, outs, strict=True)):
                slot = self._table.acquire(key)
                if slot is not None:
                    pinned.append(_Job(i, key, out, slot, self._dev(slot)))
            live = {d.index for d in self._ready(pinned)}
            jobs = [j for j in pinned if j.dev.index in live]
            got = self._run([partial(read, j) for j in jobs])
        finally:
            for j in pinned:
                self._table.release(j.slot)
        return jobs, got

    def get_layer_into(
        self, keys: Sequence[BlockKey], layer: int, outs: Sequence[Array], tenant: str = ""
    ) -> list[int | None]:
        """Read the aligned range covering layer ``layer`` of each slot (one pread per block,
        O_DIRECT where the directory allows it) into ``outs``; unverified, with the block's
        recorded checksum (``None``: absent, I/O error, or a layer-0 header that does not
        match)."""
        n = self.layout.layer_block_bytes
        if len(outs) != len(keys) or any(o.nbytes != n for o in outs):
            raise LayoutError(f"nvme: need one buffer of {n} bytes (one layer) per key")
        if not 0 <= layer < self.layout.layers:
            raise LayoutError(f"nvme: layer {layer} out of range 0..{self.layout.layers - 1}")
        result: list[int | None] = [None] * len(keys)
        jobs, got = self._read_pinned(keys, outs, partial(self._read_layer, layer=layer))
        for j, csum in zip(jobs, got, strict=True):
            result[j.i] = csum
        return result

    def delete(self, keys: Sequence[BlockKey], tenant: str = "") -> None:
        pinned: list[tuple[BlockKey, int]] = []
        nd = len(self._devs)
        try:
            by_dev: dict[int, list[tuple[int, bytes]]] = {}
            for key in keys:
                slot = self._table.acquire(key)
                if slot is not None:
                    pinned.append((key, slot))
                    by_dev.setdefault(slot % nd, []).append((slot // nd, bytes(key)))
            for d, items in by_dev.items():
                dev = self._devs[d]
                if not dev.failed:
                    self._guard(dev, "index write", partial(self._index(dev).record_del, items))
            for key, _ in pinned:
                self._table.remove(key)
        finally:
            for _, slot in pinned:
                self._table.release(slot)

    def sync(self) -> None:
        """fdatasync each healthy directory's journal: every put reported True (its bytes were
        synced before its record was written) then survives a power loss. A directory whose
        sync fails is marked full or degraded (``_guard``), as for any write."""
        for dev in self._devs:
            if not dev.failed and dev.dindex is not None:
                self._guard(dev, "journal sync", self._index(dev).sync)

    def close(self) -> None:
        """Finish in-flight work, snapshot each index, release files and locks. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        for dev in self._devs:
            dev.close()

    # -- internals ---------------------------------------------------------------------------
    def _dev(self, slot: int) -> Device:
        return self._devs[slot % len(self._devs)]

    def _reserve(self, key: BlockKey) -> int | None:
        """A slot for ``key`` on a directory that takes puts; -1 if ``key`` is present or being
        written; None if there is none. Slots of a full or failed directory are set aside."""
        while True:
            slot = self._table.reserve(key)
            if slot is None or slot < 0 or not self._dev(slot).park(slot):
                return slot
            self._table.retire(key, slot)

    def _on(self, dev: Device) -> Callable[[int], bool]:
        nd, d = len(self._devs), dev.index
        return lambda s: s % nd == d

    def _run(self, tasks: list[Callable[[], _T]]) -> list[_T]:
        """Run tasks on the worker pool (inline when there is only one) and return results."""
        if len(tasks) == 1:
            return [tasks[0]()]
        futures = [self._pool.submit(t) for t in tasks]
        return [f.result() for f in futures]

    @staticmethod
    def _index(dev: Device) -> DirIndex:
        assert dev.dindex is not None, "a device without an index is marked failed"
        return dev.dindex

    def _ready(self, jobs: Sequence[_Job]) -> list[Device]:
        """The devices of ``jobs`` that are healthy and whose slot file still exists."""
        devs = {j.dev.index: j.dev for j in jobs}.values()
        return [d for d in devs if not d.failed and self._guard(d, "stat", d.check_linked)]

    def _guard(self, dev: Device, what: str, fn: Callable[[], object]) -> bool:
        """Run ``fn``; on ``OSError`` mark ``dev`` full or failed and return False."""
        try:
            fn()
            return True
        except OSError as exc:
            self._fault(dev, what, exc)
            return False

    def _fault(self, dev: Device, what: str, exc: OSError) -> None:
        """Out of space: ``dev`` refuses puts for a while, keeping its blocks; else it fails."""
        if not is_full(exc):
            self._fail(dev, what, exc)
        elif dev.set_full(f"{what}: {exc}"):
            log.warning(
                "nvme tier: %s is out of space (%s: %s); refusing puts there, retrying every "
                "%gs; the blocks it holds stay readable",
                dev.path,
                what,
                exc,
                nvme_device.FULL_RETRY_S,
            )

    def _fail(self, dev: Device, what: str, exc: OSError) -> None:
        if not dev.set_failed(f"{what}: {exc}"):
            return
        log.error(
            "nvme tier: %s degraded after %s error (%s); its blocks are now misses",
            dev.path,
            what,
            exc,
        )
        self._table.purge(self._on(dev))

    def _write_one(self, job: _Job) -> int | None:
        """Stage, checksum and write one block; its checksum, or None on an I/O error."""
        if job.dev.failed:
            return None
        buf = self._staging.get()
        try:
            payload = buf.arr[_HB : _HB + self.block_bytes]
            csum = codec.copy_in(payload, job.data)
            buf.mv[:_HB] = codec.pack_header(job.key, self._fp, self.block_bytes, csum)
            self._io.pwrite(job.dev.fd, buf.mv, (job.slot // len(self._devs)) * self.slot_bytes)
            return csum
        except OSError as exc:
            self._fault(job.dev, "write", exc)
            return None
        finally:
            self._staging.put(buf)

    def _read_one(self, job: _Job) -> bool | None:
        """True: verified hit; False: slot does not verify; None: I/O error."""
        buf = self._staging.get()
        try:
            off = (job.slot // len(self._devs)) * self.slot_bytes
            try:
                self._io.pread(job.dev.fd, buf.mv, off)
            except OSError as exc:
                self._fail(job.dev, "read", exc)
                return None
            h = codec.unpack_header(buf.mv[:_HB])
            expected = int(self._checksums[job.slot])
            if not codec.header_matches(h, job.key, self._fp, self.block_bytes) or (
                h is not None and h.checksum != expected
            ):
                return False
            return codec.copy_out(job.data, buf.arr[_HB : _HB + self.block_bytes]) == expected
        finally:
            self._staging.put(buf)

    def _read_layer(self, job: _Job, layer: int) -> int | None:
        """Layer ``layer`` of one slot into ``job.data``; the recorded checksum or None."""
        n = self.layout.layer_block_bytes
        start = _HB + layer * n  # within the slot
        lo = start // ALIGN * ALIGN
        hi = -(-(start + n) // ALIGN) * ALIGN
        buf = self._layer_staging.get()
        try:
            off = (job.slot // len(self._devs)) * self.slot_bytes + lo
            try:
                self._io.pread(job.dev.fd, buf.mv[: hi - lo], off)
            except OSError as exc:
                self._fail(job.dev, "read", exc)
                return None
            expected = int(self._checksums[job.slot])
            if lo == 0:  # the header is in range: check it too
                h = codec.unpack_header(buf.mv[:_HB])
                if not codec.header_matches(h, job.key, self._fp, self.block_bytes) or (
                    h is not None and h.checksum != expected
                ):
                    return None
            src = buf.arr[start - lo : start - lo + n]
            np.copyto(job.data, src.view(job.data.dtype).reshape(job.data.shape), casting="no")
            return expected
        finally:
            self._layer_staging.put(buf)
