"""The memory a Mooncake transfer moves: the staging arena, registrations, one batch's buffers.

``kvtier.tiers.mooncake`` decides what to move, ``kvtier.tiers.mooncake_engine`` talks to the
client; this module says where the bytes of a batched transfer lie:

- ``StagingArena``: fixed-size slots of one buffer registered with the transfer engine once,
  handed out per call (headers, strided blocks, encrypted values).
- ``Registrations``: long-lived buffers registered by their owner (a host arena, an engine's KV
  pool), and per-call registration of caller buffers outside them (transfers from unregistered
  memory are markedly slower).
- ``BatchBuffers``: the per-value buffer lists of one batched call. A plain block in a
  C-contiguous caller buffer moves zero-copy -- its payload is the caller's memory and only the
  64-byte header is staged (or sits in the buffer's ``codec.header_room``); anything else is one
  staging slot.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from kvtier import codec
from kvtier.tiers.base import Array


class StagingArena:
    """Fixed-size slots of one buffer (registered by the owner), handed out per call.

    Thread-safe; ``acquire`` blocks while every slot is in use.
    """

    def __init__(self, slot_bytes: int, nslots: int) -> None:
        self.slot_bytes = slot_bytes
        self.arena: Array = np.empty(slot_bytes * nslots, dtype=np.uint8)
        # touch every page now: a first touch costs up to ~7 ms per 2 MiB page in a VM, and
        # would land on whichever transfer first uses the slot
        self.arena.fill(0)
        self.base = int(self.arena.ctypes.data)
        self._free = list(range(nslots))
        self._cond = threading.Condition()

    def acquire(self, want: int) -> list[int]:
        """Between 1 and ``want`` free slots (waits for one if none is free)."""
        with self._cond:
            while not self._free:
                self._cond.wait()
            n = min(want, len(self._free))
            taken, self._free = self._free[:n], self._free[n:]
            return taken

    def release(self, slots: list[int]) -> None:
        with self._cond:
            self._free.extend(slots)
            self._cond.notify_all()

    def view(self, slot: int, nbytes: int) -> Array:
        off = slot * self.slot_bytes
        return self.arena[off : off + nbytes]

    def ptr(self, slot: int) -> int:
        return self.base + slot * self.slot_bytes


class Registrations:
    """Memory registered with one client's transfer engine. Thread-safe.

    ``pin`` registers a long-lived buffer until ``unpin``; ``for_call`` registers a caller buffer
    for one transfer unless a pinned buffer covers it (``release`` undoes those).
    """

    def __init__(self) -> None:
        self._pinned: dict[int, int] = {}  # ptr -> bytes
        self._lock = threading.Lock()

    def pin(self, client: Any, buf: Array) -> bool:
        ptr, n = int(buf.ctypes.data), int(buf.nbytes)
        if client is None or n == 0 or client.register_buffer(ptr, n) != 0:
            return False
        with self._lock:
            self._pinned[ptr] = n
        return True

    def unpin(self, client: Any, buf: Array) -> None:
        ptr = int(buf.ctypes.data)
        with self._lock:
            known = self._pinned.pop(ptr, None) is not None
        if known and client is not None:
            client.unregister_buffer(ptr)

    def for_call(self, client: Any, ptr: int, n: int, registered: list[int]) -> None:
        """Register ``[ptr, ptr+n)`` (noted in ``registered``) unless a pinned buffer covers it."""
        with self._lock:
            if any(p <= ptr and ptr + n <= p + size for p, size in self._pinned.items()):
                return
        if client.register_buffer(ptr, n) == 0:
            registered.append(ptr)

    @staticmethod
    def release(client: Any, registered: list[int]) -> None:
        for ptr in registered:
            client.unregister_buffer(ptr)

    def unpin_all(self, client: Any) -> None:
        with self._lock:
            ptrs, self._pinned = list(self._pinned), {}
        for ptr in ptrs:
            client.unregister_buffer(ptr)


class BatchBuffers:
    """The buffers of one batched transfer: per value, the ``ptrs``/``sizes`` the transfer
    engine reads from or writes into, in call order; and the caller memory registered for this
    call only, which ``release`` unregisters. One per call, not thread-safe."""

    __slots__ = ("_block_bytes", "_client", "_registered", "_regs", "_staging", "ptrs", "sizes")

    def __init__(
        self, client: Any, regs: Registrations, staging: StagingArena, block_bytes: int
    ) -> None:
        self.ptrs: list[list[int]] = []
        self.sizes: list[list[int]] = []
        self._registered: list[int] = []
        self._client = client
        self._regs = regs
        self._staging = staging
        self._block_bytes = block_bytes

    def in_place(self, flat: Array, slot: int, trailer: int = 0) -> tuple[Array, Array]:
        """Lay out one value whose payload is the caller's contiguous ``flat`` and return
        where its header and its ``trailer`` bytes (a MAC; none when 0) go. A framed buffer
        (``codec.frame``) is one buffer, header and trailer in its room; otherwise both are in
        staging slot ``slot`` and the value is two or three buffers."""
        h, n = codec.HEADER_BYTES, self._block_bytes
        ptr = int(flat.ctypes.data)
        full = codec.frame(flat)
        if full is not None:
            self._regs.for_call(self._client, ptr - h, h + n + trailer, self._registered)
            self.ptrs.append([ptr - h])
            self.sizes.append([h + n + trailer])
            return full[:h], full[h + n : h + n + trailer]
        self._regs.for_call(self._client, ptr, n, self._registered)
        base = self._staging.ptr(slot)
        room = self._staging.view(slot, h + trailer)
        if trailer:
            self.ptrs.append([base, ptr, base + h])
            self.sizes.append([h, n, trailer])
        else:
            self.ptrs.append([base, ptr])
            self.sizes.append([h, n])
        return room[:h], room[h:]

    def staged(self, slot: int, nbytes: int) -> None:
        """Lay out one value of ``nbytes`` held in staging slot ``slot``."""
        self.ptrs.append([self._staging.ptr(slot)])
        self.sizes.append([nbytes])

    def release(self) -> None:
        """Unregister the caller memory registered for this call."""
        self._regs.release(self._client, self._registered)
