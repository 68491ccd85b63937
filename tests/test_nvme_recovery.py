"""NVMe tier: a directory whose persisted index cannot be trusted is rebuilt from its slot headers.

A damaged or missing ``index.snap``, a ``kvtier.meta`` that does not parse, or a journal with a
bad record in the middle costs a scan of the slot file, not the warm cache: every slot whose
header names this layout and whose payload verifies comes back, bit for bit; a damaged slot or a
block of another layout does not. The rebuilt index is snapshotted at once, so the next open is
the fast path again. A meta that names another layout still starts the directory empty. A read
error during the rebuild degrades that directory instead of trusting a partial scan. ``kvtier
check`` calls an untrusted index a problem, and ``--fix`` rebuilds it the same way, never
zeroing a block the rebuild would recover.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier import codec
from kvtier.keys import BlockKey
from kvtier.layout import KVLayout
from kvtier.tiers.nvme import NVMeTier
from kvtier.tiers.nvme_check import check_dir
from kvtier.tiers.nvme_index import (
    JOURNAL_FILE,
    META_FILE,
    REC_BYTES,
    SLOTS_FILE,
    SNAP_FILE,
    DirMeta,
    SlotIO,
    slot_bytes_for,
)
from kvtier.tiers.nvme_recover import scan_slots
from tests.nvme_helpers import crash, patch_file, slot_of
from tests.tier_conformance import LAYOUT, empty_block, rand_block, rand_key

SLOT = slot_bytes_for(LAYOUT.block_bytes)
Blocks = dict[BlockKey, np.ndarray[Any, Any]]
REBUILT = "rebuilt its index from the slot headers"


def open_tier(root: Path, n_dirs: int = 1, blocks: int = 64, layout: KVLayout = LAYOUT) -> NVMeTier:
    paths = [root / f"nvme{i}" for i in range(n_dirs)]
    return NVMeTier(layout, paths, blocks * slot_bytes_for(layout.block_bytes))


def store(tier: NVMeTier, n: int, seed: int = 0) -> Blocks:
    blocks = {rand_key(): rand_block(tier.layout, seed=seed + i) for i in range(n)}
    assert tier.put(list(blocks), list(blocks.values())) == [True] * n
    return blocks


def loaded(tier: NVMeTier, blocks: Blocks) -> list[bool]:
    """Which of ``blocks`` load from ``tier`` bit for bit."""
    outs = [empty_block(tier.layout) for _ in blocks]
    got = tier.get_into(list(blocks), outs)
    return [
        g and o.tobytes() == b.tobytes() for g, o, b in zip(got, outs, blocks.values(), strict=True)
    ]


def rebuilds(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if REBUILT in r.getMessage()]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- a damaged or missing snapshot ---------------------------------------------------------
@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "empty"])
def test_damaged_snapshot_is_rebuilt_from_the_slot_headers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    tier = open_tier(tmp_path, n_dirs=2)
    blocks = store(tier, 40)
    tier.close()
    for d in ("nvme0", "nvme1"):
        snap = tmp_path / d / SNAP_FILE
        raw = snap.read_bytes()
        if damage == "flip":
            snap.write_bytes(raw[:100] + bytes([raw[100] ^ 0xFF]) + raw[101:])
        elif damage == "truncate":
            snap.write_bytes(raw[: len(raw) // 2])
        elif damage == "delete":
            snap.unlink()
        else:
            snap.write_bytes(b"")
    with caplog.at_level(logging.WARNING):
        again = open_tier(tmp_path, n_dirs=2)
    assert all(loaded(again, blocks)) and again.usage().used_blocks == 40 and again.healthy
    lines = rebuilds(caplog)
    assert len(lines) == 2  # one line per directory: why, how many, how long
    assert all(f"{SNAP_FILE} is" in m and "20 blocks recovered" in m for m in lines)
    assert all(" in " in m and m.rstrip().endswith("s") for m in lines)
    again.close()


def test_the_rebuild_writes_a_snapshot_at_once_so_the_next_open_is_fast(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tier = open_tier(tmp_path)
    blocks = store(tier, 12)
    tier.close()
    (tmp_path / "nvme0" / SNAP_FILE).write_bytes(b"garbage")
    slots_before = digest(tmp_path / "nvme0" / SLOTS_FILE)
    with caplog.at_level(logging.WARNING):
        rebuilt = open_tier(tmp_path)
        assert len(rebuilds(caplog)) == 1
        # the rebuild only read the slot file
        assert digest(tmp_path / "nvme0" / SLOTS_FILE) == slots_before
        crash(rebuilt)  # no close: the snapshot written at open must stand on its own
        caplog.clear()
        again = open_tier(tmp_path)
        assert rebuilds(caplog) == []
        assert all(loaded(again, blocks))
        again.close()
        caplog.clear()
        open_tier(tmp_path).close()
        assert rebuilds(caplog) == []
    assert check_dir(tmp_path / "nvme0").ok == 12


def test_a_damaged_payload_is_a_miss_the_rest_recovered(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    blocks = store(tier, 10)
    keys = list(blocks)
    path, off = slot_of(tier, keys[3])
    tier.close()
    patch_file(path, off + codec.HEADER_BYTES + 500, b"\xa5\x5a\xa5")  # bit rot in the payload
    (path.parent / SNAP_FILE).unlink()
    again = open_tier(tmp_path)
    got = loaded(again, blocks)
    assert got == [i != 3 for i in range(10)]
    assert keys[3] not in set(again.keys())  # not indexed at all: its slot is free
    assert again.usage().used_blocks == 9
    again.close()


class EIOAfter(SlotIO):
    """Reads of ``path`` at or past ``offset`` fail with EIO (a bad sector)."""

    def __init__(self, path: Path, offset: int) -> None:
        self.path, self.offset = str(path), offset

    def pread(self, fd: int, buf: memoryview, offset: int) -> None:
        if offset + len(buf) > self.offset and os.readlink(f"/proc/self/fd/{fd}") == self.path:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        super().pread(fd, buf, offset)


def test_a_read_error_during_the_rebuild_degrades_the_directory(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A partial scan must not become the trusted index: it would forget every block after the
    bad sector for good. The directory opens degraded (its blocks are misses, the other
    directory serves and takes puts) and its files stay, so a later open rebuilds it whole."""
    tier = open_tier(tmp_path, n_dirs=2)
    blocks = store(tier, 40)
    tier.close()
    d0 = tmp_path / "nvme0"
    (d0 / SNAP_FILE).write_bytes(b"garbage")
    snap = digest(d0 / SNAP_FILE)
    io = EIOAfter(d0 / SLOTS_FILE, 10 * SLOT)  # slots 10.. of nvme0 cannot be read
    with caplog.at_level(logging.WARNING):
        again = NVMeTier(LAYOUT, [tmp_path / "nvme0", tmp_path / "nvme1"], 64 * SLOT, io=io)
    assert again._devs[0].failed and not again._devs[1].failed
    assert again.healthy  # nvme1 still takes puts
    got = loaded(again, blocks)
    assert sum(got) == 20 and again.usage().used_blocks == 20  # nvme1's half
    logged = [r.levelno for r in caplog.records if "O_DIRECT" not in r.getMessage()]
    assert logged == [logging.ERROR]  # one line: why, where the scan stopped, what it costs
    assert "stopped at slot" in caplog.text and "degraded" in caplog.text
    more = store(again, 4, seed=100)  # all on nvme1
    again.close()
    assert digest(d0 / SNAP_FILE) == snap  # no snapshot of a partial scan
    whole = open_tier(tmp_path, n_dirs=2)
    assert all(loaded(whole, blocks | more))
    whole.close()


