"""On-disk format of one NVMe tier directory, and its persisted index.

A directory (one per device) holds::

    kvtier.lock   flock'ed by the process that owns the directory; holds its PID
    kvtier.meta   JSON: format version, layout fingerprint, block/slot bytes, slot count
    slots.dat     n_slots preallocated slots of ``slot_bytes`` (64-byte header + payload,
                  padded to 4096 so every slot is O_DIRECT aligned)
    index.snap    snapshot of the index: (slot, key, checksum) records + trailing xxh3
    index.log     append-only journal of 64-byte PUT/DEL records, each with its own xxh3

Crash safety is an ordering rule, not a recovery procedure:

1. A PUT record is appended only after the slot's bytes are durable (``fdatasync`` of the slot
   file), so the index never names a slot whose data may still be in flight.
2. A slot freed by a DEL is rewritten only after the DEL record is durable (``sync_dels``), so
   after a crash no index entry can point at a slot that was being overwritten.
3. The snapshot is written to a temp file, fsync'd and renamed; it carries a *generation*, and
   journal records of an older generation are ignored, so a crash between writing the snapshot
   and truncating the journal replays nothing twice. Once the rename is done the new generation
   is adopted whatever follows; a directory fsync that then fails (``DirSyncError``, whatever
   its errno) is an I/O fault, never "no room": the journal is kept and the caller must stop
   writing to the directory, since it cannot know which snapshot a crash would leave.

A torn or unparsable journal record (a crash mid-append) fails its own checksum and is skipped;
bad or partial records at the end are cut off (at open, or before the next append), and an
append that fails (a full disk) is cut back to the last whole record, so records always stay
64-byte aligned and a torn one never hides the valid ones written after it. A full disk only
ever costs the records that could not be written: a snapshot that does not fit leaves the
previous snapshot and the journal in place (and no ``.tmp`` behind), and DELs that do not fit
stay pending until the next append.
Whatever the index says, a read still verifies the slot header (key, layout) and the payload
checksum, so a damaged medium yields a miss, never wrong bytes.

An index that cannot be trusted (a snapshot that is damaged or missing, a journal with a bad
record before a good one: not what a crash leaves) is rebuilt from the slot headers by the
``rescan`` the tier passes in (``kvtier.tiers.nvme_recover``) and snapshotted at once, with a
generation newer than any record in the old journal.

The syscalls go through ``SlotIO`` (``kvtier.tiers.nvme_io``), the seam tests inject faults at.

Reopening replays one numpy ``frombuffer`` of the snapshot plus a journal bounded to a few times
the slot count, so 100k blocks reopen in well under a second.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

# the I/O seam lives in nvme_io; its names stay importable from here
from kvtier.tiers.nvme_io import DirSyncError as DirSyncError
from kvtier.tiers.nvme_io import SlotIO as SlotIO
from kvtier.tiers.nvme_io import is_full as is_full
from kvtier.tiers.nvme_io import replace_file, sync_dir

# the meta (and the slot geometry it describes) lives in nvme_meta; its names stay importable here
from kvtier.tiers.nvme_meta import ALIGN as ALIGN
from kvtier.tiers.nvme_meta import META_FILE as META_FILE
from kvtier.tiers.nvme_meta import META_VERSION as META_VERSION
from kvtier.tiers.nvme_meta import SLOTS_FILE as SLOTS_FILE
from kvtier.tiers.nvme_meta import DirMeta as DirMeta
from kvtier.tiers.nvme_meta import slot_bytes_for as slot_bytes_for

SNAP_FILE = "index.snap"
JOURNAL_FILE = "index.log"
LOCK_FILE = "kvtier.lock"

PUT, DEL = 1, 2
REC_DTYPE = np.dtype(
    [
        ("gen", "<u4"),
        ("op", "u1"),
        ("_p", "V3"),
        ("slot", "<u4"),
        ("key", "V32"),
        ("csum", "<u8"),
        ("_q", "V4"),
        ("rsum", "<u8"),
    ]
)
REC_BYTES = REC_DTYPE.itemsize
assert REC_BYTES == 64
_REC_BODY = REC_BYTES - 8
SNAP_DTYPE = np.dtype([("slot", "<u4"), ("key", "V32"), ("csum", "<u8")])
_SNAP_HEAD = struct.Struct("<4sIIQ")  # magic, version, generation, count
_SNAP_MAGIC = b"KVTS"

Entry = tuple[bytes, int]  # (key, payload checksum)


def index_reserve(n_slots: int) -> int:
    """Bytes the index of ``n_slots`` slots may need next to the slot file: a bounded journal
    plus a snapshot and its temp file while it is replaced."""
    return _journal_limit(n_slots) * REC_BYTES + 2 * (
        _SNAP_HEAD.size + 8 + n_slots * SNAP_DTYPE.itemsize
    )


def _journal_limit(n_slots: int) -> int:
    return max(4096, n_slots)


class DirIndex:
    """The persisted slot -> (key, checksum) map of one directory (snapshot + journal).

    ``entries`` is what the files say, with any DELs the journal could not take yet (a full
    disk) already applied. Methods raise ``OSError`` on I/O failure; a failed update leaves the
    journal as it was. Thread-safe: every method runs under one lock.
    """

    def __init__(
        self,
        directory: Path,
        n_slots: int,
        io: SlotIO,
        fresh: bool = False,
        tidy: bool = True,
        rescan: Callable[[str], dict[int, Entry]] | None = None,
        distrust: str = "",
    ) -> None:
        """Load (or with ``fresh``, discard) the index; ``tidy`` compacts a replayed journal.

        If the files cannot be trusted (or ``distrust`` says why not), ``rescan(reason)``, if
        given, supplies the entries instead (slot -> (key, checksum), each slot below
        ``n_slots``, each key once) and they are snapshotted (with ``tidy``); ``rebuilt`` then
        holds the reason."""
        self.directory = directory
        self.n_slots = n_slots
        self._io = io
        self._lock = threading.Lock()
        self._gen = 0
        self._unsynced_dels = 0
        self._records = 0  # in the journal
        self._size = 0  # bytes of whole records in the journal: where the next one goes
        self._torn = False  # the journal may hold a partial append beyond _size
        self._pending: list[tuple[int, int, bytes, int]] = []  # DELs not yet appended
        self._compact_at = _journal_limit(n_slots)
        self.entries: dict[int, Entry] = {}
        self.dropped = 0  # entries found invalid at load (duplicates, out of range)
        self.untrusted = ""  # why the files cannot be trusted ("" if they can)
        self.rebuilt = ""  # why the entries come from ``rescan``, not the files
        if fresh:
            for name in (SNAP_FILE, JOURNAL_FILE):
                (directory / name).unlink(missing_ok=True)
        else:
            newest, damage = self._load()
            self.untrusted = distrust or damage
            if self.untrusted and rescan is not None:
                self.rebuilt = self.untrusted
                self.entries = rescan(self.rebuilt)
                self.dropped = 0
                # the next snapshot must outrank every record of the old journal
                self._gen = max(self._gen, newest)
        self._jfd = io.open(str(directory / JOURNAL_FILE), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        if not tidy:
            return
        try:
            if self._torn:  # bad or partial records from a crash mid-append
                os.ftruncate(self._jfd, self._size)
                self._torn = False
            if self._records or self.dropped or fresh or self.rebuilt:
                self._compact_or_defer()
        except BaseException:
            os.close(self._jfd)
            raise

    # -- loading ---------------------------------------------------------------------------
    def _load(self) -> tuple[int, str]:
        """Load snapshot + journal into ``entries``; return the newest journal generation and
        why the result cannot be trusted ("" if it can)."""
        damage = ""
        path = self.directory / SNAP_FILE
        snap = _read_snapshot(path)
        if snap is None:
            damage = f"{SNAP_FILE} is {'damaged' if path.exists() else 'missing'}"
        else:
            self._gen, recs = snap
            for slot, key, csum in zip(
                recs["slot"].tolist(), recs["key"].tolist(), recs["csum"].tolist(), strict=True
            ):
                self.entries[slot] = (key, csum)
        try:
            raw = (self.directory / JOURNAL_FILE).read_bytes()
        except FileNotFoundError:
            raw = b""
        n = len(raw) // REC_BYTES
        self._records = n
        self._size = n * REC_BYTES
        self._torn = len(raw) != self._size
        newest = 0
        if n:
            recs = np.frombuffer(raw, REC_DTYPE, count=n)
            h = xxhash.xxh3_64_intdigest
            ok = np.asarray(
                [
                    h(raw[i * REC_BYTES : i * REC_BYTES + _REC_BODY]) == r
                    for i, r in enumerate(recs["rsum"].tolist())
                ],
                dtype=bool,
            )
            good = np.flatnonzero(ok)
            last = int(good[-1]) + 1 if good.size else 0  # records up to the last good one
            if good.size:
                newest = int(recs["gen"][good].max())
                # a crash tears only the end; a bad record before a good one is damage
                if not ok[: good[-1]].all():
                    damage = damage or f"{JOURNAL_FILE} has a damaged record"
            if last < n:  # bad records at the end: cut them off, or appends land after them
                self._records, self._size, self._torn = last, last * REC_BYTES, True
            live = recs[ok & (recs["gen"] == self._gen)]
            for op, slot, key, csum in zip(
                live["op"].tolist(),
                live["slot"].tolist(),
                live["key"].tolist(),
                live["csum"].tolist(),
                strict=True,
            ):
                if op == PUT:
                    self.entries[slot] = (key, csum)
                elif op == DEL and self.entries.get(slot, (b"",))[0] == key:
                    del self.entries[slot]
        # a key in two slots (a DEL lost in a crash): keep one, both hold its bytes
        seen: dict[bytes, int] = {}
        for slot in sorted(self.entries):
            key = self.entries[slot][0]
            if slot >= self.n_slots:
                del self.entries[slot]
                self.dropped += 1
                continue
            prev = seen.get(key)
            if prev is not None:
                del self.entries[prev]
                self.dropped += 1
            seen[key] = slot
        return newest, damage

    # -- updates ---------------------------------------------------------------------------
    def record_put(self, items: list[tuple[int, bytes, int]]) -> None:
        """Record (slot, key, checksum) of blocks whose bytes are already durable."""
        with self._lock:
            self._append([(PUT, s, k, c) for s, k, c in items])
            for slot, key, csum in items:
                self.entries[slot] = (key, csum)
            self._maybe_compact()

    def record_del(self, items: list[tuple[int, bytes]]) -> None:
        """Record that these (slot, key) pairs are gone; see ``sync_dels`` before reusing.

        ``entries`` forgets them even if the append fails; the records then stay pending and
        go out with the next append (or snapshot)."""
        with self._lock:
            for slot, key in items:
                if self.entries.get(slot, (b"",))[0] == key:
                    del self.entries[slot]
            self._pending += [(DEL, s, k, 0) for s, k in items]
            self._unsynced_dels += len(items)
            self._append([])
            self._maybe_compact()

    def sync_dels(self) -> None:
        """Make recorded DELs durable (pending ones appended first); call before overwriting a
        slot freed since the last sync."""
        with self._lock:
            if self._pending:
                self._append([])
            if self._unsynced_dels:
                self._io.fdatasync(self._jfd)
                self._unsynced_dels = 0

    def sync(self) -> None:
        """Make every record appended so far (and pending DELs) durable: a power loss then
        keeps them too, not only a crash of the process (their bytes are in the page cache)."""
        with self._lock:
            if self._pending:
                self._append([])
            self._io.fdatasync(self._jfd)
            self._unsynced_dels = 0

    def compact(self) -> None:
        """Write a snapshot of ``entries`` (new generation) and empty the journal."""
        with self._lock:
            self._compact()

    def close(self, compact: bool = True) -> None:
        """Snapshot (unless ``compact`` is False, e.g. the device failed) and close the journal.

        If the snapshot cannot be written, the previous snapshot and the journal still hold
        everything recorded (pending DELs aside) and the ``OSError`` is raised."""
        with self._lock:
            try:
                if compact:
                    self._compact()
            finally:
                os.close(self._jfd)

    def _append(self, items: list[tuple[int, int, bytes, int]]) -> None:
        """Append pending DELs then ``items`` as (op, slot, key, checksum) records, in one write.

        On failure the journal is cut back to its last whole record: a partial append would
        otherwise misalign, and so hide, every record written after it."""
        items = self._pending + items
        if not items:
            return
        if self._torn:
            os.ftruncate(self._jfd, self._size)
            self._torn = False
        recs = np.zeros(len(items), REC_DTYPE)
        recs["gen"] = self._gen
        recs["op"] = [op for op, _, _, _ in items]
        recs["slot"] = [s for _, s, _, _ in items]
        recs["key"] = [k for _, _, k, _ in items]
        recs["csum"] = [c for _, _, _, c in items]
        rows = recs.view(np.uint8).reshape(len(items), REC_BYTES)
        recs["rsum"] = [
            xxhash.xxh3_64_intdigest(rows[i, :_REC_BODY].tobytes()) for i in range(len(items))
        ]
        try:
            self._io.append(self._jfd, recs.tobytes())
        except BaseException:
            try:
                os.ftruncate(self._jfd, self._size)
            except OSError:
                self._torn = True  # cut it before the next append
            raise
        self._pending = []
        self._size += recs.nbytes
        self._records += len(items)

    def _maybe_compact(self) -> None:
        if self._records > self._compact_at:
            self._compact_or_defer()

    def _compact_or_defer(self) -> None:
        """Compact, or if the disk is full keep the journal and try again after as many more
        records: it still holds everything, and a snapshot is no reason to fail an update."""
        try:
            self._compact()
        except OSError as exc:
            if not is_full(exc):
                raise
            self._compact_at = self._records + _journal_limit(self.n_slots)

    def _compact(self) -> None:
        recs = np.zeros(len(self.entries), SNAP_DTYPE)
        if self.entries:
            slots = sorted(self.entries)
            recs["slot"] = slots
            recs["key"] = [self.entries[s][0] for s in slots]
            recs["csum"] = [self.entries[s][1] for s in slots]
        gen = (self._gen + 1) & 0xFFFFFFFF
        body = _SNAP_HEAD.pack(_SNAP_MAGIC, META_VERSION, gen, len(recs)) + recs.tobytes()
        trailer = struct.pack("<Q", xxhash.xxh3_64_intdigest(body))
        replace_file(self.directory / SNAP_FILE, body + trailer, self._io)
        # the new snapshot is in place: records of the old generation are ignored from now on,
        # so later ones must carry the new one, even if the directory fsync fails (which keeps
        # the journal: the old snapshot may be what a crash leaves)
        self._gen = gen
        sync_dir(self.directory, self._io)
        # the snapshot is durable: pending DELs are moot
        self._pending = []
        self._unsynced_dels = 0
        self._compact_at = _journal_limit(self.n_slots)
        os.ftruncate(self._jfd, 0)
        self._size = 0
        self._torn = False
        self._records = 0


def _read_snapshot(path: Path) -> tuple[int, np.ndarray[Any, np.dtype[Any]]] | None:
    """(generation, records) of a valid snapshot, or None if absent or damaged."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    if len(raw) < _SNAP_HEAD.size + 8:
        return None
    body, (trailer,) = raw[:-8], struct.unpack("<Q", raw[-8:])
    magic, version, gen, count = _SNAP_HEAD.unpack_from(body)
    if (
        magic != _SNAP_MAGIC
        or version != META_VERSION
        or xxhash.xxh3_64_intdigest(body) != trailer
        or len(body) != _SNAP_HEAD.size + count * SNAP_DTYPE.itemsize
    ):
        return None
    return gen, np.frombuffer(body, SNAP_DTYPE, count=count, offset=_SNAP_HEAD.size)
