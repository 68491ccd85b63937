"""The Mooncake Store tier against a real ``mooncake_master`` (see ``tests/mooncake_server.py``).

Besides the conformance suite: the Mooncake behaviours the tier is designed around -- put never
overwrites, a full pool evicts silently, a master restart loses every key, a dead master is
skipped until the tier's prober sees it back -- each must read as misses, never as errors or
wrong data. (Outage timings and misconfiguration: ``tests/test_mooncake_faults.py``.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvtier import codec
from kvtier.keys import BlockKey
from kvtier.layout import KVLayout
from kvtier.tiers.base import Tier
from kvtier.tiers.mooncake import MooncakeTier
from kvtier.tiers.registry import make_tier
from kvtier.tiers.secure import BlockSealer, TenantQuotas
from tests.mooncake_server import MIB, MooncakeCluster, start_or_skip
from tests.tier_conformance import TierConformance, empty_block, rand_block, rand_key

pytest.importorskip("mooncake", reason="install mooncake-transfer-engine-non-cuda")

pytestmark = pytest.mark.server


def _tier(layout: KVLayout, master: str, **kw: object) -> MooncakeTier:
    opts: dict[str, object] = {"segment_size": 0, "buffer_size": 4 * MIB, "cooldown_s": 0.5}
    opts.update(kw)
    if "sealer" not in opts:
        opts["secret"] = b"test-secret"
    return MooncakeTier(layout, master, prefix=f"t{os.urandom(4).hex()}", **opts)  # type: ignore[arg-type]


class TestMooncakeTier(TierConformance):
    @pytest.fixture(autouse=True)
    def _cluster(self, mooncake_cluster: MooncakeCluster) -> None:
        self.cluster = mooncake_cluster

    def make_tier(self, layout: KVLayout, capacity_blocks: int, tmp_path: Path) -> Tier:
        return _tier(layout, self.cluster.address)

    def corrupt(self, tier: Tier, key: BlockKey) -> bool:
        """Replace the stored value by one with a flipped payload bit (what a torn write or a
        stray writer would leave): remove, then put the tampered bytes under the same name."""
        assert isinstance(tier, MooncakeTier)
        client = tier._ready()
        name = tier._names([key], "")[0]
        raw = np.frombuffer(client.get(name), dtype=np.uint8).copy()
        if raw.size != codec.HEADER_BYTES + tier.block_bytes:
            return False
        raw[codec.HEADER_BYTES + 5] ^= 0x10
        client.remove(name, True)
        return bool(client.put(name, raw.tobytes()) == 0)


@pytest.fixture
def tier(mooncake_cluster: MooncakeCluster) -> object:
    t = _tier(KVLayout(2, 2, 8, "float16", block_tokens=16), mooncake_cluster.address)
    yield t
    t.close()


def test_registry_builds_the_tier(mooncake_cluster: MooncakeCluster) -> None:
    layout = KVLayout(2, 2, 8, "float16", block_tokens=16)
    t = make_tier(
        layout,
        {
            "kind": "mooncake",
            "master": mooncake_cluster.address,
            "segment_size": 0,
            "buffer_size": "1MiB",
            "secret": "deployment secret",
        },
    )
    try:
        assert isinstance(t, MooncakeTier) and t.shared and t.healthy
        assert t.capacity_blocks == 0
    finally:
        t.close()


def test_put_never_overwrites_a_foreign_value(tier: MooncakeTier) -> None:
    """Mooncake keeps the first value of a key: a planted foreign object stays, reads as a miss
    and is removed; the next put then stores the real block."""
    k, block = rand_key(), rand_block(seed=1)
    name = tier._names([k], "")[0]
    assert tier._ready().put(name, b"not a kvtier block") == 0
    assert tier.contains_prefix([k]) == 1  # present, but not ours
    out = empty_block()
    assert tier.get_into([k], [out]) == [False]
    assert tier.contains_prefix([k]) == 0  # dropped on read
    assert tier.put([k], [block]) == [True]
    assert tier.get_into([k], [out]) == [True] and out.tobytes() == block.tobytes()


def test_block_under_another_key_is_a_miss(tier: MooncakeTier) -> None:
    """A valid block copied to another key's name fails the header key check."""
    a, b = rand_key(), rand_key()
    tier.put([a], [rand_block(seed=2)])
    client = tier._ready()
    na, nb = tier._names([a, b], "")
    assert client.put(nb, client.get(na)) == 0
    assert tier.get_into([b], [empty_block()]) == [False]
    assert tier.contains_prefix([b]) == 0


