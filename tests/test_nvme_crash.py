"""kill -9 torture: a writer process is killed at random points; every block the reopened tier
claims must load, byte for byte, and ``kvtier check`` must find no torn or foreign slot.

The writer puts blocks whose bytes are a function of their key and deletes at random (so slots
are reused), i.e. it crosses every step of the put/delete protocol many times a second.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.errors import TierLockedError
from kvtier.keys import BlockKey
from kvtier.tiers.nvme import NVMeTier
from kvtier.tiers.nvme_check import check_dir
from kvtier.tiers.nvme_index import slot_bytes_for
from tests.tier_conformance import LAYOUT, empty_block

CAPACITY = 24 * slot_bytes_for(LAYOUT.block_bytes)
ROOT = Path(__file__).resolve().parent.parent

WRITER = """
import random, sys
from kvtier.tiers.nvme import NVMeTier
from tests.test_nvme_crash import CAPACITY, LAYOUT, block_for, key_for
paths, seed = sys.argv[1:3], int(sys.argv[3])
tier = NVMeTier(LAYOUT, paths, CAPACITY, workers=2)
print("ready", flush=True)
rng = random.Random(seed)
i = 0
while True:
    n = rng.randint(1, 4)
    keys = [key_for(seed, i + j) for j in range(n)]
    tier.put(keys, [block_for(k) for k in keys])
    i += n
    held = list(tier.keys())
    if len(held) > 16:
        tier.delete(rng.sample(held, rng.randint(1, 6)))
"""


def key_for(seed: int, i: int) -> BlockKey:
    return BlockKey(hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=32).digest())


def block_for(key: bytes) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    return rng.integers(0, 2**16, size=LAYOUT.block_shape, dtype=np.uint16).view(np.float16)


def start_writer(paths: list[Path], seed: int) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, *map(str, paths), str(seed)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    return proc


def verify(paths: list[Path]) -> int:
    """Reopen; every claimed block must load and be exactly the bytes of its key."""
    tier = NVMeTier(LAYOUT, paths, CAPACITY)
    try:
        keys = list(tier.keys())
        outs = [empty_block() for _ in keys]
        got = tier.get_into(keys, outs)
        for k, o, g in zip(keys, outs, got, strict=True):
            assert g, f"indexed block {k.hex()[:8]} did not load after kill -9"
            assert o.tobytes() == block_for(k).tobytes(), f"wrong bytes for {k.hex()[:8]}"
        assert tier.healthy
    finally:
        tier.close()
    for p in paths:
        report = check_dir(p)
        assert report.torn == 0 and report.foreign == 0, str(report)
    return len(keys)


def torture(tmp_path: Path, rounds: int, max_delay: float) -> None:
    paths = [tmp_path / "d0", tmp_path / "d1"]
    rng = random.Random(1234)
    seen = 0
    for r in range(rounds):
        proc = start_writer(paths, seed=r)
        try:
            if r == 0:  # the live writer holds the directories
                with pytest.raises(TierLockedError, match=f"process {proc.pid}"):
                    NVMeTier(LAYOUT, paths, CAPACITY)
            time.sleep(rng.uniform(0.02, max_delay))
            assert proc.poll() is None, "writer died on its own"
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        seen += verify(paths)
    assert seen > 0, "the writer never got a block indexed before being killed"


def test_kill9_torture_quick(tmp_path: Path) -> None:
    torture(tmp_path, rounds=3, max_delay=0.4)


@pytest.mark.slow
def test_kill9_torture_long(tmp_path: Path) -> None:
    torture(tmp_path, rounds=40, max_delay=1.0)
