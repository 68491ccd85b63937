"""Integrity check of an NVMe tier directory (``kvtier check DIR [--fix]``).

``check_dir`` reads every slot (``nvme_recover.scan_slots``, trusting no index) and sorts it
into one of:

- **ok**: indexed, header names the indexed key and this layout, payload hashes to the checksum;
- **torn**: indexed but does not verify (the tier would serve a miss and drop it);
- **orphan**: not indexed but holds a header of this layout (a write that never reached the
  index, e.g. a crash between the data and the index record, or a block whose delete was
  recorded): harmless, the space is reused, and an index rebuild would find it again if it
  verifies;
- **foreign**: not indexed, non-zero, and not a block of this layout (another format version or
  model, or garbage);
- **free**: not indexed and never written (zero header).

An index that cannot be trusted (``index.snap`` damaged or missing, a bad record in the middle
of ``index.log``) is a problem of its own: the slots are then sorted against an index that lacks
blocks a warm open would recover by rebuilding it. Plain ``check`` reports it ("index damaged:
open the tier to rebuild it"); ``fix`` first rebuilds the index from the slot headers exactly as
an open does (``nvme_recover.rebuild``).

With ``fix`` the torn entries are removed from the index and the headers of the slots that do
not verify (torn, foreign, and orphans whose payload does not match) are zeroed. An orphan that
verifies, or a torn entry whose slot holds another verifying block of this layout, is left as
it is: it is harmless, and it is what a rebuild would recover. So ``fix`` never destroys a
block that an open could serve, and a second check reports no problems. The check takes the
directory lock, so it cannot run beside a live tier (``TierLockedError``). It needs no layout:
the directory's ``kvtier.meta`` describes it.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

from kvtier import codec
from kvtier.errors import ConfigError
from kvtier.tiers.nvme_device import lock_directory
from kvtier.tiers.nvme_index import META_FILE, META_VERSION, SLOTS_FILE, DirIndex, DirMeta, SlotIO
from kvtier.tiers.nvme_recover import rebuild, scan_slots

_HB = codec.HEADER_BYTES


@dataclass(slots=True)
class CheckReport:
    """Counts of slots by state, how many were fixed, and whether the index can be trusted."""

    directory: str
    ok: int = 0
    torn: int = 0
    orphan: int = 0
    foreign: int = 0
    free: int = 0
    fixed: int = 0
    damaged: str = ""  # why the persisted index cannot be trusted ("" if it can)
    rebuilt: bool = False  # ``fix`` rebuilt the damaged index from the slot headers

    @property
    def problems(self) -> int:
        """Torn and foreign slots (damage or data that is not this tier's), plus one for a
        damaged index not rebuilt. Orphans are not counted: they are what evictions and
        crashes normally leave (harmless, reused)."""
        return self.torn + self.foreign + (1 if self.damaged and not self.rebuilt else 0)

    def as_dict(self) -> dict[str, int | str]:
        return asdict(self)

    def __str__(self) -> str:
        s = (
            f"{self.directory}: {self.ok} ok, {self.torn} torn, {self.orphan} orphan, "
            f"{self.foreign} foreign, {self.free} free"
        )
        s += f" ({self.fixed} fixed)" if self.fixed else ""
        if self.rebuilt:
            return s + f"; index rebuilt from the slot headers ({self.damaged})"
        if self.damaged:
            return s + f"; index damaged ({self.damaged}): open the tier to rebuild it"
        return s


def check_dir(directory: str | Path, fix: bool = False) -> CheckReport:
    """Verify every slot of ``directory``; with ``fix``, rebuild a damaged index and drop what
    does not verify (never a block an open could serve).

    Raises ``ConfigError`` if the directory is not an NVMe tier directory, its ``kvtier.meta``
    is invalid (``DirMeta.load``: the same reader the tier uses) or it cannot be read, and
    ``TierLockedError`` if a tier holds it. Read-only unless ``fix``.
    """
    directory = Path(directory)
    meta = DirMeta.load(directory)  # the tier's own validating reader
    if meta.version != META_VERSION:
        raise ConfigError(
            f"{directory / META_FILE} is format version {meta.version}; this kvtier checks "
            f"version {META_VERSION} (use the kvtier that wrote it)"
        )
    report = CheckReport(str(directory))
    lock_fd = lock_directory(directory)
    try:
        with contextlib.ExitStack() as stack:
            fd = os.open(directory / SLOTS_FILE, os.O_RDWR if fix else os.O_RDONLY)
            stack.callback(os.close, fd)
            rescan = partial(rebuild, directory, fd, meta, SlotIO()) if fix else None
            index = DirIndex(directory, meta.n_slots, SlotIO(), tidy=False, rescan=rescan)
            stack.callback(index.close, compact=fix)
            report.damaged, report.rebuilt = index.untrusted, bool(index.rebuilt)
            bad, zap = _classify(fd, meta, index, report)
            if fix:
                if bad:
                    index.record_del(bad)
                for local in zap:
                    os.pwrite(fd, bytes(_HB), local * meta.slot_bytes)
                os.fdatasync(fd)
                report.fixed = len(zap)
    except OSError as exc:
        raise ConfigError(f"{directory} cannot be checked: {exc}") from None
    finally:
        os.close(lock_fd)
    return report


def _classify(
    fd: int, meta: DirMeta, index: DirIndex, report: CheckReport
) -> tuple[list[tuple[int, bytes]], list[int]]:
    """Classify every slot into ``report``; return (torn index entries, slots to zero): every
    slot that does not verify, but no intact block of this layout."""
    bad: list[tuple[int, bytes]] = []
    zap: list[int] = []
    for s in scan_slots(fd, meta, SlotIO()):
        entry = index.entries.get(s.local)
        if entry is not None:
            if s.intact and s.header is not None and (s.header.key, s.header.checksum) == entry:
                report.ok += 1
                continue
            report.torn += 1
            bad.append((s.local, entry[0]))
        elif s.blank:
            report.free += 1
            continue
        elif s.ours:
            report.orphan += 1
        else:
            report.foreign += 1
        if not s.intact:
            zap.append(s.local)
    return bad, zap
