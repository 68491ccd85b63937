"""A pin means what it says: every block it counts can be loaded while it is held.

A block whose eviction (or drop from its last tier) is already planned is on its way out: a pin
cannot stop a move already handed to the workers, so it must not count that block. The slow
``fdatasync`` below holds such a move in flight the way a busy disk does.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import numpy as np

from kvtier.store import TieredStore
from kvtier.tiers.host import HostTier
from kvtier.tiers.nvme import NVMeTier
from kvtier.tiers.nvme_index import SlotIO, slot_bytes_for
from tests.helpers import SMALL, kv_for

BT = SMALL.block_tokens
SLOT = slot_bytes_for(SMALL.block_bytes)


class SlowSyncIO(SlotIO):
    """``fdatasync`` takes a second once ``slow`` is set (a disk busy with other writers)."""

    slow = False

    def fdatasync(self, fd: int) -> None:
        if self.slow:
            time.sleep(1.0)
        super().fdatasync(fd)


def prompt(start: int, blocks: int = 1) -> list[int]:
    return list(range(start, start + blocks * BT))


def test_a_pin_does_not_count_a_block_whose_drop_is_planned(tmp_path: Path) -> None:
    io = SlowSyncIO()
    host = HostTier(SMALL, SMALL.block_bytes)
    nvme = NVMeTier(SMALL, [tmp_path], 2 * SLOT, io=io, workers=1)
    with TieredStore(SMALL, [host, nvme], model_id="m", policy="lru", workers=2) as st:
        a, b, c, d = (prompt(1000 * i) for i in range(1, 5))
        for p in (a, b, c):
            assert st.store(p, kv_for(p)) == BT
        st.flush()
        assert st.locate(a) == ["nvme"] and st.locate(c) == ["host"]
        io.slow = True
        # storing d demotes c into the full NVMe tier, which drops a to make room
        writer = threading.Thread(target=st.store, args=(d, kv_for(d)))
        writer.start()
        time.sleep(0.3)
        out = np.zeros(SMALL.kv_shape(BT), SMALL.storage_dtype)
        with st.pin(a) as n:
            got = st.load(a, out)
        writer.join()
        assert got == n  # before the fix: n == BT, got == 0
        io.slow = False


def test_eight_threads_on_tiny_tiers_never_load_less_than_they_pinned(tmp_path: Path) -> None:
    host = HostTier(SMALL, 3 * SMALL.block_bytes)
    nvme = NVMeTier(SMALL, [tmp_path], 6 * SLOT, workers=2)
    prompts = [prompt(1000 * i, 1 + i % 3) for i in range(12)]
    short: list[tuple[int, int]] = []
    wrong: list[int] = []
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        out = np.zeros(SMALL.kv_shape(3 * BT), SMALL.storage_dtype)
        try:
            for _ in range(60):
                p = rng.choice(prompts)
                if rng.random() < 0.5:
                    st.store(p, kv_for(p))
                    continue
                with st.pin(p) as n:
                    got = st.load(p, out)
                if got < n:
                    short.append((n, got))
                if not np.array_equal(out[:, :, :got], kv_for(p)[:, :, :got]):
                    wrong.append(got)
        except BaseException as exc:  # reported below, not lost in the thread
            errors.append(exc)

    with TieredStore(SMALL, [host, nvme], model_id="m", policy="lru", workers=2) as st:
        threads = [threading.Thread(target=work, args=(s,)) for s in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        st.flush()
        assert all(e.pins == 0 for e in st._index.entries.values())
    assert not errors
    assert not wrong
    assert not short, f"{len(short)} loads returned less than their pin: {short[:5]}"
