"""NVMe tier on a real full disk, and on directories it cannot use.

A full disk (a real tmpfs, filled up by someone else) costs only the puts that could not be
journaled: the directory refuses puts while it is full, serves every block it already holds,
takes puts again once space frees up, and a close or a crash on it loses nothing; while another
directory has room the tier stays ``healthy`` and the store keeps demoting to it. A directory
that cannot be used is a ``ConfigError`` at construction that names it and the reason, and
leaves nothing behind, in that directory or in the ones opened before it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.errors import ConfigError
from kvtier.keys import BlockKey
from kvtier.store import TieredStore
from kvtier.tiers.host import HostTier
from kvtier.tiers.nvme import NVMeTier
from kvtier.tiers.nvme_index import (
    JOURNAL_FILE,
    META_FILE,
    REC_BYTES,
    SLOTS_FILE,
    SNAP_FILE,
    slot_bytes_for,
)
from kvtier.tiers.registry import make_tier
from tests.helpers import SMALL, kv_for
from tests.nvme_helpers import crash
from tests.tier_conformance import LAYOUT, empty_block, rand_block, rand_key

SLOT = slot_bytes_for(LAYOUT.block_bytes)
ROOT = Path(__file__).resolve().parent.parent
Blocks = dict[BlockKey, np.ndarray[Any, Any]]


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs mounted for the test (needs root and mount; skipped otherwise)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "fs"
    mnt.mkdir()
    cmd = ["mount", "-t", "tmpfs", "-o", "size=8m,nr_inodes=1024", "tmpfs", str(mnt)]
    if subprocess.run(cmd, capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(mnt: Path) -> Path:
    """Someone else fills the filesystem to the last byte; returns their file."""
    filler = mnt / "filler"
    with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(bytes(1 << 16))
    return filler


def put_each(tier: NVMeTier, n: int, seed: int) -> Blocks:
    """Put ``n`` new blocks one by one; return those reported stored."""
    kept: Blocks = {}
    for i in range(n):
        k, b = rand_key(), rand_block(seed=seed + i)
        if tier.put([k], [b]) == [True]:
            kept[k] = b
    return kept


def assert_holds(tier: NVMeTier, blocks: Blocks) -> None:
    """``tier`` holds exactly ``blocks``, each loading byte for byte."""
    assert set(tier.keys()) == set(blocks)
    outs = [empty_block() for _ in blocks]
    assert tier.get_into(list(blocks), outs) == [True] * len(blocks)
    assert all(o.tobytes() == b.tobytes() for o, b in zip(outs, blocks.values(), strict=True))


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# -- a full disk ---------------------------------------------------------------------------
def test_full_disk_keeps_every_block_already_stored(
    small_fs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = small_fs / "kv"
    tier = NVMeTier(LAYOUT, [path], 256 * SLOT)
    stored = put_each(tier, 30, seed=0)
    assert len(stored) == 30
    fill(small_fs)
    with caplog.at_level(logging.WARNING):
        stored |= put_each(tier, 100, seed=100)  # the journal outgrows its last page
        assert 30 <= len(stored) < 130 and not tier.healthy
        assert_holds(tier, stored)  # nothing stored before the disk filled up is lost
        assert tier.put([rand_key()], [rand_block()]) == [False]  # refused while full
        tier.close()  # no room for the snapshot: the journal keeps the index
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert sum("out of space" in r.message for r in caplog.records) == 1
    assert not list(path.glob("*.tmp"))

    again = NVMeTier(LAYOUT, [path], 256 * SLOT)  # a reopen on the still-full disk
    assert_holds(again, stored)
    assert again.put([rand_key()], [rand_block()]) == [False]
    again.close()


def test_full_directory_takes_puts_again_once_space_frees(
    small_fs: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr("kvtier.tiers.nvme_device.FULL_RETRY_S", 60.0)
    tier = NVMeTier(LAYOUT, [small_fs / "kv"], 8 * SLOT)
    filler = fill(small_fs)
    for _ in range(200):  # PUT and DEL records until the journal needs a page it cannot get
        k = rand_key()
        if tier.put([k], [rand_block()]) != [True]:
            break
        tier.delete([k])
    assert not tier.healthy
    filler.unlink()
    assert tier.put([rand_key()], [rand_block()]) == [False]  # not before the retry time
    monkeypatch.setattr("kvtier.tiers.nvme_device.FULL_RETRY_S", 0.0)
    assert tier.healthy
    with caplog.at_level(logging.WARNING):
        stored = put_each(tier, 8, seed=0)
    assert len(stored) == 8 and "room again" in caplog.text  # every slot is usable again
    assert_holds(tier, stored)
    tier.close()
    again = NVMeTier(LAYOUT, [small_fs / "kv"], 8 * SLOT)
    assert_holds(again, stored)
    again.close()


def test_puts_go_to_the_directories_with_room(small_fs: Path, tmp_path: Path) -> None:
    tier = NVMeTier(LAYOUT, [small_fs / "kv", tmp_path / "roomy"], 64 * SLOT)
    stored = put_each(tier, 8, seed=0)
    fill(small_fs)
    stored |= put_each(tier, 80, seed=100)  # the full one refuses, the other takes its half
    on_roomy = tier._devs[1].dindex
    assert on_roomy is not None and len(on_roomy.entries) == 32
    assert 8 + 32 <= len(stored) < 8 + 80
    assert_holds(tier, stored)
    tier.close()


def test_one_full_directory_of_two_does_not_stop_demotions(small_fs: Path, tmp_path: Path) -> None:
    """``healthy`` is "a put can succeed now": the store skips unhealthy tiers, so one full
    directory must not make the whole NVMe tier look down while the other has room."""
    paths = [small_fs / "kv", tmp_path / "roomy"]
    nvme = NVMeTier(SMALL, paths, 64 * slot_bytes_for(SMALL.block_bytes))
    filler = fill(small_fs)
    for _ in range(200):  # until the full directory refuses a put (its journal needs a page)
        if nvme.put([rand_key()], [np.zeros(SMALL.block_bytes, np.uint8)]) == [False]:
            break
    assert nvme._devs[0].full and not nvme._devs[1].full
    assert nvme.healthy  # the roomy directory takes puts
    roomy = nvme._devs[1].dindex
    assert roomy is not None
    held = len(roomy.entries)
    prompts = [[s] * 8 for s in range(1, 7)]  # 12 blocks; the host tier holds 4
    with TieredStore(SMALL, [HostTier(SMALL, 4 * SMALL.block_bytes), nvme], model_id="test") as st:
        for p in prompts:
            st.store(p, kv_for(p))
        st.flush()
        assert st.stats()["store"]["demotions"] >= 8 and len(roomy.entries) >= held + 8
        assert all(st.lookup(p) == 8 for p in prompts)
        assert st.locate(prompts[0]) == ["nvme", "nvme"]
        out = np.zeros(SMALL.kv_shape(8), SMALL.storage_dtype)
        assert st.load(prompts[0], out) == 8 and out.tobytes() == kv_for(prompts[0]).tobytes()
    filler.unlink()


def test_every_directory_full_is_unhealthy(small_fs: Path, tmp_path: Path) -> None:
    tier = NVMeTier(LAYOUT, [small_fs / "kv"], 64 * SLOT)
    fill(small_fs)
    put_each(tier, 200, seed=0)
    assert not tier.healthy  # nothing can take a put: the store stops demoting here
    tier.close()


def test_crash_after_a_failed_append_recovers_exactly_what_was_stored(small_fs: Path) -> None:
    path = small_fs / "kv"
    tier = NVMeTier(LAYOUT, [path], 256 * SLOT)
    per_page = 4096 // REC_BYTES
    stored = {rand_key(): rand_block(seed=i) for i in range(per_page - 2)}
    assert tier.put(list(stored), list(stored.values())) == [True] * len(stored)
    filler = fill(small_fs)
    # four PUT records: two fit in the journal's last page, then ENOSPC; the two written must
    # not stay behind as records of a put reported failed
    batch = {rand_key(): rand_block(seed=100 + i) for i in range(4)}
    assert tier.put(list(batch), list(batch.values())) == [False] * 4
    assert (path / JOURNAL_FILE).stat().st_size == len(stored) * REC_BYTES
    filler.unlink()
    crash(tier)
    again = NVMeTier(LAYOUT, [path], 256 * SLOT)
    assert_holds(again, stored)
    again.close()


def test_partial_record_at_the_end_of_the_journal_hides_nothing(tmp_path: Path) -> None:
    path = tmp_path / "kv"
    tier = NVMeTier(LAYOUT, [path], 8 * SLOT)
    stored = put_each(tier, 2, seed=0)
    tier.close()  # snapshot, empty journal
    with open(path / JOURNAL_FILE, "ab") as f:
        f.write(b"\x01" * (REC_BYTES // 2))  # a crash in the middle of the next append
    tier = NVMeTier(LAYOUT, [path], 8 * SLOT)
    stored |= put_each(tier, 2, seed=10)
    crash(tier)
    again = NVMeTier(LAYOUT, [path], 8 * SLOT)
    assert_holds(again, stored)
    again.close()


def test_bad_records_at_the_end_of_the_journal_are_cut_off_even_on_a_full_disk(
    small_fs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A crash can leave whole bad records at the end (zeros). The open cuts them off even when
    the disk is too full for its compaction; kept, the next append would land after them and
    the open after that would see a bad record before a good one: a rebuild, bringing a
    deleted block back."""
    path = small_fs / "kv"
    tier = NVMeTier(LAYOUT, [path], 64 * SLOT)
    stored = put_each(tier, 5, seed=0)
    crash(tier)
    with open(path / JOURNAL_FILE, "ab") as f:
        f.write(bytes(REC_BYTES))
    filler = fill(small_fs)
    tier = NVMeTier(LAYOUT, [path], 64 * SLOT)  # no room for the compaction: deferred
    assert (path / JOURNAL_FILE).stat().st_size == 5 * REC_BYTES
    gone = list(stored)[:2]
    tier.delete(gone)
    for k in gone:
        del stored[k]
    k, b = rand_key(), rand_block(seed=9)
    assert tier.put([k], [b]) == [True]  # its record fits in the journal's last page
    stored[k] = b
    crash(tier)
    filler.unlink()
    with caplog.at_level(logging.WARNING):
        again = NVMeTier(LAYOUT, [path], 64 * SLOT)
    assert "rebuilt" not in caplog.text
    assert_holds(again, stored)  # the deleted blocks stay deleted
    again.close()


