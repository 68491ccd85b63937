"""The hit-density policy and its online life table (kvtier/policy/density.py, lifetable.py)."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings

from kvtier.policy.base import always
from kvtier.policy.chainlinks import ChainLinks
from kvtier.policy.density import HitDensity
from kvtier.policy.densitybelow import DensityBelow
from kvtier.sim.replay import TierSpec, replay
from kvtier.sim.trace import read_trace
from tests.helpers import host_store, store_documents_then_load_the_last
from tests.test_policies import check_set_model, ops
from tests.test_sim import MOONCAKE, tree_trace


def below(top: HitDensity[int], capacity: int) -> DensityBelow[int]:
    """The policy of a tier of ``capacity`` blocks below ``top``."""
    low = HitDensity[int](capacity).feed_by_demotion(top)
    assert isinstance(low, DensityBelow)
    return low


def test_density_learns_which_request_class_comes_back() -> None:
    """Blocks of class "doc" are asked for again 40 requests later, "chat" ones never. Once the
    classes are learned, a forced eviction takes chat blocks, old or new, and no document
    waiting for its reuse (LRU would take the oldest documents first)."""
    pol: HitDensity[int] = HitDensity(400)
    key = 0
    docs: list[list[int]] = []
    hits = 0
    for step in range(4000):
        chain = list(range(key, key + 4))
        key += 4
        if step % 2:
            pol.insert(chain, "chat")
        else:
            pol.insert(chain, "doc")
            docs.append(chain)
        if len(docs) > 20:
            reused = docs.pop(0)
            hits += step > 2000 and all(k in pol for k in reused)
            pol.insert(reused, "doc")
        if len(pol) > 380:
            assert pol.evict(len(pol) - 380, always) is not None
    assert hits >= 990, hits  # the second half's 1,000 reuses find their documents whole
    waiting = {k for d in docs for k in d}
    victims = pol.evict(200, always)
    assert victims is not None and not waiting & set(victims)


def test_density_never_drops_a_parent_before_its_child() -> None:
    """Keys of one chain in states whose densities disagree (the parent's lower): the child
    still leaves first, and a parent goes only once its children are gone."""
    pol: HitDensity[int] = HitDensity(64)
    for i in range(40):  # blocks stored under "cold" are never reused; "hot" ones always
        pol.insert([100 + i], "cold")
        pol.insert([200 + i], "hot")
        pol.insert([200 + i], "hot")
    pol.evict(len(pol), always)
    pol.insert([1, 2, 3], "cold")  # 3 is this chain's leaf
    pol.access([1, 2])
    order: list[int] = []
    while len(pol):
        victims = pol.evict(1, always)
        assert victims is not None
        order += victims
    assert order.index(3) < order.index(2) < order.index(1)


def test_a_lower_tier_keeps_a_chain_demoted_leaf_first_in_prefix_order() -> None:
    """The top tier demotes a chain leaf first, a block per eviction, mixed with other chains'
    blocks: the lower tier links each block to its parent up there once both are down, so it
    drops the chain leaf first too (linking neighbours of a batch would tie unrelated keys)."""
    top: HitDensity[int] = HitDensity(4)
    low = below(top, 64)
    top.insert([1, 2, 3, 4], "doc")
    for i in range(8):  # one new block a request: one victim per eviction
        top.insert([100 + i], "other")
        victims = top.evict(len(top) - 4, always)
        assert victims is not None
        low.insert(victims[::-1])
    assert all(k in low for k in (1, 2, 3, 4))
    assert low._links.parent.get(4) == 3 and low._links.parent.get(2) == 1
    low.access([1, 2, 3])
    low.access([4])  # the leaf is the most recently used: by age alone it would leave last
    order: list[int] = []
    while len(low):
        victims = low.evict(1, always)
        assert victims is not None
        order += victims
    assert order.index(4) < order.index(3) < order.index(2) < order.index(1)


@pytest.mark.parametrize("seed", range(3))
def test_density_in_a_hierarchy(seed: int) -> None:
    """A lower tier fed by the first tier's victims ranks them with the first tier's table:
    hits and demotions add up, and a second tier only adds hits."""
    trace = tree_trace(seed, n_req=300, nodes=120)
    one = replay(trace, [TierSpec("x", 8, "density-always")])
    two = replay(trace, [TierSpec("x", 8, "density"), TierSpec("y", 24, "density")])
    assert two.hit_tokens.sum() >= one.hit_tokens.sum()
    assert two.written_blocks[1] == two.evicted_blocks[0]  # every victim demoted
    belady = replay(trace, [TierSpec("x", 32, "belady")])
    assert two.block_hits <= belady.block_hits


def test_store_runs_on_the_density_policy() -> None:
    with host_store(blocks=8, policy="density-always") as st:
        store_documents_then_load_the_last(st)
        stats = st.stats()
        assert stats["store"]["evictions"] >= 10
        assert stats["policies"]["host"]["resident"] <= 8
        states = stats["policies"]["host"]["states"]  # what it learned, most resident first
        assert states and sum(s["resident"] for s in states) <= 8
        assert [s["resident"] for s in states] == sorted(
            (s["resident"] for s in states), reverse=True
        )


def test_per_request_hints_use_up_states_not_memory() -> None:
    """A caller passing a new hint with every request: states stop at ``max_states`` (the rest
    share the catch-all) and the policy keeps working."""
    pol: HitDensity[int] = HitDensity(100)
    for i in range(2000):
        pol.insert([3 * i, 3 * i + 1, 3 * i + 2], f"request-{i}")
        if len(pol) > 90:
            assert pol.evict(len(pol) - 90, always) is not None
    assert len(pol.states.names) <= HitDensity.max_states
    assert pol.table.density.shape[0] <= 2 * HitDensity.max_states


def test_states_of_one_place_are_one_family_whatever_the_hint() -> None:
    """The life table smooths a state's rate towards its family's: the states of a request's new
    blocks at one place share a family across hints; a reused state is a family of its own. The
    tables read the states' live family list."""
    pol: HitDensity[int] = HitDensity(100)
    pol.insert([1, 2, 3, 4, 5], "short")
    pol.insert([11, 12, 13, 14, 15], "long")
    names, fams = pol.states.names, pol.states.families
    assert len(fams) == len(names)
    family = {n: f for n, f in zip(names, fams, strict=True)}
    for place in range(4):
        assert family[("new", "short", place)] == family[("new", "long", place)]
    assert len({family[("new", "short", p)] for p in range(4)}) == 4
    assert len({family[n] for n in names if n[0] != "new"}) == len(
        [n for n in names if n[0] != "new"]
    )
    assert not {family[n] for n in names if n[0] != "new"} & {family[("new", "long", 0)]}
    assert pol.table.families is fams
    below = pol.extend(1000)  # a tier below: its table pulls towards the mean, same families
    assert below.table.families is fams
    assert below.table.mean_window == HitDensity.mean_window_below < pol.table.mean_window


def test_a_failed_evict_keeps_every_key_evictable() -> None:
    """An eviction that cannot be met (too much pinned) changes nothing: the same keys can be
    evicted afterwards, down to the last one."""
    pol: HitDensity[int] = HitDensity(6)
    pol.insert([0])
    pol.insert([1, 2, 3, 4])
    assert pol.evict(5, lambda k: k != 1) is None
    assert len(pol) == 5
    victims = pol.evict(2, lambda k: k != 1)
    assert victims is not None and len(victims) == 2 and 1 not in victims
    rest = pol.evict(3, always)
    assert rest is not None and set(victims) | set(rest) == {0, 1, 2, 3, 4}


def test_a_lower_tier_hit_is_learned_once_by_the_top_tier() -> None:
    """A hit in a lower tier changes only that tier's order; the top tier's table learns the use
    when the block comes back up (found in its ghost), not twice."""
    top: HitDensity[int] = HitDensity(8)
    low = below(top, 32)
    for i in range(6):  # chains of 3; the first ones are demoted
        top.insert([10 * i, 10 * i + 1, 10 * i + 2], "doc")
        if len(top) > 8:
            victims = top.evict(len(top) - 8, always)
            assert victims is not None
            low.insert(victims)
    assert 0 in low and 0 not in top
    events = top.table._ev.sum()
    low.access([0, 1])
    assert top.table._ev.sum() == events  # nothing learned in the lower tier
    for k in (0, 1):
        low.remove(k)  # promoted: it leaves the lower tier and comes back up
    top.insert([0, 1], "doc")
    assert top.table._ev.sum() == events + 2  # learned once, as two returns from the ghost
    resident = set(low.resident())
    victims = low.evict(len(low), always)  # every key the lower tier holds can still leave
    assert victims is not None and set(victims) == resident


def test_a_lower_tier_prices_a_touched_block_at_the_top_tiers_clock() -> None:
    """A lower tier has no clock of its own: a hit there on a block waiting for its child (out
    of its queue) queues it again at age 0 by the top tier's clock, however far that moved on
    (an own, lagging clock once priced it at a negative age: the oldest bucket's density)."""
    top: HitDensity[int] = HitDensity(8)
    low = below(top, 64)
    top.insert([1], "a")
    top.insert([1, 2], "a")
    for i in range(24):
        top.insert([300 + 3 * i, 301 + 3 * i, 302 + 3 * i], "c")
        victims = top.evict(len(top) - 8, always) if len(top) > 8 else []
        assert victims is not None
        low.insert(victims)
    kids = [k for k, p in low._links.parent.items() if p == 1]
    assert kids  # 1 is a parent in the lower tier
    while 1 not in low._links.waiting:  # an eviction meets it while its children are pinned
        assert low.evict(1, lambda k: k not in kids) is not None
    for i in range(40):  # only the top tier moves on
        top.insert([1000 + 3 * i, 1001 + 3 * i, 1002 + 3 * i], "c")
        assert top.evict(len(top) - 8, always) is not None
    low.access([1])
    starts = [st for _, st, _ in low._heap]
    assert top.now in starts and max(starts) <= top.now


def test_chain_links_adopt_either_order_and_bound_the_orphans() -> None:
    """A child that comes down before its parent is linked when the parent arrives; children
    waiting for parents that never come are forgotten once ``orphan_cap`` parents are awaited;
    a waiting parent is freed when its last child leaves."""
    freed: list[int] = []
    links: ChainLinks[int] = ChainLinks(freed.append, orphan_cap=4)
    here: set[int] = set()
    for key, parent in ((2, 1), (3, 2), (1, None)):  # leaf side first, the root last
        here.add(key)
        links.adopt(key, parent, here)
    assert links.parent == {2: 1, 3: 2} and links.kids == {1: 1, 2: 1}
    links.waiting.add(2)
    assert links.unlink(3) == 2 and freed == [2] and 2 not in links.waiting
    for k in range(100, 110):  # parents that never come down
        here.add(k)
        links.adopt(k, k + 1000, here)
    assert len(links.orphans) <= 4


@pytest.mark.parametrize("seed", range(6))
def test_density_never_evicts_a_parent_of_an_unpinned_resident_child(seed: int) -> None:
    """Random prefix trees, reused in part (runs split), with pins and removals in the middle of
    runs: no victim has a resident child unless every such child is pinned (the emergency the
    contract allows), and victims and residents add up. (A removed key's descendants become
    orphans: they are not linked to it again if it comes back.)"""
    rng = random.Random(seed)
    trace = tree_trace(seed, n_req=400, nodes=150)
    parent = {r.blocks[i]: r.blocks[i - 1] for r in trace.requests for i in range(1, len(r.blocks))}
    kids: dict[int, list[int]] = {}
    for k, p in parent.items():
        kids.setdefault(p, []).append(k)
    pol: HitDensity[int] = HitDensity(24)
    orphaned: set[int] = set()
    evicted = 0
    for req in trace.requests:
        chain = list(req.blocks)
        need = len(pol) + sum(k not in pol for k in chain) - 24
        if need > 0:
            pinned = {k for k in chain if k in pol} if rng.random() < 0.5 else set()
            victims = pol.evict(need, lambda k, p=pinned: k not in p)
            if victims is None:
                continue
            assert not set(victims) & pinned and len(set(victims)) == need
            evicted += need
            for v in victims:
                stay = [k for k in kids.get(v, []) if k in pol and k not in orphaned]
                assert set(stay) <= pinned, (v, stay)
        pol.insert(chain, rng.choice(["a", "b"]))
        if rng.random() < 0.1:
            gone = rng.choice(sorted(pol.resident()))  # type: ignore[type-var]
            pol.remove(gone)
            below = kids.get(gone, [])
            while below:  # its descendants: cut off from it, and re-made when it comes back
                orphaned.update(below)
                below = [c for k in below for c in kids.get(k, [])]
        assert len(set(pol.resident())) == len(pol)
    assert evicted


def test_a_reuse_splits_a_run_and_the_parent_part_outlives_the_rest() -> None:
    """A request reusing the first half of a document splits its run: the used half (a parent
    of the unused half) takes the used state and is kept while the unused half goes first."""
    pol: HitDensity[int] = HitDensity(64)
    doc = list(range(100, 110))
    pol.insert(doc, "doc")
    pol.insert(doc[:5] + [500, 501], "chat")  # the first half, then new blocks of its own
    assert pol.describe()["runs"] >= 3
    order: list[int] = []
    while len(pol):
        victims = pol.evict(1, always)
        assert victims is not None
        order += victims
    for a, b in itertools.pairwise(doc):  # within the document: leaf side first
        assert order.index(b) < order.index(a)
    assert order.index(501) < order.index(500) < order.index(104)


def test_store_style_refresh_hangs_new_blocks_below_a_key_inside_a_run() -> None:
    """The store inserts only new keys, then ``refresh``es their cached prefix: when that ends
    inside a run, the run is split there and the new keys outlive nothing they hang below."""
    pol: HitDensity[int] = HitDensity(64)
    pol.insert([1, 2, 3, 4, 5], "doc")
    pol.insert([10, 11], "chat")  # the store passes only the new keys ...
    pol.refresh([1, 2, 3])  # ... then their cached prefix: 10 hangs below 3, inside the run
    order: list[int] = []
    while len(pol):
        victims = pol.evict(1, always)
        assert victims is not None
        order += victims
    assert order.index(11) < order.index(10) < order.index(3) < order.index(2) < order.index(1)
    assert order.index(5) < order.index(4) < order.index(3)


@pytest.mark.parametrize("gone", [1, 3, 5])
def test_removing_a_key_of_a_run_orphans_the_keys_below_and_learns_nothing_wrong(gone: int) -> None:
    """``remove`` of a key at the start, in the middle or at the end of a run (the ends are
    found without a scan): it is gone, the keys below it stay (an orphan run, evictable) and
    its life is censored, not counted as a use."""
    pol: HitDensity[int] = HitDensity(64)
    pol.insert([1, 2, 3, 4, 5], "doc")
    events = pol.table._ev.sum()
    pol.remove(gone)
    rest = {1, 2, 3, 4, 5} - {gone}
    assert gone not in pol and all(k in pol for k in rest)
    assert pol.table._ev.sum() == events
    victims = pol.evict(4, always)
    assert victims is not None and set(victims) == rest
    assert len(pol) == 0 and not pol.describe()["runs"]


def test_each_tier_below_ranks_by_a_table_at_its_own_scale() -> None:
    """A tier below gets a table at the scale of the hierarchy down to it, fed the same lives
    as the top tier's: its age buckets are wider, and every use is counted in each table."""
    top: HitDensity[int] = HitDensity(640)
    mid = below(top, 1280)
    low = HitDensity[int](6400).feed_by_demotion(mid)
    assert isinstance(low, DensityBelow)
    widths = [top.ranked.width, mid._scale.width, low._scale.width]  # type: ignore[union-attr]
    assert widths == [640 // 64, (640 + 1280) // 64, (640 + 1280 + 6400) // 64]
    for i in range(50):
        top.insert([3 * i, 3 * i + 1, 3 * i + 2], "doc")
    top.insert([0, 1, 2], "doc")  # a use of 3 blocks
    events = [t.table._ev.sum() for t in (top.ranked, mid._scale, low._scale)]  # type: ignore[union-attr]
    assert events[0] == pytest.approx(3.0, rel=0.01)
    assert events == pytest.approx([events[0]] * 3)


def test_a_chain_that_breaks_prefix_order_is_taken_as_new_keys() -> None:
    """Keys are meant to identify their prefix; a caller that breaks it (1 came below 0, now
    below 5) must not break the policy: such a key is forgotten where it was and inserted
    anew, the keys below it stay (orphans), and everything is evictable, children first."""
    pol: HitDensity[int] = HitDensity(16)
    pol.insert([0, 1, 2, 3, 4])
    pol.insert([0, 5, 1])  # 0 is a split-off part of its run, 1 the first key of the rest
    assert sorted(pol.resident()) == [0, 1, 2, 3, 4, 5]  # type: ignore[type-var]
    order = pol.evict(6, always)
    assert order is not None and sorted(order) == [0, 1, 2, 3, 4, 5]
    assert order.index(1) < order.index(5) < order.index(0)
    assert order.index(4) < order.index(3) < order.index(2)


@settings(max_examples=400, deadline=None)
@given(ops=ops)
def test_density_matches_a_set_model_in_many_orders(
    ops: list[tuple[str, list[int]]],
) -> None:
    """The set-model check of every policy, with more examples: density's runs split, merge and
    get cut in many ways (small keys repeat in new orders, which breaks prefix order)."""
    check_set_model("density-always", ops)


def test_the_ghost_covers_the_whole_hierarchy() -> None:
    """A return after a block left the last tier is learned at its true age: the ghost holds
    ``ghost_factor`` times every tier's blocks (it holds the keys resident below as well)."""
    top: HitDensity[int] = HitDensity(100)
    assert top.ghost.cap == int(HitDensity.ghost_factor * 100)
    DensityBelow(1_000, top)
    DensityBelow(10_000, top)
    assert top.ghost.cap == int(HitDensity.ghost_factor * 11_100)


@pytest.mark.parametrize("tiers", [(300, 3_000, 20_000), (1_000, 20_000)])
def test_density_hierarchies_beat_lru_on_mooncake(tiers: tuple[int, ...]) -> None:
    """With a ghost of the tier's own factor plus the blocks below, a block was forgotten soon
    after it left the last tier; these two were below LRU without hints (docs/simulation.md)."""
    trace = read_trace(MOONCAKE)

    def ratio(policy: str, hints: bool) -> float:
        specs = [TierSpec(f"t{i}", c, policy) for i, c in enumerate(tiers)]
        return replay(trace, specs, hints=hints).token_hit_ratio

    lru = ratio("lru", False)
    for hints in (True, False):
        assert ratio("density", hints) > lru, hints
