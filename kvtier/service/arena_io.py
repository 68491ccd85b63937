"""The client's half of the direct data path: KV copied straight into and out of the shared
host arena (the service's half, and the protocol, are in ``kvtier.service.direct``).

A store asks the service to ``reserve`` slots for the new blocks of the call, copies each block
into its slot with the host tier's own fused copy + checksum (``codec.copy_in``) and
``commit``s the checksums; a load ``acquire``s the slots of the cached blocks the host tier
holds, copies them out with the fused copy + verify (``codec.copy_out``) straight into the
caller's array and reports how many verified (``read_done``, not waited for: the service
handles it before the session's next request). The copies run on a transfer engine
(``kvtier.transfer``) over as many threads as an in-process store's, so a store costs what it
costs in-process plus two round trips, a load plus one.

Every function here runs under the connection's ``lock``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtier import codec
from kvtier.config import DEFAULT_WORKERS
from kvtier.layout import KVLayout
from kvtier.service.connection import Connection
from kvtier.tiers.base import Array
from kvtier.tiers.shm import SharedMemory
from kvtier.transfer import TransferEngine


class ArenaCopier:
    """Copies between arrays and slots of a mapped arena, on ``workers`` threads + the
    caller (as an in-process store's ``run_parallel``). Thread-safe."""

    def __init__(self, layout: KVLayout, workers: int = DEFAULT_WORKERS) -> None:
        self.layout = layout
        self._engine = TransferEngine(workers)

    def _slot(self, arena: SharedMemory, slot: int) -> Array:
        b = self.layout.block_bytes
        if not 0 <= slot < arena.nbytes // b:
            raise ValueError(f"slot {slot} is outside the arena")  # a service bug, not ours
        return arena.array[slot * b : (slot + 1) * b]

    def copy_in(
        self, arena: SharedMemory, blocks: Sequence[Array], slots: Sequence[int]
    ) -> list[int]:
        """Copy each block into its slot; the checksums of what was written."""
        return self._engine.run_parallel(
            lambda part: [codec.copy_in(self._slot(arena, s), b) for b, s in part],
            list(zip(blocks, slots, strict=True)),
        )

    def copy_out(
        self,
        arena: SharedMemory,
        outs: Sequence[Array],
        slots: Sequence[int],
        sums: Sequence[int],
    ) -> int:
        """Copy each slot into its array, verifying it against its checksum; how many leading
        arrays hold verified bytes (those after the first failure are unspecified)."""
        ok = self._engine.run_parallel(
            lambda part: [codec.copy_out(o, self._slot(arena, s)) == c for o, s, c in part],
            list(zip(outs, slots, sums, strict=True)),
        )
        return ok.index(False) if False in ok else len(ok)

    def close(self) -> None:
        self._engine.close()


def _blocks(arr: Array, positions: Sequence[int], bt: int) -> list[Array]:
    return [arr[:, :, p * bt : (p + 1) * bt] for p in positions]


def store_direct(
    conn: Connection, copier: ArenaCopier, arr: Array, raw: bytes, fields: dict[str, Any]
) -> int:
    """Store the full blocks of ``arr`` (``fields``: the call's scope, ``start``, ``n`` tokens)
    through reserved arena slots; the tokens written (0 when the service is unreachable)."""
    bt = conn.layout.block_tokens
    reply = conn.call("reserve", fields, raw)  # resent on a new session: nothing reserved yet
    while reply is not None:
        if "written" in reply:
            return int(reply["written"])
        link = conn.link
        tid = int(reply["tid"])
        if link is None or link.arena is None:  # the session changed under this call
            return 0
        try:
            sums = copier.copy_in(link.arena, _blocks(arr, reply["blocks"], bt), reply["slots"])
        except BaseException:
            conn.call_once("abort", {"tid": tid}, None)
            raise
        sums_raw = np.asarray(sums, "<u8").tobytes()
        reply = conn.call_once("commit", {"tid": tid, "sums": sums_raw}, None)
    return 0


def load_direct(
    conn: Connection,
    copier: ArenaCopier,
    arr: Array,
    raw: bytes,
    fields: dict[str, Any],
    want: int,
) -> tuple[int, bool]:
    """Load the cached blocks the host arena holds into ``arr`` from the call's ``start``
    (``want``: the full blocks asked for); (blocks loaded, whether cached blocks follow them
    in lower tiers, for the caller to load through the staging region)."""
    reply = conn.call("acquire", fields, raw)
    if reply is None:
        return 0, False
    slots = reply["slots"]
    more = bool(reply["more"])
    if not slots:
        return 0, more
    link = conn.link
    got = 0
    try:
        if link is not None and link.arena is not None:
            sums = np.frombuffer(reply["sums"], "<u8").tolist()
            outs = _blocks(arr, range(len(slots)), conn.layout.block_tokens)
            got = copier.copy_out(link.arena, outs, slots, sums)
    finally:
        more = more and got == len(slots)
        # the rest, if loaded through the staging region, is counted by that load
        done = {"tid": reply["tid"], "ok": got, "asked": got if more else want}
        conn.notify("read_done", done)  # on the socket thread, before our next call
    return got, more
