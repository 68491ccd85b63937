"""The tier conformance suite: every ``Tier`` implementation must pass it.

Use it by subclassing ``TierConformance`` in a ``test_*.py`` module and defining ``make_tier``
(and ``corrupt`` if the medium can be tampered with from the test)::

    class TestHostTier(TierConformance):
        def make_tier(self, layout, capacity_blocks, tmp_path):
            return HostTier(layout, capacity_blocks * layout.block_bytes)

Tiers that are unbounded (capacity 0, e.g. a server that evicts on its own) skip the capacity
test. ``reopen`` (optional) returns a new tier instance over the same storage, for tiers that
survive a restart.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.errors import LayoutError
from kvtier.keys import BlockKey
from kvtier.layout import KVLayout
from kvtier.tiers.base import Tier

LAYOUT = KVLayout(layers=2, kv_heads=2, head_dim=8, dtype="float16", block_tokens=16)


def rand_key() -> BlockKey:
    return BlockKey(os.urandom(32))


def rand_block(layout: KVLayout = LAYOUT, seed: int | None = None) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 2**16, size=layout.block_shape, dtype=np.uint16).view(np.float16)


def empty_block(layout: KVLayout = LAYOUT) -> np.ndarray[Any, Any]:
    return np.zeros(layout.block_shape, dtype=layout.storage_dtype)


def assert_round_trip(tier: Tier, seed: int) -> None:
    """One new block put into ``tier`` comes back byte for byte."""
    k, b = rand_key(), rand_block(tier.layout, seed=seed)
    assert tier.put([k], [b]) == [True]
    out = empty_block(tier.layout)
    assert tier.get_into([k], [out]) == [True] and out.tobytes() == b.tobytes()


class TierConformance:
    """Mixin of contract tests; subclasses provide ``make_tier``."""

    layout = LAYOUT
    capacity = 8

    def make_tier(self, layout: KVLayout, capacity_blocks: int, tmp_path: Path) -> Tier:
        raise NotImplementedError

    def corrupt(self, tier: Tier, key: BlockKey) -> bool:
        """Flip a bit of the stored block; return False if this medium cannot be tampered with."""
        return False

    def reopen(self, tier: Tier, tmp_path: Path) -> Tier | None:
        """A fresh instance over the same storage, or None if the tier is not persistent."""
        return None

    @pytest.fixture
    def tier(self, tmp_path: Path) -> Any:
        t = self.make_tier(self.layout, self.capacity, tmp_path)
        yield t
        t.close()

    # -- basic contract --------------------------------------------------------------------
    def test_empty_tier_misses(self, tier: Tier) -> None:
        k = rand_key()
        assert tier.contains_prefix([k]) == 0
        assert tier.get_into([k], [empty_block()]) == [False]
        assert tier.usage().used_blocks == 0

    def test_roundtrip_is_byte_identical(self, tier: Tier) -> None:
        keys = [rand_key() for _ in range(3)]
        blocks = [rand_block(seed=i) for i in range(3)]
        assert tier.put(keys, blocks) == [True, True, True]
        outs = [empty_block() for _ in keys]
        assert tier.get_into(keys, outs) == [True, True, True]
        for b, o in zip(blocks, outs, strict=True):
            assert o.tobytes() == b.tobytes()
        assert tier.usage().used_blocks == 3

    def test_get_into_strided_destination(self, tier: Tier) -> None:
        """A block lands in a slice of a larger [layers, kv, tokens, heads, dim] array."""
        lay = self.layout
        key, block = rand_key(), rand_block(seed=7)
        assert tier.put([key], [block]) == [True]
        big = np.zeros(lay.kv_shape(3 * lay.block_tokens), dtype=np.float16)
        bt = lay.block_tokens
        dst = big[:, :, bt : 2 * bt]
        assert tier.get_into([key], [dst]) == [True]
        assert np.array_equal(dst.view(np.uint16), block.view(np.uint16))
        assert not big[:, :, :bt].any() and not big[:, :, 2 * bt :].any()

    def test_put_from_strided_source(self, tier: Tier) -> None:
        lay = self.layout
        bt = lay.block_tokens
        kv = rand_block(
            KVLayout(lay.layers, lay.kv_heads, lay.head_dim, lay.dtype, lay.kv_factor, 3 * bt),
            seed=3,
        )
        key = rand_key()
        assert tier.put([key], [kv[:, :, bt : 2 * bt]]) == [True]
        out = empty_block()
        assert tier.get_into([key], [out]) == [True]
        assert out.tobytes() == np.ascontiguousarray(kv[:, :, bt : 2 * bt]).tobytes()

    def test_contains_prefix_counts_leading_keys(self, tier: Tier) -> None:
        keys = [rand_key() for _ in range(4)]
        tier.put([keys[0], keys[1], keys[3]], [rand_block() for _ in range(3)])
        assert tier.contains_prefix(keys) == 2
        assert tier.contains_prefix(keys[3:]) == 1
        assert tier.contains_prefix([]) == 0

    def test_delete(self, tier: Tier) -> None:
        a, b = rand_key(), rand_key()
        tier.put([a, b], [rand_block(), rand_block()])
        tier.delete([a, rand_key()])  # absent keys are ignored
        assert tier.contains_prefix([a]) == 0
        assert tier.get_into([a, b], [empty_block(), empty_block()]) == [False, True]
        assert tier.usage().used_blocks == 1

    def test_put_existing_key_keeps_first_value(self, tier: Tier) -> None:
        k = rand_key()
        first, second = rand_block(seed=1), rand_block(seed=2)
        assert tier.put([k], [first]) == [True]
        assert tier.put([k], [second]) == [True]
        out = empty_block()
        assert tier.get_into([k], [out]) == [True]
        assert out.tobytes() == first.tobytes()
        assert tier.usage().used_blocks == 1

    def test_wrong_buffer_size_raises_and_stores_nothing(self, tier: Tier) -> None:
        k = rand_key()
        with pytest.raises(LayoutError):
            tier.put([k], [np.zeros(3, dtype=np.float16)])
        assert tier.contains_prefix([k]) == 0
        with pytest.raises(LayoutError):
            tier.get_into([k], [np.zeros(3, dtype=np.float16)])

    def test_capacity_is_enforced(self, tier: Tier) -> None:
        if tier.capacity_blocks == 0:
            pytest.skip("unbounded tier")
        n = tier.capacity_blocks
        keys = [rand_key() for _ in range(n + 2)]
        blocks = [rand_block(seed=i) for i in range(n + 2)]
        ok = tier.put(keys, blocks)
        assert sum(ok) == n and ok[:n] == [True] * n
        outs = [empty_block() for _ in keys]
        got = tier.get_into(keys, outs)
        for k, b, o, g in zip(keys, blocks, outs, got, strict=True):
            if g:
                assert o.tobytes() == b.tobytes(), k.hex()
        tier.delete(keys[:1])
        assert tier.put(keys[-1:], blocks[-1:]) == [True]

    def test_corrupted_block_is_a_miss_and_dropped(self, tier: Tier) -> None:
        k, block = rand_key(), rand_block(seed=5)
        tier.put([k], [block])
        if not tier.verifies_checksums or not self.corrupt(tier, k):
            pytest.skip("this tier cannot be corrupted from the test")
        out = empty_block()
        assert tier.get_into([k], [out]) == [False]
        assert tier.contains_prefix([k]) == 0

    def test_reopen_keeps_blocks(self, tier: Tier, tmp_path: Path) -> None:
        keys = [rand_key() for _ in range(3)]
        blocks = [rand_block(seed=10 + i) for i in range(3)]
        tier.put(keys, blocks)
        again = self.reopen(tier, tmp_path)
        if again is None:
            pytest.skip("tier is not persistent")
        try:
            outs = [empty_block() for _ in keys]
            assert again.get_into(keys, outs) == [True] * 3
            assert [o.tobytes() for o in outs] == [b.tobytes() for b in blocks]
        finally:
            again.close()

    def test_concurrent_put_get(self, tier: Tier) -> None:
        """Readers racing writers and deleters only ever see whole, correct blocks."""
        keys = [rand_key() for _ in range(6)]
        blocks = {k: rand_block(seed=i) for i, k in enumerate(keys)}
        errors: list[str] = []

        def worker(seed: int) -> None:
            rng = np.random.default_rng(seed)
            out = empty_block()
            for _ in range(60):
                k = keys[int(rng.integers(len(keys)))]
                op = int(rng.integers(3))
                if op == 0:
                    tier.put([k], [blocks[k]])
                elif op == 1:
                    if tier.get_into([k], [out]) == [True] and out.tobytes() != blocks[k].tobytes():
                        errors.append(f"wrong bytes for {k.hex()[:8]}")
                else:
                    tier.delete([k])

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