def test_tenants_are_namespaced(tier: MooncakeTier) -> None:
    k, block = rand_key(), rand_block(seed=3)
    assert tier.put([k], [block], tenant="alice") == [True]
    assert tier.contains_prefix([k], tenant="bob") == 0
    assert tier.get_into([k], [empty_block()], tenant="bob") == [False]
    out = empty_block()
    assert tier.get_into([k], [out], tenant="alice") == [True]
    assert out.tobytes() == block.tobytes()
    assert tier._names([k], "alice")[0] == f"{tier.prefix}/alice/{k.hex()}"


def test_prefix_of_a_long_prompt_in_one_call(tier: MooncakeTier) -> None:
    keys = [rand_key() for _ in range(512)]  # 128K tokens at 256 tokens per block
    assert tier.put(keys[:300], [rand_block(seed=4)] * 300) == [True] * 300
    assert tier.contains_prefix(keys) == 300


def test_blocks_in_a_registered_arena_roundtrip(tier: MooncakeTier) -> None:
    """Slots of a buffer registered once (as a host arena would be) move without per-call
    registration; a buffer outside it still works; unregister is idempotent."""
    lay = tier.layout
    arena = np.zeros((4, *lay.block_shape), dtype=np.float16)
    assert tier.register(arena)
    keys = [rand_key() for _ in range(2)]
    arena[0], arena[1] = rand_block(seed=1), rand_block(seed=2)
    assert tier.put(keys, [arena[0], arena[1]]) == [True, True]
    assert tier.get_into(keys, [arena[2], arena[3]]) == [True, True]
    assert arena[2].tobytes() == arena[0].tobytes() and arena[3].tobytes() == arena[1].tobytes()
    outside = empty_block()
    assert tier.get_into(keys[:1], [outside]) == [True]
    assert outside.tobytes() == arena[0].tobytes()
    tier.unregister(arena)
    tier.unregister(arena)
    assert tier.get_into(keys[1:], [arena[2]]) == [True]


def _framed_block(seed: int | None = None) -> np.ndarray:  # type: ignore[type-arg]
    src = rand_block(seed=seed) if seed is not None else empty_block()
    out = codec.framed_empty(src.nbytes).view(src.dtype).reshape(src.shape)
    out[...] = src
    return out


def test_framed_buffers_move_as_one_value_and_interoperate(tier: MooncakeTier) -> None:
    """A framed block (header room before it, as the store's staging buffers) is written and
    read as one buffer; the stored value is the same as from a plain array, so either side may
    be framed; a corrupted payload is still a miss."""
    a, b = rand_key(), rand_key()
    framed, plain = _framed_block(seed=5), rand_block(seed=6)
    assert tier.put([a, b], [framed, plain]) == [True, True]
    client = tier._ready()
    (na,) = tier._names([a], "")
    n = codec.HEADER_BYTES + framed.nbytes
    assert client.get(na)[codec.HEADER_BYTES : n] == framed.tobytes()  # then the MAC
    outs = [empty_block(), _framed_block()]  # a (framed) into plain, b (plain) into framed
    assert tier.get_into([a, b], outs) == [True, True]
    assert outs[0].tobytes() == framed.tobytes() and outs[1].tobytes() == plain.tobytes()
    value = bytearray(client.get(na))
    value[n - 1] ^= 1  # a flipped payload bit, written back in place of the good value
    assert client.remove(na, True) == 0 and client.put(na, bytes(value)) == 0
    assert tier.get_into([a], [_framed_block()]) == [False]
    assert tier.contains_prefix([a]) == 0  # dropped on read


