"""Learned admission: per-class reuse rates, what S3-FIFO does with the verdicts, hints in the
store and the simulator."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvtier.policy.admission import COLD, HOT, NORMAL, ReuseClasses, output_class
from kvtier.policy.base import always
from kvtier.policy.s3fifo import S3FIFO, TAIL_CLASSES
from kvtier.sim.replay import TierSpec, replay
from kvtier.sim.trace import Request, Trace
from kvtier.store import TieredStore
from tests.helpers import SMALL, host_store, kv_for


def test_verdicts_follow_the_reuse_rate() -> None:
    rc: ReuseClasses[int] = ReuseClasses(window=10_000, handoff=10)
    dead, doc, mixed = rc.cid("dead"), rc.cid("doc"), rc.cid("mixed")
    assert rc.cid("doc") == doc and 0 not in (dead, doc, mixed)
    for c in (dead, doc, mixed):
        rc.new(c, 40)
    assert rc.verdict(dead) == NORMAL  # too few samples to judge
    for c in (dead, doc, mixed):
        rc.new(c, 60)
    for _ in range(90):
        rc.reused(doc)
    for _ in range(50):
        rc.reused(mixed)
    rc.refresh()  # overall rate 140/300: cold below 0.4x that
    assert (rc.verdict(dead), rc.verdict(doc), rc.verdict(mixed)) == (COLD, HOT, NORMAL)
    assert rc.verdict(0) == NORMAL  # unlabelled keys are never judged
    rc.new(0, 1000)
    assert rc.verdict(0) == NORMAL


def test_cold_is_relative_to_the_overall_reuse_rate() -> None:
    """8% reuse is cold beside documents reused 90% of the time, not beside keys reused 9%."""
    rc: ReuseClasses[int] = ReuseClasses(window=10_000, handoff=10)
    rare, often = rc.cid("rare"), rc.cid("often")
    rc.new(rare, 1000)
    rc.new(often, 1000)
    for _ in range(80):
        rc.reused(rare)
    for _ in range(100):
        rc.reused(often)
    rc.refresh()
    assert (rc.verdict(rare), rc.verdict(often)) == (NORMAL, NORMAL)
    for _ in range(800):
        rc.reused(often)
    rc.refresh()
    assert (rc.verdict(rare), rc.verdict(often)) == (COLD, HOT)
    nothing: ReuseClasses[int] = ReuseClasses(window=10_000, handoff=10)
    c = nothing.cid("x")
    nothing.new(c, 5000)  # nothing is ever reused: no class is worse than the rest
    assert nothing.verdict(c) == NORMAL


def test_the_overall_rate_refreshes_as_keys_arrive() -> None:
    rc: ReuseClasses[int] = ReuseClasses(window=100_000, handoff=10)
    dead, doc = rc.cid("dead"), rc.cid("doc")
    rc.new(doc, 100)
    for _ in range(100):
        rc.reused(doc)
    assert rc.admit(dead, 10) == NORMAL  # no refresh yet: no cut
    assert rc.admit(dead, rc.min_samples) == COLD  # refreshed after min_samples + classes keys


def test_counts_halve_so_verdicts_follow_a_changing_workload() -> None:
    rc: ReuseClasses[int] = ReuseClasses(window=200, handoff=10)
    c, other = rc.cid("x"), rc.cid("other")
    rc.new(other, 100)
    for _ in range(50):
        rc.reused(other)
    rc.new(c, 150)
    rc.refresh()
    assert rc.verdict(c) == COLD
    for _ in range(10):  # the class starts being reused: 100% of what comes now
        rc.new(c, 10)
        for _ in range(10):
            rc.reused(c)
    rc.refresh()
    assert rc.verdict(c) != COLD


def test_class_count_is_bounded() -> None:
    rc: ReuseClasses[int] = ReuseClasses(window=100, handoff=10)
    rc.max_classes = 3
    ids = [rc.cid(i) for i in range(5)]
    assert ids[:3] == [1, 2, 3] and ids[3:] == [0, 0]  # beyond the cap: unlabelled


def test_handoff_is_bounded() -> None:
    rc: ReuseClasses[int] = ReuseClasses(window=100, handoff=4)
    for k in range(10):
        rc.send(rc.down, k, 1)
    assert len(rc.down) <= 4 and rc.down[9] == 1


def test_output_class() -> None:
    assert output_class(None, True) is None
    assert output_class(10, False) == (0, False)
    assert output_class(60, True) == (2, True)
    assert output_class(10_000, False) == (8, False)


def _train(p: S3FIFO[int], hint: str, reused: bool, n: int, base: int) -> int:
    """Insert ``n`` six-block requests of class ``hint`` (each one again if ``reused``), so
    every place of the class (the last three new blocks and the body) is learned."""
    for i in range(n):
        chain = list(range(base + 6 * i, base + 6 * i + 6))
        p.insert(chain, hint)
        if reused:
            p.insert(chain, hint)  # a hit: the class's keys come back
    return base + 6 * n


def test_cold_class_is_evicted_first_and_hot_class_skips_probation() -> None:
    p: S3FIFO[int] = S3FIFO(10_000)
    nxt = _train(p, "dead", False, 100, 0)
    nxt = _train(p, "doc", True, 100, nxt)
    q: S3FIFO[int] = S3FIFO(20)
    q._classes = p._classes  # the same learned rates, a small cache
    q._ids_by_hint = p._ids_by_hint
    q.insert([nxt, nxt + 1, nxt + 2, nxt + 3, nxt + 4], "doc")
    q.insert(list(range(nxt + 10, nxt + 25)), None)  # unlabelled: probation
    q.insert([nxt + 50, nxt + 51], "dead")
    victims = q.evict(2, always)
    assert victims == [nxt + 51, nxt + 50]  # the cold request's keys go first, leaf first
    assert nxt in q._main  # the hot request skipped probation
    victims = q.evict(12, always)  # probation (15 keys) is over its share (4): it goes first
    assert victims is not None and all(nxt + i in q for i in range(5))


def test_labels_travel_down_a_hierarchy() -> None:
    upper: S3FIFO[int] = S3FIFO(10_000)
    lower: S3FIFO[int] = S3FIFO(10)
    lower.feed_by_demotion(upper)
    nxt = _train(upper, "dead", False, 100, 0)
    nxt = _train(upper, "doc", True, 100, nxt)  # cold is relative: some class must come back
    upper.insert(list(range(nxt, nxt + 6)), None)
    upper.insert([nxt + 10, nxt + 11], "dead")
    victims = upper.evict(len(upper), always)
    assert victims is not None
    lower.insert([v for v in reversed(victims) if v >= nxt])  # demoted, prefix order
    assert set(lower._cold) == {nxt + 10, nxt + 11}  # still cold one tier down
    assert lower.evict(2, always) == [nxt + 11, nxt + 10]


@pytest.mark.parametrize("seed", range(4))
def test_unpinned_fast_path_matches_with_hints(seed: int) -> None:
    rng = random.Random(seed)
    fast: S3FIFO[int] = S3FIFO(64)
    slow: S3FIFO[int] = S3FIFO(64)
    cold_seen = 0
    for i in range(3000):
        root = rng.randrange(40)
        if root % 2:
            chain, hint = [root * 100 + j for j in range(rng.randrange(1, 8))], rng.choice("ab")
        else:  # never reused: learns to be cold
            chain, hint = [10_000 + 10 * i + j for j in range(rng.randrange(1, 8))], "dead"
        for p in (fast, slow):
            p.insert(chain, hint)
        cold_seen = max(cold_seen, len(fast._cold))
        over = len(fast) - 64
        if over > 0:
            assert fast.evict(over, always) == slow.evict(over, lambda _: True)
        assert sorted(fast._freq.items()) == sorted(slow._freq.items())
        assert list(fast._cold) == list(slow._cold)
    assert cold_seen, "the test should exercise cold keys"


def test_tail_places_learn_separately() -> None:
    """Requests whose last new block is never reused (a partial block) and whose body is."""
    p: S3FIFO[int] = S3FIFO(100_000)
    for r in range(100):
        chain = [r * 10 + j for j in range(5)]
        p.insert(chain)
        p.insert(chain[:-1])  # the next request reuses all but the last block
    ids = p._class_ids(None)
    assert p._classes.verdict(ids[0]) == COLD  # last new block
    assert p._classes.verdict(ids[TAIL_CLASSES]) == HOT  # the body
    assert p._classes.verdict(ids[1]) == HOT


def _doc_trace(n: int, seed: int = 0) -> Trace:
    """Documents (short answer, asked about 3 times later) among one-shot long-answer prompts."""
    rng = random.Random(seed)
    reqs: list[Request] = []
    docs: list[tuple[int, ...]] = []
    nxt = 0
    t = 0.0
    for _ in range(n):
        t += 10
        if docs and rng.random() < 0.3:
            d = docs[rng.randrange(len(docs))]
            blocks = (*d[:-1], nxt)
            nxt += 1
            reqs.append(Request(t, 512 * len(blocks), 300, blocks))
            continue
        size = rng.randint(8, 16)
        blocks = tuple(range(nxt, nxt + size))
        nxt += size
        if rng.random() < 0.3:
            docs.append(blocks)
            docs = docs[-20:]
            reqs.append(Request(t, 512 * size, 10, blocks))
        else:
            reqs.append(Request(t, 512 * size, 400, blocks))
    return Trace(tuple(reqs), 512, "docs")


def test_hints_pay_in_the_simulator() -> None:
    tr = _doc_trace(3000)
    tiers = [TierSpec("hbm", 120, "s3fifo")]
    plain = replay(tr, tiers, hints=False).token_hit_ratio
    hinted = replay(tr, tiers, hints=True).token_hit_ratio
    lru = replay(tr, [TierSpec("hbm", 120, "lru")]).token_hit_ratio
    assert hinted > plain and hinted > lru


def test_store_passes_the_reuse_class_and_only_a_load_is_a_reuse() -> None:
    """A request that stores its prompt and then prompt + answer (the HF integration's
    default) reuses nothing: the cached part is reordered, not hit. A later load is a reuse."""
    with host_store(16, policy="s3fifo") as st:
        toks = list(range(12))  # 3 blocks
        st.store(toks[:8], kv_for(toks[:8]), reuse_class="doc")
        st.store(toks, kv_for(toks), reuse_class="doc")  # 2 cached blocks, 1 new
        pol = st._index.policies[0]
        assert isinstance(pol, S3FIFO)
        ids = pol._class_ids("doc")
        counters = list(pol._freq.values())
        assert all(c & 3 == 0 for c in counters)  # no hits, all three still labelled
        assert sorted(c >> 2 for c in counters) == sorted([ids[0], ids[1], ids[0]])
        assert sum(pol._classes.reuses) == 0
        out = np.zeros(SMALL.kv_shape(12), SMALL.storage_dtype)
        assert st.load(toks, out) == 12
        assert sum(pol._classes.reuses) == 3  # the first reuse of each block


@pytest.mark.parametrize("policy", ["s3fifo", "lru"])
def test_a_store_never_evicts_its_own_cached_prefix(policy: str) -> None:
    """Extending a cached prompt in a full cache evicts other blocks, not the prompt's own
    prefix (which would leave the new blocks unreachable)."""
    bt = SMALL.block_tokens
    a = [1] * (4 * bt)
    b = [2] * (2 * bt)
    with host_store(4, policy=policy) as st:
        st.store(a[: 2 * bt], kv_for(a[: 2 * bt]))
        st.store(b, kv_for(b))  # the cache is full; a's prefix is the oldest
        assert st.store(a, kv_for(a)) == 2 * bt
        assert st.lookup(a) == 4 * bt
        assert st.lookup(b) == 0


def _store_dead_and_docs(st: TieredStore, n: int, base: int) -> None:
    """``n`` one-block prompts of a class never seen again ("dead"), each followed by a prompt of
    a class that is read back at once ("doc"): cold is judged against the overall reuse rate."""
    bt = SMALL.block_tokens
    out = np.zeros(SMALL.kv_shape(bt), SMALL.storage_dtype)
    for i in range(n):
        toks = [base + i] * bt
        st.store(toks, kv_for(toks), reuse_class="dead")
        doc = [base + n + i] * bt
        st.store(doc, kv_for(doc), reuse_class="doc")
        assert st.load(doc, out) == bt


def test_store_labels_follow_demotions_to_the_lower_tier() -> None:
    """In the store, a cold class learned in the first tier is cold in the tier below too."""
    with host_store(8, lower=400, policy="s3fifo") as st:
        _store_dead_and_docs(st, 120, 10_000)
        st.flush()
        lower = st._index.policies[1]
        assert isinstance(lower, S3FIFO) and lower._classes is st._index.policies[0]._classes
        assert lower._cold, "demoted blocks of a cold class should be first victims below"


def test_stats_show_what_the_policy_learned() -> None:
    with host_store(8, lower=64, policy="s3fifo") as st:
        _store_dead_and_docs(st, 80, 20_000)
        st.flush()
        pols = st.stats()["policies"]
        first, lower = pols["host"], pols["host2"]
        assert first["small"] + first["cold"] + first["main"] <= 8
        learned = {c["class"]: c for c in first["classes"]}
        dead = learned["('dead', 0)"]
        assert dead["verdict"] == "cold" and dead["new"] >= 50
        assert learned["('doc', 0)"]["verdict"] == "hot"
        assert "classes" not in lower  # the lower tier shares the first tier's classes
