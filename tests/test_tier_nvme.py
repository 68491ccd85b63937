"""NVMe tier: conformance, warm restart, damaged slot files and index, faults, locking, config."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest

from kvtier.errors import ConfigError, TierLockedError
from kvtier.keys import BlockKey
from kvtier.layout import KVLayout
from kvtier.tiers.base import Tier
from kvtier.tiers.nvme import NVMeTier
from kvtier.tiers.nvme_check import check_dir
from kvtier.tiers.nvme_index import SLOTS_FILE, SNAP_FILE, SlotIO, slot_bytes_for
from kvtier.tiers.registry import make_tier
from tests.nvme_helpers import crash, patch_file, slot_of
from tests.tier_conformance import LAYOUT, TierConformance, empty_block, rand_block, rand_key

SLOT = slot_bytes_for(LAYOUT.block_bytes)


def dirs(tmp_path: Path, n: int = 2) -> list[Path]:
    return [tmp_path / f"nvme{i}" for i in range(n)]


def open_tier(tmp_path: Path, blocks: int = 8, n_dirs: int = 2, **kw: object) -> NVMeTier:
    return NVMeTier(LAYOUT, dirs(tmp_path, n_dirs), blocks * SLOT, **kw)  # type: ignore[arg-type]


class TestNVMeTier(TierConformance):
    def make_tier(self, layout: KVLayout, capacity_blocks: int, tmp_path: Path) -> Tier:
        return NVMeTier(
            layout, dirs(tmp_path), capacity_blocks * slot_bytes_for(layout.block_bytes)
        )

    def corrupt(self, tier: Tier, key: BlockKey) -> bool:
        assert isinstance(tier, NVMeTier)
        path, off = slot_of(tier, key)
        byte = os.pread(os.open(path, os.O_RDONLY), 1, off + 100)
        patch_file(path, off + 100, bytes([byte[0] ^ 0x10]))
        return True

    def reopen(self, tier: Tier, tmp_path: Path) -> Tier | None:
        tier.close()
        return self.make_tier(self.layout, self.capacity, tmp_path)


# -- warm restart --------------------------------------------------------------------------
def test_warm_restart_and_cold_start(tmp_path: Path) -> None:
    keys = [rand_key() for _ in range(5)]
    blocks = [rand_block(seed=i) for i in range(5)]
    with_tier = open_tier(tmp_path)
    assert with_tier.put(keys, blocks) == [True] * 5
    with_tier.delete(keys[:1])
    with_tier.close()

    warm = open_tier(tmp_path)
    assert set(warm.keys()) == set(keys[1:])
    outs = [empty_block() for _ in keys]
    assert warm.get_into(keys, outs) == [False, True, True, True, True]
    assert [o.tobytes() for o in outs[1:]] == [b.tobytes() for b in blocks[1:]]
    warm.close()

    cold = open_tier(tmp_path, warm_restart=False)
    assert cold.usage().used_blocks == 0 and cold.contains_prefix(keys[1:]) == 0
    assert cold.put(keys[:1], blocks[:1]) == [True]
    cold.close()


def test_journal_replay_without_clean_close(tmp_path: Path) -> None:
    """A process that dies without close leaves only the journal; the reopen replays it."""
    keys = [rand_key() for _ in range(6)]
    tier = open_tier(tmp_path)
    tier.put(keys[:4], [rand_block(seed=i) for i in range(4)])
    tier.delete(keys[1:2])
    tier.put(keys[4:], [rand_block(seed=i) for i in range(4, 6)])
    crash(tier)  # drop the locks without writing the snapshot
    again = open_tier(tmp_path)
    assert set(again.keys()) == {keys[0], keys[2], keys[3], keys[4], keys[5]}
    out = empty_block()
    assert again.get_into([keys[5]], [out]) == [True]
    assert out.tobytes() == rand_block(seed=5).tobytes()
    again.close()


def test_capacity_shrink_keeps_blocks_that_fit(tmp_path: Path) -> None:
    tier = open_tier(tmp_path, blocks=8)
    keys = [rand_key() for _ in range(8)]
    tier.put(keys, [rand_block(seed=i) for i in range(8)])
    tier.close()
    small = open_tier(tmp_path, blocks=4)
    held = list(small.keys())
    assert len(held) == 4 and small.usage().used_blocks == 4
    assert small.get_into(held, [empty_block() for _ in held]) == [True] * 4
    small.close()


def test_layout_change_starts_empty(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tier = open_tier(tmp_path)
    tier.put([rand_key()], [rand_block()])
    tier.close()
    other = KVLayout(layers=2, kv_heads=2, head_dim=8, dtype="bfloat16", block_tokens=16)
    with caplog.at_level(logging.WARNING):
        t2 = NVMeTier(other, dirs(tmp_path), 8 * SLOT)
    assert t2.usage().used_blocks == 0
    assert "another layout" in caplog.text
    t2.close()


# -- damaged files -------------------------------------------------------------------------
def test_torn_slot_found_on_reopen_and_by_check(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    keys = [rand_key() for _ in range(4)]
    tier.put(keys, [rand_block(seed=i) for i in range(4)])
    path, off = slot_of(tier, keys[2])
    tier.close()
    patch_file(path, off + 64 + 10, b"\xff" * 64)  # half-written payload
    report = check_dir(path.parent)
    assert (report.torn, report.ok + report.torn) == (1, 2)
    again = open_tier(tmp_path)
    got = again.get_into(keys, [empty_block() for _ in keys])
    assert got == [True, True, False, True]
    assert again.contains_prefix(keys[2:3]) == 0  # dropped
    again.close()


def test_header_bit_flip_and_truncation_are_misses(tmp_path: Path) -> None:
    tier = open_tier(tmp_path, n_dirs=1)
    keys = [rand_key() for _ in range(4)]
    tier.put(keys, [rand_block(seed=i) for i in range(4)])
    path, off0 = slot_of(tier, keys[0])
    tier.close()
    patch_file(path, off0 + 20, b"\x01")  # inside the key field of the header
    os.truncate(path, 2 * SLOT + 100)  # slots 2 and 3 cut off
    again = open_tier(tmp_path, n_dirs=1)
    outs = [empty_block() for _ in keys]
    assert again.get_into(keys, outs) == [False, True, False, False]
    assert outs[1].tobytes() == rand_block(seed=1).tobytes()
    again.close()


def test_damaged_snapshot_is_rebuilt_without_raising(tmp_path: Path) -> None:
    """More in tests/test_nvme_recovery.py."""
    tier = open_tier(tmp_path, n_dirs=1)
    k, b = rand_key(), rand_block(seed=7)
    tier.put([k], [b])
    tier.close()
    snap = dirs(tmp_path, 1)[0] / SNAP_FILE
    snap.write_bytes(snap.read_bytes()[:-3] + b"xyz")
    again = open_tier(tmp_path, n_dirs=1)
    out = empty_block()
    assert again.get_into([k], [out]) == [True] and again.healthy
    assert out.tobytes() == b.tobytes()
    again.close()
    report = check_dir(dirs(tmp_path, 1)[0])
    assert (report.ok, report.orphan) == (1, 0)  # indexed again, by the rebuilt snapshot


def test_check_fix_drops_bad_slots(tmp_path: Path) -> None:
    tier = open_tier(tmp_path, n_dirs=1)
    keys = [rand_key() for _ in range(3)]
    tier.put(keys, [rand_block(seed=i) for i in range(3)])
    path, off = slot_of(tier, keys[1])
    tier.delete(keys[2:])  # its bytes stay on disk: an orphan
    tier.close()
    patch_file(path, off + 64, b"\0\1\2\3")
    patch_file(path, 6 * SLOT, b"not a kvtier block")
    d = path.parent
    found = check_dir(d)
    assert (found.ok, found.torn, found.orphan, found.foreign) == (1, 1, 1, 1)
    assert found.problems == 2  # an orphan is what a delete leaves: not a problem
    assert check_dir(d, fix=True).fixed == 2  # the torn and the foreign slot
    clean = check_dir(d)
    # the orphan verifies: harmless, and what an index rebuild would bring back, so kept
    assert (clean.ok, clean.orphan, clean.problems, clean.free) == (1, 1, 0, 6)


def test_check_fix_zeroes_an_orphan_that_does_not_verify(tmp_path: Path) -> None:
    tier = open_tier(tmp_path, n_dirs=1)
    keys = [rand_key() for _ in range(2)]
    tier.put(keys, [rand_block(seed=i) for i in range(2)])
    path, off = slot_of(tier, keys[1])
    tier.delete(keys[1:])
    tier.close()
    patch_file(path, off + 64, b"\0\1\2\3")  # the deleted block's payload rots
    d = path.parent
    assert check_dir(d, fix=True).fixed == 1
    assert (check_dir(d).orphan, check_dir(d).free) == (0, 7)


def test_check_releases_everything_when_the_slot_file_is_missing(tmp_path: Path) -> None:
    open_tier(tmp_path, n_dirs=1).close()
    d = dirs(tmp_path, 1)[0]
    (d / SLOTS_FILE).unlink()
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(ConfigError, match=r"nvme0 cannot be checked: .*slots\.dat"):
        check_dir(d)
    assert len(os.listdir("/proc/self/fd")) == fds


# -- faults --------------------------------------------------------------------------------
class FaultyIO(SlotIO):
    """Raises ``OSError(err)`` from the armed operation."""

    def __init__(self) -> None:
        self.fail: dict[str, int] = {}

    def _maybe(self, op: str) -> None:
        if op in self.fail:
            raise OSError(self.fail[op], os.strerror(self.fail[op]))

    def open(self, path: str, flags: int) -> int:
        if flags & os.O_DIRECT:
            self._maybe("open_direct")
        self._maybe("open")
        return super().open(path, flags)

    def pwrite(self, fd: int, buf: memoryview, offset: int) -> None:
        self._maybe("pwrite")
        super().pwrite(fd, buf, offset)

    def pread(self, fd: int, buf: memoryview, offset: int) -> None:
        self._maybe("pread")
        super().pread(fd, buf, offset)

    def fsync(self, fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            self._maybe("fsync_dir")
        super().fsync(fd)


def errors_logged(caplog: pytest.LogCaptureFixture) -> int:
    return sum(1 for r in caplog.records if r.levelno >= logging.ERROR)


@pytest.mark.parametrize("err", [errno.EIO, errno.EACCES])  # ENOSPC: tests/test_nvme_faults.py
def test_write_fault_is_false_and_degrades(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, err: int
) -> None:
    io = FaultyIO()
    tier = open_tier(tmp_path, n_dirs=1, io=io)
    kept = rand_key()
    assert tier.put([kept], [rand_block()]) == [True]
    io.fail["pwrite"] = err
    with caplog.at_level(logging.ERROR):
        assert tier.put([rand_key(), rand_key()], [rand_block(), rand_block()]) == [False, False]
        assert tier.put([rand_key()], [rand_block()]) == [False]
        assert tier.get_into([kept], [empty_block()]) == [False]
    assert not tier.healthy
    assert errors_logged(caplog) == 1 and os.strerror(err) in caplog.text
    tier.close()


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
def test_a_directory_fsync_failing_after_a_snapshot_rename_loses_no_stored_block(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, err: int
) -> None:
    """Once the new snapshot is renamed in, records of the old generation are ignored: the
    index must carry on in the new one, and a directory it cannot fsync is an I/O fault (the
    directory degrades), never a full disk whose compaction can wait. Whatever a crash then
    leaves, every put reported stored is there."""
    io = FaultyIO()
    tier = open_tier(tmp_path, n_dirs=1, io=io)
    stored = {rand_key(): rand_block(seed=i) for i in range(3)}
    assert tier.put(list(stored), list(stored.values())) == [True] * 3
    crash(tier)  # the journal holds the three puts
    io.fail["fsync_dir"] = err
    with pytest.raises(ConfigError, match="directory fsync failed"):
        open_tier(tmp_path, n_dirs=1, io=io)  # its compaction at open renamed a snapshot in
    del io.fail["fsync_dir"]
    tier = open_tier(tmp_path, n_dirs=1, io=io)
    more = {rand_key(): rand_block(seed=10 + i) for i in range(3)}
    assert tier.put(list(more), list(more.values())) == [True] * 3
    stored |= more
    dindex = tier._devs[0].dindex
    assert dindex is not None
    dindex._compact_at = 0  # the next record compacts
    io.fail["fsync_dir"] = err
    with caplog.at_level(logging.ERROR):
        assert tier.put([rand_key()], [rand_block()]) == [False]
        assert tier.put([rand_key()], [rand_block()]) == [False]
    assert not tier.healthy and errors_logged(caplog) == 1
    assert "directory fsync failed" in caplog.text and "out of space" not in caplog.text
    crash(tier)
    del io.fail["fsync_dir"]
    again = open_tier(tmp_path, n_dirs=1)
    assert set(stored) <= set(again.keys())
    outs = [empty_block() for _ in stored]
    assert again.get_into(list(stored), outs) == [True] * len(stored)
    assert all(o.tobytes() == b.tobytes() for o, b in zip(outs, stored.values(), strict=True))
    again.close()


def test_read_eio_is_a_miss(tmp_path: Path) -> None:
    io = FaultyIO()
    tier = open_tier(tmp_path, n_dirs=1, io=io)
    k = rand_key()
    tier.put([k], [rand_block()])
    io.fail["pread"] = errno.EIO
    assert tier.get_into([k], [empty_block()]) == [False]
    assert not tier.healthy and tier.contains_prefix([k]) == 0
    tier.close()


def test_unusable_directory_at_open_is_a_config_error(tmp_path: Path) -> None:
    io = FaultyIO()
    io.fail["open"] = errno.EACCES
    with pytest.raises(ConfigError, match=r"nvme0 cannot be used: permission denied"):
        open_tier(tmp_path, n_dirs=1, io=io)
    assert not dirs(tmp_path, 1)[0].exists()  # it created the directory: it removes it


def test_directory_removed_underneath(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tier = open_tier(tmp_path, n_dirs=2)
    keys = [rand_key() for _ in range(4)]
    assert tier.put(keys, [rand_block(seed=i) for i in range(4)]) == [True] * 4
    shutil.rmtree(dirs(tmp_path)[1])
    with caplog.at_level(logging.ERROR):
        got = tier.get_into(keys, [empty_block() for _ in keys])
    assert sorted(got) == [False, False, True, True]  # the other directory still serves
    assert tier.healthy and "removed" in caplog.text  # it still takes puts
    more = [rand_key() for _ in range(4)]
    assert tier.put(more, [rand_block() for _ in more]) == [True, True, False, False]
    assert errors_logged(caplog) == 1
    shutil.rmtree(dirs(tmp_path)[0])
    assert tier.get_into(more, [empty_block() for _ in more]) == [False] * 4
    assert not tier.healthy  # no directory left to take a put
    tier.close()


def test_no_o_direct_falls_back_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    io = FaultyIO()
    io.fail["open_direct"] = errno.EINVAL  # what tmpfs and some network filesystems say
    with caplog.at_level(logging.WARNING):
        tier = open_tier(tmp_path, io=io)
    assert not tier.o_direct and tier.healthy
    assert sum(1 for r in caplog.records if "O_DIRECT" in r.message) == 1
    k, b = rand_key(), rand_block(seed=3)
    out = empty_block()
    assert tier.put([k], [b]) == [True] and tier.get_into([k], [out]) == [True]
    assert out.tobytes() == b.tobytes()
    tier.close()
    with pytest.raises(ConfigError, match="O_DIRECT"):
        open_tier(tmp_path, io=io, o_direct="always")


# -- locking and config --------------------------------------------------------------------
def test_second_opener_gets_a_clear_lock_error(tmp_path: Path) -> None:
    first = open_tier(tmp_path)
    with pytest.raises(TierLockedError, match=rf"nvme0 is in use by process {os.getpid()}"):
        open_tier(tmp_path)
    with pytest.raises(TierLockedError):
        check_dir(dirs(tmp_path)[0])
    first.close()
    open_tier(tmp_path).close()  # released on close


def test_from_config_and_registry(tmp_path: Path) -> None:
    spec = {
        "kind": "nvme",
        "paths": [str(p) for p in dirs(tmp_path)],
        "capacity": 8 * SLOT,
        "warm_restart": True,
        "o_direct": "auto",
        "workers": 2,
    }
    tier = make_tier(LAYOUT, spec)
    assert isinstance(tier, NVMeTier) and tier.capacity_blocks == 8 and tier.persistent
    tier.close()
    with pytest.raises(ConfigError, match="capacity"):
        make_tier(LAYOUT, {"kind": "nvme", "paths": [str(tmp_path)]})
    with pytest.raises(ConfigError, match="unknown key"):
        make_tier(LAYOUT, {"kind": "nvme", "paths": [str(tmp_path)], "capacity": "1GiB", "x": 1})
    with pytest.raises(ConfigError, match="o_direct"):
        make_tier(LAYOUT, {"kind": "nvme", "paths": "p", "capacity": "1GiB", "o_direct": "yes"})
    with pytest.raises(ConfigError, match="fewer than"):
        NVMeTier(LAYOUT, dirs(tmp_path, 3), 2 * SLOT)


def test_striping_alternates_directories(tmp_path: Path) -> None:
    tier = open_tier(tmp_path, blocks=8, n_dirs=2)
    keys = [rand_key() for _ in range(4)]
    tier.put(keys, [rand_block() for _ in keys])
    per_dir = [len(d.dindex.entries) for d in tier._devs if d.dindex is not None]
    assert per_dir == [2, 2]
    assert np.all(np.asarray(per_dir) > 0)
    tier.close()


def test_check_command_reports_and_fixes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvtier.cli.main import main

    tier = open_tier(tmp_path, n_dirs=1)
    kept, evicted = rand_key(), rand_key()
    tier.put([kept, evicted], [rand_block(), rand_block(seed=1)])
    tier.delete([evicted])  # an orphan: a clean directory still passes
    tier.close()
    d = str(dirs(tmp_path, 1)[0])
    assert main(["check", d]) == 0
    assert "1 ok, 0 torn, 1 orphan, 0 foreign" in capsys.readouterr().out
    patch_file(Path(d) / SLOTS_FILE, 5 * SLOT, b"junk")
    assert main(["check", d]) == 1
    assert "1 ok, 0 torn, 1 orphan, 1 foreign" in capsys.readouterr().out
    assert main(["check", "--fix", d]) == 0
    assert main(["check", "--json", d]) == 0
    assert '"foreign": 0' in capsys.readouterr().out.splitlines()[-1]
    assert main(["check", str(tmp_path)]) == 2  # not a tier directory: a clear error
    assert "not a kvtier NVMe tier directory" in capsys.readouterr().err
