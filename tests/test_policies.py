"""The contract every eviction policy passes (one mixin), plus a hypothesis model check."""

from __future__ import annotations

import random
from collections.abc import Hashable
from pathlib import Path
from typing import cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import ConfigError
from kvtier.index import BlockIndex
from kvtier.keys import BlockKey
from kvtier.policy import DEFAULT_POLICY, POLICIES, EvictionPolicy, make_policy
from kvtier.policy.base import always
from kvtier.policy.duel import Auto
from kvtier.policy.s3fifo import S3FIFO
from kvtier.sim.basket import distinct_full_blocks
from kvtier.sim.replay import TierSpec, replay
from kvtier.sim.trace import read_trace
from kvtier.sim.workload import generate


class PolicyContract:
    """Subclass with ``name`` set; every registered policy gets one subclass below."""

    name: str

    def make(self, capacity: int = 16) -> EvictionPolicy[Hashable]:
        return make_policy(self.name, capacity)

    def test_insert_tracks_and_remove_forgets(self) -> None:
        p = self.make()
        p.insert([1, 2, 3])
        assert len(p) == 3 and 2 in p
        p.remove(2)
        p.remove(99)  # absent: ignored
        assert len(p) == 2 and 2 not in p

    def test_insert_of_resident_keys_does_not_duplicate(self) -> None:
        p = self.make()
        p.insert([1, 2, 3])
        p.insert([1, 2, 3, 4])
        assert len(p) == 4

    def test_evict_is_all_or_nothing(self) -> None:
        p = self.make()
        p.insert([b"a", b"b", b"c"])  # bytes keys, as in the store
        assert p.evict(4, always) is None
        assert len(p) == 3
        assert p.evict(0, always) == []
        victims = p.evict(3, always)
        assert victims is not None and set(victims) == {b"a", b"b", b"c"}
        assert len(p) == 0

    def test_evictable_predicate_is_respected(self) -> None:
        p = self.make()
        p.insert(list(range(10)))
        pinned = {0, 3, 9}
        victims = p.evict(7, lambda k: k not in pinned)
        assert victims is not None and not set(victims) & pinned
        assert len(p) == 3 and all(k in p for k in pinned)
        assert p.evict(1, lambda k: k not in pinned) is None
        assert len(p) == 3

    def test_parent_outlives_child_after_access(self) -> None:
        p = self.make(capacity=8)
        chain = [10, 11, 12, 13]
        p.insert(chain)
        p.access(chain)
        for n in range(1, len(chain)):
            q = self.make(capacity=8)
            q.insert(chain)
            q.access(chain)
            victims = q.evict(n, always)
            assert victims is not None
            kept = [k for k in chain if k in q]
            assert kept == chain[: len(kept)], f"{self.name} dropped a parent before its child"

    def test_refreshed_parents_outlive_the_children_stored_after_them(self) -> None:
        """A cached prefix, then new blocks extending it (cold ones included: a class that is
        never reused), then ``refresh`` of the prefix: victims come from the new blocks first."""
        for hint in (None, "dead"):
            q = self.make(capacity=64)
            for i in range(60):  # teach S3-FIFO that "dead" blocks are never reused
                q.insert([1000 + i], "dead")
                q.insert([3000 + i], "doc")
                q.insert([3000 + i], "doc")  # and "doc" blocks always are
            q.evict(len(q), always)
            prefix, extension = [10, 11, 12], [13, 14, 15]
            q.insert(prefix, hint)
            q.insert(extension, hint)
            q.refresh(prefix)
            for n in range(1, 7):
                victims = q.evict(1, always)
                assert victims is not None
                kept = [k for k in prefix + extension if k in q]
                assert kept == (prefix + extension)[: len(kept)], f"{self.name}, {hint}, {n}"

    def test_victims_are_forgotten(self) -> None:
        p = self.make(capacity=4)
        p.insert([1, 2, 3, 4])
        victims = p.evict(2, always)
        assert victims is not None and all(v not in p for v in victims)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_registry_builds_every_policy(name: str) -> None:
    assert make_policy(name, 4).name == name


