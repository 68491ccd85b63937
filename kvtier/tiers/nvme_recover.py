"""Rebuilding an NVMe tier directory's index from its slot headers, and the slot scanner it
shares with ``kvtier check`` (``kvtier.tiers.nvme_check``).

``scan_slots`` reads a slot file front to back in large aligned reads (so the file may be open
with ``O_DIRECT``) and says, for each slot, what its header is and whether it is an intact block
of the directory's layout, trusting no index.

Every slot carries a self-describing header (key, layout fingerprint, payload length, payload
checksum; see ``kvtier.codec``), so a small metadata fault need not throw away a large, warm
cache. At open, a directory whose persisted index cannot be trusted (``index.snap`` damaged or
missing, ``index.log`` with a bad record before a good one, ``kvtier.meta`` that does not parse
and names no other layout) has its index rebuilt by ``rebuild``: the slot file is read front to
back (``scan_slots``) and a slot is kept only if its
header parses, names this tier's layout and its payload hashes to the header's checksum.
Anything else is left free. A meta that names another layout is a layout change: the directory
starts empty, as before, and no block of the old layout comes back.

A key found in two slots (a delete lost in a crash, then the same block put again) keeps its
lowest slot and the other is left free. Both verified, so either is a whole block written for
that key in this layout; choosing by position, not by what was read first or last, makes every
rebuild of the same file choose the same slot, so a rebuild interrupted by a crash and the one
after it agree.

A read error during the scan ends the rebuild with ``RebuildError``: a partial scan is never
taken for the index (it would forget every block after the error for good), so the directory
is degraded instead (the tier's fault contract for EIO) and the old files stay for the next open.

Crash safety: the rebuild only reads the slot file. The index then writes the result as a new
snapshot (temp file + fsync + rename) with a generation newer than any record of the old
journal, so a crash before the rename leaves the old, untrusted files (and the next open
rebuilds again) and a crash after it leaves a snapshot the old journal cannot change.

What comes back is a superset of what the lost index held: a block deleted since the last
snapshot whose slot was not reused yet is found again. Its bytes are still the verified bytes
of its key, so for a cache it is a correct hit.

Cost: one sequential read of the slot file (a few MiB per read; slots larger than that read
only the header page unless the header is of this layout) and one xxh3 pass over each block.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import xxhash

from kvtier import codec
from kvtier.tiers.nvme_index import ALIGN, META_FILE, DirMeta, Entry, SlotIO

log = logging.getLogger(__name__)
_FINGERPRINT = re.compile(rb'"fingerprint"\s*:\s*"([0-9a-f]+)"')  # as DirMeta.write puts it
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


class RebuildError(OSError):
    """A read error stopped the rebuild: the directory's blocks cannot be known."""


def meta_damaged(directory: Path, fingerprint: str) -> bool:
    """True if ``directory`` has a meta file that ``DirMeta.read`` rejects and that names no
    other layout, so its slot headers, not its meta, say which blocks are of ``fingerprint``
    (hex). A fingerprint still legible in a damaged meta and different is a layout change."""
    try:
        raw = (directory / META_FILE).read_bytes()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    named = _FINGERPRINT.search(raw)
    return named is None or named.group(1).decode() == fingerprint


def rebuild(directory: Path, fd: int, meta: DirMeta, io: SlotIO, reason: str) -> dict[int, Entry]:
    """The index of the slot file ``fd`` (``meta`` describes it and this tier), from its slot
    headers: local slot -> (key, payload checksum) for every intact block of this layout, each
    key once. Logs one warning line (why, how many blocks, how long). Reads only; a read error
    logs one error line and raises ``RebuildError`` (no partial result)."""
    t0 = time.monotonic()
    entries: dict[int, Entry] = {}
    seen: set[bytes] = set()
    rejected = duplicates = scanned = 0
    try:
        for s in scan_slots(fd, meta, io):
            scanned += 1
            if s.intact and s.header is not None:
                if s.header.key in seen:
                    duplicates += 1
                    continue
                seen.add(s.header.key)
                entries[s.local] = (s.header.key, s.header.checksum)
            elif not s.blank:
                rejected += 1
    except OSError as exc:
        log.error(
            "nvme tier: %s: %s; rebuilding its index from the slot headers stopped at slot %d "
            "of %d by a read error (%s): the directory is degraded, its blocks are misses",
            directory,
            reason,
            scanned,
            meta.n_slots,
            exc,
        )
        raise RebuildError(exc.errno, f"index rebuild: read error ({exc})") from exc
    log.warning(
        "nvme tier: %s: %s; rebuilt its index from the slot headers: %d blocks recovered, "
        "%d slots rejected, %d duplicates freed, in %.2fs",
        directory,
        reason,
        len(entries),
        rejected,
        duplicates,
        time.monotonic() - t0,
    )
    return entries
