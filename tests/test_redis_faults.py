"""The Redis tier when the server is unreachable, full, holds foreign values, or is misconfigured.

The contract under test: a dead or unreachable server (single or Cluster) is a miss and opens the
breaker; a request the server *refuses* (``OOM`` on a write, ``WRONGTYPE``) is a miss / a put not
stored for that block only, and leaves the tier in service; a URL that is not a Redis URL is a
``ConfigError`` at construction that names the key and never shows the password.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.cluster

from kvtier.errors import ConfigError
from kvtier.tiers.redis import RedisOptions, RedisTier, masked
from tests.servers import (
    ServerProcess,
    free_port,
    redis_server_process,
    require_binary,
    start_redis_cluster,
)
from tests.tier_conformance import LAYOUT, empty_block, rand_block, rand_key

pytestmark = [pytest.mark.server, pytest.mark.timeout(120)]
TIMEOUT_S = 0.5


def _prefix() -> str:
    return "f" + uuid.uuid4().hex[:12]


def _assert_all_misses(tier: RedisTier) -> None:
    """Every call answers a miss / False / nothing at once; no exception reaches the caller."""
    k, b, out = rand_key(), rand_block(), empty_block()
    assert tier.contains_prefix([k]) == 0
    assert tier.get_into([k], [out]) == [False]
    assert tier.put([k], [b]) == [False]
    tier.delete([k])
    assert tier.usage().used_blocks == 0


# -- a Redis Cluster nobody can reach ---------------------------------------------------------
@pytest.mark.parametrize("hash_tag", ["tenant", "block"])
def test_cluster_with_wrong_ports_is_a_miss(hash_tag: Any) -> None:
    """Nothing listens on the configured nodes: redis-py raises ``RedisClusterException``, which
    is no ``RedisError`` -- the tier must still answer misses, never raise."""
    nodes = (f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}")
    opts = RedisOptions(cluster=nodes, timeout=TIMEOUT_S, connect_timeout=TIMEOUT_S)
    tier = RedisTier(
        LAYOUT, opts, hash_tag=hash_tag, cooldown_s=0.0, secret=b"test-secret"
    )  # every call tries
    try:
        _assert_all_misses(tier)
        assert tier.breaker.trips >= 5
    finally:
        tier.close()


@pytest.fixture
def own_cluster() -> Iterator[list[ServerProcess]]:
    """A private 3-master cluster (this test kills it)."""
    require_binary("redis-server", "Debian package redis-server")
    nodes = start_redis_cluster(3)
    yield nodes
    for n in nodes:
        n.stop()


def test_cluster_with_every_master_dead_is_a_miss_then_recovers(
    own_cluster: list[ServerProcess],
) -> None:
    addrs = tuple(f"127.0.0.1:{n.port}" for n in own_cluster)
    opts = RedisOptions(cluster=addrs, timeout=TIMEOUT_S, connect_timeout=TIMEOUT_S)
    writer = RedisTier(
        LAYOUT, opts, prefix=_prefix(), cooldown_s=0.0, secret=b"test-secret"
    )  # every call tries
    try:
        k, b = rand_key(), rand_block(seed=1)
        assert writer.put([k], [b]) == [True]
        for n in own_cluster:
            n.kill()
        fresh = RedisTier(LAYOUT, opts, prefix=writer.prefix, cooldown_s=0.0, secret=b"test-secret")
        for tier in (fresh, writer):  # a client that never connected, and one that had
            _assert_all_misses(tier)
            _assert_all_misses(tier)
        for n in own_cluster:
            n.start()  # same ports and nodes.conf: the cluster re-forms, empty
        deadline = time.monotonic() + 30
        k2, out = rand_key(), empty_block()
        while fresh.put([k2], [b]) != [True]:
            assert time.monotonic() < deadline, "tier did not come back with the cluster"
            time.sleep(0.3)
        assert fresh.healthy and fresh.get_into([k2], [out]) == [True]
        assert out.tobytes() == b.tobytes()
        fresh.close()
    finally:
        writer.close()


def _timed(fn: Any) -> tuple[Any, float]:
    t0 = time.monotonic()
    result = fn()
    return result, time.monotonic() - t0


def test_a_hung_shard_costs_a_batch_about_one_timeout(own_cluster: list[ServerProcess]) -> None:
    """One master of three stops answering (SIGSTOP: the kernel still accepts, nothing replies)
    with blocks spread over every shard: a 64-key batch costs about one timeout, not one per key
    on that shard (redis-py resends each command of a shard that timed out on its own: ~20 x
    the timeout). The tier is back once the shard is."""
    for n in own_cluster:  # the others must not declare it failed (CLUSTERDOWN) mid-test
        redis.Redis(port=n.port).config_set("cluster-node-timeout", 60_000)
    timeout = 0.25
    addrs = tuple(f"127.0.0.1:{n.port}" for n in own_cluster)
    opts = RedisOptions(cluster=addrs, timeout=timeout, connect_timeout=timeout)
    tier = RedisTier(
        LAYOUT, opts, prefix=_prefix(), hash_tag="block", cooldown_s=0.0, secret=b"test-secret"
    )
    hung = own_cluster[1]
    assert hung.pid is not None
    try:
        keys = [rand_key() for _ in range(64)]
        blocks = [rand_block(seed=i) for i in range(64)]
        assert tier.put(keys, blocks) == [True] * 64
        os.kill(hung.pid, signal.SIGSTOP)
        ops = {
            "get_into": lambda: tier.get_into(keys, [empty_block() for _ in keys]),
            "contains_prefix": lambda: tier.contains_prefix(keys),
            "put": lambda: tier.put([rand_key() for _ in keys], blocks),
        }
        for name, op in ops.items():  # cooldown 0: every call is the trial, and reaches it
            got, took = _timed(op)
            assert not any(got) if isinstance(got, list) else got == 0
            # one timeout; two when a fresh connection's set-up times out and redis-py then
            # asks the hung node for the slot map
            assert took < 5 * timeout, f"{name} took {took:.2f}s at timeout {timeout}s"
        assert tier.breaker.trips == 3  # each call found it out
    finally:
        os.kill(hung.pid, signal.SIGCONT)
    try:
        assert tier.contains_prefix(keys) == 64 and tier.healthy
    finally:
        tier.close()


def test_a_moved_slot_is_followed_not_an_outage(own_cluster: list[ServerProcess]) -> None:
    """A slot changes owner after the client learned the slot map (resharding, failover): the
    old owner answers MOVED; the tier refreshes the map and resends -- a hit, breaker closed."""
    addrs = tuple(f"127.0.0.1:{n.port}" for n in own_cluster)
    tier = RedisTier(
        LAYOUT,
        RedisOptions(cluster=addrs),
        prefix=_prefix(),
        hash_tag="block",
        secret=b"test-secret",
    )
    try:
        assert tier.put([rand_key()], [rand_block()]) == [True]  # the slot map is known now
        client = tier.client()
        assert isinstance(client, redis.cluster.RedisCluster)
        k = rand_key()
        name = tier.redis_key(k, "")
        slot = client.keyslot(name)
        owner = client.get_node_from_key(name)
        nodes = {n.port: redis.Redis(port=n.port) for n in own_cluster}
        assert nodes[owner.port].execute_command("CLUSTER COUNTKEYSINSLOT", slot) == 0
        target = next(r for port, r in nodes.items() if port != owner.port)
        new_id = target.execute_command("CLUSTER MYID")
        for r in sorted(nodes.values(), key=lambda r: r is not target):  # new owner first
            r.execute_command("CLUSTER SETSLOT", slot, "NODE", new_id)
        b, out = rand_block(seed=5), empty_block()
        assert tier.put([k], [b]) == [True]
        assert tier.get_into([k], [out]) == [True] and out.tobytes() == b.tobytes()
        assert tier.contains_prefix([k]) == 1
        assert tier.healthy and tier.breaker.trips == 0
        assert client.get_node_from_key(name).port != owner.port
    finally:
        tier.close()


# -- a full server (maxmemory + noeviction) ---------------------------------------------------
@pytest.fixture
def full_server() -> Iterator[ServerProcess]:
    server = redis_server_process(
        None, "--maxmemory", "2mb", "--maxmemory-policy", "noeviction"
    ).start()
    yield server
    server.stop()


def test_full_server_refuses_puts_and_keeps_serving_reads(full_server: ServerProcess) -> None:
    url = f"redis://127.0.0.1:{full_server.port}"
    tier = RedisTier(
        LAYOUT, RedisOptions(url=url), prefix=_prefix(), cooldown_s=60.0, secret=b"test-secret"
    )
    try:
        k0, b0 = rand_key(), rand_block(seed=7)
        assert tier.put([k0], [b0]) == [True]
        stored = refused = 0
        for i in range(100):  # 64 x 2 KiB blocks a batch: OOM well before 13 MB
            result = tier.put([rand_key() for _ in range(64)], [rand_block(seed=i)] * 64)
            stored += sum(result)
            refused += result.count(False)
            if refused:
                break
        assert refused and stored  # it filled up, then refused
        assert tier.refusals >= refused
        # the server is up and answering: the breaker stays closed, reads still hit
        assert tier.breaker.trips == 0 and tier.healthy
        out = empty_block()
        assert tier.contains_prefix([k0]) == 1
        assert tier.get_into([k0], [out]) == [True] and out.tobytes() == b0.tobytes()
        assert tier.put([rand_key()], [b0]) == [False]  # still full: that put is False
        assert tier.get_into([k0, rand_key()], [out, empty_block()]) == [True, False]
        assert tier.breaker.trips == 0 and tier.breaker.skipped == 0
    finally:
        tier.close()


# -- a foreign value of another Redis type at a block's key -----------------------------------
@pytest.fixture(params=["single", "cluster-tenant", "cluster-block"])
def any_redis(request: pytest.FixtureRequest) -> RedisTier:
    if request.param == "single":
        opts = RedisOptions(url=request.getfixturevalue("redis_url"))
    else:
        opts = RedisOptions(cluster=tuple(request.getfixturevalue("redis_cluster")))
    tag = "block" if request.param == "cluster-block" else "tenant"
    return RedisTier(
        LAYOUT, opts, prefix=_prefix(), hash_tag=tag, cooldown_s=60.0, secret=b"test-secret"
    )


def test_wrong_type_value_is_a_dropped_miss_and_nothing_else(any_redis: RedisTier) -> None:
    tier = any_redis
    try:
        keys = [rand_key() for _ in range(3)]
        blocks = [rand_block(seed=i) for i in range(3)]
        assert tier.put(keys, blocks, tenant="acme") == [True] * 3
        other = rand_key()
        assert tier.put([other], [blocks[0]], tenant="beta") == [True]
        client: Any = tier.client()
        name = tier.redis_key(keys[1], "acme")
        client.delete(name)
        client.rpush(name, "not a block")
        outs = [empty_block() for _ in keys]
        # one batch: the WRONGTYPE key is a miss, its neighbours are hits
        assert tier.get_into(keys, outs, tenant="acme") == [True, False, True]
        assert outs[0].tobytes() == blocks[0].tobytes()
        assert outs[2].tobytes() == blocks[2].tobytes()
        assert client.exists(name) == 0  # garbage at our key name: dropped, as a corrupt block
        assert tier.breaker.trips == 0 and tier.healthy and tier.refusals == 1
        assert tier.contains_prefix(keys, tenant="acme") == 1
        assert tier.get_into([other], [outs[0]], tenant="beta") == [True]
        assert tier.put([keys[1]], [blocks[1]], tenant="acme") == [True]  # the slot is usable
        assert tier.get_into(keys, outs, tenant="acme") == [True] * 3
    finally:
        tier.close()


def test_refused_connection_setup_opens_the_breaker(redis_url: str) -> None:
    """``SELECT`` of a db the server lacks: every connection fails, so it is an outage."""
    tier = RedisTier(
        LAYOUT, RedisOptions(url=f"{redis_url}/99"), cooldown_s=60.0, secret=b"test-secret"
    )
    try:
        _assert_all_misses(tier)
        assert not tier.healthy and tier.breaker.trips == 1 and tier.refusals == 0
    finally:
        tier.close()


# -- URLs -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:6379",
        "not a url",
        "",
        "redis://127.0.0.1:notaport",
        "redis://127.0.0.1:99999",
        "redis://127.0.0.1:6379/0?db=zero",
        "redis://127.0.0.1:6379/0?colour=red",
        "redis://127.0.0.1:6379/0?protocol=x",
    ],
)
def test_bad_url_is_a_config_error(url: str) -> None:
    with pytest.raises(ConfigError, match="url"):
        RedisOptions(url=url)
    with pytest.raises(ConfigError, match="url"):
        RedisTier.from_config(LAYOUT, {"url": url})


@pytest.mark.parametrize(
    "url",
    [
        "http://kv:hunter2@127.0.0.1:6379",
        "redis://:hunter2@127.0.0.1:notaport",
        "redis://hunter2@127.0.0.1:6379/0?colour=red",
        "kv:hunter2@127.0.0.1:6379",
    ],
)
def test_bad_url_error_never_shows_the_password(url: str) -> None:
    with pytest.raises(ConfigError, match=r"url .*\*\*\*") as err:
        RedisTier.from_config(LAYOUT, {"url": url})
    assert "hunter2" not in str(err.value)


def test_masked() -> None:
    assert masked("redis://kv:pw@h:1/0") == "redis://kv:***@h:1/0"
    assert masked("rediss://:pw@h") == "rediss://:***@h"
    assert masked("redis://pw@h") == "redis://***@h"
    assert masked("redis://h:1/0") == "redis://h:1/0"
    assert masked("redis://kv:p@ss@h") == "redis://kv:***@h"  # an unescaped @ in the password
    assert masked("kv:pw@h:1") == "kv:***@h:1"  # no scheme


def test_bad_cluster_node_and_unix_with_tls_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="host:port"):
        RedisOptions(cluster=("127.0.0.1:99999",))
    with pytest.raises(ConfigError, match="unix"):
        RedisOptions(url="unix:///tmp/redis.sock", tls=True)


def test_unix_socket_url_works() -> None:
    server = redis_server_process(None, "--unixsocket", "{dir}/redis.sock").start()
    try:
        url = f"unix://{server.workdir}/redis.sock"
        tier = RedisTier(LAYOUT, RedisOptions(url=url), prefix=_prefix(), secret=b"test-secret")
        k, b, out = rand_key(), rand_block(seed=5), empty_block()
        assert tier.put([k], [b]) == [True] and tier.get_into([k], [out]) == [True]
        assert out.tobytes() == b.tobytes()
        assert redis.Redis(unix_socket_path=f"{server.workdir}/redis.sock").exists(
            tier.redis_key(k, "")
        )
        tier.close()
    finally:
        server.stop()
