"""The simulator is the store: the same trace through a real ``TieredStore`` and through
``kvtier.sim.replay`` gives the same token hits, one tier and host + NVMe."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from kvtier.layout import KVLayout
from kvtier.policy import DEFAULT_POLICY
from kvtier.sim.basket import distinct_full_blocks
from kvtier.sim.cluster import replay_cluster
from kvtier.sim.replay import TierSpec, replay
from kvtier.sim.storereplay import replay_store
from kvtier.sim.trace import Trace, read_trace
from kvtier.sim.workload import generate
from kvtier.tiers.base import Tier
from kvtier.tiers.redis import RedisOptions, RedisTier
from kvtier.tiers.secure import BlockSealer

MOONCAKE = Path("/work/shared/data/traces/mooncake_synthetic.jsonl")


def traces() -> list[Trace]:
    out = [generate("mixed", 600, seed=1), generate("chat", 600, seed=2)]
    if MOONCAKE.exists():
        t = read_trace(MOONCAKE)
        out.append(Trace(t.requests[:400], t.block_tokens, "mooncake-400"))
    return out


@pytest.mark.parametrize("trace", traces(), ids=lambda t: t.name)
@pytest.mark.parametrize("policy", ["lru", DEFAULT_POLICY])
@pytest.mark.parametrize("nvme", [False, True], ids=["host", "host+nvme"])
def test_simulator_hits_equal_the_stores(
    trace: Trace, policy: str, nvme: bool, tmp_path: Path
) -> None:
    n = distinct_full_blocks(trace)
    host = max(4, n // (40 if nvme else 10))
    nvme_blocks = n // 10 if nvme else 0
    store = replay_store(trace, host, nvme_blocks, tmp_path, policy=policy)
    specs = [TierSpec("host", host, policy)]
    if nvme:
        specs.append(TierSpec("nvme", nvme_blocks, policy))
    sim = replay(trace, specs)
    assert store.hit_tokens > 0
    assert sim.hit_tokens.sum() == pytest.approx(store.hit_tokens, rel=0.01)
    if nvme:  # the hierarchy is the same too: NVMe serves what the host tier demoted
        assert store.by_tier[1] > 0
        for t in range(2):
            assert sim.hit_tokens[t].sum() == pytest.approx(store.by_tier[t], rel=0.01)


@pytest.mark.server
@pytest.mark.parametrize("nodes", [1, 2])
def test_a_shared_tier_is_the_stores_shared_tier(
    nodes: int, redis_url: str, tmp_path: Path
) -> None:
    """Host + NVMe per node over a real Redis tier they share (big enough never to evict):
    the simulator's shared-tier model gives the store's token hits, per tier. A host victim goes
    down the local chain although the pool holds a copy: NVMe serves before the pool, in both."""
    trace = generate("chat", 400, seed=3)
    n = distinct_full_blocks(trace)
    prefix = "simshared" + uuid.uuid4().hex[:8]

    def pool(layout: KVLayout) -> Tier:
        sealer = BlockSealer(layout, secret=b"s" * 32)
        return RedisTier(layout, RedisOptions(url=redis_url), prefix=prefix, sealer=sealer)

    host, nvme = max(4, n // 40), n // 10
    store = replay_store(trace, host, nvme, tmp_path, shared=pool, nodes=nodes)
    specs = [TierSpec("host", host, "auto"), TierSpec("nvme", nvme, "auto")]
    sim = replay_cluster(trace, [*specs, TierSpec("pool", 10 * n, "lru")], nodes, 2)
    assert store.by_tier[2] > 0
    assert sim.hit_tokens.sum() == pytest.approx(store.hit_tokens, rel=0.01)
    for t in range(3):
        assert sim.hit_tokens[t].sum() == pytest.approx(store.by_tier[t], rel=0.01, abs=1)
    assert store.by_tier[1] > 0
