"""Scenario tests of TieredStore on host tiers: the stories users rely on."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from kvtier.decider import Decider
from kvtier.errors import ConfigError, LayoutError, TokenError
from kvtier.moves import Move
from kvtier.store import TieredStore
from kvtier.tiers.host import HostTier
from tests.helpers import SMALL, host_store, kv_for

BT = SMALL.block_tokens


def test_shared_system_prompt_is_reused_across_requests() -> None:
    system = list(range(100, 112))  # 3 blocks
    a, b = system + [1, 2, 3, 4, 5], system + [9, 9, 9, 9, 9, 9]
    with host_store() as st:
        assert st.lookup(a) == 0
        assert st.store(a, kv_for(a)) == 16
        assert st.lookup(b) == 12  # the system prompt, not b's own tail
        out = np.zeros(SMALL.kv_shape(len(b)), SMALL.storage_dtype)
        assert st.load(b, out) == 12
        assert np.array_equal(out[:, :, :12], kv_for(b)[:, :, :12])
        assert st.store(b, kv_for(b)) == 4  # the 3 shared blocks were skipped
        assert st.stats()["store"]["skipped_blocks"] == 3


def test_partial_block_is_not_cached() -> None:
    toks = list(range(7))
    with host_store() as st:
        assert st.store(toks, kv_for(toks)) == BT
        assert st.lookup(toks) == BT
        assert st.lookup(toks[:3]) == 0


def test_different_prefix_same_block_tokens_do_not_match() -> None:
    """A block's identity includes everything before it."""
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    b = [9, 9, 9, 9, 5, 6, 7, 8]
    with host_store() as st:
        st.store(a, kv_for(a))
        assert st.lookup(b) == 0


def test_tenants_are_isolated_unless_mapped_into_one_share_group() -> None:
    toks = list(range(8))
    with host_store() as st:
        st.store(toks, kv_for(toks), tenant="alice")
        assert st.lookup(toks, tenant="alice") == 8
        assert st.lookup(toks, tenant="bob") == 0
        assert st.stats()["tenants"]["alice"]["stored_tokens"] == 8
    with host_store(share_groups={"alice": "org", "bob": "org"}) as st:
        st.store(toks, kv_for(toks), tenant="alice")
        assert st.lookup(toks, tenant="bob") == 8
        assert st.lookup(toks, tenant="carol") == 0  # not in the group
        assert st.lookup(toks) == 0  # nor is the default tenant


def test_eviction_demotes_and_hit_promotes() -> None:
    with host_store(4, lower=32) as st:
        seqs = [[s] * 8 for s in range(1, 7)]  # 6 prompts x 2 blocks = 12 blocks > 4
        for s in seqs:
            st.store(s, kv_for(s))
        st.flush()
        assert all(st.lookup(s) == 8 for s in seqs)  # nothing lost: demoted to host2
        assert "host2" in st.locate(seqs[0])
        out = np.zeros(SMALL.kv_shape(8), SMALL.storage_dtype)
        assert st.load(seqs[0], out) == 8
        assert np.array_equal(out, kv_for(seqs[0]))
        st.flush()
        assert st.locate(seqs[0]) == ["host", "host"]  # promoted
        s = st.stats()["store"]
        assert s["demotions"] >= 8 and s["promotions"] >= 1


def test_block_falls_off_the_last_tier() -> None:
    with host_store(4) as st:
        for s in range(1, 5):
            st.store([s] * 8, kv_for([s] * 8))
        st.flush()
        assert st.lookup([1] * 8) == 0
        assert st.lookup([4] * 8) == 8


def test_parent_is_kept_over_its_child() -> None:
    """Prefix-aware eviction: a child is evicted before its parent."""
    with host_store(3) as st:
        long = list(range(12))
        st.store(long, kv_for(long))
        other = [50] * 4
        st.store(other, kv_for(other))  # forces one eviction
        st.flush()
        assert st.lookup(long) == 8  # the leaf went, the root stayed


def test_pinned_blocks_are_not_evicted() -> None:
    with host_store(4) as st:
        keep = [7] * 8
        st.store(keep, kv_for(keep))
        with st.pin(keep) as n:
            assert n == 8
            for s in range(1, 6):
                st.store([s] * 8, kv_for([s] * 8))
            assert st.lookup(keep) == 8


def test_bit_flip_is_a_miss_and_counted() -> None:
    toks = list(range(12))
    with host_store() as st:
        st.store(toks, kv_for(toks))
        host = st.tiers[0].inner
        assert isinstance(host, HostTier)
        slot = host._table.acquire(st_keys(st, toks)[1])
        assert slot is not None
        host.slot_view(slot)[3] ^= 0x40
        host._table.release(slot)
        out = np.zeros(SMALL.kv_shape(12), SMALL.storage_dtype)
        assert st.load(toks, out) == 4  # block 0 fine, block 1 corrupt -> prefix stops
        assert np.array_equal(out[:, :, :4], kv_for(toks)[:, :, :4])
        assert st.stats()["store"]["invalid_blocks"] == 1
        assert st.lookup(toks) == 4


