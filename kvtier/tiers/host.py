"""Host DRAM tier (G2): one preallocated arena of fixed-size slots.

The arena is allocated (and its pages touched) once at construction, so the hot path does no
allocation: a put is one fused copy+checksum into a free slot, a get one fused copy+verify out of
it. When torch with CUDA is importable and ``pin_memory`` allows it, the arena is page-locked
(pinned) so device transfers can be asynchronous DMA.

Checksums are kept beside the arena (one uint64 per slot); a get whose bytes no longer hash to
the recorded checksum (a bit flip in DRAM, a stray write) is a miss and the slot is dropped.
"""

from __future__ import annotations

import logging
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

log = logging.getLogger(__name__)

PinMode = Literal["auto", "always", "never"]


def _allocate(nbytes: int, pin_memory: PinMode) -> Array:
    """A page-touched uint8 arena, pinned when asked (or when 'auto' and CUDA is in use)."""
    want_pin = pin_memory == "always" or (pin_memory == "auto" and "torch" in sys.modules)
    if want_pin:
        try:
            import torch

            if torch.cuda.is_available():
                t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                arena: Array = t.numpy()
                arena.fill(0)
                return arena
            if pin_memory == "always":
                raise ConfigError("host tier pin_memory='always' needs torch with CUDA")
        except ImportError:
            if pin_memory == "always":
                raise ConfigError("host tier pin_memory='always' needs torch installed") from None
    arena = np.empty(nbytes, dtype=np.uint8)
    arena.fill(0)  # touch every page now, not on the first store
    return arena


class HostTier(ArenaTier):
    """A DRAM arena of ``capacity_bytes // block_bytes`` slots."""

    name = "host"
    layer_reads = True

    def __init__(self, layout: KVLayout, capacity_bytes: int, pin_memory: PinMode = "auto") -> None:
        super().__init__(layout, capacity_bytes)
        n = self._table.capacity
        self._arena = _allocate(n * layout.block_bytes, pin_memory)
        self._checksums = np.zeros(n, dtype=np.uint64)

    @classmethod
    def from_config(cls, layout: KVLayout, spec: Mapping[str, Any]) -> HostTier:
        """``{"capacity": "8GiB", "pin_memory": "auto"|"always"|"never"}``."""
        check_keys("tiers.host", spec, {"capacity", "pin_memory"})
        pin = str(spec.get("pin_memory", "auto"))
        if pin not in ("auto", "always", "never"):
            raise ConfigError(f"tiers.host pin_memory must be auto/always/never, got {pin!r}")
        cap = parse_size(spec.get("capacity", "1GiB"), "tiers.host capacity")
        return cls(layout, cap, pin)  # type: ignore[arg-type]

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
