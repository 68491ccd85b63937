"""``Lease``: a cached prefix held in place (pinned) between a lookup and the load that uses it.

An engine's scheduler promises the tokens a lookup found; the worker loads them later. A lease
makes the promise hold meanwhile: its blocks cannot be evicted until ``release()``. Leases are
cheap values; releasing one twice is a no-op, and a lease is also a context manager.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class Lease:
    """Blocks ``[start, end)`` (tokens) pinned until ``release()``. Thread-safe."""

    __slots__ = ("_lock", "_release", "end", "start")

    def __init__(self, start: int, end: int, release: Callable[[], None]) -> None:
        self.start = start
        self.end = end
        self._release: Callable[[], None] | None = release
        self._lock = threading.Lock()

    @property
    def tokens(self) -> int:
        """How many tokens the lease holds (``end - start``)."""
        return self.end - self.start

    @property
    def held(self) -> bool:
        return self._release is not None

    def release(self) -> None:
        """Unpin the blocks (idempotent)."""
        with self._lock:
            release, self._release = self._release, None
        if release is not None:
            release()

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "held" if self.held else "released"
        return f"Lease(start={self.start}, end={self.end}, {state})"
