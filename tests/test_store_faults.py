"""The store when things go wrong: pinned tiers, tiers that raise, slow lower tiers.

Faults are injected by small subclasses of the real host tier (a wrapper around real bytes),
the way a flaky device, a busy disk or a bug in a tier would behave.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtier.keys import BlockKey
from kvtier.store import TieredStore
from kvtier.tiers.base import Array
from kvtier.tiers.host import HostTier
from tests.helpers import SMALL, host_store, kv_for

BT = SMALL.block_tokens


def prompt(start: int, blocks: int) -> list[int]:
    return list(range(start, start + blocks * BT))


class RaisingTier(HostTier):
    """A host tier whose next ``failures`` reads or writes raise (a transient device error)."""

    def __init__(self, *a: Any, op: str, failures: int = 1) -> None:
        super().__init__(*a)
        self.op, self.failures = op, failures

    def _maybe_fail(self, op: str) -> None:
        if self.op == op and self.failures:
            self.failures -= 1
            raise RuntimeError(f"transient {op} error")

    def _read(self, slot: int, out: Array) -> bool:
        self._maybe_fail("read")
        return super()._read(slot, out)

    def put(
        self, keys: Sequence[BlockKey], blocks: Sequence[Array], tenant: str = ""
    ) -> list[bool]:
        self._maybe_fail("write")
        return super().put(keys, blocks, tenant)


class SlowTier(HostTier):
    """A lower tier whose writes take a while (a busy disk, a remote pool)."""

    def put(
        self, keys: Sequence[BlockKey], blocks: Sequence[Array], tenant: str = ""
    ) -> list[bool]:
        time.sleep(1.3)  # longer than the store's 1 s wait between checks
        return super().put(keys, blocks, tenant)


def test_store_evicts_what_it_can_when_part_of_the_tier_is_pinned() -> None:
    with host_store(8) as st:
        a, b = prompt(1000, 8), prompt(5000, 8)
        st.store(a, kv_for(a))
        with st.pin(a[: 2 * BT]):
            assert st.store(b, kv_for(b)) == 6 * BT  # 6 evictable slots, not 0
            assert st.lookup(a[: 2 * BT]) == 2 * BT
        assert st.prefetch(b) == 0  # already in the first tier


def test_a_tier_raising_on_read_is_a_miss_and_releases_pins() -> None:
    t = RaisingTier(SMALL, 4 * SMALL.block_bytes, op="read")
    with TieredStore(SMALL, [t], workers=1, model_id="test") as st:
        a = prompt(100, 4)
        st.store(a, kv_for(a))
        out = np.zeros(SMALL.kv_shape(len(a)), SMALL.storage_dtype)
        n = st.load(a, out)  # no exception into the inference path
        assert n < len(a)
        assert np.array_equal(out[:, :, :n], kv_for(a)[:, :, :n])
        assert all(e.pins == 0 for e in st._index.entries.values())
        b = prompt(900, 4)
        assert st.store(b, kv_for(b)) == 4 * BT  # nothing stranded by the failure


def test_a_failing_demotion_keeps_index_and_tiers_in_step() -> None:
    top = HostTier(SMALL, 4 * SMALL.block_bytes)
    low = RaisingTier(SMALL, 8 * SMALL.block_bytes, op="write")
    low.name = "low"
    with TieredStore(SMALL, [top, low], workers=1, model_id="test") as st:
        a, b = prompt(100, 4), prompt(500, 4)
        st.store(a, kv_for(a))
        assert st.store(b, kv_for(b)) == 4 * BT  # a's demotion raised once: a is dropped
        st.flush()
        assert st._index.resident == [len(top._table), len(low._table)]
        for i in range(3):
            c = prompt(10_000 * (i + 1), 2)
            assert st.store(c, kv_for(c)) == 2 * BT
        st.flush()
        assert st._index.resident == [len(top._table), len(low._table)]
        assert st.stats()["store"]["failed_moves"] >= 1


def test_a_slow_demotion_is_waited_for_not_answered_with_more_evictions() -> None:
    top = HostTier(SMALL, 8 * SMALL.block_bytes)
    low = SlowTier(SMALL, 64 * SMALL.block_bytes)
    low.name = "slow"
    with TieredStore(SMALL, [top, low], workers=2, model_id="test") as st:
        a = prompt(100, 8)
        st.store(a, kv_for(a))
        b = prompt(900, 1)
        assert st.store(b, kv_for(b)) == BT
        st.flush()
        assert st.stats()["store"]["evictions"] == 1
        assert st.lookup(a) == 8 * BT  # the victim lives on in the lower tier
