"""``Session``: one connected client -- its identity, staging region, leases and counters.

Every pin and transfer a client starts belongs to its session. A session is alive while the
client talks (any message, the client's heartbeat included, renews it); one silent for the lease
TTL with nothing in flight is *expired*: its leases are released and its staging region unmapped,
so a client killed with ``kill -9`` holds nothing for longer than the TTL.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kvtier.identity import Identity
from kvtier.lease import Lease
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
    """A client's state on the service. ``lock`` guards ``leases``, ``inflight`` and ``ops``
    (workers and the socket thread both touch them)."""

    sid: bytes
    identity: Identity
    tenant: str
    staging: Staging
    pid: int = 0
    name: str = ""
    peer: bytes = b""  # the ZeroMQ routing id of the connection that opened the session
    number: int = 0  # what stats show (the sid is the client's credential, never shown)
    last_seen: float = field(default_factory=time.monotonic)
    inflight: int = 0
    leases: dict[int, Lease] = field(default_factory=dict)
    next_lease: int = 1
    ops: dict[str, OpStats] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, op: str, seconds: float, tokens: int = 0, nbytes: int = 0) -> None:
        with self.lock:
            s = self.ops.setdefault(op, OpStats())
            s.calls += 1
            s.tokens += tokens
            s.bytes += nbytes
            s.seconds += seconds

    def add_lease(self, lease: Lease) -> int:
        with self.lock:
            lid = self.next_lease
            self.next_lease += 1
            self.leases[lid] = lease
        return lid

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
        """Release every lease and unmap the staging region (idempotent)."""
        with self.lock:
            leases, self.leases = list(self.leases.values()), {}
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
        return {
            "session": self.number,
            "pid": self.pid,
            "name": self.name,
            "tenant": self.tenant,
            "identity": self.identity.describe(),
            "leases": leases,
            "idle_s": round(time.monotonic() - self.last_seen, 3),
            "ops": ops,
        }
