"""``SharedMemory``: one mapping of a shared-memory file, the memory every kvtier arena lives in.

The host tier's arena and the service's per-session staging regions are both one of these: a
file on the kernel's shared memory, mapped ``MAP_SHARED`` and read and written through numpy
views. Two kinds, chosen at creation:

- *anonymous* (``create(n)``): a ``memfd`` (an unlinked temp file where there is none). Only
  this process maps it; it is freed when the process ends, however it ends. Not limited by the
  size of ``/dev/shm`` (a container's is often 64 MiB).
- *named* (``create(n, path)``): a file under ``/dev/shm``, mode 0600 (0660 for a group), that
  other processes of the same user (or group) map with ``attach(path, n)``. The name outlives
  a process killed with SIGKILL: its creator removes a stale one before creating it again
  (``create(..., replace=True)``), and ``unlink`` removes it once nobody needs to attach.

Every page is allocated at creation (``posix_fallocate``; not with ``prefault=False``): a
shared-memory file that cannot hold its size is a ``ConfigError`` now, not a ``SIGBUS`` on the
first store into a page the filesystem has no room for; and the creator's mapping (and an
``attach`` with ``populate``) fills its page tables up front (``MAP_POPULATE``), so the hot
path never takes a page fault.

``array`` starts ``DATA_OFFSET`` (64) bytes into the mapping, not on its page boundary. Measured
on the host tier's own copies (a block's planes between an engine's ``[layers, 2, tokens, ...]``
array and a slot), glibc's ``memcpy`` is fastest when source and destination sit at the same
offset modulo 64 and slowest when the destination is 16 bytes past the source modulo 4096: a
page-aligned arena against a numpy array (16 bytes past a page: glibc's ``malloc`` header),
in the load direction. 64 bytes past is cache-line aligned as torch's tensors are (the engine
integrations' buffers; a large one starts 64 bytes past a page) and is not slow against either;
the numbers are in ``docs/benchmarks.md`` (host tier).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import tempfile

import numpy as np

from kvtier.errors import ConfigError
from kvtier.tiers.base import Array


def shm_dir() -> str:
    """Where named shared memory lives: ``/dev/shm`` (every Linux), else the temp directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


#: where ``array`` starts in the mapping: 64 bytes past a page boundary (module docstring)
DATA_OFFSET = 64


def _anonymous_fd() -> int:
    if hasattr(os, "memfd_create"):
        return os.memfd_create("kvtier-arena", os.MFD_CLOEXEC)
    fd, path = tempfile.mkstemp(prefix="kvtier-arena-")
    os.unlink(path)
    return fd


def _map(fd: int, nbytes: int, populate: bool) -> mmap.mmap:
    """``MAP_SHARED`` of the file; ``populate`` fills this process's page tables now
    (``MAP_POPULATE``), so no copy into it later takes a page fault per 4 KiB."""
    flags = mmap.MAP_SHARED
    if populate and hasattr(mmap, "MAP_POPULATE"):
        flags |= mmap.MAP_POPULATE
    return mmap.mmap(fd, nbytes, flags=flags)


def _allocate(fd: int, nbytes: int, where: str) -> None:
    """Give the file ``nbytes`` of real pages (``ConfigError`` if the filesystem is full)."""
    try:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, nbytes)
        else:  # no fallocate (macOS): sparse, pages come on first touch
            os.ftruncate(fd, nbytes)

    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise
        st = os.statvfs(os.path.dirname(where) or "/")
        raise ConfigError(
            f"shared memory {where}: cannot allocate {nbytes} bytes ({exc.strerror}; "
            f"{st.f_bavail * st.f_frsize} bytes free there): lower the host tier capacity, "
            "give the machine (or container: docker --shm-size) more shared memory, or set "
            '[service] data = "staging" so the arena is not shared'
        ) from None


class SharedMemory:
    """``nbytes`` of mapped shared memory; ``array`` is all of it as uint8.

    Not thread-safe for ``close``/``unlink``; the bytes themselves are the users' to guard."""

    __slots__ = ("_map", "array", "nbytes", "path")

    def __init__(self, mapping: mmap.mmap, nbytes: int, path: str | None) -> None:
        self._map: mmap.mmap | None = mapping
        self.nbytes = nbytes
        self.path = path  # None: anonymous
        self.array: Array = np.frombuffer(mapping, dtype=np.uint8, count=nbytes, offset=DATA_OFFSET)

    @classmethod
    def create(
        cls,
        nbytes: int,
        path: str | None = None,
        *,
        gid: int | None = None,
        replace: bool = False,
        prefault: bool = True,
    ) -> SharedMemory:
        """New zeroed shared memory: anonymous without ``path``, else the named file ``path``
        (mode 0600, 0660 with ``gid``; ``replace`` removes a stale file of that name first,
        else ``FileExistsError``). ``prefault``: allocate every page now (``ConfigError`` if
        the memory cannot be had); else pages come on first touch (sparse)."""
        if nbytes < 1:
            raise ConfigError(f"shared memory of {nbytes} bytes: need at least one byte")
        if path is None:
            fd = _anonymous_fd()
        else:
            if replace:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            if path is not None and gid is not None:
                os.fchown(fd, -1, gid)
                os.fchmod(fd, 0o660)
            if prefault:
                _allocate(fd, nbytes + DATA_OFFSET, path or os.path.join(shm_dir(), "memfd"))
            else:
                os.ftruncate(fd, nbytes + DATA_OFFSET)
            mapping = _map(fd, nbytes + DATA_OFFSET, prefault)
        except BaseException:
            if path is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            raise
        finally:
            os.close(fd)
        return cls(mapping, nbytes, path)

    @classmethod
    def attach(cls, path: str, nbytes: int, *, populate: bool = False) -> SharedMemory:
        """Map the named shared memory another process created (read-write); ``OSError`` if
        it cannot (missing, no permission, another size). ``populate``: fill this process's
        page tables for all of it now (a cost per page, paid at attach instead of at first
        touch)."""
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_size != nbytes + DATA_OFFSET:
                raise OSError(f"shared memory {path} does not hold {nbytes} bytes")
            mapping = _map(fd, nbytes + DATA_OFFSET, populate)
        finally:
            os.close(fd)
        return cls(mapping, nbytes, path)

    @property
    def closed(self) -> bool:
        return self._map is None

    def unlink(self) -> None:
        """Remove the name (mappings stay valid; the memory goes with the last). Idempotent."""
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def close(self) -> None:
        """Drop this process's mapping (idempotent). Views still alive keep it mapped until
        they go; the memory is freed when no process maps it and it has no name."""
        mapping, self._map = self._map, None
        if mapping is not None:
            self.array = np.empty(0, np.uint8)
            with contextlib.suppress(BufferError):  # a view still exported: freed with it
                mapping.close()
