"""The store's read path over a shared tier (real redis-server): what a node may delete, and a
tier that breaks its contract."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import numpy as np
import pytest

from kvtier.keys import BlockKey
from kvtier.layout import KVLayout
from kvtier.store import TieredStore
from kvtier.tiers.host import HostTier
from kvtier.tiers.redis import RedisOptions, RedisTier
from kvtier.tiers.secure import BlockSealer

pytestmark = pytest.mark.server

LAY = KVLayout(layers=2, kv_heads=2, head_dim=16, dtype="float16", block_tokens=16)
TOKENS = list(range(10 * LAY.block_tokens))


def _kv(n: int) -> np.ndarray:
    rng = np.random.default_rng(7)
    return rng.standard_normal(LAY.kv_shape(n)).astype(np.float16)


def _node(url: str, prefix: str, key: bytes) -> TieredStore:
    """A node: a small host tier over the shared Redis tier, blocks encrypted with ``key``."""
    shared = RedisTier(LAY, RedisOptions(url=url), prefix=prefix, sealer=BlockSealer(LAY, key))
    return TieredStore(LAY, [HostTier(LAY, 16 * LAY.block_bytes), shared], model_id="m")


def test_a_node_with_another_key_does_not_wipe_the_pool(redis_url: str) -> None:
    """A misconfigured node (another encryption key) misses, and the blocks it could not open
    stay in the pool for the nodes that can."""
    prefix = "wk" + uuid.uuid4().hex[:8]
    kv = _kv(len(TOKENS))
    with _node(redis_url, prefix, bytes(range(32))) as good:
        assert good.store(TOKENS, kv) == len(TOKENS)
        good.flush()
    with _node(redis_url, prefix, bytes(32)) as wrong:
        out = np.zeros_like(kv)
        assert wrong.load(TOKENS, out) == 0
        assert wrong.load(TOKENS, out) == 0
    with _node(redis_url, prefix, bytes(range(32))) as fresh:
        out = np.zeros_like(kv)
        assert fresh.load(TOKENS, out) == len(TOKENS)
        assert np.array_equal(out.view(np.uint16), kv.view(np.uint16))


class _Raising(RedisTier):
    """A shared tier that breaks the contract: ``contains_prefix`` raises."""

    def contains_prefix(self, keys: Sequence[BlockKey], tenant: str = "") -> int:
        raise RuntimeError("tier bug")


def test_a_shared_tier_that_raises_is_a_miss(redis_url: str) -> None:
    shared = _Raising(
        LAY, RedisOptions(url=redis_url), prefix="rz" + uuid.uuid4().hex[:8], secret=b"s"
    )
    with TieredStore(LAY, [HostTier(LAY, 4 * LAY.block_bytes), shared], model_id="m") as st:
        out = np.zeros(LAY.kv_shape(len(TOKENS)), np.float16)
        assert st.lookup(TOKENS) == 0
        assert st.load(TOKENS, out) == 0
        assert st.prefetch(TOKENS) == 0


def test_a_shared_block_the_server_dropped_is_a_miss_not_a_loss(redis_url: str) -> None:
    """The index lists a block in the shared tier (written through), the server evicts it on
    its own: a plain miss, not counted as lost or corrupt."""
    prefix = "ev" + uuid.uuid4().hex[:8]
    shared = RedisTier(LAY, RedisOptions(url=redis_url), prefix=prefix, secret=b"test-secret")
    with TieredStore(LAY, [HostTier(LAY, 4 * LAY.block_bytes), shared], model_id="m") as st:
        short = TOKENS[: 4 * LAY.block_tokens]
        kv = _kv(len(short))
        assert st.store(short, kv) == len(short)
        st.flush()
        other = list(range(10_000, 10_000 + 4 * LAY.block_tokens))
        st.store(other, _kv(len(other)))  # the host tier drops the first prompt; Redis keeps it
        st.flush()
        assert st.locate(short)[0] == "redis"
        client = shared.client()
        client.delete(*client.keys(f"{prefix}*"))  # the server evicts everything
        out = np.zeros_like(kv)
        assert st.load(short, out) == 0
        assert st.stats()["store"]["invalid_blocks"] == 0
