"""Host DRAM tier (G2): one preallocated arena of fixed-size slots in shared memory.

The arena is a ``SharedMemory`` (``kvtier.tiers.shm``) allocated, every page of it, once at
construction, so the hot path does no allocation: a put is one fused copy+checksum into a free
slot, a get one fused copy+verify out of it. In-process the arena is anonymous; built with
``shm_path`` it is a named file other processes map (the node service's clients), and those
processes copy blocks in and out of slots themselves through the external-copy API
(``reserve``/``publish``/``abort`` for writes, ``acquire``/``release`` for reads), with the
same fused copy + checksum (``codec.copy_in``/``codec.copy_out``). When torch with CUDA is
importable and ``pin_memory`` allows it, the arena is page-locked (``cudaHostRegister``) so
device transfers can be asynchronous DMA.

Checksums are kept beside the arena, in this process's private memory (one uint64 per slot); a
get whose bytes no longer hash to the recorded checksum (a bit flip in DRAM, a stray write by a
process that maps the arena) is a miss and the slot is dropped.
"""

from __future__ import annotations

import logging
import mmap
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np

from kvtier import codec
from kvtier.config import check_keys, parse_size
from kvtier.errors import ConfigError, LayoutError
from kvtier.keys import BlockKey
from kvtier.layout import KVLayout
from kvtier.tiers.arena import ArenaTier
from kvtier.tiers.base import Array
from kvtier.tiers.shm import SharedMemory

log = logging.getLogger(__name__)

PinMode = Literal["auto", "always", "never"]


