"""``kvtier.meta``: what an NVMe tier directory holds, and the one validating reader of it.

The meta is a small JSON object written by the tier (``DirMeta.write``: temp file, fsync, rename,
directory fsync) and read by the tier at open and by ``kvtier check``, both through
``DirMeta.load``, so the two never disagree on what a valid meta is. It is valid only if:

- it is a JSON object with exactly the keys ``fingerprint``, ``block_bytes``, ``slot_bytes``,
  ``n_slots`` and ``version``;
- ``version`` is an integer >= 1 (a ``bool`` or ``"1"`` is not);
- ``fingerprint`` is the hex form of a layout fingerprint (the 8 bytes a block header holds);
- ``block_bytes``, ``n_slots`` are integers >= 1 and ``slot_bytes`` is the slot size a block of
  ``block_bytes`` takes (``slot_bytes_for``): for this format the one is fixed by the other;
- where ``slots.dat`` exists, it is exactly ``n_slots * slot_bytes`` bytes long (the tier
  preallocates it to that size before it writes the meta), so a count the files do not back
  can never drive a scan of billions of slots.

A meta of another ``version`` is well formed (``compatible`` then says it is not this tier's).
The tier treats an invalid meta as damage (``DirMeta.read`` returns None, and the slot headers
decide: ``kvtier.tiers.nvme_recover``); ``kvtier check`` refuses the directory with a
``ConfigError`` naming the key and what is wrong.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from kvtier import codec
from kvtier.errors import ConfigError
from kvtier.tiers.nvme_io import SlotIO, replace_file, sync_dir

ALIGN = 4096
META_FILE = "kvtier.meta"
SLOTS_FILE = "slots.dat"
META_VERSION = 1
FINGERPRINT_BYTES = 8  # as ``codec.HEADER`` holds it (``KVLayout.fingerprint``)
_KEYS = ("fingerprint", "block_bytes", "slot_bytes", "n_slots", "version")


def slot_bytes_for(block_bytes: int) -> int:
    """Bytes one slot occupies on disk: 64-byte header + payload, rounded up to 4096."""
    return -(-(codec.HEADER_BYTES + block_bytes) // ALIGN) * ALIGN


@dataclass(frozen=True, slots=True)
class DirMeta:
    """What a directory holds; a directory whose meta differs from the tier's is started empty."""

    fingerprint: str  # layout fingerprint, hex
    block_bytes: int
    slot_bytes: int
    n_slots: int
    version: int = META_VERSION

    def compatible(self, other: DirMeta) -> bool:
        return (self.fingerprint, self.block_bytes, self.slot_bytes, self.version) == (
            other.fingerprint,
            other.block_bytes,
            other.slot_bytes,
            other.version,
        )

    @staticmethod
    def load(directory: Path) -> DirMeta:
        """The directory's meta, validated (module docstring); ``ConfigError`` naming the file,
        the key and what is wrong if it is absent, unreadable or invalid. Reads only."""
        path = directory / META_FILE
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise ConfigError(
                f"{directory} is not a kvtier NVMe tier directory (no {META_FILE})"
            ) from None
        except OSError as exc:
            raise ConfigError(f"{path} cannot be read: {exc.strerror or exc}") from None
        try:
            meta = _parse(raw)
            _check_files(meta, directory)
        except _Invalid as exc:
            raise ConfigError(
                f"{path} is not a valid kvtier meta: {exc}; opening the tier with its layout "
                f"rebuilds it from the slot headers"
            ) from None
        return meta

    @staticmethod
    def read(directory: Path) -> DirMeta | None:
        """``load``, or None if the meta is absent, unreadable or invalid (the tier's use: it
        then asks the slot headers)."""
        try:
            return DirMeta.load(directory)
        except ConfigError:
            return None

    def write(self, directory: Path) -> None:
        """Replace the meta atomically and durably (temp file + fsync + rename + dir fsync)."""
        replace_file(directory / META_FILE, json.dumps(asdict(self)).encode(), SlotIO())
        sync_dir(directory, SlotIO())


class _Invalid(ValueError):
    """Why a meta is invalid (internal: ``DirMeta.load`` turns it into a ``ConfigError``)."""


def _parse(raw: bytes) -> DirMeta:
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _Invalid(f"not JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise _Invalid(f"expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in _KEYS if k not in obj]
    extra = sorted(set(obj) - set(_KEYS))
    if missing or extra:
        raise _Invalid(f"keys missing: {missing or 'none'}, unknown: {extra or 'none'}")
    fp = obj["fingerprint"]
    fp_len = 2 * FINGERPRINT_BYTES
    if not isinstance(fp, str) or len(fp) != fp_len or not _is_hex(fp):
        raise _Invalid(f"fingerprint must be {fp_len} lowercase hex digits, got {fp!r:.40}")
    version, block, slot, n = (
        _count(obj, k) for k in ("version", "block_bytes", "slot_bytes", "n_slots")
    )
    if slot != slot_bytes_for(block):
        raise _Invalid(
            f"slot_bytes {slot} does not fit block_bytes {block} (a slot of that block is "
            f"{slot_bytes_for(block)} bytes)"
        )
    return DirMeta(fp, block, slot, n, version)


def _count(obj: dict[str, object], key: str) -> int:
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _Invalid(f"{key} must be a whole number >= 1, got {value!r:.40}")
    return value


def _is_hex(s: str) -> bool:
    return all(c in "0123456789abcdef" for c in s)


def _check_files(meta: DirMeta, directory: Path) -> None:
    """The slot file, where present, is the size the meta says (the tier preallocated it)."""
    try:
        size = os.stat(directory / SLOTS_FILE).st_size
    except FileNotFoundError:
        return
    except OSError as exc:
        raise _Invalid(f"{SLOTS_FILE} cannot be read ({exc.strerror or exc})") from None
    want = meta.n_slots * meta.slot_bytes
    if size != want:
        raise _Invalid(
            f"n_slots {meta.n_slots} of {meta.slot_bytes} bytes is {want} bytes but "
            f"{SLOTS_FILE} is {size} bytes ({size // meta.slot_bytes} slots)"
        )
