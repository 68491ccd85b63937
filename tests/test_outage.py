"""A shared-tier server dies mid-run and comes back: misses (never exceptions), then recovery.

Each test owns its server (started on a free port, killed with SIGKILL by PID, restarted on the
same port). The only time bound asserted is a generous "it did not hang" ceiling: every call
against a dead server must return within a small multiple of the configured timeout.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from kvtier.layout import KVLayout
from kvtier.store import TieredStore
from kvtier.tiers.base import Tier
from kvtier.tiers.breaker import CircuitBreaker
from kvtier.tiers.host import HostTier
from kvtier.tiers.redis import RedisOptions, RedisTier
from kvtier.tiers.s3 import S3Options, S3Tier
from tests.servers import ServerProcess, redis_server_process, s3_server_process
from tests.tier_conformance import LAYOUT, empty_block, rand_block, rand_key

pytestmark = [pytest.mark.server, pytest.mark.timeout(120)]
TIMEOUT_S = 0.5
COOLDOWN_S = 1.0
HANG_CEILING_S = 10 * TIMEOUT_S


@pytest.fixture
def redis_proc() -> Iterator[ServerProcess]:
    server = redis_server_process().start()
    yield server
    server.stop()


@pytest.fixture
def s3_proc() -> Iterator[ServerProcess]:
    server = s3_server_process().start()
    yield server
    server.stop()


def _redis(server: ServerProcess) -> RedisTier:
    opts = RedisOptions(
        url=f"redis://127.0.0.1:{server.port}", timeout=TIMEOUT_S, connect_timeout=TIMEOUT_S
    )
    return RedisTier(LAYOUT, opts, cooldown_s=COOLDOWN_S, secret=b"test-secret")


def _s3(server: ServerProcess) -> S3Tier:
    opts = S3Options(
        bucket="outage", endpoint_url=f"http://127.0.0.1:{server.port}", timeout=TIMEOUT_S
    )
    return S3Tier(LAYOUT, opts, create_bucket=True, cooldown_s=COOLDOWN_S, secret=b"test-secret")


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.monotonic()
    result = fn()
    return result, time.monotonic() - t0


def _kill_and_recover(tier: Tier, server: ServerProcess) -> None:
    k, b = rand_key(), rand_block(seed=1)
    assert tier.put([k], [b]) == [True] and tier.healthy
    server.kill()
    out = empty_block()
    # every operation: a miss / False / nothing, never an exception, never a hang
    for op in (
        lambda: tier.get_into([k], [out]),
        lambda: tier.contains_prefix([k]),
        lambda: tier.put([rand_key()], [b]),
        lambda: tier.delete([k]),
        lambda: tier.usage(),
    ):
        _, took = _timed(op)
        assert took < HANG_CEILING_S
    assert tier.get_into([k], [out]) == [False]
    assert tier.contains_prefix([k]) == 0
    assert tier.put([k], [b]) == [False]
    assert not tier.healthy
    server.start()  # same port, empty (no persistence)
    time.sleep(COOLDOWN_S + 0.2)
    k2 = rand_key()
    assert tier.put([k2], [b]) == [True]  # the trial call goes through and closes the breaker
    assert tier.healthy
    assert tier.get_into([k2], [out]) == [True] and out.tobytes() == b.tobytes()


def test_redis_server_killed_and_restarted(redis_proc: ServerProcess) -> None:
    tier = _redis(redis_proc)
    try:
        _kill_and_recover(tier, redis_proc)
    finally:
        tier.close()


def test_s3_server_killed_and_restarted(s3_proc: ServerProcess) -> None:
    tier = _s3(s3_proc)
    try:
        _kill_and_recover(tier, s3_proc)
    finally:
        tier.close()


def test_hung_s3_costs_each_of_concurrent_callers_about_one_timeout(s3_proc: ServerProcess) -> None:
    """The S3 server stops answering (SIGSTOP: connections are accepted, nothing answers) while
    three callers load at once. They share the tier's pool threads; once a request timed out
    the requests not sent yet, of every caller, are given up: each caller waits about one
    timeout, not one per turn in the pool's queue (2, 4, 6 timeouts), and no pool thread
    rebuilds the client and checks the bucket again on its own (create_bucket, ttl_days: ~20).
    The trial after the cool-down prepares the bucket again, once. Then the server is back."""
    opts = S3Options(
        bucket="hung", endpoint_url=f"http://127.0.0.1:{s3_proc.port}", timeout=TIMEOUT_S
    )
    opts = dataclasses.replace(opts, workers=4)
    tier = S3Tier(
        LAYOUT, opts, create_bucket=True, ttl_days=1, cooldown_s=COOLDOWN_S, secret=b"test-secret"
    )
    keys = [rand_key() for _ in range(8)]
    blocks = [rand_block(seed=i) for i in range(8)]

    def callers() -> list[float]:
        took: list[float] = []

        def load() -> None:
            outs = [empty_block() for _ in keys]
            got, t = _timed(lambda: tier.get_into(keys, outs))
            assert got == [False] * len(keys)
            took.append(t)

        threads = [threading.Thread(target=load) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(took) == 3
        return took

    assert s3_proc.pid is not None
    try:
        assert tier.put(keys, blocks) == [True] * 8
        os.kill(s3_proc.pid, signal.SIGSTOP)
        try:
            # 24 requests on 4 pool threads: were each timed out on its own, the last caller
            # would wait 6 timeouts; the bound leaves room for a loaded CI machine
            bound = 4 * TIMEOUT_S
            took = callers()
            assert max(took) < bound, f"callers took {took}s at timeout {TIMEOUT_S}s"
            time.sleep(COOLDOWN_S + 0.1)
            took = callers()  # one is the trial: a fresh client, the bucket checked once
            assert max(took) < bound, f"callers took {took}s at timeout {TIMEOUT_S}s"
            assert not tier.healthy
        finally:
            os.kill(s3_proc.pid, signal.SIGCONT)
        time.sleep(COOLDOWN_S + 0.1)
        out = empty_block()
        assert tier.get_into(keys[:1], [out]) == [True] and out.tobytes() == blocks[0].tobytes()
        assert tier.healthy
    finally:
        tier.close()


def test_tier_built_while_server_is_down_serves_misses(redis_proc: ServerProcess) -> None:
    redis_proc.kill()
    tier = _redis(redis_proc)
    try:
        assert tier.contains_prefix([rand_key()]) == 0 and not tier.healthy
        redis_proc.start()
        time.sleep(COOLDOWN_S + 0.2)
        assert tier.put([rand_key()], [rand_block()]) == [True] and tier.healthy
    finally:
        tier.close()


def test_store_keeps_serving_from_host_while_shared_tier_is_down(
    redis_proc: ServerProcess,
) -> None:
    """The run goes on: stores and loads work from the host tier; the shared tier is skipped."""
    lay = KVLayout(layers=2, kv_heads=2, head_dim=8, dtype="float16", block_tokens=16)
    shared = _redis(redis_proc)
    store = TieredStore(
        lay, [HostTier(lay, 64 * lay.block_bytes), shared], tenant="t", model_id="test"
    )
    try:
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, 50_000, size=64)
        kv = rng.integers(0, 2**16, size=lay.kv_shape(64), dtype=np.uint16).view(np.float16)
        redis_proc.kill()
        assert store.store(tokens, kv) == 64
        store.flush()  # the write-through fails quietly
        out = np.zeros_like(kv)
        assert store.load(tokens, out) == 64
        assert np.array_equal(out.view(np.uint16), kv.view(np.uint16))
        other = rng.integers(0, 50_000, size=64)
        assert store.lookup(other) == 0  # shared tier skipped: a miss, no exception
        assert not shared.healthy
    finally:
        store.close()


def test_breaker_is_healthy_again_when_the_trial_is_due() -> None:
    """``healthy`` answers "would a call reach the server now?" (a fake clock, no server)."""
    now = [0.0]
    breaker = CircuitBreaker("b", cooldown_s=5.0, clock=lambda: now[0])

    def boom() -> bool:
        raise OSError("down")

    assert breaker.call(boom, False, (OSError,)) is False and not breaker.healthy
    now[0] = 4.9
    assert not breaker.healthy and breaker.call(lambda: True, False) is False  # skipped
    now[0] = 5.0
    assert breaker.healthy  # half-open: the next call is the trial; asking claims nothing
    assert breaker.healthy and breaker.call(boom, False, (OSError,)) is False
    assert not breaker.healthy and breaker.trips == 2  # the failed trial reopened it
    now[0] = 10.0
    assert breaker.healthy and breaker.call(lambda: True, False) is True and breaker.healthy


@pytest.mark.parametrize("error", [OSError, RuntimeError])
def test_only_the_trial_ends_the_trial(error: type[Exception]) -> None:
    """A call let through while the breaker was closed ends -- with a server error, or with a
    caller's mistake -- while the trial is in flight: that must not let a second trial in."""
    now = [0.0]
    breaker = CircuitBreaker("b", cooldown_s=1.0, clock=lambda: now[0])
    straggler_may_end, trial_started, trial_may_end = (threading.Event() for _ in range(3))

    def straggler() -> bool:
        straggler_may_end.wait(10)
        raise error("late")

    def trial() -> bool:
        trial_started.set()
        trial_may_end.wait(10)
        return True

    results: list[bool] = []
    errors: list[BaseException] = []

    def run(fn: Callable[[], bool]) -> None:
        try:
            results.append(breaker.call(fn, False, (OSError,)))
        except RuntimeError as exc:
            errors.append(exc)

    first = threading.Thread(target=run, args=(straggler,))
    first.start()  # admitted while closed
    breaker.failed(OSError("another caller found the server down"))
    now[0] = 2.0
    second = threading.Thread(target=run, args=(trial,))
    second.start()
    assert trial_started.wait(10) and not breaker.healthy
    straggler_may_end.set()
    first.join()
    now[0] = 3.5  # past the cool-down the straggler's failure may have restarted
    assert not breaker.healthy and not breaker.allow()  # the trial is still the only one
    trial_may_end.set()
    second.join()
    assert breaker.healthy and results[-1] is True