def test_default_policy_is_registered() -> None:
    assert DEFAULT_POLICY in POLICIES


for _name in sorted(POLICIES):
    _cls = type(f"TestContract_{_name.replace('-', '_')}", (PolicyContract,), {"name": _name})
    globals()[_cls.__name__] = _cls

ops = st.lists(
    st.tuples(
        st.sampled_from(["insert", "access", "remove", "evict"]),
        st.lists(st.integers(0, 12), min_size=1, max_size=5, unique=True),
    ),
    max_size=60,
)


@pytest.mark.parametrize("name", sorted(POLICIES))
@settings(max_examples=60, deadline=None)
@given(ops=ops)
def test_policy_matches_a_set_model(name: str, ops: list[tuple[str, list[int]]]) -> None:
    """Whatever the order, a policy's resident set is exactly what a dict model says."""
    check_set_model(name, ops)


def check_set_model(name: str, ops: list[tuple[str, list[int]]]) -> None:
    """Replay ``ops`` on policy ``name`` (6 blocks) and on a dict model, comparing after each."""
    p = make_policy(name, 6)
    model: dict[int, None] = {}
    for op, keys in ops:
        if op == "insert":
            p.insert(keys)
            model.update(dict.fromkeys(keys))
        elif op == "access":
            p.access(keys)
        elif op == "remove":
            p.remove(keys[0])
            model.pop(keys[0], None)
        else:
            n = len(keys)
            pinned = set(keys[1:2])
            victims = p.evict(n, lambda k, pinned=pinned: k not in pinned)  # type: ignore[misc]
            free = [k for k in model if k not in pinned]
            if n > len(free):
                assert victims is None
            else:
                assert victims is not None and len(victims) == n == len(set(victims))
                assert set(victims) <= set(free)
                for v in victims:
                    model.pop(v)  # type: ignore[call-overload]
        assert len(p) == len(model)
        resident = p.resident()
        assert all((k in p) == (k in resident) == (k in model) for k in range(13))


def test_s3fifo_ghost_remembers_the_last_capacity_of_drops() -> None:
    """A dropped key that comes back while it is among the last ``ghost_fraction x capacity``
    drops is a ghost hit (it skips probation); one that comes back later is new. The list
    stays bounded however many keys pass through."""

    def comes_back_after(later_drops: int) -> S3FIFO[int]:
        p: S3FIFO[int] = S3FIFO(10)
        for k in range(later_drops + 1):  # key 0 is the first drop
            p.insert([k])
            p.evict(1, always)
        p.insert([0])
        return p

    ghost_len = S3FIFO(10)._ghost_cap
    assert 0 in comes_back_after(ghost_len - 1)._main
    p = comes_back_after(ghost_len)
    assert 0 in p._small and 0 not in p._main
    for k in range(100, 100 + 20 * ghost_len):
        p.insert([k])
        p.evict(1, always)
    assert len(p._ghost) <= 2 * ghost_len + 1


def test_auto_s3fifo_ranking_remembers_what_lru_evicted() -> None:
    """While LRU ranks, its victims enter the S3-FIFO ranking's ghost list: one written again
    soon skips probation there (as under S3-FIFO alone), one never dropped does not."""
    p: Auto[int] = Auto(10)
    p._shadows[0].hits = 1  # LRU's shadow ahead: LRU ranks
    p.insert(list(range(10)))
    victims = p.evict(3, always)
    assert victims == [9, 8, 7]  # LRU: the least recent end (a chain's leaf first)
    assert all(v not in p and v not in p._s3 for v in victims)
    p._shadows[1].hits = 2  # S3-FIFO's shadow ahead
    p.insert([9, 100])
    assert 9 in p._s3._main and 100 in p._s3._small


