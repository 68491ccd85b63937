"""Tenants on a shared tier: isolation, encryption that authenticates, quotas that refuse loudly.

Run against the real Redis server (the Redis tier is the shared pool); the sealing and quota
code is the same for every remote tier.
"""

from __future__ import annotations

import logging
import uuid

import pytest

from kvtier.layout import KVLayout
from kvtier.tiers.redis import RedisOptions, RedisTier
from kvtier.tiers.secure import BlockSealer, TenantQuotas
from tests.tier_conformance import LAYOUT, empty_block, rand_block, rand_key

pytestmark = pytest.mark.server
MASTER = bytes(range(32))


def make(url: str, prefix: str, **kw: object) -> RedisTier:
    kw.setdefault("secret", b"test-secret") if "sealer" not in kw else None
    return RedisTier(LAYOUT, RedisOptions(url=url), prefix=prefix, **kw)  # type: ignore[arg-type]


@pytest.fixture
def prefix() -> str:
    return "sec" + uuid.uuid4().hex[:10]


def test_tenant_b_cannot_hit_tenant_a_blocks(redis_url: str, prefix: str) -> None:
    tier = make(redis_url, prefix, sealer=BlockSealer(LAYOUT, MASTER))
    try:
        keys = [rand_key() for _ in range(3)]
        blocks = [rand_block(seed=i) for i in range(3)]
        assert tier.put(keys, blocks, tenant="alice") == [True] * 3
        assert tier.contains_prefix(keys, tenant="alice") == 3
        assert tier.contains_prefix(keys, tenant="bob") == 0
        assert tier.get_into(keys, [empty_block() for _ in keys], tenant="bob") == [False] * 3
        outs = [empty_block() for _ in keys]
        assert tier.get_into(keys, outs, tenant="alice") == [True] * 3
        assert [o.tobytes() for o in outs] == [b.tobytes() for b in blocks]
    finally:
        tier.close()


def test_ciphertext_moved_to_another_tenant_fails_authentication(
    redis_url: str, prefix: str
) -> None:
    """An attacker with server access copies alice's value under bob's key: bob gets a miss."""
    tier = make(redis_url, prefix, sealer=BlockSealer(LAYOUT, MASTER))
    try:
        k, b = rand_key(), rand_block(seed=1)
        tier.put([k], [b], tenant="alice")
        client = tier.client()
        stolen = client.get(tier.redis_key(k, "alice"))
        assert b.tobytes() not in stolen  # encrypted at rest
        client.set(tier.redis_key(k, "bob"), stolen)
        assert tier.contains_prefix([k], tenant="bob") == 1  # present...
        assert tier.get_into([k], [empty_block()], tenant="bob") == [False]  # ...but a miss
        out = empty_block()  # alice's own copy is untouched
        assert tier.get_into([k], [out], tenant="alice") == [True] and out.tobytes() == b.tobytes()
        other = rand_key()  # same tenant, another block key
        client.set(tier.redis_key(other, "alice"), stolen)
        assert tier.get_into([other], [empty_block()], tenant="alice") == [False]
    finally:
        tier.close()


@pytest.mark.parametrize("offset", [10, 64 + 3, 64 + 12 + 5, -1])  # header, nonce, body, tag
def test_tampered_ciphertext_is_a_miss(redis_url: str, prefix: str, offset: int) -> None:
    tier = make(redis_url, prefix, sealer=BlockSealer(LAYOUT, MASTER))
    try:
        k = rand_key()
        tier.put([k], [rand_block(seed=2)], tenant="alice")
        client = tier.client()
        name = tier.redis_key(k, "alice")
        value = bytearray(client.get(name))
        value[offset] ^= 0x01
        client.set(name, bytes(value))
        assert tier.get_into([k], [empty_block()], tenant="alice") == [False]
    finally:
        tier.close()


