"""The Redis tier against real servers: a single redis-server and a 3-master Redis Cluster."""

from __future__ import annotations

import gc
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.cluster

from kvtier.errors import ConfigError
from kvtier.keys import BlockKey
from kvtier.layout import KVLayout
from kvtier.tiers.base import Tier
from kvtier.tiers.redis import RedisOptions, RedisTier
from kvtier.tiers.registry import make_tier
from tests.servers import redis_server_process
from tests.tier_conformance import (
    LAYOUT,
    TierConformance,
    assert_round_trip,
    rand_block,
    rand_key,
)

pytestmark = pytest.mark.server


def _prefix() -> str:
    return "t" + uuid.uuid4().hex[:12]  # each tier instance gets its own key space


def _flip_byte(client: Any, name: str, offset: int) -> bool:
    value = client.get(name)
    if value is None:
        return False
    client.setrange(name, offset, bytes([value[offset] ^ 0x10]))
    return True


class TestRedisSingle(TierConformance):
    @pytest.fixture(autouse=True)
    def _server(self, redis_url: str) -> None:
        self.url = redis_url

    def make_tier(self, layout: KVLayout, capacity_blocks: int, tmp_path: Path) -> Tier:
        return RedisTier(
            layout, RedisOptions(url=self.url), prefix=_prefix(), secret=b"test-secret"
        )

    def corrupt(self, tier: Tier, key: BlockKey) -> bool:
        assert isinstance(tier, RedisTier)
        return _flip_byte(tier.client(), tier.redis_key(key, ""), 100)


class TestRedisCluster(TierConformance):
    @pytest.fixture(autouse=True)
    def _server(self, redis_cluster: list[str]) -> None:
        self.nodes = tuple(redis_cluster)

    def make_tier(self, layout: KVLayout, capacity_blocks: int, tmp_path: Path) -> Tier:
        return RedisTier(
            layout, RedisOptions(cluster=self.nodes), prefix=_prefix(), secret=b"test-secret"
        )

    def corrupt(self, tier: Tier, key: BlockKey) -> bool:
        assert isinstance(tier, RedisTier)
        return _flip_byte(tier.client(), tier.redis_key(key, ""), 100)


class TestRedisClusterSpread(TestRedisCluster):
    """``hash_tag = "block"``: blocks spread over all shards."""

    def make_tier(self, layout: KVLayout, capacity_blocks: int, tmp_path: Path) -> Tier:
        return RedisTier(
            layout,
            RedisOptions(cluster=self.nodes),
            prefix=_prefix(),
            hash_tag="block",
            secret=b"test-secret",
        )


def _calls(client: redis.Redis, command: str) -> int:
    stats = client.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


def test_prefix_lookup_of_128k_token_prompt_is_one_command(redis_url: str) -> None:
    """512 blocks of 256 tokens: ``contains_prefix`` is ONE script call (one round trip)."""
    lay = KVLayout(layers=1, kv_heads=1, head_dim=8, dtype="float16", block_tokens=256)
    tier = RedisTier(lay, RedisOptions(url=redis_url), prefix=_prefix(), secret=b"test-secret")
    try:
        keys = [rand_key() for _ in range(512)]
        block = rand_block(lay, seed=1)
        assert all(tier.put(keys[:500], [block] * 500))
        assert tier.contains_prefix(keys[:1]) == 1  # warm up: loads the script once
        admin = redis.Redis.from_url(redis_url)
        before = {c: _calls(admin, c) for c in ("evalsha", "exists", "get", "eval")}
        assert tier.contains_prefix(keys) == 500
        after = {c: _calls(admin, c) for c in before}
        assert after["evalsha"] - before["evalsha"] == 1
        assert after["get"] == before["get"] and after["eval"] == before["eval"]
    finally:
        tier.close()


def test_cluster_keys_of_one_tenant_share_a_slot(redis_cluster: list[str]) -> None:
    tier = RedisTier(
        LAYOUT, RedisOptions(cluster=tuple(redis_cluster)), prefix=_prefix(), secret=b"test-secret"
    )
    try:
        client = tier.client()
        assert isinstance(client, redis.cluster.RedisCluster)
        slots = {client.keyslot(tier.redis_key(rand_key(), "acme")) for _ in range(20)}
        assert len(slots) == 1
        keys = [rand_key() for _ in range(4)]
        assert tier.put(keys, [rand_block(seed=i) for i in range(4)], tenant="acme") == [True] * 4
        assert tier.contains_prefix(keys, tenant="acme") == 4
        assert tier.contains_prefix(keys, tenant="other") == 0
    finally:
        tier.close()


