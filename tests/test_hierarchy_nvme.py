"""Host DRAM + NVMe through TieredStore: the stories of a two-level cache that survives restarts."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.keys import block_keys
from kvtier.store import TieredStore
from kvtier.tiers.host import HostTier
from kvtier.tiers.nvme import NVMeTier
from kvtier.tiers.nvme_index import SLOTS_FILE, slot_bytes_for
from tests.helpers import SMALL, kv_for

SLOT = slot_bytes_for(SMALL.block_bytes)
FILLER = [9999] * 8  # two blocks that evict whatever the 2-block host tier held
PROMPTS = [[s] * 8 for s in range(1, 7)]  # 6 prompts x 2 blocks = 12 blocks, host holds 4


def nvme_store(
    tmp_path: Path, host_blocks: int = 4, nvme_blocks: int = 32, **kw: Any
) -> TieredStore:
    tiers = [
        HostTier(SMALL, host_blocks * SMALL.block_bytes),
        NVMeTier(SMALL, [tmp_path / "nvme0", tmp_path / "nvme1"], nvme_blocks * SLOT, workers=2),
    ]
    return TieredStore(SMALL, tiers, model_id="test", **kw)


def loaded(st: TieredStore, toks: list[int]) -> tuple[int, np.ndarray[Any, Any]]:
    out = np.zeros(SMALL.kv_shape(len(toks)), SMALL.storage_dtype)
    return st.load(toks, out), out


def same(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> bool:
    return a.tobytes() == b.tobytes()


def test_host_evictions_are_demoted_to_nvme_and_hits_promoted(tmp_path: Path) -> None:
    with nvme_store(tmp_path) as st:
        for p in PROMPTS:
            st.store(p, kv_for(p))
        st.flush()
        assert all(st.lookup(p) == 8 for p in PROMPTS)  # nothing lost
        assert st.locate(PROMPTS[0]) == ["nvme", "nvme"]
        assert st.tiers[1].usage().used_blocks >= 8
        n, out = loaded(st, PROMPTS[0])
        assert n == 8 and same(out, kv_for(PROMPTS[0]))
        st.flush()
        assert st.locate(PROMPTS[0]) == ["host", "host"]  # promoted back to DRAM
        stats = st.stats()["store"]
        assert stats["demotions"] >= 8 and stats["promotions"] >= 1


def test_prefetch_brings_a_prefix_up_before_use(tmp_path: Path) -> None:
    with nvme_store(tmp_path) as st:
        for p in PROMPTS:
            st.store(p, kv_for(p))
        st.flush()
        target = PROMPTS[1]
        assert st.locate(target) == ["nvme", "nvme"]
        assert st.prefetch(target) == 8
        st.flush()
        assert st.locate(target) == ["host", "host"]
        n, out = loaded(st, target)
        assert n == 8 and same(out, kv_for(target))


def test_warm_restart_finds_the_prefix(tmp_path: Path) -> None:
    doc = list(range(100, 120))  # 5 blocks: a long shared document
    with nvme_store(tmp_path, host_blocks=2) as st:
        st.store(doc, kv_for(doc))
        st.store(FILLER, kv_for(FILLER))  # pushes the whole document down to NVMe
        st.flush()
        assert set(st.locate(doc)) == {"nvme"}
    # a new process: empty DRAM, same NVMe directories
    with nvme_store(tmp_path, host_blocks=2) as st:
        asked = doc + [7, 7, 7, 7]
        assert st.lookup(asked) == 20
        assert set(st.locate(doc)) == {"nvme"}
        out = np.zeros(SMALL.kv_shape(len(asked)), SMALL.storage_dtype)
        assert st.load(asked, out) == 20
        assert same(out[:, :, :20], kv_for(doc))


def test_cold_start_config_discards_old_contents(tmp_path: Path) -> None:
    def config(warm: bool) -> dict[str, Any]:
        return {
            "store": {
                "layers": 2,
                "kv_heads": 2,
                "head_dim": 4,
                "dtype": "float16",
                "block_tokens": 4,
                "model_id": "test",
            },
            "tiers": [
                {"kind": "host", "capacity": 2 * SMALL.block_bytes},
                {
                    "kind": "nvme",
                    "paths": [str(tmp_path / "n")],
                    "capacity": 16 * SLOT,
                    "warm_restart": warm,
                },
            ],
        }

    doc = list(range(16))
    with TieredStore.from_config(config(True)) as st:
        st.store(doc, kv_for(doc))
        st.store(FILLER, kv_for(FILLER))
        st.flush()
    with TieredStore.from_config(config(True)) as st:
        assert st.lookup(doc) == 16
    with TieredStore.from_config(config(False)) as st:
        assert st.lookup(doc) == 0


def test_corrupt_nvme_block_is_a_miss_not_garbage(tmp_path: Path) -> None:
    toks = list(range(12))  # 3 blocks, host holds 1: blocks end up on NVMe
    with nvme_store(tmp_path, host_blocks=1) as st:
        st.store(toks, kv_for(toks))
        st.flush()
        nv = st.tiers[1].inner
        assert isinstance(nv, NVMeTier)
        key = block_keys(st.namespace(), toks)[1]
        slot = nv._table.acquire(key)
        assert slot is not None, "block 1 should have been demoted to NVMe"
        nv._table.release(slot)
        path = nv._devs[slot % 2].path / SLOTS_FILE
        fd = os.open(path, os.O_WRONLY)
        os.pwrite(fd, b"\x5a", (slot // 2) * SLOT + 64 + 7)
        os.close(fd)
        n, out = loaded(st, toks)
        assert n == 4  # the prefix stops at the corrupt block
        assert same(out[:, :, :n], kv_for(toks)[:, :, :n])


def test_nvme_directory_lost_mid_run_keeps_serving(tmp_path: Path) -> None:
    with nvme_store(tmp_path) as st:
        for p in PROMPTS[:3]:
            st.store(p, kv_for(p))
        st.flush()
        shutil.rmtree(tmp_path / "nvme0")
        shutil.rmtree(tmp_path / "nvme1")
        for p in PROMPTS:  # demotions now fail: blocks fall off, no exception
            st.store(p, kv_for(p))
            n, out = loaded(st, p)
            assert same(out[:, :, :n], kv_for(p)[:, :, :n])
        st.flush()
        assert not st.tiers[1].healthy
        n, out = loaded(st, PROMPTS[-1])
        assert n == 8 and same(out, kv_for(PROMPTS[-1]))


def test_close_writes_host_only_blocks_down_for_a_warm_restart(tmp_path: Path) -> None:
    toks = list(range(16))  # 4 blocks, all fit in the host tier: nothing demoted while running
    with nvme_store(tmp_path, host_blocks=8) as st:
        st.store(toks, kv_for(toks))
        assert st.locate(toks) == ["host"] * 4
    with nvme_store(tmp_path, host_blocks=8) as again:
        assert again.locate(toks) == ["nvme"] * 4
        n, out = loaded(again, toks)
        assert n == 16 and same(out, kv_for(toks))
