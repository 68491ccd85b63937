"""Rebuilding an NVMe tier directory's index from its slot headers.

Every slot carries a self-describing header (key, layout fingerprint, payload length, payload
checksum; see ``kvtier.codec``), so a small metadata fault need not throw away a large, warm
cache. At open, a directory whose persisted index cannot be trusted (``index.snap`` damaged or
missing, ``index.log`` with a bad record before a good one, ``kvtier.meta`` that does not parse
and names no other layout) has its index rebuilt by ``rebuild``: the slot file is read front to
back (``nvme_check.scan_slots``: the scanner ``kvtier check`` uses) and a slot is kept only if its
header parses, names this tier's layout and its payload hashes to the header's checksum.
Anything else is left free. A meta that names another layout is a layout change: the directory
starts empty, as before, and no block of the old layout comes back.

A key found in two slots (a delete lost in a crash, then the same block put again) keeps its
lowest slot and the other is left free. Both verified, so either is a whole block written for
that key in this layout; choosing by position, not by what was read first or last, makes every
rebuild of the same file choose the same slot, so a rebuild interrupted by a crash and the one
after it agree.

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
import re
import time
from pathlib import Path

from kvtier.tiers.nvme_check import scan_slots
from kvtier.tiers.nvme_index import META_FILE, DirMeta, Entry, SlotIO

log = logging.getLogger(__name__)
_FINGERPRINT = re.compile(rb'"fingerprint"\s*:\s*"([0-9a-f]+)"')  # as DirMeta.write puts it


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
    ends the scan, keeping the blocks verified before it."""
    t0 = time.monotonic()
    entries: dict[int, Entry] = {}
    seen: set[bytes] = set()
    rejected = duplicates = 0
    stopped = ""
    try:
        for s in scan_slots(fd, meta, io):
            if s.intact and s.header is not None:
                if s.header.key in seen:
                    duplicates += 1
                    continue
                seen.add(s.header.key)
                entries[s.local] = (s.header.key, s.header.checksum)
            elif not s.blank:
                rejected += 1
    except OSError as exc:
        stopped = f"; stopped early by a read error ({exc})"
    log.warning(
        "nvme tier: %s: %s; rebuilt its index from the slot headers: %d blocks recovered, "
        "%d slots rejected, %d duplicates freed, in %.2fs%s",
        directory,
        reason,
        len(entries),
        rejected,
        duplicates,
        time.monotonic() - t0,
        stopped,
    )
    return entries
