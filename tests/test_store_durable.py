"""The durability point: ``flush(durable=True)``.

A child process stores prompts into host + NVMe, calls ``flush(durable=True)``, reports what it
stored, keeps storing, and is killed with SIGKILL. A new store over the same directory must
serve every block acknowledged before the durable flush, byte for byte. With a plain
``flush()`` the blocks still held only by the host tier are lost (the issue's 99.2%).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvtier.errors import ConfigError
from kvtier.store import TieredStore
from kvtier.tiers.host import HostTier
from kvtier.tiers.nvme import NVMeTier
from kvtier.tiers.nvme_index import slot_bytes_for
from tests.helpers import SMALL, host_store, kv_for

ROOT = Path(__file__).resolve().parent.parent
BT = SMALL.block_tokens
HOST_BLOCKS, NVME_BLOCKS = 8, 48


def open_store(d: Path) -> TieredStore:
    host = HostTier(SMALL, HOST_BLOCKS * SMALL.block_bytes)
    nvme = NVMeTier(SMALL, [d], NVME_BLOCKS * slot_bytes_for(SMALL.block_bytes), workers=2)
    return TieredStore(SMALL, [host, nvme], model_id="m", policy="lru", workers=2)


def prompt(i: int, blocks: int = 3) -> list[int]:
    return list(range(1000 * i, 1000 * i + blocks * BT))


CHILD = """
import json, sys, time
from pathlib import Path
from tests.helpers import kv_for
from tests.test_store_durable import open_store, prompt
st = open_store(Path(sys.argv[1]))
acked = [i for i in range(8) if st.store(prompt(i), kv_for(prompt(i))) == len(prompt(i))]
left = st.flush(durable=sys.argv[2] == "durable")
print(json.dumps({"acked": acked, "left": left}), flush=True)
i = 100
while True:  # more stores after the durability point, fitting the host tier: no eviction
    st.store(prompt(i, 1), kv_for(prompt(i, 1)))
    i += 1
    time.sleep(0.01)
"""


def run_and_kill(d: Path, mode: str) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(d), mode], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, "the child died before its flush"
        time.sleep(0.05)
        assert proc.poll() is None, "the child died on its own"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    report: dict[str, object] = json.loads(line)
    return report


def served(d: Path, prompts: list[int]) -> list[int]:
    """The prompts a new store over ``d`` serves in full and exactly."""
    good = []
    with open_store(d) as st:
        for i in prompts:
            p = prompt(i)
            out = np.zeros(SMALL.kv_shape(len(p)), SMALL.storage_dtype)
            n = st.load(p, out)
            assert np.array_equal(out[:, :, :n], kv_for(p)[:, :, :n])  # never wrong bytes
            if n == len(p):
                good.append(i)
    return good


def test_every_block_acknowledged_before_a_durable_flush_survives_kill_9(tmp_path: Path) -> None:
    d = tmp_path / "nvme0"
    report = run_and_kill(d, "durable")
    acked = report["acked"]
    assert isinstance(acked, list) and len(acked) == 8
    assert report["left"] == 0
    assert served(d, acked) == acked


def test_without_the_durable_flush_host_only_blocks_are_lost(tmp_path: Path) -> None:
    d = tmp_path / "nvme0"
    report = run_and_kill(d, "plain")
    acked = report["acked"]
    assert isinstance(acked, list)
    assert served(d, acked) != acked  # the newest prompts were on the host tier only


def test_durable_flush_reports_what_the_persistent_tier_could_not_take(tmp_path: Path) -> None:
    host = HostTier(SMALL, 16 * SMALL.block_bytes)
    nvme = NVMeTier(SMALL, [tmp_path / "nvme0"], 4 * slot_bytes_for(SMALL.block_bytes))
    with TieredStore(SMALL, [host, nvme], model_id="m", policy="lru") as st:
        for i in range(4):
            st.store(prompt(i), kv_for(prompt(i)))
        assert st.flush(durable=True) == 12 - 4  # 12 blocks, 4 slots on NVMe
        assert st.flush() == 0


def test_durable_flush_needs_a_persistent_tier() -> None:
    with host_store(4) as st, pytest.raises(ConfigError, match="persistent tier"):
        st.flush(durable=True)