def test_redis_tier_reports_healthy_when_its_trial_is_due(redis_proc: ServerProcess) -> None:
    """A node whose only traffic is write-through (planned for healthy tiers only) must get to
    make the trial call: ``healthy`` turns True once the cooldown elapsed, even while the server
    is still down; the failed trial turns it False; once the server is back, the trial works."""
    tier = _redis(redis_proc)
    try:
        k, b = rand_key(), rand_block(seed=3)
        assert tier.put([k], [b]) == [True] and tier.healthy
        redis_proc.kill()
        assert tier.put([rand_key()], [b]) == [False] and not tier.healthy
        time.sleep(COOLDOWN_S + 0.2)
        assert tier.healthy  # still down, but the trial is due
        trips = tier.breaker.trips
        assert tier.put([rand_key()], [b]) == [False]  # the trial fails
        assert not tier.healthy and tier.breaker.trips == trips + 1
        redis_proc.start()
        assert not tier.healthy  # back, but nothing tried it yet: still cooling down
        time.sleep(COOLDOWN_S + 0.2)
        assert tier.healthy
        k2 = rand_key()
        assert tier.put([k2], [b]) == [True] and tier.healthy  # the trial is a write
        out = empty_block()
        assert tier.get_into([k2], [out]) == [True] and out.tobytes() == b.tobytes()
    finally:
        tier.close()