# -- a damaged meta ------------------------------------------------------------------------
@pytest.mark.parametrize("content", [b"{not json", b"", b"[1, 2]", b'{"fingerprint": 7'])
def test_unparsable_meta_of_this_layout_is_rebuilt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: bytes
) -> None:
    tier = open_tier(tmp_path)
    blocks = store(tier, 16)
    tier.close()
    meta_path = tmp_path / "nvme0" / META_FILE
    good = meta_path.read_bytes()
    meta_path.write_bytes(content)
    with caplog.at_level(logging.WARNING):
        again = open_tier(tmp_path)
    assert all(loaded(again, blocks))
    assert [m for m in rebuilds(caplog) if f"{META_FILE} does not parse" in m]
    again.close()
    assert meta_path.read_bytes() == good  # rewritten


def test_meta_of_another_layout_still_starts_empty(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A layout change is not damage: even with the snapshot damaged too, nothing of the old
    layout is resurrected, and a damaged meta that still names another layout is the same."""
    tier = open_tier(tmp_path)
    store(tier, 8)
    tier.close()
    d = tmp_path / "nvme0"
    meta = DirMeta.read(d)
    assert meta is not None
    other = KVLayout(layers=2, kv_heads=2, head_dim=8, dtype="bfloat16", block_tokens=16)
    assert other.fingerprint != LAYOUT.fingerprint and other.block_bytes == LAYOUT.block_bytes
    DirMeta(other.fingerprint.hex(), meta.block_bytes, meta.slot_bytes, meta.n_slots).write(d)
    (d / SNAP_FILE).write_bytes(b"garbage")
    with caplog.at_level(logging.WARNING):
        again = open_tier(tmp_path)
    assert again.usage().used_blocks == 0
    assert "another layout" in caplog.text and rebuilds(caplog) == []
    again.close()
    # the same, through a meta that no longer parses but still names the other layout
    store_again = open_tier(tmp_path)
    store(store_again, 4)
    store_again.close()
    (d / META_FILE).write_text(f'{{"fingerprint": "{other.fingerprint.hex()}", "block_bytes": ')
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        third = open_tier(tmp_path)
    assert third.usage().used_blocks == 0 and rebuilds(caplog) == []
    third.close()


def test_blocks_of_another_layout_in_the_slot_file_are_not_recovered(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    blocks = store(tier, 6)
    keys = list(blocks)
    path, off = slot_of(tier, keys[0])
    _, off1 = slot_of(tier, keys[1])
    tier.close()
    # a bf16 tier used the directory meanwhile (a layout change, so it started empty) and put a
    # block in the first free slot: the fp16 block there is gone, a bf16 one took its place
    other = KVLayout(layers=2, kv_heads=2, head_dim=8, dtype="bfloat16", block_tokens=16)
    bf16 = open_tier(tmp_path, layout=other)
    foreign = rand_key()
    assert bf16.put([foreign], [empty_block(other) + 1]) == [True]
    assert slot_of(bf16, foreign) == (path, off)
    bf16.close()
    # the second slot's header is re-stamped with the bf16 fingerprint, payload untouched:
    # everything verifies but the layout
    with open(path, "rb") as f:
        f.seek(off1)
        hdr = codec.unpack_header(f.read(codec.HEADER_BYTES))
    assert hdr is not None and hdr.key == keys[1]
    patch_file(
        path, off1, codec.pack_header(hdr.key, other.fingerprint, hdr.payload_len, hdr.checksum)
    )
    (path.parent / META_FILE).write_bytes(b"\0" * 10)  # and the meta that would say so is lost
    again = open_tier(tmp_path)
    held = set(again.keys())
    assert foreign not in held and keys[0] not in held and keys[1] not in held
    assert held == set(keys[2:]) and all(loaded(again, {k: blocks[k] for k in keys[2:]}))
    again.close()


# -- a damaged journal ---------------------------------------------------------------------
def test_a_bad_record_in_the_middle_of_the_journal_is_rebuilt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tier = open_tier(tmp_path)
    blocks: Blocks = {}
    for i in range(6):  # one journal record per put
        blocks |= store(tier, 1, seed=i)
    crash(tier)  # the journal is the only record of these puts
    journal = tmp_path / "nvme0" / JOURNAL_FILE
    assert journal.stat().st_size == 6 * REC_BYTES
    patch_file(journal, 2 * REC_BYTES + 12, b"\xff\xff")  # the third record, inside its key
    with caplog.at_level(logging.WARNING):
        again = open_tier(tmp_path)
    assert all(loaded(again, blocks))
    assert [m for m in rebuilds(caplog) if "damaged record" in m]
    again.close()


def test_a_torn_tail_of_the_journal_is_not_a_reason_to_rebuild(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A crash mid-append tears only the end: the journal is replayed as before, no scan."""
    tier = open_tier(tmp_path)
    blocks = store(tier, 3)
    crash(tier)
    with open(tmp_path / "nvme0" / JOURNAL_FILE, "ab") as f:
        f.write(b"\x01" * REC_BYTES)  # a whole record's worth of garbage at the end
    with caplog.at_level(logging.WARNING):
        again = open_tier(tmp_path)
    assert all(loaded(again, blocks)) and rebuilds(caplog) == []
    again.close()


def test_the_old_journal_is_never_replayed_over_a_rebuilt_snapshot(tmp_path: Path) -> None:
    """A crash after the rebuilt snapshot is renamed in but before the journal is emptied
    leaves the old journal: its records are of an older generation and must be ignored."""
    tier = open_tier(tmp_path)
    blocks = store(tier, 6)
    tier.delete([next(iter(blocks))])  # a DEL record in the journal; the bytes stay in the slot
    crash(tier)
    d = tmp_path / "nvme0"
    old_journal = (d / JOURNAL_FILE).read_bytes()
    (d / SNAP_FILE).write_bytes(b"garbage")
    rebuilt = open_tier(tmp_path)
    after_rebuild = set(rebuilt.keys())
    assert after_rebuild >= set(list(blocks)[1:])
    crash(rebuilt)
    (d / JOURNAL_FILE).write_bytes(old_journal)  # as if the truncate never happened
    again = open_tier(tmp_path)
    assert set(again.keys()) == after_rebuild
    assert all(loaded(again, {k: blocks[k] for k in after_rebuild}))
    again.close()


# -- kvtier check on an index that cannot be trusted ----------------------------------------
@pytest.mark.parametrize("damage", ["snapshot", "journal"])
def test_check_calls_an_untrusted_index_a_problem_and_fix_rebuilds_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str
) -> None:
    """Against an index that lacks them, live blocks look like orphans; zeroing them would
    wipe the warm cache an open would have rebuilt."""
    from kvtier.cli.main import main

    tier = open_tier(tmp_path)
    blocks = store(tier, 10)
    d = tmp_path / "nvme0"
    if damage == "snapshot":
        tier.close()
        (d / SNAP_FILE).write_bytes(b"garbage")
    else:
        crash(tier)  # the puts are in the journal only
        patch_file(d / JOURNAL_FILE, 3 * REC_BYTES + 12, b"\xff\xff")
    slots = digest(d / SLOTS_FILE)
    found = check_dir(d)
    assert found.damaged and found.problems >= 1
    assert main(["check", str(d)]) == 1
    assert "index damaged" in capsys.readouterr().out
    assert digest(d / SLOTS_FILE) == slots  # a plain check changes nothing
    fixed = check_dir(d, fix=True)
    assert fixed.rebuilt and (fixed.ok, fixed.fixed, fixed.problems) == (10, 0, 0)
    assert digest(d / SLOTS_FILE) == slots  # no block zeroed
    clean = check_dir(d)
    assert (clean.ok, clean.damaged, clean.problems) == (10, "", 0)
    assert main(["check", str(d)]) == 0
    again = open_tier(tmp_path)
    assert all(loaded(again, blocks)) and again.usage().used_blocks == 10
    again.close()