def test_ttl_expires_blocks(redis_url: str) -> None:
    tier = RedisTier(
        LAYOUT, RedisOptions(url=redis_url), prefix=_prefix(), ttl_s=100, secret=b"test-secret"
    )
    try:
        k = rand_key()
        tier.put([k], [rand_block()])
        ttl = int(tier.client().ttl(tier.redis_key(k, "")))
        assert 0 < ttl <= 100
    finally:
        tier.close()


@pytest.mark.parametrize("mode", ["single", "cluster"])
def test_close_closes_the_tiers_connections(mode: str, request: pytest.FixtureRequest) -> None:
    """redis-py's close() leaves open a connection pool it was given (ours all are): a node
    that builds and closes tiers must not pile up connections on the server."""
    if mode == "single":
        url = request.getfixturevalue("redis_url")
        opts, ports = RedisOptions(url=url), [int(url.rsplit(":", 1)[1])]
    else:
        nodes = tuple(request.getfixturevalue("redis_cluster"))
        opts, ports = RedisOptions(cluster=nodes), [int(n.rsplit(":", 1)[1]) for n in nodes]
    admins = [redis.Redis(port=p) for p in ports]

    def connected() -> int:
        return sum(int(a.info("clients")["connected_clients"]) for a in admins)

    gc.collect()  # connections of tiers other tests dropped go now, not mid-count
    before = connected()
    tiers = [
        RedisTier(LAYOUT, opts, prefix=_prefix(), hash_tag="block", secret=b"test-secret")
        for _ in range(3)
    ]
    for tier in tiers:
        keys = [rand_key() for _ in range(8)]
        assert tier.put(keys, [rand_block()] * 8) == [True] * 8
        assert tier.contains_prefix(keys) == 8
    assert connected() >= before + len(tiers)
    for tier in tiers:
        tier.close()
    deadline = time.monotonic() + 2.0
    while connected() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert connected() == before


def test_from_config_via_registry(redis_url: str) -> None:
    spec = {"kind": "redis", "url": redis_url, "prefix": _prefix(), "ttl": 60}
    with pytest.raises(ConfigError, match="trust_pool"):
        make_tier(LAYOUT, spec)  # neither a secret nor encryption: refused
    tier = make_tier(LAYOUT, spec, secret=b"deployment secret")  # the store's secret
    try:
        assert isinstance(tier, RedisTier) and tier.shared and not tier.persistent
        assert_round_trip(tier, seed=3)
    finally:
        tier.close()


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ({"url": "redis://x", "colour": "red"}, "colour"),
        ({"hash_tag": "slot", "secret": "s"}, "hash_tag"),
        ({"url": "redis://127.0.0.1:1"}, "trust_pool = true"),  # neither secret nor encryption
        ({"secret": 5}, "secret"),
        ({"secret": "s", "trust_pool": "maybe"}, "trust_pool"),
        ({"cluster": ["nohost"]}, "host:port"),
        ({"encryption_key": "zz"}, "hex"),
        ({"timeout": 0}, "timeout"),
        ({"url": "http://127.0.0.1:6379"}, "url"),
    ],
)
def test_bad_config_names_the_problem(spec: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        RedisTier.from_config(LAYOUT, spec)


def test_auth_password_is_passed_through(tmp_path: Path) -> None:
    """A server with ``requirepass``: wrong password -> misses and unhealthy; right one works."""

    server = redis_server_process(None, "--requirepass", "s3cret").start()
    try:
        url = f"redis://127.0.0.1:{server.port}/0"
        bad = RedisTier(
            LAYOUT, RedisOptions(url=url, password="wrong"), prefix=_prefix(), secret=b"test-secret"
        )
        good = RedisTier(
            LAYOUT,
            RedisOptions(url=url, password="s3cret"),
            prefix=_prefix(),
            secret=b"test-secret",
        )
        k = rand_key()
        assert bad.put([k], [rand_block()]) == [False] and not bad.healthy
        assert good.put([k], [rand_block()]) == [True] and good.healthy
        bad.close()
        good.close()
    finally:
        server.stop()
