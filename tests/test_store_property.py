"""A hypothesis state machine: good and bad calls through the public API, mid-workload, on small
host + NVMe tiers. After every step the store must be consistent: the index, the tiers and the
policies agree, no pin or pending write is left behind, every load returns exact bytes (never
less than a pin promised), and a bad call (unhashable ``reuse_class``, malformed tokens or KV,
an exception inside a pin) raises its named exception and stores nothing. A long run of good
stores must still write everything it is given: no block was stranded unevictable.

The default run is short; ``test_store_property_long`` (slow) runs many more examples.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvtier.errors import ConfigError, LayoutError, RequestError, TokenError
from kvtier.store import TieredStore
from kvtier.tiers.host import HostTier
from kvtier.tiers.nvme import NVMeTier
from kvtier.tiers.nvme_index import slot_bytes_for
from tests.helpers import SMALL, kv_for

BT = SMALL.block_tokens
HOST, NVME = 4, 8
POOL = 10  # prompts of the workload; 1-3 blocks each
good_hints = st.sampled_from([None, "chat", ("rag", 2), 7])
bad_hints = st.sampled_from([["x"], {"a": 1}, {3}, ("t", [1])])


def prompt(i: int) -> list[int]:
    return list(range(1000 * i, 1000 * i + (1 + i % 3) * BT))


class Boom(Exception):
    """Raised by the caller inside a pin."""


class StoreUnderFire(RuleBasedStateMachine):
    #: the default policy; subclasses run the others (below)
    policy = "auto"

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="kvtier-prop-"))
        host = HostTier(SMALL, HOST * SMALL.block_bytes)
        nvme = NVMeTier(SMALL, [self.dir], NVME * slot_bytes_for(SMALL.block_bytes), workers=1)
        self.st = TieredStore(SMALL, [host, nvme], model_id="m", policy=self.policy, workers=2)
        self.fresh = 10**6  # token ids of prompts never stored

    def fresh_prompt(self, blocks: int) -> list[int]:
        self.fresh += 10_000
        return list(range(self.fresh, self.fresh + blocks * BT))

    def out(self, n: int) -> np.ndarray[Any, Any]:
        return np.zeros(SMALL.kv_shape(n), SMALL.storage_dtype)

    def check_load(self, p: list[int]) -> int:
        out = self.out(len(p))
        n = self.st.load(p, out)
        assert n % BT == 0 and n <= len(p)
        assert np.array_equal(out[:, :, :n], kv_for(p)[:, :, :n]), "wrong bytes"
        return n

    def nothing_stored_by(self, call: Any, exc: type[BaseException]) -> None:
        self.st.flush()
        before = len(self.st._index.entries)
        with pytest.raises(exc):
            call()
        self.st.flush()
        assert len(self.st._index.entries) == before

    # -- good calls ----------------------------------------------------------------------------
    @rule(i=st.integers(0, POOL - 1), hint=good_hints)
    def store(self, i: int, hint: object) -> None:
        p = prompt(i)
        written = self.st.store(p, kv_for(p), reuse_class=hint)  # type: ignore[arg-type]
        assert written % BT == 0 and written <= len(p)

    @rule(i=st.integers(0, POOL - 1))
    def load(self, i: int) -> None:
        self.check_load(prompt(i))

    @rule(i=st.integers(0, POOL - 1))
    def pin_then_load(self, i: int) -> None:
        p = prompt(i)
        with self.st.pin(p) as n:
            assert self.check_load(p) >= n, "a pin promised more than the load found"

    @rule(
        i=st.integers(0, POOL - 1),
        skip=st.integers(0, 2),
        adapter=st.sampled_from([None, "lora-a"]),
    )
    def lease_then_load_from(self, i: int, skip: int, adapter: str | None) -> None:
        p = prompt(i)
        start = min(skip, len(p) // BT) * BT
        out = self.out(len(p) - start)
        with self.st.lease(p, adapter=adapter, start=start) as held:
            n = self.st.load(p, out, adapter=adapter, start=start)
            assert n >= held.end >= start, "a lease promised more than the load found"
        assert not held.held
        want = kv_for(p)[:, :, start:n]
        assert np.array_equal(out[:, :, : n - start], want), "wrong bytes"

    @rule(i=st.integers(0, POOL - 1))
    def prefetch(self, i: int) -> None:
        assert 0 <= self.st.prefetch(prompt(i)) <= len(prompt(i))

    @rule(durable=st.booleans())
    def flush(self, durable: bool) -> None:
        assert self.st.flush(durable=durable) >= 0

    # -- bad calls -----------------------------------------------------------------------------
    @rule(hint=bad_hints, blocks=st.integers(1, 3))
    def store_unhashable_reuse_class(self, hint: object, blocks: int) -> None:
        p = self.fresh_prompt(blocks)
        self.nothing_stored_by(
            lambda: self.st.store(p, kv_for(p), reuse_class=hint),  # type: ignore[arg-type]
            RequestError,
        )
        assert self.st.lookup(p) == 0

    @rule(
        blocks=st.integers(1, 3),
        at=st.integers(0, 3 * BT - 1),
        bad=st.sampled_from([-1, 2**32, 2**64, 2**70, 1.5]),
    )
    def store_bad_tokens(self, blocks: int, at: int, bad: object) -> None:
        p = self.fresh_prompt(blocks)
        toks: list[Any] = list(p)
        toks[at % len(toks)] = bad
        self.nothing_stored_by(lambda: self.st.store(toks, kv_for(p)), TokenError)
        with pytest.raises(TokenError):
            self.st.lookup(toks)

    @rule(blocks=st.integers(1, 3), kind=st.sampled_from(["dtype", "longer", "shape"]))
    def store_bad_kv(self, blocks: int, kind: str) -> None:
        p = self.fresh_prompt(blocks)
        kv = kv_for(p)
        if kind == "dtype":
            kv = kv.astype(np.float32)
        elif kind == "longer":
            p = p[:-1]
        else:
            kv = kv[:, :, :, :1]
        self.nothing_stored_by(lambda: self.st.store(p, kv), LayoutError)

    @rule(i=st.integers(0, POOL - 1))
    def load_into_too_small_a_buffer(self, i: int) -> None:
        p = prompt(i)
        with pytest.raises(LayoutError):
            self.st.load(p, self.out(len(p) - BT))

    @rule(
        i=st.integers(0, POOL - 1),
        bad=st.sampled_from(
            [{"start": 1}, {"start": -BT}, {"start": 99 * BT}, {"adapter": ""}, {"salt": 5}]
        ),
    )
    def calls_with_a_bad_scope_or_start(self, i: int, bad: dict[str, Any]) -> None:
        p = self.fresh_prompt(1 + i % 3)
        exc = LayoutError if "start" in bad else ConfigError
        self.nothing_stored_by(lambda: self.st.store(p, kv_for(p), **bad), exc)
        with pytest.raises(exc):
            self.st.lookup(p, **bad)
        with pytest.raises(exc):
            self.st.load(p, self.out(len(p)), **bad)
        with pytest.raises(exc):
            self.st.lease(p, **bad)

    @rule(i=st.integers(0, POOL - 1))
    def exception_inside_a_pin(self, i: int) -> None:
        with pytest.raises(Boom), self.st.pin(prompt(i)):
            raise Boom

    # -- invariants ----------------------------------------------------------------------------
    @invariant()
    def index_tiers_and_policies_agree(self) -> None:
        self.st.flush()
        idx = self.st._index
        for t, tier in enumerate(self.st.tiers):
            held = {k for k, e in idx.entries.items() if e.tiers & 1 << t}
            assert held == set(tier.keys()), f"index and {tier.name} disagree"
            assert idx.resident[t] == len(held) <= tier.capacity_blocks
            pol = idx.policies[t]
            assert pol is not None and set(pol.resident()) == held, f"{tier.name} policy"
        assert all(e.pins == 0 and e.pending == 0 and e.tiers for e in idx.entries.values())

    def teardown(self) -> None:
        try:
            # every block stays evictable: fresh stores, more than both tiers hold, all fit
            for _ in range(HOST + NVME):
                p = self.fresh_prompt(2)
                assert self.st.store(p, kv_for(p)) == 2 * BT, "the store is wedged"
            self.index_tiers_and_policies_agree()
        finally:
            self.st.close()
            shutil.rmtree(self.dir, ignore_errors=True)


_quiet = [HealthCheck.too_slow, HealthCheck.filter_too_much]
StoreUnderFire.TestCase.settings = settings(
    max_examples=12, stateful_step_count=20, deadline=None, suppress_health_check=_quiet
)
TestStoreUnderFire = StoreUnderFire.TestCase


class LRUStoreUnderFire(StoreUnderFire):
    """The same with plain LRU (the default evicts by LRU or S3-FIFO, whichever leads)."""

    policy = "lru"


class S3FIFOStoreUnderFire(StoreUnderFire):
    policy = "s3fifo"


for _machine in (LRUStoreUnderFire, S3FIFOStoreUnderFire):
    _machine.TestCase.settings = settings(
        max_examples=6, stateful_step_count=20, deadline=None, suppress_health_check=_quiet
    )
TestLRUStoreUnderFire = LRUStoreUnderFire.TestCase
TestS3FIFOStoreUnderFire = S3FIFOStoreUnderFire.TestCase


@pytest.mark.slow
def test_store_property_long() -> None:
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(
        StoreUnderFire,
        settings=settings(
            max_examples=300, stateful_step_count=60, deadline=None, suppress_health_check=_quiet
        ),
    )
