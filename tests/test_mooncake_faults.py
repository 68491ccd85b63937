"""The Mooncake Store tier when the master is dead, comes back, or was never configured right.

The contract told as stories: a dead master is a miss *at once* on the inference path (the
client's own reconnect costs ~4 s per call, so no caller may be the one to find out whether the
master is back), the tier returns by itself when the master does, and a ``master`` that can
never work is a ``ConfigError`` naming it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvtier.errors import ConfigError
from kvtier.layout import KVLayout
from kvtier.store import TieredStore
from kvtier.tiers.host import HostTier
from kvtier.tiers.mooncake import MooncakeTier
from tests.mooncake_server import MIB, MooncakeCluster, start_or_skip
from tests.servers import free_port
from tests.tier_conformance import empty_block, rand_block, rand_key

pytest.importorskip("mooncake", reason="install mooncake-transfer-engine-non-cuda")

pytestmark = [pytest.mark.server, pytest.mark.timeout(120)]
LAYOUT = KVLayout(2, 2, 8, "float16", block_tokens=16)
COOLDOWN_S = 0.5
#: what "a miss at once" may take on a loaded 2-core test machine (it takes microseconds)
AT_ONCE_S = 0.5


def _tier(master: str, **kw: Any) -> MooncakeTier:
    opts: dict[str, Any] = {
        "segment_size": 16 * MIB,
        "buffer_size": MIB,
        "cooldown_s": COOLDOWN_S,
        "rpc_timeout_s": 1.0,
        "prefix": f"f{os.urandom(4).hex()}",
    }
    opts.update(kw)
    return MooncakeTier(LAYOUT, master, **opts, secret=b"test-secret")


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.monotonic()
    result = fn()
    return result, time.monotonic() - t0


def _wait_healthy(tier: MooncakeTier, within_s: float = 20.0) -> None:
    """Wait (without calling the tier) until its prober has brought it back."""
    deadline = time.monotonic() + within_s
    while not tier.healthy:
        assert time.monotonic() < deadline, "the tier did not come back by itself"
        time.sleep(0.1)


def _round_trip(tier: MooncakeTier, within_s: float = 15.0) -> None:
    """A new block goes in and comes back byte-identical (the client may take a heartbeat or
    two to re-mount its segment on a fresh master)."""
    k, block = rand_key(), rand_block(LAYOUT, seed=7)
    deadline = time.monotonic() + within_s
    while tier.put([k], [block]) != [True]:
        assert time.monotonic() < deadline, "puts were never accepted again"
        time.sleep(0.25)
    out = empty_block(LAYOUT)
    assert tier.get_into([k], [out]) == [True] and out.tobytes() == block.tobytes()


def test_built_while_the_master_is_down_then_it_starts() -> None:
    """A node that starts before the master: construction does not wait for it, lookups and
    loads are misses at once, and the tier comes into service when the master starts."""
    with start_or_skip(0) as cluster:
        cluster.kill_master()
        tier, took = _timed(lambda: _tier(cluster.address))
        try:
            assert took < 1.0, f"construction against a dead master took {took:.2f}s"
            assert not tier.healthy and tier.client is None
            k = rand_key()
            end = time.monotonic() + 4 * COOLDOWN_S  # across several prober attempts
            while time.monotonic() < end:
                n, took = _timed(lambda: tier.contains_prefix([k]))
                assert n == 0 and took < AT_ONCE_S, f"lookup took {took:.2f}s"
                got, took = _timed(lambda: tier.get_into([k], [empty_block(LAYOUT)]))
                assert got == [False] and took < AT_ONCE_S, f"load took {took:.2f}s"
                ok, took = _timed(lambda: tier.put([k], [rand_block(LAYOUT)]))
                assert ok == [False] and took < AT_ONCE_S, f"put took {took:.2f}s"
                time.sleep(0.05)
            assert tier.skipped > 0
            cluster.master.start()
            _wait_healthy(tier)
            assert tier.client is not None
            _round_trip(tier)
        finally:
            tier.close()


def test_killed_master_costs_no_caller_a_reconnect_then_recovers() -> None:
    """After the master dies every call is a miss at once, over many cool-downs (the client's
    reconnect, ~4 s a call, runs on the prober's thread, never on a caller's); the store goes
    on from the host tier; when the master is back the tier is back without a caller's help."""
    with start_or_skip(0) as cluster:
        tier = _tier(cluster.address)
        store = TieredStore(
            LAYOUT, [HostTier(LAYOUT, 64 * LAYOUT.block_bytes), tier], tenant="t", model_id="test"
        )
        try:
            assert tier.healthy
            k = rand_key()
            assert tier.put([k], [rand_block(LAYOUT, seed=1)]) == [True]
            cluster.kill_master()
            _, took = _timed(lambda: tier.contains_prefix([k]))  # finds out: one failed RPC
            assert took < AT_ONCE_S, f"the first call after the kill took {took:.2f}s"
            assert not tier.healthy
            tokens = list(range(64))
            end = time.monotonic() + 6 * COOLDOWN_S
            while time.monotonic() < end:
                for op in (
                    lambda: tier.contains_prefix([k]),
                    lambda: tier.get_into([k], [empty_block(LAYOUT)]),
                    lambda: store.lookup(tokens),
                ):
                    _, took = _timed(op)
                    assert took < AT_ONCE_S, f"a call against a dead master took {took:.2f}s"
                time.sleep(0.05)
            assert tier.breaker.trips >= 2  # the prober kept trying, off the callers' threads
            cluster.master.start()  # same port; without HA every key is gone
            _wait_healthy(tier)
            assert tier.contains_prefix([k]) == 0
            _round_trip(tier)
        finally:
            store.close()


