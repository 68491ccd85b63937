"""Block identity (``kvtier.identity``): every field that changes a block's bytes separates key
spaces; bad identity input is a ``ConfigError`` naming the field, and nothing is stored."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvtier.errors import ConfigError, LayoutError
from kvtier.identity import Identity, Namespace, Scope
from kvtier.keys import block_keys
from kvtier.store import TieredStore
from kvtier.tiers.host import HostTier
from tests.helpers import SMALL, host_store, kv_for

TOKS = list(range(100, 116))  # 4 blocks of SMALL


def keys(identity: Identity, scope: Scope | None = None, **kw: Any) -> list[bytes]:
    return list(block_keys(Namespace(identity, SMALL, scope or Scope("t"), **kw), TOKS))


BASE = Identity("org/model")


@pytest.mark.parametrize(
    "other",
    [
        Identity("org/model-2"),
        Identity("org/model", revision="v2"),
        Identity("org/model", tp_rank=1, tp_size=2),
        Identity("org/model", tp_rank=0, tp_size=2),
        Identity("org/model", pp_rank=1, pp_size=2),
        Identity("org/model", engine_tag="vllm-cpu:block128:avx512"),
        Identity("org/model", model_fingerprint="hf:rope-theta-1e6"),
    ],
)
def test_every_identity_field_separates_key_spaces(other: Identity) -> None:
    assert not set(keys(BASE)) & set(keys(other))


def test_tp_ranks_differ_unless_the_layout_is_rank_agnostic() -> None:
    r0, r1 = (Identity("m", tp_rank=r, tp_size=2) for r in (0, 1))
    assert not set(keys(r0)) & set(keys(r1))
    a0, a1 = (Identity("m", tp_rank=r, tp_size=2, rank_agnostic=True) for r in (0, 1))
    assert keys(a0) == keys(a1)  # e.g. an MLA latent, the same on every rank
    p0, p1 = (Identity("m", pp_rank=s, pp_size=2, rank_agnostic=True) for s in (0, 1))
    assert not set(keys(p0)) & set(keys(p1))  # stages hold other layers: never agnostic


def test_adapters_salts_and_tenants_separate_key_spaces() -> None:
    scopes = [
        Scope("t"),
        Scope("t", adapter="lora-a"),
        Scope("t", adapter="lora-b"),
        Scope("t", salt="user-1"),
        Scope("t", salt=b"user-1"),  # bytes and text salts are different salts
        Scope("t", salt="user-2"),
        Scope("u"),
    ]
    seen = [set(keys(BASE, s)) for s in scopes]
    for i, a in enumerate(seen):
        for b in seen[i + 1 :]:
            assert not a & b


def test_field_values_cannot_be_shifted_between_fields() -> None:
    """A length-prefixed encoding: no two field assignments collide by concatenation."""
    assert keys(Identity("ab", revision="c")) != keys(Identity("a", revision="bc"))
    assert keys(BASE, Scope("t", adapter="x")) != keys(BASE, Scope("t", salt="x"))


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"model_id": ""}, "model_id"),
        ({"model_id": 5}, "model_id"),
        ({"model_id": "m", "revision": 3}, "revision"),
        ({"model_id": "m", "tp_rank": 2, "tp_size": 2}, "tp_rank"),
        ({"model_id": "m", "tp_size": 0}, "tp_size"),
        ({"model_id": "m", "tp_rank": True}, "tp_rank"),
        ({"model_id": "m", "pp_rank": -1}, "pp_rank"),
        ({"model_id": "m", "engine_tag": b"x"}, "engine_tag"),
        ({"model_id": "m", "model_fingerprint": 1.5}, "model_fingerprint"),
        ({"model_id": "m", "rank_agnostic": "yes"}, "rank_agnostic"),
        ({"model_id": "m\x00"}, "model_id"),
    ],
)
def test_bad_identity_fields_name_the_field(kw: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        Identity(**kw)


def test_a_store_without_a_model_id_says_what_to_set() -> None:
    with pytest.raises(ConfigError, match="model_id="):
        TieredStore(SMALL, [HostTier(SMALL, 4 * SMALL.block_bytes)])
    with pytest.raises(ConfigError, match="not both"):
        TieredStore(SMALL, [HostTier(SMALL, 4 * SMALL.block_bytes)], identity=BASE, model_id="x")


@pytest.mark.parametrize(
    ("scope", "field"),
    [
        ({"tenant": ""}, "tenant"),
        ({"tenant": 0}, "tenant"),
        ({"tenant": False}, "tenant"),
        ({"tenant": 5}, "tenant"),
        ({"adapter": ""}, "adapter"),
        ({"adapter": 7}, "adapter"),
        ({"salt": ""}, "salt"),
        ({"salt": 3}, "salt"),
        ({"salt": ["x"]}, "salt"),
    ],
)
def test_bad_per_call_scope_is_an_error_and_nothing_is_stored(
    scope: dict[str, Any], field: str
) -> None:
    with host_store() as st:
        st.store(TOKS, kv_for(TOKS))  # the default tenant's blocks, which must not leak
        others = list(range(500, 516))
        for call in (
            lambda: st.store(others, kv_for(others), **scope),
            lambda: st.lookup(TOKS, **scope),
            lambda: st.load(TOKS, np.zeros(SMALL.kv_shape(16), SMALL.storage_dtype), **scope),
            lambda: st.prefetch(TOKS, **scope),
            lambda: st.lease(TOKS, **scope),
        ):
            with pytest.raises(ConfigError, match=field):
                call()
        with pytest.raises(ConfigError, match=field), st.pin(TOKS, **scope):
            pass
        assert st.lookup(others) == 0 and st.stats()["store"]["stored_tokens"] == 16


def test_per_call_adapter_and_salt_scope_a_request() -> None:
    with host_store() as st:
        assert st.store(TOKS, kv_for(TOKS), adapter="lora-a", salt="alice") == 16
        assert st.lookup(TOKS, adapter="lora-a", salt="alice") == 16
        assert st.lookup(TOKS, adapter="lora-a") == 0
        assert st.lookup(TOKS, salt="alice") == 0
        assert st.lookup(TOKS, adapter="lora-b", salt="alice") == 0
        assert st.lookup(TOKS, "other", adapter="lora-a", salt="alice") == 0
        with st.pin(TOKS, adapter="lora-a", salt="alice") as n:
            assert n == 16
        out = np.zeros(SMALL.kv_shape(16), SMALL.storage_dtype)
        assert st.load(TOKS, out, adapter="lora-a", salt="alice") == 16
        assert np.array_equal(out, kv_for(TOKS))


def test_load_and_store_from_an_offset_skip_what_the_engine_holds() -> None:
    bt = SMALL.block_tokens
    kv = kv_for(TOKS)
    with host_store() as st:
        # the engine stored the first block earlier; now it stores only what follows
        assert st.store(TOKS[:bt], kv[:, :, :bt]) == bt
        assert st.store(TOKS, kv[:, :, bt:], start=bt) == 3 * bt
        assert st.lookup(TOKS) == 4 * bt
        assert st.lookup(TOKS, start=2 * bt) == 4 * bt
        out = np.zeros(SMALL.kv_shape(2 * bt), SMALL.storage_dtype)
        assert st.load(TOKS, out, start=2 * bt) == 4 * bt  # tokens [8, 16) into out[:, :, :8]
        assert np.array_equal(out, kv[:, :, 2 * bt :])
        with pytest.raises(LayoutError, match="multiple of block_tokens"):
            st.load(TOKS, out, start=3)
        with pytest.raises(LayoutError, match="past the"):
            st.lookup(TOKS, start=5 * bt)
        with pytest.raises(LayoutError, match="covers"):
            st.store(TOKS, kv, start=bt)  # kv would run past the tokens


def test_an_offset_does_not_need_the_blocks_before_it() -> None:
    """vLLM holds the first blocks in its own cache; kvtier may have evicted them."""
    bt = SMALL.block_tokens
    kv = kv_for(TOKS)
    with host_store() as st:
        assert st.store(TOKS, kv[:, :, 2 * bt :], start=2 * bt) == 2 * bt
        assert st.lookup(TOKS) == 0  # the chain from the start is not cached
        assert st.lookup(TOKS, start=2 * bt) == 4 * bt
        out = np.zeros(SMALL.kv_shape(2 * bt), SMALL.storage_dtype)
        assert st.load(TOKS, out, start=2 * bt) == 4 * bt
        assert np.array_equal(out, kv[:, :, 2 * bt :])


def test_a_lease_holds_a_prefix_until_released() -> None:
    with host_store(4) as st:  # room for exactly one 4-block prompt
        st.store(TOKS, kv_for(TOKS))
        lease = st.lease(TOKS)
        assert (lease.start, lease.end, lease.tokens) == (0, 16, 16)
        others = list(range(900, 916))
        assert st.store(others, kv_for(others)) == 0  # every block is leased: no room
        assert st.lookup(TOKS) == 16
        lease.release()
        lease.release()  # idempotent
        assert st.store(others, kv_for(others)) == 16
        assert st.lookup(TOKS) == 0
        with st.lease(others, start=8) as tail:
            assert (tail.start, tail.end) == (8, 16)
        assert not tail.held


def test_share_groups_are_per_tenant_from_config() -> None:
    raw = {
        "store": {
            "layers": 2,
            "kv_heads": 2,
            "head_dim": 4,
            "dtype": "fp16",
            "block_tokens": 4,
            "model_id": "m",
            "share_groups": {"alice": "g", "bob": "g"},
        },
        "tiers": [{"kind": "host", "capacity": "64KiB"}],
    }
    with TieredStore.from_config(raw, env={}) as st:
        st.store(TOKS, kv_for(TOKS), tenant="alice")
        assert st.lookup(TOKS, tenant="bob") == 16
        assert st.lookup(TOKS, tenant="carol") == 0
        assert st.lookup(TOKS) == 0
        assert st.stats()["identity"]["model_id"] == "m"