def test_reader_with_another_master_key_misses_without_destroying(
    redis_url: str, prefix: str
) -> None:
    writer = make(redis_url, prefix, sealer=BlockSealer(LAYOUT, MASTER))
    wrong = make(redis_url, prefix, sealer=BlockSealer(LAYOUT, b"x" * 32))
    plain = make(redis_url, prefix)
    try:
        k, b = rand_key(), rand_block(seed=3)
        writer.put([k], [b], tenant="alice")
        assert wrong.get_into([k], [empty_block()], tenant="alice") == [False]
        assert plain.get_into([k], [empty_block()], tenant="alice") == [False]
        out = empty_block()  # the plaintext reader left the block alone
        assert writer.get_into([k], [out], tenant="alice") == [True]
        assert out.tobytes() == b.tobytes()
    finally:
        for t in (writer, wrong, plain):
            t.close()


def test_explicit_tenant_key_overrides_derivation() -> None:
    lay = KVLayout(layers=1, kv_heads=1, head_dim=8, block_tokens=4)
    k, b = rand_key(), rand_block(lay, seed=1)
    given = BlockSealer(lay, MASTER, {"alice": b"k" * 32})
    derived = BlockSealer(lay, MASTER)
    value = given.seal(k, b, "alice")
    assert value is not None
    assert derived.open_into(k, value, empty_block(lay), "alice") is False
    out = empty_block(lay)
    assert given.open_into(k, value, out, "alice") and out.tobytes() == b.tobytes()
    only_alice = BlockSealer(lay, b"", {"alice": b"k" * 32})
    assert only_alice.seal(k, b, "bob") is None  # no key for bob: refused, never plaintext


def test_quota_refusal_is_counted_logged_and_reported(
    redis_url: str, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    quotas = TenantQuotas(default_bytes=2 * LAYOUT.block_bytes, name="redis")
    tier = make(redis_url, prefix, quotas=quotas)
    try:
        keys = [rand_key() for _ in range(4)]
        with caplog.at_level(logging.WARNING):
            got = tier.put(keys[:3], [rand_block(seed=i) for i in range(3)], tenant="alice")
        assert got == [True, True, False]
        assert quotas.refusals() == {"alice": 1}
        assert "quota refusal" in caplog.text and "alice" in caplog.text
        assert tier.contains_prefix(keys[2:3], tenant="alice") == 0  # refused = not stored
        assert tier.put(keys[:1], [rand_block()], tenant="alice") == [True]  # present: no charge
        assert tier.put(keys[3:], [rand_block()], tenant="bob") == [True]  # bob has his own
        tier.delete(keys[:1], tenant="alice")  # deleting refunds
        assert tier.put(keys[2:3], [rand_block()], tenant="alice") == [True]
        assert quotas.used("alice") == 2 * LAYOUT.block_bytes
    finally:
        tier.close()


def test_framed_plain_block_is_sealed_in_place() -> None:
    """A framed block's value is its own buffer (header written into the room, no copy), and it
    opens like a copied one."""
    import numpy as np

    from kvtier import codec
    from kvtier.keys import BlockKey
    from kvtier.tiers.secure import BlockSealer
    from tests.helpers import SMALL

    sealer = BlockSealer(SMALL, b"")
    key = BlockKey(bytes(range(32)))
    block = codec.framed_empty(SMALL.block_bytes)
    block[:] = np.arange(block.size, dtype=np.uint8)
    value = sealer.seal(key, block, "t")
    assert value is not None and len(value) == sealer.value_bytes
    room = codec.header_room(block)
    assert room is not None
    assert np.frombuffer(value, np.uint8).ctypes.data == room.ctypes.data  # no copy
    copied = sealer.seal(key, block.copy(), "t")  # a plain array: a copied value
    assert copied is not None and bytes(copied) == bytes(value)
    out = np.zeros(SMALL.block_bytes, np.uint8)
    assert sealer.open_into(key, value, out, "t") and out.tobytes() == block.tobytes()