def test_full_pool_evicts_silently(tmp_path: Path) -> None:
    """A 16 MiB pool takes 40 x 1 MiB blocks: puts that find no room say False, evicted blocks
    are misses, and every hit is byte-identical."""
    layout = KVLayout(4, 8, 128, "float16", block_tokens=64)  # 1 MiB blocks
    with start_or_skip(0) as cluster:
        t = _tier(layout, cluster.address, segment_size=16 * MIB, buffer_size=8 * MIB)
        try:
            keys = [rand_key() for _ in range(40)]
            blocks = [rand_block(layout, seed=i) for i in range(40)]
            stored = [t.put([k], [b])[0] for k, b in zip(keys, blocks, strict=True)]
            assert not all(stored)  # the pool filled up
            time.sleep(0.5)
            outs = [empty_block(layout) for _ in keys]
            got = t.get_into(keys, outs)
            assert 0 < sum(got) < 40
            for g, b, o in zip(got, blocks, outs, strict=True):
                if g:
                    assert o.tobytes() == b.tobytes()
            assert t.healthy
        finally:
            t.close()


def test_master_restart_loses_keys_as_misses() -> None:
    layout = KVLayout(2, 2, 8, "float16", block_tokens=16)
    with start_or_skip(0) as cluster:
        t = _tier(layout, cluster.address, segment_size=16 * MIB)
        try:
            keys = [rand_key() for _ in range(3)]
            assert t.put(keys, [rand_block(seed=i) for i in range(3)]) == [True] * 3
            cluster.restart_master()
            time.sleep(1.0)  # the client re-mounts its segment on the next heartbeat
            assert t.contains_prefix(keys) == 0
            assert t.get_into(keys, [empty_block() for _ in keys]) == [False] * 3
            block = rand_block(seed=9)
            deadline = time.monotonic() + 15
            while t.put(keys[:1], [block]) != [True] and time.monotonic() < deadline:
                time.sleep(0.5)
            out = empty_block()
            assert t.get_into(keys[:1], [out]) == [True] and out.tobytes() == block.tobytes()
        finally:
            t.close()


def test_dead_master_is_skipped_then_retried() -> None:
    layout = KVLayout(2, 2, 8, "float16", block_tokens=16)
    with start_or_skip(0) as cluster:
        t = _tier(layout, cluster.address, segment_size=16 * MIB, cooldown_s=1.0)
        try:
            k = rand_key()
            assert t.put([k], [rand_block(seed=1)]) == [True]
            cluster.kill_master()
            assert t.contains_prefix([k]) == 0  # one bounded RPC timeout, no exception
            assert not t.healthy
            trips = t.breaker.trips
            assert t.get_into([k], [empty_block()]) == [False]  # skipped: breaker open
            assert t.put([k], [rand_block()]) == [False]
            assert t.skipped >= 2 and t.breaker.trips == trips
            cluster.master.start()
            deadline = time.monotonic() + 30
            while not (t.put([k], [rand_block(seed=2)]) == [True] and t.healthy):
                assert time.monotonic() < deadline, "tier did not come back"
                time.sleep(0.5)
            assert t.contains_prefix([k]) == 1
        finally:
            t.close()


_WRITER = """
import sys
import numpy as np
from kvtier.keys import BlockKey
from kvtier.layout import KVLayout
from kvtier.tiers.mooncake import MooncakeTier

master, prefix, tenant, *hex_keys = sys.argv[1:]
layout = KVLayout(2, 2, 8, "float16", block_tokens=16)
tier = MooncakeTier(layout, master, segment_size=0, buffer_size=1 << 20, prefix=prefix,
                    secret=b"test-secret")
blocks = [np.random.default_rng(i).integers(0, 2**16, layout.block_shape, dtype=np.uint16)
          for i in range(len(hex_keys))]
ok = tier.put([BlockKey(bytes.fromhex(h)) for h in hex_keys], blocks, tenant=tenant)
tier.close()
sys.exit(0 if all(ok) else 1)
"""


