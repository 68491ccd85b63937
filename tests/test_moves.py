"""Write-through split over the transfer workers (``moves.split_moves``): every key goes exactly
once, in whole batches, and a store whose write-through ran as several jobs is complete and
readable from another node (real redis-server)."""

from __future__ import annotations

import os
import uuid

import numpy as np
import pytest

from kvtier.keys import BlockKey
from kvtier.layout import KVLayout
from kvtier.moves import BATCH, Move, split_moves
from kvtier.store import TieredStore
from kvtier.tiers.host import HostTier
from kvtier.tiers.redis import RedisOptions, RedisTier
from kvtier.tiers.secure import BlockSealer

LAY = KVLayout(layers=2, kv_heads=2, head_dim=16, dtype="float16", block_tokens=16)


def _move(n: int, dst: int = 1) -> Move:
    keys = [BlockKey(os.urandom(32)) for _ in range(n)]
    return Move(0, dst, keys, [f"t{i % 2}" for i in range(n)], delete_src=False)


@pytest.mark.parametrize("n", [1, BATCH - 1, BATCH, BATCH + 1, 2 * BATCH, 5 * BATCH + 3])
@pytest.mark.parametrize("parts", [1, 2, 3])
def test_split_moves_keeps_every_key_once_in_whole_batches(n: int, parts: int) -> None:
    moves = [_move(n), _move(n, dst=2)]
    lists = split_moves(moves, parts)
    assert 1 <= len(lists) <= parts
    for original in moves:
        pieces = [m for lst in lists for m in lst if m.dst == original.dst]
        assert [k for m in pieces for k in m.keys] == original.keys  # in order, each once
        assert [t for m in pieces for t in m.tenants] == original.tenants
        assert all(len(m.keys) % BATCH == 0 for m in pieces[:-1])  # only the last run is short
        assert all(not m.delete_src and m.src == 0 for m in pieces)
    if n >= parts * BATCH:
        assert len(lists) == parts  # enough for every worker: all of them get a share


@pytest.mark.server
def test_a_write_through_split_over_workers_is_whole_on_another_node(redis_url: str) -> None:
    prefix = "split" + uuid.uuid4().hex[:8]
    n = 3 * BATCH + 1
    tokens = list(range(n * LAY.block_tokens))
    kv = np.random.default_rng(5).standard_normal(LAY.kv_shape(len(tokens))).astype(np.float16)

    def node() -> TieredStore:
        shared = RedisTier(LAY, RedisOptions(url=redis_url), prefix=prefix,
                           sealer=BlockSealer(LAY, secret=b"s" * 32))  # fmt: skip
        host = HostTier(LAY, (n + 1) * LAY.block_bytes)
        return TieredStore(LAY, [host, shared], model_id="m", workers=2)

    with node() as writer:
        assert writer.store(tokens, kv) == len(tokens)
        writer.flush()
        assert writer.stats()["store"]["write_through"] == n
    with node() as reader:
        out = np.zeros_like(kv)
        assert reader.load(tokens, out) == len(tokens)
        assert np.array_equal(out.view(np.uint16), kv.view(np.uint16))