# -- directories that cannot be used -------------------------------------------------------
def test_capacity_larger_than_the_filesystem_is_a_config_error(small_fs: Path) -> None:
    free = os.statvfs(small_fs).f_bavail
    fds = open_fds()
    with pytest.raises(ConfigError, match=r"big cannot hold .* need 67108864 bytes .* bytes free"):
        NVMeTier(LAYOUT, [small_fs / "big"], 64 << 20)
    assert not (small_fs / "big").exists()  # it created the directory: it removes it
    assert os.statvfs(small_fs).f_bavail == free and open_fds() == fds
    (small_fs / "mine").mkdir()
    with pytest.raises(ConfigError, match=r"lower tiers\.nvme capacity"):
        NVMeTier(LAYOUT, [small_fs / "mine"], 64 << 20)
    assert list((small_fs / "mine").iterdir()) == []  # refused before it created any file
    assert open_fds() == fds

    tier = NVMeTier(LAYOUT, [small_fs / "kv"], 8 * SLOT)
    stored = put_each(tier, 4, seed=0)
    tier.close()
    with pytest.raises(ConfigError, match="bytes free"):  # growing it past the disk
        NVMeTier(LAYOUT, [small_fs / "kv"], 64 << 20)
    assert (small_fs / "kv" / SLOTS_FILE).stat().st_size == 8 * SLOT
    again = NVMeTier(LAYOUT, [small_fs / "kv"], 8 * SLOT)
    assert_holds(again, stored)
    again.close()