def test_close_while_the_master_is_down_is_prompt() -> None:
    with start_or_skip(0) as cluster:
        cluster.kill_master()
        tier = _tier(cluster.address)
        time.sleep(2 * COOLDOWN_S)
        _, took = _timed(tier.close)
        assert took < 2.0
        assert tier.contains_prefix([rand_key()]) == 0  # closed: a miss, not an exception


def test_close_against_a_hung_master_is_bounded() -> None:
    """The master hangs (SIGSTOP): the tier finds out, and its prober's check is stuck on the
    master too. close() returns within about one RPC timeout, not after the prober's check
    and the client's own close against a master that does not answer (~4-20 s, holding the
    GIL); the client is closed in the background once the master answers again."""
    with start_or_skip(0) as cluster:
        tier = _tier(cluster.address)
        pid = cluster.master.pid
        assert pid is not None
        try:
            k = rand_key()
            assert tier.put([k], [rand_block(LAYOUT)]) == [True]
            os.kill(pid, signal.SIGSTOP)
            try:
                # finds out within an RPC timeout; the client may answer from what it already
                # knows for a moment (as in test_tier_mooncake's hung-master test)
                deadline = time.monotonic() + 15
                while tier.contains_prefix([k]) != 0:
                    assert time.monotonic() < deadline, "a hung master was never noticed"
                time.sleep(COOLDOWN_S + 0.2)  # the prober's check is now stuck as well
                _, took = _timed(tier.close)
                assert took < 2.0, f"close against a hung master took {took:.2f}s"
                assert tier.contains_prefix([k]) == 0 and tier.put([k], [rand_block()]) == [False]
            finally:
                os.kill(pid, signal.SIGCONT)
            closer = tier._link.closer
            assert closer is not None
            closer.join(30)
            assert not closer.is_alive()
        finally:
            tier.close()


def test_zero_cooldown_does_not_spin() -> None:
    """``cooldown_s = 0`` (check again at once) against a dead master: the prober still
    waits a little between attempts, not a core's worth of TCP connects (~13k a second)."""
    tier = _tier(f"127.0.0.1:{free_port()}", cooldown_s=0)
    try:
        before = tier.breaker.trips  # one per failed attempt
        time.sleep(1.0)
        attempts = tier.breaker.trips - before
        assert attempts <= 20, f"{attempts} reconnect attempts in 1s"
        assert tier.contains_prefix([rand_key()]) == 0
    finally:
        tier.close()


