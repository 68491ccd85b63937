"""Block moves between tiers, executed on transfer-engine workers.

A ``Move`` is the small spec between the decider and the mover: copy ``keys`` from tier ``src``
to tier ``dst`` (or just delete them from ``src`` when ``dst`` is None), optionally deleting the
source copies afterwards (a demotion). A job runs a list of moves *in order* -- a cascade is
planned deepest-first, so room in a lower tier exists before the tier above writes into it.

Bytes pass through staging buffers from a ``StagingPool`` (preallocated, page-touched, reused,
framed with room for a block header: ``codec.framed_empty``), a few blocks at a time so a
batch-capable tier still gets batches.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier import codec
from kvtier.keys import BlockKey
from kvtier.tiers.base import Array, Tier

BATCH = 4
log = logging.getLogger(__name__)


@dataclass(slots=True)
class Move:
    src: int
    dst: int | None
    keys: list[BlockKey]
    tenants: list[str]
    delete_src: bool
    ok: list[bool] = field(default_factory=list)


class StagingPool:
    """Reusable block-sized buffers. Thread-safe; grows on demand, keeps at most ``keep``."""

    def __init__(self, block_bytes: int, keep: int) -> None:
        self._block_bytes = block_bytes
        self._keep = keep
        self._free: list[Array] = []
        self._lock = threading.Lock()

    def take(self, n: int) -> list[Array]:
        with self._lock:
            got = [self._free.pop() for _ in range(min(n, len(self._free)))]
        while len(got) < n:  # framed: a remote tier moves header + payload as one buffer
            got.append(codec.framed_empty(self._block_bytes))
        return got

    def give(self, bufs: Sequence[Array]) -> None:
        with self._lock:
            room = self._keep - len(self._free)
            self._free.extend(bufs[: max(0, room)])


def split_moves(moves: Sequence[Move], parts: int) -> list[list[Move]]:
    """``moves`` as up to ``parts`` job-sized lists that can run at once, on separate workers.

    Each move's keys are cut into contiguous runs of whole ``BATCH`` es (so a batch-capable tier
    still gets full batches), the i-th run of every move going to list i; a move too small to
    cut stays whole in list 0. Order between lists is lost, so this is only for moves that do
    not depend on each other (write-through copies of blocks already in the first tier), not
    for a cascade planned deepest-first.
    """
    out: list[list[Move]] = [[] for _ in range(max(1, parts))]
    for mv in moves:
        n = min(len(out), -(-len(mv.keys) // BATCH))
        bounds = [BATCH * (-(-len(mv.keys) * i // n) // BATCH) for i in range(n)] + [len(mv.keys)]
        for i in range(n):
            lo, hi = bounds[i], bounds[i + 1]
            if lo < hi:
                out[i].append(
                    Move(mv.src, mv.dst, mv.keys[lo:hi], mv.tenants[lo:hi], mv.delete_src)
                )
    return [part for part in out if part]


def _groups(tenants: Sequence[str]) -> dict[str, list[int]]:
    """Positions of each tenant's keys (tiers are called once per tenant)."""
    out: dict[str, list[int]] = {}
    for i, t in enumerate(tenants):
        out.setdefault(t, []).append(i)
    return out


def _delete(src: Tier, keys: Sequence[BlockKey], tenants: Sequence[str]) -> None:
    for tenant, idx in _groups(tenants).items():
        src.delete([keys[i] for i in idx], tenant)


def run_moves(tiers: Sequence[Tier], moves: Sequence[Move], staging: StagingPool) -> None:
    """Execute ``moves`` in order, filling each ``Move.ok`` (one outcome per key).

    A key counts as moved only if it was read verified from ``src`` and stored in ``dst``.
    Source copies are deleted afterwards when ``delete_src``, whether or not the copy worked
    (the decider needed the room) and even if a tier raised. Never raises: a tier that raises
    (a bug or an unexpected fault) fails the blocks of that batch, logged, and the job goes on,
    so the decider's view and the tiers' contents stay in step.
    """
    for mv in moves:
        mv.ok = [False] * len(mv.keys)
        try:
            if mv.dst is not None:
                _copy(tiers[mv.src], tiers[mv.dst], mv, staging)
            else:
                mv.ok = [True] * len(mv.keys)
        finally:
            if mv.delete_src:
                try:
                    _delete(tiers[mv.src], mv.keys, mv.tenants)
                except Exception:
                    log.exception("deleting moved blocks from %s failed", tiers[mv.src].name)


def _copy(src: Tier, dst: Tier, mv: Move, staging: StagingPool) -> None:
    for start in range(0, len(mv.keys), BATCH):
        keys = mv.keys[start : start + BATCH]
        bufs = staging.take(len(keys))
        try:
            for tenant, idx in _groups(mv.tenants[start : start + BATCH]).items():
                got = src.get_into([keys[i] for i in idx], [bufs[i] for i in idx], tenant)
                good = [i for i, g in zip(idx, got, strict=True) if g]
                stored = dst.put([keys[i] for i in good], [bufs[i] for i in good], tenant)
                for i, ok in zip(good, stored, strict=True):
                    mv.ok[start + i] = ok
        except Exception:
            log.exception("moving blocks %s -> %s failed", src.name, dst.name)
        finally:
            staging.give(bufs)
