"""Integrity check of an NVMe tier directory (``kvtier check DIR [--fix]``), and the slot
scanner it shares with the index rebuild (``kvtier.tiers.nvme_recover``).

``scan_slots`` reads a slot file front to back in large aligned reads (so the file may be open
with ``O_DIRECT``) and says, for each slot, what its header is and whether it is an intact block
of the directory's layout, trusting no index. ``check_dir`` sorts every slot into one of:

- **ok**: indexed, header names the indexed key and this layout, payload hashes to the checksum;
- **torn**: indexed but does not verify (the tier would serve a miss and drop it);
- **orphan**: not indexed but holds a header of this layout (a write that never reached the
  index, e.g. a crash between the data and the index record, or a block whose delete was
  recorded): harmless, the space is reused;
- **foreign**: not indexed, non-zero, and not a block of this layout (another format version or
  model, or garbage);
- **free**: not indexed and never written (zero header).

With ``fix`` the torn entries are removed from the index and the headers of torn, orphan and
foreign slots are zeroed, so a second check reports only ok and free. The check takes the
directory lock, so it cannot run beside a live tier (``TierLockedError``). It needs no layout:
the directory's ``kvtier.meta`` describes it.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import xxhash

from kvtier import codec
from kvtier.errors import ConfigError
from kvtier.tiers.nvme_index import (
    ALIGN,
    META_FILE,
    SLOTS_FILE,
    DirIndex,
    DirMeta,
    SlotIO,
    lock_directory,
)

_HB = codec.HEADER_BYTES
SCAN_BYTES = 4 << 20  # one read of a scan: a few MiB, sequential, a multiple of ALIGN


class SlotScan(NamedTuple):
    """What one slot holds, read without trusting any index."""

    local: int  # slot number within the directory
    header: codec.Header | None  # None: no kvtier header (never written, garbage, past EOF)
    blank: bool  # all-zero header, or the slot lies past the end of the file: never written
    ours: bool  # the header names the directory's layout (fingerprint and payload length)
    intact: bool  # ours, and the payload hashes to the header's checksum


def scan_slots(
    fd: int, meta: DirMeta, io: SlotIO, chunk_bytes: int = SCAN_BYTES
) -> Iterator[SlotScan]:
    """Read the ``meta.n_slots`` slots of the slot file ``fd`` in order, one ``SlotScan`` each.

    Slots up to ``chunk_bytes`` are read several per ``pread`` (at least ``chunk_bytes``, at most
    twice that); a larger slot has its header page read, then, only if the header is of this
    layout, its payload in ``chunk_bytes`` pieces. Buffers, offsets and lengths are
    ``ALIGN``-aligned. Slots past the end of the file are blank. Reads only; raises ``OSError``
    from a read.
    """
    fp = bytes.fromhex(meta.fingerprint)
    sb, bb = meta.slot_bytes, meta.block_bytes
    chunk = max(ALIGN, chunk_bytes // ALIGN * ALIGN)
    per = -(-chunk // sb) if sb <= chunk else 0  # slots per read (>= chunk); 0: several reads
    n = min(meta.n_slots, os.fstat(fd).st_size // sb)
    buf = memoryview(mmap.mmap(-1, per * sb if per else chunk))

    def judge(local: int, head: memoryview, payload: memoryview | None) -> SlotScan:
        h = codec.unpack_header(head)
        if h is None or h.fingerprint != fp or h.payload_len != bb:
            return SlotScan(local, h, not any(head), False, False)
        if payload is None:  # a large slot: stream its payload in (reusing ``buf``)
            got = _stream_sum(fd, io, buf, local * sb, bb)
        else:
            got = codec.checksum(payload)
        return SlotScan(local, h, False, True, got == h.checksum)

    for first in range(0, n, max(per, 1)):
        if per:
            m = min(per, n - first)
            io.pread(fd, buf[: m * sb], first * sb)
            for i in range(m):
                base = i * sb
                yield judge(first + i, buf[base : base + _HB], buf[base + _HB : base + _HB + bb])
        else:
            io.pread(fd, buf[:ALIGN], first * sb)
            yield judge(first, buf[:_HB], None)
    for local in range(n, meta.n_slots):
        yield SlotScan(local, None, True, False, False)


def _stream_sum(fd: int, io: SlotIO, buf: memoryview, off: int, bb: int) -> int:
    """xxh3 of the ``bb`` payload bytes of the slot at ``off``, read ``len(buf)`` at a time."""
    h = xxhash.xxh3_64()
    end = -(-(_HB + bb) // ALIGN) * ALIGN  # the payload's last page; the rest is padding
    for pos in range(0, end, len(buf)):
        ln = min(len(buf), end - pos)
        io.pread(fd, buf[:ln], off + pos)
        h.update(buf[max(0, _HB - pos) : min(ln, _HB + bb - pos)])
    return int(h.intdigest())


@dataclass(slots=True)
class CheckReport:
    """Counts of slots by state, and how many were fixed."""

    directory: str
    ok: int = 0
    torn: int = 0
    orphan: int = 0
    foreign: int = 0
    free: int = 0
    fixed: int = 0

    @property
    def problems(self) -> int:
        """Torn and foreign slots: damage or data that is not this tier's. Orphans are not
        counted: they are what evictions and crashes normally leave (harmless, reused)."""
        return self.torn + self.foreign

    def as_dict(self) -> dict[str, int | str]:
        return asdict(self)

    def __str__(self) -> str:
        s = (
            f"{self.directory}: {self.ok} ok, {self.torn} torn, {self.orphan} orphan, "
            f"{self.foreign} foreign, {self.free} free"
        )
        return s + (f" ({self.fixed} fixed)" if self.fixed else "")


def check_dir(directory: str | Path, fix: bool = False) -> CheckReport:
    """Verify every slot of ``directory``; with ``fix``, drop what does not verify.

    Raises ``ConfigError`` if the directory is not an NVMe tier directory and
    ``TierLockedError`` if a tier holds it. Read-only unless ``fix``.
    """
    directory = Path(directory)
    meta = DirMeta.read(directory)
    if meta is None:
        raise ConfigError(f"{directory} is not a kvtier NVMe tier directory (no valid {META_FILE})")
    report = CheckReport(str(directory))
    lock_fd = lock_directory(directory)
    try:
        index = DirIndex(directory, meta.n_slots, SlotIO(), tidy=False)
        fd = os.open(directory / SLOTS_FILE, os.O_RDWR if fix else os.O_RDONLY)
        try:
            bad, zap = _classify(fd, meta, index, report)
            if fix:
                if bad:
                    index.record_del(bad)
                for local in zap:
                    os.pwrite(fd, bytes(_HB), local * meta.slot_bytes)
                os.fdatasync(fd)
                report.fixed = len(zap)
        finally:
            os.close(fd)
            index.close(compact=fix)
    finally:
        os.close(lock_fd)
    return report


def _classify(
    fd: int, meta: DirMeta, index: DirIndex, report: CheckReport
) -> tuple[list[tuple[int, bytes]], list[int]]:
    """Classify every slot into ``report``; return (torn index entries, slots to zero)."""
    bad: list[tuple[int, bytes]] = []
    zap: list[int] = []
    for s in scan_slots(fd, meta, SlotIO()):
        entry = index.entries.get(s.local)
        if entry is not None:
            if s.intact and s.header is not None and (s.header.key, s.header.checksum) == entry:
                report.ok += 1
            else:
                report.torn += 1
                bad.append((s.local, entry[0]))
                zap.append(s.local)
        elif s.blank:
            report.free += 1
        else:
            if s.ours:
                report.orphan += 1
            else:
                report.foreign += 1
            zap.append(s.local)
    return bad, zap