_CLOSE_UNDER_LOAD = textwrap.dedent(
    """
    import sys, threading, time
    from kvtier.layout import KVLayout
    from kvtier.tiers.mooncake import MooncakeTier
    from tests.tier_conformance import empty_block, rand_block, rand_key

    master, rounds = sys.argv[1], int(sys.argv[2])
    lay = KVLayout(2, 2, 8, "float16", block_tokens=16)
    errors = []
    for r in range(rounds):
        tier = MooncakeTier(lay, master, segment_size=16 << 20, buffer_size=1 << 20,
                            cooldown_s=0.5, rpc_timeout_s=1.0, prefix=f"close{r}",
                            secret=b"test-secret")
        stop = threading.Event()

        def work():
            keys = [rand_key() for _ in range(4)]
            blocks = [rand_block(lay, seed=j) for j in range(4)]
            while not stop.is_set():
                try:
                    tier.put(keys, blocks)
                    tier.get_into(keys, [empty_block(lay) for _ in keys])
                    tier.contains_prefix(keys)
                    tier.usage()
                except Exception as exc:
                    errors.append(repr(exc))

        threads = [threading.Thread(target=work) for _ in range(3)]
        for t in threads:
            t.start()
        time.sleep(0.3)
        tier.close()
        time.sleep(0.1)
        stop.set()
        for t in threads:
            t.join()
    print("exceptions:", sorted(set(errors)))
    sys.exit(1 if errors else 0)
    """
)


def test_close_while_calls_are_in_flight() -> None:
    """Three threads put, load and look up while the tier is closed: the calls in flight
    finish first (the client crashes the process if it is closed under a transfer), later
    ones are misses, none raises. In a child process: a crash must not take pytest along."""
    with start_or_skip(0) as cluster:
        child = subprocess.run(
            [sys.executable, "-c", _CLOSE_UNDER_LOAD, cluster.address, "3"],
            cwd=Path(__file__).resolve().parents[1],
            capture_output=True,
            text=True,
            timeout=90,
        )
    tail = (child.stdout + child.stderr)[-3000:]
    assert child.returncode == 0, f"exit {child.returncode}:\n{tail}"


@pytest.mark.parametrize(
    "master", ["garbage", "127.0.0.1", "127.0.0.1:", ":50051", "host:port", "h:0", "h:70000",
               "a b:1", ""],
)  # fmt: skip
def test_master_that_can_never_work_is_a_config_error(master: str) -> None:
    with pytest.raises(ConfigError, match="master") as err:
        MooncakeTier(LAYOUT, master, segment_size=0, buffer_size=MIB, secret=b"test-secret")
    assert repr(master) in str(err.value)
    with pytest.raises(ConfigError, match="master"):
        MooncakeTier.from_config(LAYOUT, {"master": master})


def test_per_key_errors_leave_the_tier_in_service(mooncake_cluster: MooncakeCluster) -> None:
    """A key the master answers with an error (not found, a foreign value too large for the
    block) is that key's miss: the good blocks of the same batch are hits, and the tier stays
    in service for every later call."""
    tier = _tier(mooncake_cluster.address, segment_size=0)
    try:
        good, foreign, missing = rand_key(), rand_key(), rand_key()
        block = rand_block(LAYOUT, seed=3)
        assert tier.put([good], [block]) == [True]
        client = tier._ready()
        (name,) = tier._names([foreign], "")
        assert client.put(name, b"x" * (2 * tier.value_bytes)) == 0
        outs = [empty_block(LAYOUT) for _ in range(3)]
        assert tier.get_into([foreign, missing, good], outs) == [False, False, True]
        assert outs[2].tobytes() == block.tobytes()
        assert tier.healthy and tier.breaker.trips == 0 and tier.skipped == 0
        assert tier.contains_prefix([good]) == 1
    finally:
        tier.close()
