"""Bad input never wedges the store: a clear named exception before anything is stored, and an
exception raised after blocks are committed leaves index, tiers and policy in step.

The cases are the issue-26 fault findings: an unhashable ``reuse_class``, a policy hook that
raises after the commit, ``workers`` out of range, a token id of 2**64 or more, one tier object
passed twice.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np
import pytest

from kvtier.errors import ConfigError, RequestError, TokenError
from kvtier.keys import BlockKey
from kvtier.policy import POLICIES
from kvtier.policy.lru import LRU
from kvtier.store import TieredStore
from kvtier.tiers.base import Array
from kvtier.tiers.host import HostTier
from tests.helpers import SMALL, host_store, kv_for

BT = SMALL.block_tokens


def prompt(start: int, blocks: int = 1) -> list[int]:
    return list(range(start, start + blocks * BT))


def assert_consistent(st: TieredStore) -> None:
    """Index, tiers and policies agree; no pin is left behind (no call in flight)."""
    st.flush()
    idx = st._index
    for i, tier in enumerate(st.tiers):
        bit = 1 << i
        held = {k for k, e in idx.entries.items() if e.tiers & bit}
        assert held == set(tier.keys()), f"index and {tier.name} disagree"
        assert idx.resident[i] == len(held)
        pol = idx.policies[i]
        if pol is not None:
            assert set(pol.resident()) == held, f"policy of {tier.name} lost track"
    assert all(e.pins == 0 and e.pending == 0 for e in idx.entries.values())


@pytest.mark.parametrize("bad", [["x"], {"a": 1}, {1}, (1, [2])])
def test_an_unhashable_reuse_class_is_refused_before_anything_is_stored(bad: object) -> None:
    with host_store(8, policy="auto") as st:
        a = prompt(100, 2)
        with pytest.raises(RequestError, match="reuse_class") as err:
            st.store(a, kv_for(a), reuse_class=bad)  # type: ignore[arg-type]
        assert isinstance(err.value, TypeError)  # what callers catching TypeError expect
        assert st.lookup(a) == 0
        assert st.stats()["store"]["indexed_blocks"] == 0
        assert st.store(a, kv_for(a), reuse_class=("chat", 1)) == 2 * BT


def test_bad_reuse_classes_mid_workload_leave_every_block_evictable() -> None:
    # the repro, scaled down: a full tier, stores with an unhashable class, then more
    # ordinary stores -- each must write all it is given (nothing stranded, unevictable)
    cap = 30
    with host_store(cap, policy="auto") as st:
        for i in range(2 * cap):
            p = prompt(1000 * i)
            assert st.store(p, kv_for(p)) == BT
        for i in range(cap):
            p = prompt(10**6 + 1000 * i)
            with pytest.raises(RequestError):
                st.store(p, kv_for(p), reuse_class=["x"])  # type: ignore[arg-type]
            assert st.lookup(p) == 0
        for i in range(2 * cap):
            p = prompt(2 * 10**6 + 1000 * i)
            assert st.store(p, kv_for(p)) == BT
        assert_consistent(st)


class FailingInsertLRU(LRU[Hashable]):
    """LRU whose ``insert`` raises for one hint after recording the keys (a policy hook that
    breaks half-way: the kind of fault the commit path must survive)."""

    name = "lru-failing-insert"

    def insert(self, keys: Sequence[Hashable], hint: Hashable | None = None) -> None:
        super().insert(keys, hint)
        if hint == "boom":
            raise RuntimeError("policy hook failed")


def test_a_policy_raising_after_the_commit_rolls_the_store_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(POLICIES, FailingInsertLRU.name, FailingInsertLRU)
    with host_store(6, policy=FailingInsertLRU.name) as st:
        a, b = prompt(100, 3), prompt(500, 3)
        assert st.store(a, kv_for(a)) == 3 * BT
        with pytest.raises(RuntimeError, match="policy hook failed"):
            st.store(b, kv_for(b), reuse_class="boom")
        assert st.lookup(b) == 0  # nothing of the failed call is stored
        assert_consistent(st)
        out = np.zeros(SMALL.kv_shape(3 * BT), SMALL.storage_dtype)
        assert st.load(a, out) == 3 * BT
        assert np.array_equal(out, kv_for(a))
        for i in range(4):  # every block stays evictable: later stores make room
            c = prompt(10_000 * (i + 1), 3)
            assert st.store(c, kv_for(c)) == 3 * BT
        assert_consistent(st)


@pytest.mark.parametrize("workers", [0, -3, 1.5, True, "2"])
def test_workers_out_of_range_is_a_config_error(workers: object) -> None:
    tiers = [HostTier(SMALL, 4 * SMALL.block_bytes)]
    with pytest.raises(ConfigError, match="workers"):
        TieredStore(SMALL, tiers, model_id="m", workers=workers)  # type: ignore[arg-type]


def test_the_same_tier_twice_is_a_config_error() -> None:
    t = HostTier(SMALL, 4 * SMALL.block_bytes)
    with pytest.raises(ConfigError, match="twice"):
        TieredStore(SMALL, [t, t], model_id="m")


@pytest.mark.parametrize("value", [2**64, 2**70, 2**32])
def test_a_huge_token_id_in_a_list_names_its_value_and_position(value: int) -> None:
    with host_store(8) as st:
        toks = prompt(0, 2)
        toks[5] = value
        with pytest.raises(TokenError, match=rf"{value} at position 5"):
            st.store(toks, kv_for(prompt(0, 2)))
        with pytest.raises(TokenError, match=rf"{value} at position 5"):
            st.lookup(toks)
        assert st.stats()["store"]["indexed_blocks"] == 0


class PartialPutTier(HostTier):
    """A first tier whose ``put`` stores its first block, then raises (a tier breaking its
    contract half-way through a batch)."""

    armed = False

    def put(
        self, keys: Sequence[BlockKey], blocks: Sequence[Array], tenant: str = ""
    ) -> list[bool]:
        if not self.armed:
            return super().put(keys, blocks, tenant)
        super().put(keys[:1], blocks[:1], tenant)
        raise RuntimeError("tier failed mid-batch")


def test_a_first_tier_raising_mid_put_stores_nothing_and_strands_nothing() -> None:
    tier = PartialPutTier(SMALL, 6 * SMALL.block_bytes)
    with TieredStore(SMALL, [tier], model_id="m", workers=1) as st:
        tier.armed = True
        a = prompt(100, 3)
        assert st.store(a, kv_for(a)) == 0  # a fault is an outcome, not an exception
        assert st.lookup(a) == 0
        assert_consistent(st)
        tier.armed = False
        for i in range(4):  # the slot it wrote before raising was given back
            b = prompt(10_000 * (i + 1), 3)
            assert st.store(b, kv_for(b)) == 3 * BT
        assert_consistent(st)