def test_load_misses_count_in_the_token_hit_ratio_per_tenant() -> None:
    """Every full-block token a load asks for is a hit or a miss: not cached counts too."""
    bt = SMALL.block_tokens
    with host_store() as st:
        cached = list(range(2 * bt))
        st.store(cached, kv_for(cached), tenant="a")
        out = np.zeros(SMALL.kv_shape(4 * bt), SMALL.storage_dtype)
        assert st.load(list(range(1000, 1000 + 4 * bt)), out, tenant="a") == 0
        assert st.load([*cached, *range(500, 500 + 2 * bt + 1)], out, tenant="a") == 2 * bt
        st.lookup(cached, tenant="b")
        st.store(cached, kv_for(cached), tenant="a")  # all cached: skipped
        s = st.stats()
        a = s["tenants"]["a"]
        assert (a["loads"], a["hit_tokens"], a["miss_tokens"]) == (2, 2 * bt, 6 * bt)
        assert s["store"]["token_hit_ratio"] == 0.25 == a["token_hit_ratio"]
        assert a["skipped_blocks"] == 2 and s["tenants"]["b"]["lookups"] == 1
        # moves between tiers serve every tenant: counted in the store's totals only
        assert "evictions" in s["store"] and "evictions" not in a and "invalid_blocks" not in a
        # lookups: the request-level ratio of an engine that loads only what lookup found
        st.lookup([*cached, *range(900, 900 + 2 * bt)], tenant="a")
        a = st.stats()["tenants"]["a"]
        assert (a["lookup_tokens"], a["lookup_hit_tokens"], a["lookup_hit_ratio"]) == (
            4 * bt,
            2 * bt,
            0.5,
        )


def test_a_block_an_eviction_is_removing_is_a_miss_not_a_loss() -> None:
    """A reader that finds a victim already deleted by its (uncommitted) eviction counts a
    plain miss; the same block vanishing with no eviction is counted as lost."""
    layout = SMALL
    tiers = [HostTier(layout, 4 * layout.block_bytes), HostTier(layout, 4 * layout.block_bytes)]
    dec = Decider(tiers, "lru", layout.block_tokens)
    keys = [bytes([i]) * 32 for i in range(3)]
    for k in keys:
        dec.index.add_present([k], 1)
    reads = {k: dec.readable_prefix(iter([k]), 1) for k in keys}  # readers, before the evict
    assert all(len(r) == 1 for r in reads.values())
    moves: list[Move] = []  # the last tier drops its victims: the move deletes, apply commits
    dec.plan_eviction(1, [keys[0]], moves)
    assert [m.dst for m in moves] == [None]
    assert dec.readable_prefix(iter([keys[0]]), 1) == []  # a later reader does not count it
    for k in keys:
        dec.index.pin([k])
        dec.finish_load(reads[k], [False], 0, "t")  # none of them is in the tier
    # keys[0]: being evicted -> a miss; keys[1], keys[2]: listed present, unreadable -> lost
    assert dec.counters.invalid_blocks == 2


def st_keys(st: object, toks: list[int]) -> list[bytes]:
    from kvtier.keys import block_keys

    return list(block_keys(st.namespace(), toks))  # type: ignore[attr-defined]


def test_bad_input_is_rejected_and_nothing_stored() -> None:
    toks = list(range(8))
    with host_store() as st:
        with pytest.raises(TokenError):
            st.store([1.5] * 8, kv_for(toks))
        with pytest.raises(TokenError):
            st.lookup([-1, 2, 3, 4])
        with pytest.raises(TokenError):
            st.lookup([[1, 2], [3, 4]])
        with pytest.raises(LayoutError, match="dtype"):
            st.store(toks, kv_for(toks).astype(np.float32))
        with pytest.raises(LayoutError, match="shape"):
            st.store(toks, np.zeros((2, 2, 8, 3, 4), np.float16))
        with pytest.raises(LayoutError, match="covers"):
            st.store(toks[:4], kv_for(toks))
        with pytest.raises(LayoutError, match="5-D"):
            st.load(toks, np.zeros(10, np.float16))
        with pytest.raises(LayoutError, match="numpy"):
            st.store(toks, [[1]])
        # every id is checked on store, also past the last full block (never keyed), by position
        with pytest.raises(TokenError, match="-1 at position 9"):
            st.store([*toks, 3, -1], kv_for(toks))
        with pytest.raises(TokenError, match=r"2\.5 at position 6"):
            st.store([1, 2, 3, 4, 5, 6, 2.5, 8], kv_for(toks))
        assert st.lookup(toks) == 0
        assert st.stats()["store"]["stored_tokens"] == 0


def test_misconfigured_store_says_what_to_change() -> None:
    with pytest.raises(ConfigError, match="holds no block"):
        HostTier(SMALL, 10)
    with pytest.raises(ConfigError, match="policy"):
        host_store(policy="nope")


