"""``kvtier.meta`` is read through one validating reader by the tier and by ``kvtier check``.

Each damaged meta below once made ``check`` loop for minutes (a slot count the files do not
back), trace back (a string, a fraction, a zero slot size, a fingerprint that is not hex) or
report a directory holding blocks as empty (a negative count), while the tier judged the same
file differently (``version: "1"`` emptied the directory). Now ``check`` refuses each with a
``ConfigError`` naming the key, and the tier, seeing damage, rebuilds the index from the slot
headers and keeps every block.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.cli.main import main
from kvtier.errors import ConfigError
from kvtier.keys import BlockKey
from kvtier.tiers.nvme import NVMeTier
from kvtier.tiers.nvme_check import check_dir
from kvtier.tiers.nvme_index import META_FILE, slot_bytes_for
from tests.tier_conformance import LAYOUT, rand_block, rand_key

SLOTS = 16


def tier_dir(root: Path) -> tuple[Path, list[BlockKey]]:
    """A closed tier directory of ``SLOTS`` slots holding 10 blocks."""
    d = root / "nvme0"
    tier = NVMeTier(LAYOUT, [d], SLOTS * slot_bytes_for(LAYOUT.block_bytes))
    blocks = {rand_key(): rand_block(LAYOUT, seed=i) for i in range(10)}
    assert tier.put(list(blocks), list(blocks.values())) == [True] * 10
    tier.close()
    return d, list(blocks)


def damage(d: Path, **changes: object) -> None:
    meta = json.loads((d / META_FILE).read_text())
    meta.update(changes)
    (d / META_FILE).write_text(json.dumps(meta))


BAD = [
    ({"n_slots": 10**9}, "n_slots"),
    ({"n_slots": -5}, "n_slots"),
    ({"n_slots": 0}, "n_slots"),
    ({"n_slots": "many"}, "n_slots"),
    ({"n_slots": 2.5}, "n_slots"),
    ({"n_slots": True}, "n_slots"),
    ({"n_slots": SLOTS + 1}, "n_slots"),  # plausible alone, not what slots.dat holds
    ({"slot_bytes": 0}, "slot_bytes"),
    ({"slot_bytes": 512}, "slot_bytes"),
    ({"block_bytes": -1}, "block_bytes"),
    ({"fingerprint": "zz"}, "fingerprint"),
    ({"fingerprint": 5}, "fingerprint"),
    ({"fingerprint": "zz" * 8}, "fingerprint"),
    ({"version": "1"}, "version"),
    ({"version": 0}, "version"),
    ({"extra": 1}, "unknown"),
]


@pytest.mark.parametrize(("changes", "key"), BAD)
def test_check_refuses_an_invalid_meta_naming_the_key(
    tmp_path: Path, changes: dict[str, object], key: str
) -> None:
    d, _ = tier_dir(tmp_path)
    damage(d, **changes)
    with pytest.raises(ConfigError, match=key):
        check_dir(d)


def test_check_cli_reports_an_invalid_meta_as_an_error_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d, _ = tier_dir(tmp_path)
    damage(d, slot_bytes=0)
    assert main(["check", str(d)]) == 2
    err = capsys.readouterr().err
    assert "slot_bytes" in err and "Traceback" not in err


def test_check_refuses_another_format_version(tmp_path: Path) -> None:
    d, _ = tier_dir(tmp_path)
    damage(d, version=2)
    with pytest.raises(ConfigError, match="version 2"):
        check_dir(d)


@pytest.mark.parametrize(
    "changes",
    [c for c, key in BAD if key in ("n_slots", "slot_bytes", "version", "fingerprint")],
)
def test_the_tier_reads_the_same_invalid_meta_as_damage_and_keeps_its_blocks(
    tmp_path: Path, changes: dict[str, object]
) -> None:
    d, blocks = tier_dir(tmp_path)
    damage(d, **changes)
    tier = NVMeTier(LAYOUT, [d], SLOTS * slot_bytes_for(LAYOUT.block_bytes))
    try:
        assert tier.contains_prefix(blocks) == len(blocks)  # rebuilt, not emptied
    finally:
        tier.close()
    assert check_dir(d).ok == len(blocks)  # and the meta it rewrote is valid again
