"""Block identity over real shared pools: one redis-server and one mooncake_master, several
stores ("ranks", "stages", "engines") writing and reading the same pool.

Each store has its own host tier, so a hit across stores can only come from the pool: 0 hits
across ranks, stages, adapters, revisions, salts and engine layout tags; each store's own
prefix hits; a value planted under a valid key with a valid xxh3 but no valid MAC is a miss,
counted, and never returned."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvtier import codec
from kvtier.errors import ConfigError
from kvtier.identity import Identity, Namespace, Scope
from kvtier.keys import block_keys
from kvtier.layout import KVLayout
from kvtier.store import TieredStore
from kvtier.tiers.base import Tier
from kvtier.tiers.host import HostTier
from tests.mooncake_server import MooncakeCluster

pytestmark = [pytest.mark.server, pytest.mark.timeout(180)]

LAY = KVLayout(layers=2, kv_heads=2, head_dim=8, dtype="float16", block_tokens=16)
SECRET = b"deployment secret shared by every node"
TOKENS = list(range(7, 7 + 4 * 16))


def kv(seed: int) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 2**16, LAY.kv_shape(len(TOKENS)), dtype=np.uint16).view(np.float16)


@pytest.fixture(params=["redis", "mooncake"])
def pool(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """How to build one more client of one shared pool (a fresh prefix per test)."""
    prefix = "id" + uuid.uuid4().hex[:8]
    if request.param == "redis":
        yield {"kind": "redis", "url": request.getfixturevalue("redis_url"), "prefix": prefix}
    else:
        cluster: MooncakeCluster = request.getfixturevalue("mooncake_cluster")
        yield {
            "kind": "mooncake",
            "master": cluster.address,
            "segment_size": 0,
            "buffer_size": "1MiB",
            "prefix": prefix,
        }


def client(pool: dict[str, Any], **kw: Any) -> Tier:
    from kvtier.tiers.registry import make_tier

    return make_tier(LAY, {**pool, **kw})


def node(pool: dict[str, Any], identity: Identity, **kw: Any) -> TieredStore:
    """A store with a private host tier over the shared pool, authenticated with SECRET."""
    tiers = [HostTier(LAY, 16 * LAY.block_bytes), client(pool, secret=SECRET)]
    return TieredStore(LAY, tiers, identity=identity, **kw)


def write(st: TieredStore, seed: int, **scope: Any) -> None:
    assert st.store(TOKENS, kv(seed), **scope) == len(TOKENS)
    st.flush()  # the write-through has reached the pool


def read(st: TieredStore, **scope: Any) -> tuple[int, np.ndarray[Any, Any]]:
    out = np.zeros(LAY.kv_shape(len(TOKENS)), np.float16)
    return st.load(TOKENS, out, **scope), out


def same(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> bool:
    return bool(np.array_equal(a.view(np.uint16), b.view(np.uint16)))


def test_tensor_parallel_ranks_never_read_each_others_heads(pool: dict[str, Any]) -> None:
    ranks = [node(pool, Identity("org/m", tp_rank=r, tp_size=2)) for r in (0, 1)]
    try:
        write(ranks[0], seed=0)
        assert ranks[1].lookup(TOKENS) == 0 and read(ranks[1])[0] == 0  # 0 cross-rank hits
        write(ranks[1], seed=1)
        for r, st in enumerate(ranks):  # each rank's own prefix hits, from the pool too
            fresh = node(pool, st.identity)
            try:
                n, out = read(fresh)
                assert n == len(TOKENS) and same(out, kv(r))
                assert set(fresh.locate(TOKENS)) == {"host"}  # promoted on the hit
            finally:
                fresh.close()
    finally:
        for st in ranks:
            st.close()


def test_pipeline_stages_never_share_blocks(pool: dict[str, Any]) -> None:
    a = node(pool, Identity("org/m", pp_rank=0, pp_size=2))
    b = node(pool, Identity("org/m", pp_rank=1, pp_size=2))
    with a, b:
        write(a, seed=2)
        assert b.lookup(TOKENS) == 0 and read(b)[0] == 0


@pytest.mark.parametrize(
    ("writer", "reader"),
    [
        ((Identity("org/m", revision="v1"), {}), (Identity("org/m", revision="v2"), {})),
        ((Identity("org/m", engine_tag="cpu:128"), {}), (Identity("org/m", engine_tag="gpu"), {})),
        ((Identity("org/m"), {"adapter": "lora-a"}), (Identity("org/m"), {"adapter": "lora-b"})),
        ((Identity("org/m"), {"salt": "alice"}), (Identity("org/m"), {"salt": "bob"})),
        ((Identity("org/m"), {"adapter": "lora-a"}), (Identity("org/m"), {})),
    ],
    ids=["revisions", "engine-tags", "adapters", "salts", "adapter-vs-base"],
)
def test_no_cross_hits_between_identities(
    pool: dict[str, Any],
    writer: tuple[Identity, dict[str, Any]],
    reader: tuple[Identity, dict[str, Any]],
) -> None:
    a, b = node(pool, writer[0]), node(pool, reader[0])
    with a, b:
        write(a, seed=3, **writer[1])
        assert b.lookup(TOKENS, **reader[1]) == 0 and read(b, **reader[1])[0] == 0
        n, out = read(node_again := node(pool, writer[0]), **writer[1])
        node_again.close()
        assert n == len(TOKENS) and same(out, kv(3))  # the writer's identity still hits


def test_a_value_planted_without_a_valid_mac_is_a_counted_miss(pool: dict[str, Any]) -> None:
    """An attacker with write access to the pool and no secret: computes the key from public
    token ids (no namespace secret), frames a block with a correct header and xxh3, and plants
    it. It must never be served."""
    ident = Identity("org/m")
    victim = node(pool, ident)
    planter = client(pool, trust_pool=True)  # writes plain values: header + payload + xxh3
    try:
        keys = block_keys(victim.namespace(), TOKENS)
        evil = kv(66)
        views = [evil[:, :, i * 16 : (i + 1) * 16] for i in range(len(keys))]
        assert planter.put(keys, views, victim.namespace().owner) == [True] * len(keys)
        # the value is well-formed: the header and the xxh3 of its payload match
        assert planter.contains_prefix(keys, victim.namespace().owner) == len(keys)
        n, out = read(victim)
        assert n == 0 and not same(out[:, :, :16], evil[:, :, :16])
        tier = victim.stats()["tiers"][victim.tiers[1].name]
        assert tier["auth"] == "mac" and tier["rejected_blocks"] >= 1
        # a forged tag (the MAC framing, a wrong tag) is a miss as well
        forger = client(pool, secret=b"not the deployment secret")
        try:
            forger.put(keys, views, victim.namespace().owner)
            assert read(victim)[0] == 0
        finally:
            forger.close()
    finally:
        planter.close()
        victim.close()


def test_a_pool_without_authentication_refuses_to_start(pool: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="trust_pool") as err:
        client(pool)
    assert "plant KV" in str(err.value)
    trusted = client(pool, trust_pool=True)  # the operator vouches for every writer
    with TieredStore(LAY, [HostTier(LAY, 4 * LAY.block_bytes), trusted], model_id="m") as st:
        assert st.stats()["tiers"][trusted.name]["auth"] == "trusted-unauthenticated"


def test_the_store_secret_authenticates_tiers_built_from_its_config(
    pool: dict[str, Any],
) -> None:
    raw = {
        "store": {
            "layers": 2,
            "kv_heads": 2,
            "head_dim": 8,
            "dtype": "float16",
            "block_tokens": 16,
            "model_id": "org/m",
            "secret": "deployment secret",
        },
        "tiers": [{"kind": "host", "capacity": "1MiB"}, pool],
    }
    with TieredStore.from_config(raw, env={}) as st:
        assert st.stats()["tiers"][st.tiers[1].name]["auth"] == "mac"
    without = {**raw, "store": {k: v for k, v in raw["store"].items() if k != "secret"}}
    with pytest.raises(ConfigError, match="trust_pool"):
        TieredStore.from_config(without, env={})


def test_share_groups_over_a_pool(pool: dict[str, Any]) -> None:
    groups = {"alice": "team", "bob": "team"}
    a = node(pool, Identity("org/m"), share_groups=groups)
    b = node(pool, Identity("org/m"), share_groups=groups)
    with a, b:
        write(a, seed=5, tenant="alice")
        n, out = read(b, tenant="bob")
        assert n == len(TOKENS) and same(out, kv(5))
        assert b.lookup(TOKENS, tenant="carol") == 0 and read(b, tenant="carol")[0] == 0


def test_framed_values_keep_the_header_checksum_for_corruption_triage() -> None:
    """A MAC'd value carries its payload's xxh3 in the header, so a reader can tell a torn or
    flipped value (dropped) from an intact one it cannot authenticate (kept)."""
    from kvtier.tiers.secure import BlockSealer

    lay = LAY
    key = block_keys(Namespace(Identity("m"), lay, Scope("t")), TOKENS)[0]
    block = kv(7)[:, :, :16]
    sealer = BlockSealer(lay, secret=SECRET)
    value = bytearray(sealer.seal(key, np.ascontiguousarray(block), "t") or b"")
    hdr = codec.unpack_header(bytes(value[: codec.HEADER_BYTES]))
    assert hdr is not None and hdr.flags == codec.FLAG_MAC
    other = BlockSealer(lay, secret=b"another secret")
    out = np.empty_like(block)
    assert not other.open_into(key, value, out, "t") and not other.droppable(key, value)
    value[codec.HEADER_BYTES + 5] ^= 1
    assert not sealer.open_into(key, value, out, "t") and sealer.droppable(key, value)
