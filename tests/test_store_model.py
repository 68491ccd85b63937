"""A hypothesis state machine: TieredStore against a dict model of what may be cached.

The model knows, per prompt, the KV that is correct. The store may forget anything (it is a
cache), but whatever it returns must be a prefix of correct KV, lookups must agree with loads,
and a store into an empty-enough cache must be readable right after.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.store import TieredStore
from tests.helpers import SMALL, host_store, kv_for

BT = SMALL.block_tokens
prompts = st.lists(st.integers(0, 3), min_size=0, max_size=14)


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.store: TieredStore = host_store(6, lower=10)
        self.seen: list[list[int]] = []

    @rule(toks=prompts)
    def store_prompt(self, toks: list[int]) -> None:
        written = self.store.store(toks, kv_for(toks))
        assert written % BT == 0 and written <= len(toks)
        self.seen.append(toks)
        # right after a store, the whole full-block prefix is cached (capacity 6 > 3 blocks)
        assert self.store.lookup(toks) == (len(toks) // BT) * BT

    @precondition(lambda self: bool(self.seen))
    @rule(i=st.integers(0, 50), extra=prompts)
    def load_prompt(self, i: int, extra: list[int]) -> None:
        toks = self.seen[i % len(self.seen)] + extra
        self.store.flush()  # background moves finishing between lookup and load may evict
        expect = self.store.lookup(toks)
        out = np.zeros(SMALL.kv_shape(len(toks)), SMALL.storage_dtype)
        n = self.store.load(toks, out)
        assert n == expect
        assert np.array_equal(out[:, :, :n], kv_for(toks)[:, :, :n])

    @rule(toks=prompts)
    def prefetch(self, toks: list[int]) -> None:
        assert self.store.prefetch(toks) <= self.store.lookup(toks)

    @rule()
    def flush(self) -> None:
        self.store.flush()

    @invariant()
    def occupancy_within_capacity(self) -> None:
        for t in self.store.tiers:
            u = t.usage()
            assert u.used_blocks <= u.capacity_blocks

    def teardown(self) -> None:
        self.store.close()


StoreMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
TestStoreModel = StoreMachine.TestCase


def test_model_helper_is_prefix_consistent() -> None:
    a, b = [1, 2, 3, 4, 5], [1, 2, 3, 4, 9]
    ka: Any = kv_for(a)
    assert np.array_equal(ka[:, :, :4], kv_for(b)[:, :, :4])
    assert not np.array_equal(ka[:, :, 4], kv_for(b)[:, :, 4])
