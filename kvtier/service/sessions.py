"""``Session``: one client -- its identity, pool, staging region, leases, transfers, counters.

Every pin and transfer a client starts belongs to its session: its leases (``Lease``), and the
direct transfers it is copying (``kvtier.service.direct``: a store's reserved slots, a load's
pinned slots). A session is alive while the client talks (any message, the client's heartbeat
included, renews it); one silent for the lease TTL with nothing in flight is *expired*: its
leases are released, its reservations aborted (never visible), its read slots unpinned and its
staging region unmapped, so a client killed with ``kill -9`` holds nothing for longer than the
TTL.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kvtier.identity import Identity
from kvtier.lease import Lease
from kvtier.service.direct import Reservation, SlotRead
from kvtier.service.scoped import ServiceStore
from kvtier.service.staging import Staging


@dataclass(slots=True)
class OpStats:
    """Counters of one operation of one session (seconds of service time, not wall clock)."""

    calls: int = 0
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0


@dataclass(slots=True)
class Session:
    """A client's state on the service. ``lock`` guards ``leases``, ``transfers``,
    ``inflight`` and ``ops`` (workers and the socket thread both touch them)."""

    sid: bytes
    identity: Identity
    tenant: str
    staging: Staging
    store: ServiceStore  # its pool's (``kvtier.service.pools``): every call of the session
    pool: str = "default"
    pid: int = 0
    name: str = ""
    peer: bytes = b""  # the ZeroMQ routing id of the connection that opened the session
    number: int = 0  # what stats show (the sid is the client's credential, never shown)
    last_seen: float = field(default_factory=time.monotonic)
    inflight: int = 0
    leases: dict[int, Lease] = field(default_factory=dict)
    transfers: dict[int, Reservation | SlotRead] = field(default_factory=dict)
    next_lease: int = 1  # ids of leases and transfers (one sequence)
    ops: dict[str, OpStats] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(
        self, op: str, seconds: float, tokens: int = 0, nbytes: int = 0, calls: int = 1
    ) -> None:
        with self.lock:
            s = self.ops.setdefault(op, OpStats())
            s.calls += calls
            s.tokens += tokens
            s.bytes += nbytes
            s.seconds += seconds

    def add_lease(self, lease: Lease) -> int:
        with self.lock:
            lid = self.next_lease
            self.next_lease += 1
            self.leases[lid] = lease
        return lid

    def add_transfer(self, transfer: Reservation | SlotRead) -> int:
        with self.lock:
            tid = self.next_lease
            self.next_lease += 1
            self.transfers[tid] = transfer
        return tid

    def peek_transfer(self, tid: int) -> Reservation | SlotRead | None:
        """The transfer ``tid`` (still the session's); ``None`` if none."""
        with self.lock:
            return self.transfers.get(tid)

    def take_transfer(self, tid: int) -> Reservation | SlotRead | None:
        """The transfer ``tid``, no longer the session's (its owner ends it); ``None`` if none."""
        with self.lock:
            return self.transfers.pop(tid, None)

    def put_back(self, tid: int, transfer: Reservation | SlotRead) -> None:
        """Give a transfer taken by ``take_transfer`` back (it goes on)."""
        with self.lock:
            self.transfers[tid] = transfer

    def release(self, lid: int) -> bool:
        """Release one lease (idempotent); ``False`` if the session holds none by that id."""
        with self.lock:
            lease = self.leases.pop(lid, None)
        if lease is None:
            return False
        lease.release()
        return True

    def expired(self, now: float, ttl: float) -> bool:
        with self.lock:
            return self.inflight == 0 and now - self.last_seen > ttl

    def close(self) -> None:
        """Release every lease and transfer, unmap the staging region (idempotent)."""
        with self.lock:
            leases, self.leases = list(self.leases.values()), {}
            transfers, self.transfers = list(self.transfers.values()), {}
        for transfer in transfers:
            transfer.release()
        for lease in leases:
            lease.release()
        self.staging.unlink()
        self.staging.close()

    def describe(self) -> dict[str, Any]:
        with self.lock:
            ops = {
                op: {
                    "calls": s.calls,
                    "tokens": s.tokens,
                    "bytes": s.bytes,
                    "mean_us": 1e6 * s.seconds / s.calls if s.calls else 0.0,
                }
                for op, s in self.ops.items()
            }
            leases = len(self.leases)
            transfers = len(self.transfers)
        return {
            "session": self.number,
            "pid": self.pid,
            "name": self.name,
            "tenant": self.tenant,
            "pool": self.pool,
            "identity": self.identity.describe(),
            "leases": leases,
            "transfers": transfers,
            "idle_s": round(time.monotonic() - self.last_seen, 3),
            "ops": ops,
        }