@pytest.mark.parametrize("seed", range(3))
def test_auto_ranks_one_resident_set_twice(seed: int) -> None:
    """Whichever ranking evicts, the other forgets the victims: both always hold the policy's
    resident set (pinned keys included)."""
    rng = random.Random(seed)
    p: Auto[int] = Auto(32)
    for _ in range(300):
        chain = [rng.randrange(20) * 100 + j for j in range(rng.randrange(1, 6))]
        p.insert([k for k in chain if k not in p])
        p.access([k for k in chain if k in p])
        p.refresh([k for k in chain if k in p])
        over = len(p) - 32
        if over > 0:
            root = chain[0]
            assert p.evict(over, root.__ne__) is not None  # the request's root pinned
        assert set(p._lru.resident()) == set(p._s3.resident()) == set(p.resident())


@pytest.mark.parametrize(
    ("kind", "seed", "cap", "winner"),
    [("chat", 2, 301, "lru"), ("rag", 2, 143, "s3fifo")],  # 10% and 1% of their blocks
)
def test_auto_follows_the_ranking_the_traffic_favours(
    kind: str, seed: int, cap: int, winner: str
) -> None:
    """Conversations returning after more than S3-FIFO's probation favour LRU; documents
    drowned in one-shot questions favour S3-FIFO. ``auto`` is within 1% of the better one."""
    trace = generate(kind, 2000, seed)
    hit = {
        pol: replay(trace, [TierSpec("x", cap, pol)]).token_hit_ratio
        for pol in ("lru", "s3fifo", "auto")
    }
    assert max(hit, key=lambda p: hit[p] if p != "auto" else -1) == winner
    assert hit["auto"] >= 0.99 * max(hit["lru"], hit["s3fifo"]), hit


@pytest.mark.parametrize("name", ["density", "Density-Always"])
def test_a_removed_policy_says_what_to_use(name: str) -> None:
    with pytest.raises(ConfigError, match=r"was removed.*'auto'"):
        make_policy(name, 8)


def test_a_lower_tier_is_told_the_lookups_that_missed_it() -> None:
    """A block written into the first tier that the tier below does not hold is a lookup that
    reached the lower tier and missed: its ``auto`` admits it into both shadows, and a second
    miss on it (after it left every tier) is a hit for them -- the lower tier is judged on the
    lookups that reach it, not only on the first tier's victims."""
    idx = BlockIndex("auto", [4, 8])
    lower = idx.policies[1]
    assert isinstance(lower, Auto)
    keys = cast(list[BlockKey], [1, 2, 3])
    for k in keys:
        idx.begin_write(k, 0)
    idx.end_write(keys, 0, [True] * 3)
    assert lower.describe()["lru_shadow_hits"] == 0
    idx.drop_all(keys, 0)  # gone from every tier, never demoted
    for k in keys:
        idx.begin_write(k, 0)
    idx.end_write(keys, 0, [True] * 3)
    d = lower.describe()
    assert d["lru_shadow_hits"] == d["s3fifo_shadow_hits"] == 3
    first = idx.policies[0]
    assert isinstance(first, Auto) and first.describe()["lru_shadow_hits"] == 3  # re-stored


MOONCAKE = Path("/work/shared/data/traces/mooncake_synthetic.jsonl")


@pytest.mark.skipif(not MOONCAKE.exists(), reason="the shared Mooncake trace is not here")
def test_auto_on_host_and_nvme_holds_where_lru_wins_below() -> None:
    """Host + NVMe on the Mooncake trace at 1% of its blocks: LRU on both tiers beats
    S3-FIFO's, and the NVMe tier's ``auto`` finds it (judged on the lookups reaching it; on the
    first tier's victims it chose S3-FIFO and lost 8%)."""
    trace = read_trace(MOONCAKE)
    n = distinct_full_blocks(trace)
    caps = (round(0.0025 * n), round(0.01 * n))
    hit = {
        pol: replay(trace, [TierSpec(f"t{i}", c, pol) for i, c in enumerate(caps)]).token_hit_ratio
        for pol in ("lru", "s3fifo", "auto")
    }
    assert hit["auto"] >= 0.99 * max(hit["lru"], hit["s3fifo"]), hit
