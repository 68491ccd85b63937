"""The directories of an NVMe tier: opening one (lock, preallocation, O_DIRECT probe, index,
meta), its state (healthy, full, failed), noticing it vanish, closing it.

Global slot ``g`` lives in directory ``g % D`` at local slot ``g // D``.

A directory that cannot be opened is a configuration problem: ``open`` raises ``ConfigError``
naming it and the reason, and leaves nothing behind; ``abandon`` undoes a successful ``open``
the same way when a later directory of the tier fails to open. After a successful open, a full
disk (ENOSPC, EDQUOT) makes the directory *full*: it refuses puts, keeps serving what it holds,
and lets puts try again every ``FULL_RETRY_S`` seconds; any other fault makes it *failed* for
good. While it is full, each of its slots a put draws from the shared free list is set aside
(``park``) and the put draws again; after each failed retry they are all free again, so parking
them costs O(its free slots) per retry window (at worst in one put).

A warm open whose index cannot be trusted (a damaged or missing snapshot, a damaged journal, a
meta that does not parse) rebuilds it from the slot headers (``nvme_recover``); a read error
during that rebuild opens the directory *failed* (an I/O fault, not a configuration mistake).
A meta of another layout, or none at all, starts the directory empty.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import threading
import time
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Literal

from kvtier.errors import ConfigError, TierLockedError
from kvtier.tiers.nvme_index import (
    JOURNAL_FILE,
    LOCK_FILE,
    META_FILE,
    SLOTS_FILE,
    SNAP_FILE,
    DirIndex,
    DirMeta,
    SlotIO,
    index_reserve,
    is_full,
)
from kvtier.tiers.nvme_recover import RebuildError, meta_damaged, rebuild

log = logging.getLogger(__name__)

ODirectMode = Literal["auto", "always", "never"]
FULL_RETRY_S = 5.0  # how long a full directory refuses puts before it lets them try again
_OURS = (SLOTS_FILE, META_FILE, JOURNAL_FILE, SNAP_FILE, LOCK_FILE)


@dataclass(slots=True)
class Device:
    """One directory of the tier. ``failed`` holds the reason once it is degraded (sticky);
    ``full`` the reason while it is out of space, with slots handed out for it ``parked``.
    The state methods are thread-safe."""

    index: int
    path: Path
    n_slots: int
    fd: int = -1
    lock_fd: int = -1
    dindex: DirIndex | None = None
    direct: bool = False
    failed: str = ""
    full: str = ""
    full_at: float = 0.0  # time.monotonic() of the last out-of-space error
    parked: list[int] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _undo: _Undo | None = field(default=None, repr=False)  # what ``abandon`` must undo

    # -- state ---------------------------------------------------------------------------------
    def accepting(self, now: float) -> bool:
        """Not failed, and not full or its retry time has come."""
        return not self.failed and (not self.full or now - self.full_at >= FULL_RETRY_S)

    def park(self, slot: int) -> bool:
        """Keep ``slot`` (just reserved, then retired) off the free list while this directory
        refuses puts; False if it takes puts now (use the slot)."""
        if not self.full and not self.failed:
            return False  # the common case, without the lock
        with self._lock:
            if self.accepting(time.monotonic()):
                return False
            if not self.failed:
                self.parked.append(slot)
            return True

    def unpark(self, now: float, force: bool = False) -> list[int]:
        """The parked slots, now free again, if this directory takes puts (or ``force``)."""
        if not self.parked:
            return []
        with self._lock:
            if not (force or self.accepting(now)):
                return []
            slots, self.parked = self.parked, []
            return slots

    def set_full(self, reason: str) -> bool:
        """Mark the directory out of space; True if it was not already."""
        with self._lock:
            first = not self.full and not self.failed
            self.full, self.full_at = reason, time.monotonic()
            return first

    def clear_full(self) -> list[int]:
        """Space again: take puts; return the parked slots to free."""
        with self._lock:
            self.full = ""
        return self.unpark(0.0, force=True)

    def set_failed(self, reason: str) -> bool:
        """Mark the directory degraded for good; True if it was not already."""
        with self._lock:
            if self.failed:
                return False
            self.failed, self.parked = reason, []
            return True

    # -- files ---------------------------------------------------------------------------------
    def open(self, meta: DirMeta, warm: bool, o_direct: ODirectMode, io: SlotIO) -> None:
        """Lock, preallocate and open the directory, load (or reset) its index, describe it.

        ``meta`` describes the tier (its ``n_slots`` is replaced by this directory's). Raises
        ``ConfigError`` naming the directory and the reason if it cannot be used (not a
        directory, no permission, not enough free space for the slot file, an I/O error) or if
        ``o_direct='always'`` cannot be honoured, and ``TierLockedError`` if another process owns
        it; either way it first undoes what it did (``abandon``). A read error while rebuilding
        an untrusted index is not raised: the directory opens ``failed``, with no index.
        """
        self._undo = _Undo(_missing(self.path))
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self.lock_fd = lock_directory(self.path)
            self._undo.slots_size = _size(self.path / SLOTS_FILE)
            self._undo.existed = {n for n in _NAMES if os.path.lexists(self.path / n)}
            self._undo.meta = DirMeta.read(self.path)
            self._open(replace(meta, n_slots=self.n_slots), warm, o_direct, io)
        except BaseException as exc:
            self.abandon()
            if isinstance(exc, OSError):
                raise ConfigError(
                    f"nvme tier directory {self.path} cannot be used: {_why(exc)}; "
                    f"fix the directory or choose another one in tiers.nvme paths"
                ) from None
            raise

    def _open(self, meta: DirMeta, warm: bool, o_direct: ODirectMode, io: SlotIO) -> None:
        old = DirMeta.read(self.path)
        distrust = ""  # why the index must be rebuilt from the slot headers
        if not warm:
            fresh = True
        elif old is not None:
            fresh = not old.compatible(meta)
            if fresh:
                log.warning(
                    "nvme tier: %s holds blocks of another layout; starting it empty", self.path
                )
        else:  # no meta: a new directory; one that does not parse: the slot headers tell
            fresh = not meta_damaged(self.path, meta.fingerprint)
            distrust = "" if fresh else f"{META_FILE} does not parse"
        path = str(self.path / SLOTS_FILE)
        fd = io.open(path, os.O_RDWR | os.O_CREAT)
        try:
            self._allocate(fd, meta.slot_bytes, io)
        finally:
            os.close(fd)
        self.fd, self.direct = _open_slots(path, o_direct, io)
        rescan = partial(rebuild, self.path, self.fd, meta, io)
        try:
            self.dindex = DirIndex(
                self.path, self.n_slots, io, fresh=fresh, rescan=rescan, distrust=distrust
            )
        except RebuildError as exc:  # logged by ``rebuild``; the old files stay for a reopen
            self.set_failed(f"index rebuild: {exc}")
            return
        if old != meta:  # last: a reopen on a full disk rewrites nothing
            meta.write(self.path)

    def check_space(self, slot_bytes: int) -> None:
        """Raise ``ConfigError`` if the filesystem the directory is (or would be) on cannot
        hold its slot file and index: a check before anything is created or allocated (the
        one in ``open`` is authoritative). Creates nothing; a path it cannot stat is left to
        ``open`` to report."""
        probe = self.path
        while not os.path.lexists(probe) and probe != probe.parent:
            probe = probe.parent
        try:
            st = os.statvfs(probe)
            have = _size_on_disk(self.path / SLOTS_FILE) if probe == self.path else 0
        except OSError:
            return
        grow = self.n_slots * slot_bytes - have
        if grow > 0 and grow + index_reserve(self.n_slots) > st.f_bavail * st.f_frsize:
            raise self._no_room(slot_bytes, st.f_bavail * st.f_frsize, "no space")

    def _no_room(self, slot_bytes: int, free: int, why: str) -> ConfigError:
        return ConfigError(
            f"nvme tier directory {self.path} cannot hold its {self.n_slots} slots: they "
            f"need {self.n_slots * slot_bytes} bytes (plus {index_reserve(self.n_slots)} for "
            f"the index) but the filesystem has {free} bytes free ({why}); lower tiers.nvme "
            f"capacity or free space"
        )

    def _allocate(self, fd: int, slot_bytes: int, io: SlotIO) -> None:
        """Preallocate the slot file, refusing up front what the filesystem cannot hold."""
        size = self.n_slots * slot_bytes
        grow = size - os.fstat(fd).st_blocks * 512
        try:
            if grow > 0:
                st = os.statvfs(self.path)
                if grow + index_reserve(self.n_slots) > st.f_bavail * st.f_frsize:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            io.allocate(fd, size)
        except OSError as exc:
            if not is_full(exc):
                raise
            st = os.statvfs(self.path)
            raise self._no_room(slot_bytes, st.f_bavail * st.f_frsize, exc.strerror or "") from None

    def abandon(self) -> None:
        """Undo ``open`` (it failed, or another directory of the tier did): close everything
        without a snapshot, remove the files it created (and the directories, if it created
        them), shrink back a slot file it grew and put back a meta it rewrote. Files that were
        there before stay, and so does a lock file it created in a directory that was there
        (removing a lock file others may hold open is racy). Idempotent."""
        undo, self._undo = self._undo, None
        if self.dindex is not None:
            with contextlib.suppress(OSError):
                self.dindex.close(compact=False)
            self.dindex = None
        if self.fd >= 0:
            os.close(self.fd)
        if undo is not None:
            with contextlib.suppress(OSError):
                if self.lock_fd >= 0:  # only the lock holder may touch the files
                    undo.restore(self.path)
                for d in undo.made:
                    d.rmdir()  # fails, harmlessly, on a directory someone else filled meanwhile
        if self.lock_fd >= 0:
            os.close(self.lock_fd)
        self.fd = self.lock_fd = -1

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
                if is_full(exc):
                    log.warning(
                        "nvme tier: %s: no room for an index snapshot on close (%s); "
                        "the previous snapshot and the journal still hold it",
                        self.path,
                        exc,
                    )
                else:
                    log.error(
                        "nvme tier: %s: could not save the index on close (%s)", self.path, exc
                    )
            self.dindex = None
        for fd in (self.fd, self.lock_fd):
            if fd >= 0:
                os.close(fd)
        self.fd = self.lock_fd = -1


def lock_directory(directory: Path) -> int:
    """Take the directory's exclusive lock; return its fd (close it to release).

    Raises ``TierLockedError`` naming the directory and the holder's PID if another process
    (or another tier in this process) holds it.
    """
    path = directory / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise TierLockedError(
            f"NVMe tier directory {directory} is in use by process {holder} (lock {path}); "
            f"stop that process or give this one a different directory"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    try:  # the PID is for the error message above; a full disk must not stop a reopen
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as exc:
        if not is_full(exc):
            os.close(fd)
            raise
    return fd


_NAMES = tuple(n for name in _OURS for n in (name, f"{name}.tmp"))


@dataclass(slots=True)
class _Undo:
    """What an ``open`` found, so that ``abandon`` can put it back."""

    made: list[Path]  # the directories it creates, deepest first
    slots_size: int | None = None  # the slot file's size (-1: absent; None: not reached)
    existed: set[str] = field(default_factory=set)  # which of our files were there
    meta: DirMeta | None = None  # the meta that was there, if it parsed

    def restore(self, path: Path) -> None:
        """Put ``path`` (locked by us) back as it was, as far as it can be."""
        if self.made:  # the directory is ours: everything in it goes
            names = list(_NAMES)
        elif self.slots_size is None:
            return  # the open stopped before touching any file but the lock
        else:
            names = [n for n in _NAMES if n not in self.existed and n != LOCK_FILE]
        for name in names:
            (path / name).unlink(missing_ok=True)
        slots, size = path / SLOTS_FILE, self.slots_size
        if size is not None and 0 <= size < _size(slots):
            os.truncate(slots, size)
        if self.meta is not None and DirMeta.read(path) != self.meta:
            self.meta.write(path)


def _missing(path: Path) -> list[Path]:
    """``path`` and its ancestors that do not exist yet, deepest first."""
    made = []
    while not os.path.lexists(path) and path != path.parent:
        made.append(path)
        path = path.parent
    return made


def _size_on_disk(path: Path) -> int:
    """Bytes allocated to the file at ``path``; 0 if there is none."""
    try:
        return os.stat(path).st_blocks * 512
    except FileNotFoundError:
        return 0


def _size(path: Path) -> int:
    """The size of the file at ``path``; -1 if there is none."""
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return -1


def _why(exc: OSError) -> str:
    """The reason an open failed, in the user's terms."""
    if exc.errno == errno.EEXIST:
        return "it exists and is not a directory"
    if exc.errno == errno.ENOTDIR:
        return f"part of the path is not a directory ({exc.strerror})"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"permission denied on {exc.filename or 'it'} (run as a user who may write it)"
    if exc.errno == errno.EROFS:
        return "it is on a read-only filesystem"
    return f"{exc.strerror or exc} ({exc.filename})" if exc.filename else str(exc)


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
