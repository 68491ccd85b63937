"""The NVMe tier against a dict model: put/get/delete/reopen in any order, and the persisted
index compacted many times over, always agree with what was stored."""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvtier.keys import BlockKey
from kvtier.tiers.nvme import NVMeTier
from kvtier.tiers.nvme_index import DirIndex, SlotIO, slot_bytes_for
from tests.tier_conformance import LAYOUT, empty_block, rand_block

CAPACITY = 6


def key_of(i: int) -> BlockKey:
    return BlockKey(hashlib.blake2b(i.to_bytes(4, "little"), digest_size=32).digest())


class NVMeModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="kvtier-model-"))
        self.model: dict[BlockKey, int] = {}
        self.tier = self._open()

    def _open(self) -> NVMeTier:
        paths = [self.root / "a", self.root / "b"]
        return NVMeTier(LAYOUT, paths, CAPACITY * slot_bytes_for(LAYOUT.block_bytes), workers=2)

    @rule(ids=st.lists(st.integers(0, 12), min_size=1, max_size=4, unique=True))
    def put(self, ids: list[int]) -> None:
        keys = [key_of(i) for i in ids]
        free = CAPACITY - len(self.model)
        ok = self.tier.put(keys, [rand_block(seed=i) for i in ids])
        new = [good for k, good in zip(keys, ok, strict=True) if k not in self.model]
        assert new == [True] * min(free, len(new)) + [False] * max(0, len(new) - free)
        for i, k, good in zip(ids, keys, ok, strict=True):
            if k in self.model:
                assert good, "a present key is reported stored"
            elif good:
                self.model[k] = i

    @rule(ids=st.lists(st.integers(0, 12), min_size=1, max_size=4, unique=True))
    def delete(self, ids: list[int]) -> None:
        keys = [key_of(i) for i in ids]
        self.tier.delete(keys)
        for k in keys:
            self.model.pop(k, None)

    @rule()
    def reopen(self) -> None:
        self.tier.close()
        self.tier = self._open()

    @rule(ids=st.lists(st.integers(0, 12), min_size=1, max_size=4, unique=True))
    def get(self, ids: list[int]) -> None:
        keys = [key_of(i) for i in ids]
        outs = [empty_block() for _ in keys]
        got = self.tier.get_into(keys, outs)
        for i, k, o, g in zip(ids, keys, outs, got, strict=True):
            assert g == (k in self.model)
            if g:
                assert o.tobytes() == rand_block(seed=i).tobytes()

    @invariant()
    def same_keys(self) -> None:
        assert set(self.tier.keys()) == set(self.model)
        assert self.tier.usage().used_blocks == len(self.model)

    def teardown(self) -> None:
        self.tier.close()
        shutil.rmtree(self.root, ignore_errors=True)


TestNVMeModel = NVMeModel.TestCase
TestNVMeModel.settings = settings(
    max_examples=25,
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_index_survives_many_compactions(tmp_path: Path) -> None:
    """More records than the compaction threshold, then a reload without a clean close."""
    ix = DirIndex(tmp_path, 8, SlotIO())
    live: dict[int, bytes] = {}
    for n in range(6000):
        slot = n % 8
        key = n.to_bytes(32, "little")
        if slot in live:
            ix.record_del([(slot, live.pop(slot))])
        ix.record_put([(slot, key, n)])
        live[slot] = key
    ix.record_del([(3, live.pop(3))])
    again = DirIndex(tmp_path, 8, SlotIO())  # the first was never closed: journal replay
    assert {s: k for s, (k, _) in again.entries.items()} == live
    assert again.entries[0][1] == 5992