def test_a_regular_file_as_directory_is_a_config_error(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    fds = open_fds()
    with pytest.raises(ConfigError, match=rf"{afile} cannot be used: it exists and is not a dir"):
        NVMeTier(LAYOUT, [afile], 8 * SLOT)
    with pytest.raises(ConfigError, match=r"afile/sub cannot be used: part of the path is not"):
        NVMeTier(LAYOUT, [afile / "sub"], 8 * SLOT)
    with pytest.raises(ConfigError, match="not a directory"):
        make_tier(LAYOUT, {"kind": "nvme", "paths": [str(afile)], "capacity": 8 * SLOT})
    good = tmp_path / "good"
    with pytest.raises(ConfigError, match="afile"):  # the good one opened first is undone too
        NVMeTier(LAYOUT, [good, afile], 8 * SLOT)
    assert afile.read_text() == "x" and open_fds() == fds
    assert not good.exists()  # no slot file, snapshot, meta or lock left behind
    NVMeTier(LAYOUT, [good], 8 * SLOT).close()


def test_a_failed_open_leaves_the_directories_opened_before_it_as_they_were(
    tmp_path: Path,
) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    mine = tmp_path / "mine"  # the user's directory, with a file of theirs
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    kv = tmp_path / "kv"  # a tier directory, with blocks
    tier = NVMeTier(LAYOUT, [kv], 8 * SLOT)
    stored = put_each(tier, 4, seed=0)
    tier.close()
    before = {p.name: p.read_bytes() for p in kv.iterdir()}
    fds = open_fds()
    with pytest.raises(ConfigError, match="afile"):  # kv grows to 16 slots, then afile fails
        NVMeTier(LAYOUT, [kv, mine, afile], 3 * 16 * SLOT)
    assert open_fds() == fds
    assert sorted(p.name for p in mine.iterdir()) == ["kvtier.lock", "notes.txt"]
    assert {p.name: p.read_bytes() for p in kv.iterdir()} == before  # shrunk back, same meta
    assert (kv / SLOTS_FILE).stat().st_size == 8 * SLOT
    assert {SNAP_FILE, META_FILE} <= set(before)
    again = NVMeTier(LAYOUT, [kv], 8 * SLOT)
    assert_holds(again, stored)
    again.close()


CHILD = """
import sys
from kvtier.errors import ConfigError
from kvtier.tiers.nvme import NVMeTier
from tests.nvme_helpers import crash
from tests.tier_conformance import LAYOUT
try:
    NVMeTier(LAYOUT, [sys.argv[1]], 8 * 4096).close()
    print("opened")
except ConfigError as exc:
    print("ConfigError:", exc)
"""


def test_a_directory_the_user_cannot_write_is_a_config_error() -> None:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run as another user")
    parent = Path(tempfile.mkdtemp(prefix="kvtier-ro-"))
    try:
        parent.chmod(0o555)  # owned by root: nobody may not create anything in it
        cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        out = subprocess.run(
            [*cmd, sys.executable, "-c", CHILD, str(parent / "kv")],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=120,
        )
        if "ConfigError" not in out.stdout and "opened" not in out.stdout:
            pytest.skip(f"cannot run the tier as another user here: {out.stderr[-300:]}")
        assert "permission denied" in out.stdout and str(parent / "kv") in out.stdout
        assert not list(parent.iterdir())
    finally:
        shutil.rmtree(parent)