def test_block_written_by_another_process_loads_byte_identical(
    mooncake_cluster: MooncakeCluster, tier: MooncakeTier
) -> None:
    """Node A (a separate process) stores blocks; node B (this one) finds and loads them."""
    keys = [rand_key() for _ in range(3)]
    proc = subprocess.run(
        [sys.executable, "-c", _WRITER, mooncake_cluster.address, tier.prefix, "team",
         *(k.hex() for k in keys)],
        capture_output=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-2000:]
    assert tier.contains_prefix(keys, tenant="team") == 3
    assert tier.contains_prefix(keys, tenant="other") == 0
    outs = [empty_block() for _ in keys]
    assert tier.get_into(keys, outs, tenant="team") == [True] * 3
    for i, o in enumerate(outs):
        want = np.random.default_rng(i).integers(0, 2**16, tier.layout.block_shape, np.uint16)
        assert o.view(np.uint16).tobytes() == want.tobytes()


def test_encrypted_blocks_and_tampering(mooncake_cluster: MooncakeCluster) -> None:
    layout = KVLayout(2, 2, 8, "float16", block_tokens=16)
    sealer = BlockSealer(layout, master_key=os.urandom(32))
    t = _tier(layout, mooncake_cluster.address, sealer=sealer)
    try:
        k, block = rand_key(), rand_block(seed=6)
        assert t.put([k], [block], tenant="alice") == [True]
        client = t._ready()
        name = t._names([k], "alice")[0]
        raw = bytes(client.get(name))
        assert len(raw) == t.value_bytes and block.tobytes() not in raw  # ciphertext at rest
        out = empty_block()
        assert t.get_into([k], [out], tenant="alice") == [True]
        assert out.tobytes() == block.tobytes()
        # another tenant's namespace holding alice's ciphertext fails authentication
        assert client.put(t._names([k], "bob")[0], raw) == 0
        assert t.get_into([k], [empty_block()], tenant="bob") == [False]
        # a flipped ciphertext bit is a miss, and the object is dropped
        tampered = bytearray(raw)
        tampered[-40] ^= 1
        client.remove(name, True)
        assert client.put(name, bytes(tampered)) == 0
        assert t.get_into([k], [empty_block()], tenant="alice") == [False]
        assert t.contains_prefix([k], tenant="alice") == 0
    finally:
        t.close()


def test_quota_refusal_is_counted(mooncake_cluster: MooncakeCluster) -> None:
    layout = KVLayout(2, 2, 8, "float16", block_tokens=16)
    quotas = TenantQuotas(default_bytes=2 * layout.block_bytes, name="mooncake")
    t = _tier(layout, mooncake_cluster.address, quotas=quotas)
    try:
        keys = [rand_key() for _ in range(3)]
        assert t.put(keys, [rand_block(seed=i) for i in range(3)], tenant="a") == [
            True,
            True,
            False,
        ]
        assert quotas.refusals() == {"a": 1}
        assert t.contains_prefix(keys, tenant="a") == 2
        t.delete(keys[:1], tenant="a")  # frees room for one more block
        assert t.put(keys[2:], [rand_block(seed=2)], tenant="a") == [True]
    finally:
        t.close()


def test_hung_master_costs_one_rpc_timeout() -> None:
    """A master that stops answering (SIGSTOP) costs ``rpc_timeout_s`` once, then the breaker
    answers misses at once; when it answers again the tier comes back."""
    layout = KVLayout(2, 2, 8, "float16", block_tokens=16)
    with start_or_skip(0) as cluster:
        t = _tier(layout, cluster.address, segment_size=16 * MIB, cooldown_s=1.0, rpc_timeout_s=1.0)
        pid = cluster.master.pid
        assert pid is not None
        try:
            k = rand_key()
            assert t.put([k], [rand_block(seed=1)]) == [True]
            os.kill(pid, signal.SIGSTOP)
            try:
                # the client may answer from what it already knows for a moment: within a few
                # bounded calls the hang must be noticed
                deadline = time.monotonic() + 15
                while t.contains_prefix([k]) != 0:
                    assert time.monotonic() < deadline, "a hung master was never noticed"
                assert not t.healthy
                assert t.get_into([k], [empty_block()]) == [False]  # skipped, no second wait
                assert t.skipped >= 1
            finally:
                os.kill(pid, signal.SIGCONT)
            deadline = time.monotonic() + 30
            while t.contains_prefix([k]) != 1:
                assert time.monotonic() < deadline, "tier did not come back"
                time.sleep(0.5)
            assert t.healthy
        finally:
            t.close()