# -- duplicates, large slots, the scanner --------------------------------------------------
def test_a_key_in_two_slots_keeps_one_and_frees_the_other(tmp_path: Path) -> None:
    tier = open_tier(tmp_path, blocks=8)
    blocks = store(tier, 4)
    keys = list(blocks)
    path, off = slot_of(tier, keys[1])
    tier.close()
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, os.pread(fd, SLOT, off), 6 * SLOT)  # a copy of keys[1] in free slot 6
    finally:
        os.close(fd)
    (path.parent / SNAP_FILE).unlink()
    again = open_tier(tmp_path, blocks=8)
    assert again.usage().used_blocks == 4 and all(loaded(again, blocks))
    assert slot_of(again, keys[1]) == (path, off)  # the lower slot is kept
    more = {rand_key(): rand_block(seed=50 + i) for i in range(4)}  # the copy's slot is free
    assert again.put(list(more), list(more.values())) == [True] * 4
    assert all(loaded(again, blocks | more))
    again.close()


def test_slots_larger_than_one_scan_read_are_recovered(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    big = KVLayout(layers=4, kv_heads=8, head_dim=128, dtype="float16", block_tokens=256)
    assert slot_bytes_for(big.block_bytes) > 4 << 20  # header page, then the payload in pieces
    tier = open_tier(tmp_path, blocks=4, layout=big)
    blocks = store(tier, 3)
    path, off = slot_of(tier, list(blocks)[2])
    tier.close()
    patch_file(path, off + big.block_bytes, b"\x01")  # near the end of the last block's payload
    (path.parent / SNAP_FILE).unlink()
    with caplog.at_level(logging.WARNING):
        again = open_tier(tmp_path, blocks=4, layout=big)
    assert loaded(again, blocks) == [True, True, False]
    assert "2 blocks recovered, 1 slots rejected" in caplog.text
    again.close()


@pytest.mark.parametrize("chunk", [4096, 3 * 4096, 64 << 10, 4 << 20])
def test_scan_reads_the_same_whatever_its_read_size(tmp_path: Path, chunk: int) -> None:
    layout = KVLayout(layers=3, kv_heads=2, head_dim=64, dtype="float16", block_tokens=16)
    tier = open_tier(tmp_path, blocks=10, layout=layout)
    blocks = store(tier, 7)
    path, off = slot_of(tier, list(blocks)[4])
    tier.delete(list(blocks)[5:6])
    tier.close()
    patch_file(path, off + 200, b"\0\0\0")
    meta = DirMeta.read(path.parent)
    assert meta is not None
    fd = os.open(path, os.O_RDONLY)
    try:
        scans = list(scan_slots(fd, meta, SlotIO(), chunk_bytes=chunk))
    finally:
        os.close(fd)
    assert [s.local for s in scans] == list(range(10))
    assert [s.intact for s in scans] == [True] * 4 + [False, True, True] + [False] * 3
    assert [s.blank for s in scans] == [False] * 7 + [True] * 3
    assert all(s.ours for s in scans[:7])


def test_o_direct_directory_is_rebuilt(tmp_path: Path) -> None:
    tier = open_tier(tmp_path, n_dirs=2)
    if not tier.o_direct:
        tier.close()
        pytest.skip("this filesystem refuses O_DIRECT")
    blocks = store(tier, 9)
    tier.close()
    for d in ("nvme0", "nvme1"):
        (tmp_path / d / SNAP_FILE).unlink()
    again = open_tier(tmp_path, n_dirs=2)
    assert again.o_direct and all(loaded(again, blocks))
    again.close()
