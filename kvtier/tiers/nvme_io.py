"""The syscalls of the NVMe tier, as one seam (``SlotIO``: tests subclass it to inject faults),
and the two steps of replacing a file durably: ``replace_file`` (temp file, fsync, rename) and
``sync_dir`` (the directory fsync that makes the rename durable). ``is_full`` tells "out of
space" from a broken device. Used by ``kvtier.tiers.nvme_index`` (format and index) and
``nvme_device`` (opening a directory).
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path


class DirSyncError(OSError):
    """The directory fsync after a rename failed: the rename happened, but whether a crash
    keeps it is unknown. Never "out of space", whatever its errno."""


def is_full(exc: OSError) -> bool:
    """True for "out of space" (ENOSPC, EDQUOT): a full disk, not a broken one."""
    return exc.errno in (errno.ENOSPC, errno.EDQUOT) and not isinstance(exc, DirSyncError)


class SlotIO:
    """The syscalls the NVMe tier makes. Tests subclass it to inject faults (ENOSPC, EIO, ...).

    Every method raises ``OSError`` on failure; the tier turns that into misses.
    """

    def open(self, path: str, flags: int) -> int:
        return os.open(path, flags, 0o644)

    def pwrite(self, fd: int, buf: memoryview, offset: int) -> None:
        done = 0
        while done < len(buf):
            n = os.pwritev(fd, [buf[done:]], offset + done)
            if n <= 0:
                raise OSError(errno.EIO, "short write")
            done += n

    def pread(self, fd: int, buf: memoryview, offset: int) -> None:
        done = 0
        while done < len(buf):
            n = os.preadv(fd, [buf[done:]], offset + done)
            if n <= 0:
                raise OSError(errno.EIO, f"short read at offset {offset + done}")
            done += n

    def append(self, fd: int, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]

    def fdatasync(self, fd: int) -> None:
        os.fdatasync(fd)

    def fsync(self, fd: int) -> None:
        """A full fsync: of a temp file before its rename, of a directory after it."""
        os.fsync(fd)

    def allocate(self, fd: int, size: int) -> None:
        """Make the file exactly ``size`` bytes, with its blocks reserved on the device."""
        if os.fstat(fd).st_size > size:
            os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)


def replace_file(path: Path, data: bytes, io: SlotIO) -> None:
    """Write ``data`` to a temp file, fsync it and rename it over ``path`` (not yet durable:
    see ``sync_dir``). On ``OSError`` ``path`` is as it was and no temp file is left."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            io.append(fd, data)
            io.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)  # the old file stays valid; leave no partial temp
        raise


def sync_dir(directory: Path, io: SlotIO) -> None:
    """Make the renames in ``directory`` durable; raises ``DirSyncError`` if it cannot."""
    try:
        dfd = os.open(directory, os.O_RDONLY)
        try:
            io.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError as exc:
        raise DirSyncError(
            exc.errno, f"directory fsync failed: {exc.strerror}", str(directory)
        ) from exc
