"""The directories of an NVMe tier: opening one (lock, meta, preallocation, O_DIRECT probe,
index), noticing it vanish, closing it; and the slot table striped over them.

Global slot ``g`` lives in directory ``g % D`` at local slot ``g // D``.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from kvtier.errors import ConfigError
from kvtier.tiers.nvme_index import SLOTS_FILE, DirIndex, DirMeta, SlotIO, lock_directory

log = logging.getLogger(__name__)

ODirectMode = Literal["auto", "always", "never"]


@dataclass(slots=True)
class Device:
    """One directory of the tier. ``failed`` holds the reason once it is degraded."""

    index: int
    path: Path
    n_slots: int
    fd: int = -1
    lock_fd: int = -1
    dindex: DirIndex | None = None
    direct: bool = False
    failed: str = ""

    def open(self, meta: DirMeta, warm: bool, o_direct: ODirectMode, io: SlotIO) -> None:
        """Lock, describe, preallocate and open the directory and load (or reset) its index.

        ``meta`` describes the tier (its ``n_slots`` is replaced by this directory's). Raises
        ``OSError`` on I/O faults, ``TierLockedError`` if another process owns the directory,
        ``ConfigError`` if ``o_direct='always'`` cannot be honoured.
        """
        meta = replace(meta, n_slots=self.n_slots)
        self.path.mkdir(parents=True, exist_ok=True)
        self.lock_fd = lock_directory(self.path)
        old = DirMeta.read(self.path)
        if warm and old is not None and not old.compatible(meta):
            log.warning(
                "nvme tier: %s holds blocks of another layout; starting it empty", self.path
            )
        fresh = not warm or old is None or not old.compatible(meta)
        meta.write(self.path)
        path = str(self.path / SLOTS_FILE)
        fd = io.open(path, os.O_RDWR | os.O_CREAT)
        try:
            io.allocate(fd, self.n_slots * meta.slot_bytes)
        finally:
            os.close(fd)
        self.fd, self.direct = _open_slots(path, o_direct, io)
        self.dindex = DirIndex(self.path, self.n_slots, io, fresh=fresh)

    def check_linked(self) -> None:
        """Raise ``OSError`` if the slot file (or its directory) was removed underneath us."""
        if os.fstat(self.fd).st_nlink == 0:
            raise OSError(errno.ENOENT, "slot file or directory was removed")

    def close(self) -> None:
        """Snapshot the index (unless failed), close files, release the lock. Idempotent."""
        if self.dindex is not None:
            try:
                self.dindex.close(compact=not self.failed)
            except OSError as exc:
                log.error("nvme tier: %s: could not save the index on close (%s)", self.path, exc)
            self.dindex = None
        for fd in (self.fd, self.lock_fd):
            if fd >= 0:
                os.close(fd)
        self.fd = self.lock_fd = -1


def _open_slots(path: str, o_direct: ODirectMode, io: SlotIO) -> tuple[int, bool]:
    """Open the slot file with O_DIRECT if the filesystem takes it (probed by a read).

    Any refusal of the O_DIRECT open or probe (EINVAL on tmpfs and some network or FUSE
    filesystems) falls back to buffered I/O; the plain open then reports real faults.
    """
    if o_direct != "never":
        fd = -1
        try:
            fd = io.open(path, os.O_RDWR | os.O_DIRECT)
            io.pread(fd, memoryview(mmap.mmap(-1, 4096)), 0)
            return fd, True
        except OSError as exc:
            if fd >= 0:
                os.close(fd)
            if o_direct == "always":
                raise ConfigError(
                    f"nvme tier o_direct='always' but {path} refuses O_DIRECT ({exc}); "
                    f"use o_direct='auto' or another filesystem"
                ) from None
    return io.open(path, os.O_RDWR), False