def test_concurrent_store_and_load_on_overlapping_prefixes() -> None:
    system = list(range(1000, 1016))
    errors: list[str] = []
    with host_store(12, lower=24) as st:

        def worker(seed: int) -> None:
            rng = np.random.default_rng(seed)
            for _ in range(40):
                toks = system[: 4 * int(rng.integers(1, 5))] + [
                    int(x) for x in rng.integers(0, 5, 8)
                ]
                if rng.random() < 0.5:
                    st.store(toks, kv_for(toks))
                else:
                    out = np.zeros(SMALL.kv_shape(len(toks)), SMALL.storage_dtype)
                    n = st.load(toks, out)
                    if not np.array_equal(out[:, :, :n], kv_for(toks)[:, :, :n]):
                        errors.append(f"wrong KV for {toks[:n]}")

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        st.flush()
    assert errors == []


def test_out_buffer_too_small_is_rejected() -> None:
    toks = list(range(12))
    with host_store() as st:
        st.store(toks, kv_for(toks))
        with pytest.raises(LayoutError, match="out holds 8 tokens"):
            st.load(toks, np.zeros(SMALL.kv_shape(8), SMALL.storage_dtype))
        out = np.zeros(SMALL.kv_shape(8), SMALL.storage_dtype)
        assert st.load(toks[:8], out) == 8


def test_store_from_toml_file_with_env_override(tmp_path: Path) -> None:
    cfg = tmp_path / "kvtier.toml"
    cfg.write_text(
        '[store]\nlayers = 2\nkv_heads = 2\nhead_dim = 4\ndtype = "fp16"\nblock_tokens = 4\n'
        'tenant = "acme"\nmodel_id = "m"\n\n[[tiers]]\nkind = "host"\ncapacity = "1MiB"\n'
    )
    with TieredStore.from_config(cfg, env={"KVTIER_TIER0_CAPACITY": "64KiB"}) as st:
        assert st.layout == SMALL
        assert st.tiers[0].capacity_blocks == 64 * 1024 // SMALL.block_bytes
        toks = list(range(8))
        st.store(toks, kv_for(toks))
        assert st.stats()["tenants"]["acme"]["stored_tokens"] == 8
    (tmp_path / "bad.toml").write_text("[store]\nlayers = 2\n[[tiers]]\nkind = 'host'\nsize = 1\n")
    with pytest.raises(ConfigError):
        TieredStore.from_config(tmp_path / "bad.toml")


def test_stats_per_tier_and_tenant_and_prometheus() -> None:
    from prometheus_client import REGISTRY

    toks = list(range(8))
    with host_store(metrics_port=0) as st:
        st.store(toks, kv_for(toks), tenant="t1")
        out = np.zeros(SMALL.kv_shape(8), SMALL.storage_dtype)
        st.load(toks, out, tenant="t1")
        st.lookup(list(range(100, 108)), tenant="t2")
        s = st.stats()
        host = s["tiers"]["host"]
        assert host["hits"] == 2 and host["bytes_read"] == 2 * SMALL.block_bytes
        assert host["tenants"]["t1"]["puts"] == 2
        assert s["tenants"]["t1"]["hit_tokens"] == 8
        assert s["store"]["token_hit_ratio"] == 1.0
    hits = REGISTRY.get_sample_value(
        "kvtier_blocks_total", {"tier": "host", "tenant": "t1", "op": "hit"}
    )
    assert hits is not None and hits >= 2


def test_calls_after_close_raise() -> None:
    st = host_store()
    st.close()
    st.close()  # idempotent
    for call in (
        lambda: st.lookup([1] * 8),
        lambda: st.prefetch([1] * 8),
        lambda: st.locate([1] * 8),
        lambda: st.store([1] * 4, kv_for([1] * 4)),
    ):
        with pytest.raises(RuntimeError, match="closed"):
            call()


def test_a_prompt_longer_than_a_lone_tier_keeps_its_head() -> None:
    """With nowhere to demote to, storing more blocks than the tier holds keeps the leading
    blocks (what a later prompt can reuse), not a tail whose parents were evicted."""
    toks = list(range(1000, 1000 + 10 * SMALL.block_tokens))
    with host_store(4) as st:
        assert st.store(toks, kv_for(toks)) == 4 * SMALL.block_tokens
        assert st.lookup(toks) == 4 * SMALL.block_tokens
        out = np.zeros(SMALL.kv_shape(len(toks)), SMALL.storage_dtype)
        assert st.load(toks, out) == 4 * SMALL.block_tokens
        assert np.array_equal(out[:, :, :16], kv_for(toks)[:, :, :16])
    with host_store(4, lower=16) as st:  # with a tier below, the whole prompt is kept
        assert st.store(toks, kv_for(toks)) == len(toks)
        st.flush()
        assert st.lookup(toks) == len(toks)