class _Pin:
    """``cudaHostRegister`` of a mapping (page-locked for DMA) until ``close``."""

    def __init__(self, arena: Array, pin_memory: PinMode) -> None:
        self._cudart: Any = None
        self._ptr = 0
        want = pin_memory == "always" or (pin_memory == "auto" and "torch" in sys.modules)
        if not want:
            return
        try:
            import torch
        except ImportError:
            if pin_memory == "always":
                raise ConfigError("host tier pin_memory='always' needs torch installed") from None
            return
        if not torch.cuda.is_available():
            if pin_memory == "always":
                raise ConfigError("host tier pin_memory='always' needs torch with CUDA")
            return
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        page = mmap.PAGESIZE  # whole pages of the mapping (the arena starts past a boundary)
        ptr = int(arena.ctypes.data) // page * page
        size = -(-(int(arena.ctypes.data) + int(arena.nbytes) - ptr) // page) * page
        err = cudart.cudaHostRegister(ptr, size, 0)
        if int(getattr(err, "value", err)) != 0:
            if pin_memory == "always":
                raise ConfigError(f"host tier pin_memory='always': cudaHostRegister failed ({err})")
            log.warning("host tier: cannot page-lock the arena (%s); device copies will stage", err)
            return
        self._cudart, self._ptr = cudart, ptr

    @property
    def pinned(self) -> bool:
        return self._cudart is not None

    def close(self) -> None:
        if self._cudart is not None:
            self._cudart.cudaHostUnregister(self._ptr)
            self._cudart = None


class HostTier(ArenaTier):
    """A DRAM arena of ``capacity_bytes // block_bytes`` slots.

    ``shm_path`` names the arena's shared memory (mode 0600, 0660 with ``shm_gid``) so other
    processes of that user or group can ``SharedMemory.attach`` it; a stale file of that name
    is replaced, and ``close`` removes it. Without it the arena is anonymous."""

    name = "host"
    layer_reads = True

    def __init__(
        self,
        layout: KVLayout,
        capacity_bytes: int,
        pin_memory: PinMode = "auto",
        *,
        shm_path: str | None = None,
        shm_gid: int | None = None,
    ) -> None:
        super().__init__(layout, capacity_bytes)
        n = self._table.capacity
        self.shm = SharedMemory.create(n * layout.block_bytes, shm_path, gid=shm_gid, replace=True)
        self._arena = self.shm.array
        try:
            self._pin = _Pin(self._arena, pin_memory)
        except BaseException:
            self.shm.unlink()
            self.shm.close()
            raise
        self._checksums = np.zeros(n, dtype=np.uint64)

    @classmethod
    def from_config(
        cls,
        layout: KVLayout,
        spec: Mapping[str, Any],
        *,
        shm_path: str | None = None,
        shm_gid: int | None = None,
    ) -> HostTier:
        """``{"capacity": "8GiB", "pin_memory": "auto"|"always"|"never"}`` (``shm_*``: as
        the constructor's; set by the node service, not by a config file)."""
        check_keys("tiers.host", spec, {"capacity", "pin_memory"})
        pin = str(spec.get("pin_memory", "auto"))
        if pin not in ("auto", "always", "never"):
            raise ConfigError(f"tiers.host pin_memory must be auto/always/never, got {pin!r}")
        cap = parse_size(spec.get("capacity", "1GiB"), "tiers.host capacity")
        return cls(layout, cap, pin, shm_path=shm_path, shm_gid=shm_gid)  # type: ignore[arg-type]

    def _host_bytes(self, n: int) -> int:
        """The arena and its checksums, beside the slot table."""
        return super()._host_bytes(n) + n * (self.layout.block_bytes + 8)

    def slot_view(self, slot: int) -> Array:
        b = self.block_bytes
        return self._arena[slot * b : (slot + 1) * b]

    def _write(self, slot: int, block: Array) -> None:
        self._checksums[slot] = codec.copy_in(self.slot_view(slot), block)

    def _read(self, slot: int, out: Array) -> bool:
        return codec.copy_out(out, self.slot_view(slot)) == int(self._checksums[slot])

    def get_layer_into(
        self, keys: Sequence[BlockKey], layer: int, outs: Sequence[Array], tenant: str = ""
    ) -> list[int | None]:
        """One layer's slice of each slot (unverified) and the block's recorded checksum."""
        n = self.layout.layer_block_bytes
        if len(outs) != len(keys) or any(o.nbytes != n for o in outs):
            raise LayoutError(f"host: need one buffer of {n} bytes (one layer) per key")
        if not 0 <= layer < self.layout.layers:
            raise LayoutError(f"host: layer {layer} out of range 0..{self.layout.layers - 1}")
        result: list[int | None] = []
        for key, out in zip(keys, outs, strict=True):
            slot = self._table.acquire(key)
            if slot is None:
                result.append(None)
                continue
            try:
                src = self.slot_view(slot)[layer * n : (layer + 1) * n]
                np.copyto(out, src.view(out.dtype).reshape(out.shape), casting="no")
                result.append(int(self._checksums[slot]))
            finally:
                self._table.release(slot)
        return result

    # -- external copies: another process maps the arena and moves the bytes itself --------
    def reserve(self, keys: Sequence[BlockKey]) -> list[int | None]:
        """A slot per key for a writer outside this object, invisible to readers until
        ``publish`` (or returned by ``abort``); ``None`` where there is none (the tier is full,
        or the key is present or being written: not the caller's to abort)."""
        out: list[int | None] = []
        for key in keys:
            slot = self._table.reserve(key)
            out.append(None if slot is None or slot < 0 else slot)
        return out

    def publish(
        self, keys: Sequence[BlockKey], slots: Sequence[int], checksums: Sequence[int]
    ) -> None:
        """Make reserved slots readable; ``checksums`` are what their writer's
        ``codec.copy_in`` returned (every later read is verified against them)."""
        for key, slot, csum in zip(keys, slots, checksums, strict=True):
            self._checksums[slot] = csum
            self._table.publish(key, slot)

    def abort(self, keys: Sequence[BlockKey], slots: Sequence[int]) -> None:
        """Return reserved slots unpublished: whatever was written there is never read."""
        for key, slot in zip(keys, slots, strict=True):
            self._table.abort(key, slot)

    def acquire(self, keys: Sequence[BlockKey]) -> list[tuple[int, int]]:
        """``(slot, checksum)`` of the leading ``keys`` present, each pinned (its slot is not
        freed or reused, even if the key is deleted) until ``release``; stops at the first
        key absent."""
        out: list[tuple[int, int]] = []
        for key in keys:
            slot = self._table.acquire(key)
            if slot is None:
                break
            out.append((slot, int(self._checksums[slot])))
        return out

    def release(self, slots: Sequence[int]) -> None:
        """Unpin slots ``acquire`` returned (each once)."""
        for slot in slots:
            self._table.release(slot)

    def close(self) -> None:
        """Unpin and unmap the arena and remove its name (idempotent)."""
        self._pin.close()
        self.shm.unlink()
        self.shm.close()
