"""The Mooncake client side of the Mooncake tier: connecting, error codes, registered memory.

``kvtier.tiers.mooncake`` decides what to move; this module holds what it takes to talk to a
``MooncakeDistributedStore`` client from the PyPI wheel ``mooncake-transfer-engine-non-cuda``:

- ``connect``: create and set up a client with a bounded RPC timeout (the client reads it from
  the environment at setup, so setups are serialized) and without the wheel's ~20 setup retries.
- error codes (mooncake-store ``ErrorCode``) and ``check_down``, which tells an expected outcome
  (not found, no space, a lease, a foreign size) from an unreachable master (``ServerDown``).
- ``StagingArena``: fixed-size slots of one buffer registered with the transfer engine once,
  handed out per call (headers, strided blocks, encrypted values).
- ``Registrations``: long-lived buffers registered by their owner (a host arena, an engine's KV
  pool), and per-call registration of caller buffers outside them (transfers from unregistered
  memory are markedly slower).
"""

from __future__ import annotations

import importlib.util
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.tiers.base import Array

OBJECT_NOT_FOUND = -704
BUFFER_TOO_SMALL = -600  # the stored object is larger than our buffers: foreign
TRANSFER_FAIL = -800
RPC_FAIL = -900  # master unreachable
RPC_TIMEOUT = -901  # master hung or overloaded past rpc_timeout_s
NO_SPACE = -200
OBJECT_HAS_LEASE = -706
LEASE_EXPIRED = -707
_EXPECTED = frozenset(
    {OBJECT_NOT_FOUND, BUFFER_TOO_SMALL, TRANSFER_FAIL, NO_SPACE, OBJECT_HAS_LEASE, LEASE_EXPIRED}
)
_ENV_LOCK = threading.Lock()  # MC_RPC_TIMEOUT_MS is process-global: one setup at a time


class ServerDown(Exception):
    """Raised inside a breaker-guarded call when the master is unreachable."""


def package_binary(name: str) -> Path | None:
    """A binary shipped in the ``mooncake`` package (``mooncake_master``, ``mooncake_client``)."""
    spec = importlib.util.find_spec("mooncake")
    for loc in (spec.submodule_search_locations or []) if spec is not None else []:
        p = Path(loc) / name
        if p.is_file():
            return p
    return None


def connect(setup_args: Sequence[Any], rpc_timeout_s: float) -> tuple[Any, int]:
    """A ``MooncakeDistributedStore`` and its ``setup(*setup_args)`` return code (0 = ready).

    On a non-zero code the client is already closed. Never raises for an unreachable master.
    """
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # the client logs every call at INFO
    os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")  # else ~20 x 4 s when down
    from mooncake.store import MooncakeDistributedStore

    with _ENV_LOCK:  # the client reads its RPC timeout from the environment at setup
        os.environ["MC_RPC_TIMEOUT_MS"] = str(max(1, int(rpc_timeout_s * 1000)))
        client = MooncakeDistributedStore()
        rc = int(client.setup(*setup_args))
    if rc != 0:
        client.close()
    return client, rc


def check_down(client: Any, codes: Sequence[int], master: str) -> None:
    """Raise ``ServerDown`` if a code is an unexpected error and the master is unreachable.

    Expected outcomes (not found, no space, leases, a foreign size) never cost a ping.
    """
    odd = [c for c in codes if c < 0 and c not in _EXPECTED]
    # health_check() reflects the client's last heartbeat, so it can still say 0 right
    # after the master died; an RPC failure or timeout is taken at its word.
    if odd and (RPC_FAIL in odd or RPC_TIMEOUT in odd or client.health_check() != 0):
        raise ServerDown(f"master {master} unreachable (codes {sorted(set(odd))})")


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
