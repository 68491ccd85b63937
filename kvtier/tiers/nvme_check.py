"""Integrity check of an NVMe tier directory (``kvtier check DIR [--fix]``).

Reads every slot and sorts it into one of:

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

import os
from dataclasses import asdict, dataclass
from pathlib import Path

from kvtier import codec
from kvtier.errors import ConfigError
from kvtier.tiers.nvme_index import (
    META_FILE,
    SLOTS_FILE,
    DirIndex,
    DirMeta,
    SlotIO,
    lock_directory,
)

_HB = codec.HEADER_BYTES


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
        return self.torn + self.orphan + self.foreign

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
            bad, zap = _scan(fd, meta, index, report)
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


def _scan(
    fd: int, meta: DirMeta, index: DirIndex, report: CheckReport
) -> tuple[list[tuple[int, bytes]], list[int]]:
    """Classify every slot into ``report``; return (torn index entries, slots to zero)."""
    fp = bytes.fromhex(meta.fingerprint)
    bb, sb = meta.block_bytes, meta.slot_bytes
    bad: list[tuple[int, bytes]] = []
    zap: list[int] = []
    for local in range(meta.n_slots):
        entry = index.entries.get(local)
        if entry is not None:
            key, csum = entry
            raw = os.pread(fd, _HB + bb, local * sb)
            h = codec.unpack_header(raw)
            if (
                codec.header_matches(h, key, fp, bb)
                and h is not None
                and h.checksum == csum
                and len(raw) == _HB + bb
                and codec.checksum(raw[_HB:]) == csum
            ):
                report.ok += 1
            else:
                report.torn += 1
                bad.append((local, key))
                zap.append(local)
            continue
        head = os.pread(fd, _HB, local * sb)
        h = codec.unpack_header(head)
        if not any(head):
            report.free += 1
            continue
        if h is not None and h.fingerprint == fp and h.payload_len == bb:
            report.orphan += 1
        else:
            report.foreign += 1
        zap.append(local)
    return bad, zap
