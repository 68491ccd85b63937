"""``TieredStore.load_layers``: layer-wise streamed loads give the bytes ``load`` gives, and a
corrupt block is caught by ``verify()`` (a miss), on host and NVMe tiers."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.layout import KVLayout
from kvtier.store import TieredStore
from kvtier.tiers.host import HostTier
from kvtier.tiers.nvme import NVMeTier
from kvtier.tiers.nvme_index import SLOTS_FILE, slot_bytes_for
from tests.helpers import kv_for

# 4 layers of 8 KiB per block: layer 1.. start mid-page, so NVMe layer reads need the covering
# aligned range
BIG = KVLayout(layers=4, kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
TOKS = list(range(1000, 1000 + 5 * 16 + 3))  # 5 full blocks + a partial one


def out_for(layout: KVLayout, n: int) -> np.ndarray[Any, Any]:
    return np.full(layout.kv_shape(n), 7, layout.storage_dtype)


def check_same_as_load(st: TieredStore, layout: KVLayout) -> None:
    ref = out_for(layout, len(TOKS))
    n = st.load(TOKS, ref)
    assert n == 80
    got = out_for(layout, len(TOKS))
    ll = st.load_layers(TOKS, got)
    assert ll.streamed and ll.tokens == 80
    for layer in range(layout.layers):
        ll.wait(layer)
    assert ll.verify() == 80
    assert np.array_equal(got[:, :, :80], ref[:, :, :80])
    assert np.array_equal(got[:, :, :80], kv_for(TOKS, layout)[:, :, :80])


def test_host_layer_load_equals_load() -> None:
    with TieredStore(BIG, [HostTier(BIG, 8 * BIG.block_bytes)], model_id="test") as st:
        st.store(TOKS, kv_for(TOKS, BIG))
        before = st.stats()["tiers"]["host"]
        check_same_as_load(st, BIG)
        after = st.stats()["tiers"]["host"]
        assert after["bytes_read"] > before["bytes_read"]  # layer reads are metered too
        with st.pin(TOKS) as held:  # verify() released its pins
            assert held == 80
        assert st._index.entries[next(iter(st._index.entries))].pins == 0


def test_nvme_layer_load_equals_load(tmp_path: Path) -> None:
    cap = 8 * slot_bytes_for(BIG.block_bytes)
    with TieredStore(
        BIG, [NVMeTier(BIG, [tmp_path / "a", tmp_path / "b"], cap)], model_id="test"
    ) as st:
        st.store(TOKS, kv_for(TOKS, BIG))
        check_same_as_load(st, BIG)


def test_corrupt_block_in_the_middle_is_a_miss(tmp_path: Path) -> None:
    cap = 8 * slot_bytes_for(BIG.block_bytes)
    tier = NVMeTier(BIG, [tmp_path / "a"], cap)
    with TieredStore(BIG, [tier], model_id="test") as st:
        st.store(TOKS, kv_for(TOKS, BIG))
        keys = list(st._index.entries)
        # flip bytes in layer 2 of the third block (slots are handed out in order)
        slot = tier._table.acquire(keys[2])
        assert slot is not None
        tier._table.release(slot)
        off = slot * tier.slot_bytes + 64 + 2 * BIG.layer_block_bytes + 100
        fd = os.open(tmp_path / "a" / SLOTS_FILE, os.O_WRONLY)
        try:
            os.pwrite(fd, b"\xff\xfe\xfd\xfc", off)
            os.fsync(fd)
        finally:
            os.close(fd)
        out = out_for(BIG, len(TOKS))
        ll = st.load_layers(TOKS, out)
        assert ll.tokens == 80  # streamed before anything could be checked
        assert ll.verify() == 32  # the two blocks before the corrupt one
        assert np.array_equal(out[:, :, :32], kv_for(TOKS, BIG)[:, :, :32])
        assert st.lookup(TOKS) == 32  # the corrupt block is gone
        assert st.stats()["store"]["invalid_blocks"] == 1


def test_host_corruption_and_missing_block() -> None:
    with TieredStore(BIG, [HostTier(BIG, 8 * BIG.block_bytes)], model_id="test") as st:
        st.store(TOKS, kv_for(TOKS, BIG))
        host: Any = st.tiers[0].inner
        slot = host._table.acquire(list(st._index.entries)[1])
        host._table.release(slot)
        host.slot_view(slot)[BIG.block_bytes - 1] ^= 1  # last byte of the last layer
        out = out_for(BIG, len(TOKS))
        assert st.load_layers(TOKS, out).verify() == 16
        assert st.lookup(TOKS) == 16


class NoLayerHost(HostTier):
    layer_reads = False


def test_tier_without_layer_reads_falls_back_to_load() -> None:
    with TieredStore(BIG, [NoLayerHost(BIG, 8 * BIG.block_bytes)], model_id="test") as st:
        st.store(TOKS, kv_for(TOKS, BIG))
        out = out_for(BIG, len(TOKS))
        ll = st.load_layers(TOKS, out)
        assert not ll.streamed
        ll.wait(BIG.layers - 1)  # ready at once
        assert ll.verify() == 80
        assert np.array_equal(out[:, :, :80], kv_for(TOKS, BIG)[:, :, :80])
