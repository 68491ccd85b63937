"""Device-memory tier (G1) on torch: a preallocated arena of slots on a CUDA device (or CPU).

The only tier that imports torch. Puts and gets are copies between the caller's arrays (numpy
on the host, or torch tensors) and arena slots; host<->device copies of pinned memory run as
DMA. Device memory is in-process and ECC-protected, so this tier does not checksum
(``verifies_checksums = False``): a block is checksummed by the next tier it is written to,
when it leaves the device.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from kvtier.config import check_keys, parse_size
from kvtier.errors import ConfigError
from kvtier.layout import KVLayout
from kvtier.tiers.arena import ArenaTier
from kvtier.tiers.base import Array


class DeviceTier(ArenaTier):
    """``capacity_bytes // block_bytes`` slots in one torch uint8 tensor on ``device``."""

    name = "device"
    verifies_checksums = False

    def __init__(self, layout: KVLayout, capacity_bytes: int, device: str = "auto") -> None:
        import torch

        super().__init__(layout, capacity_bytes)
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"device tier on {device!r} but torch sees no CUDA device")
        n = self._table.capacity
        self.device = torch.device(device)
        self._torch = torch
        self._arena = torch.zeros((n, layout.block_bytes), dtype=torch.uint8, device=self.device)
        lay = layout
        self._byte_shape = (
            lay.layers,
            lay.kv_factor,
            lay.block_tokens,
            lay.kv_heads,
            lay.head_dim * lay.bytes_per_element,
        )

    @classmethod
    def from_config(cls, layout: KVLayout, spec: Mapping[str, Any]) -> DeviceTier:
        """``{"capacity": "16GiB", "device": "auto"|"cuda:0"|"cpu"}``."""
        check_keys("tiers.device", spec, {"capacity", "device"})
        return cls(
            layout,
            parse_size(spec.get("capacity", "1GiB"), "tiers.device capacity"),
            str(spec.get("device", "auto")),
        )

    def _as_bytes(self, a: Any) -> Any:
        """A uint8 torch view ``[L, F, T, H, D*itemsize]`` of a numpy array or tensor."""
        torch = self._torch
        if isinstance(a, np.ndarray):
            if a.ndim != 5:
                a = a.reshape(self.layout.block_shape) if a.flags.c_contiguous else a
            return torch.from_numpy(a.view(np.uint8))
        return a.view(torch.uint8)

    def _slot(self, slot: int) -> Any:
        return self._arena[slot].view(self._byte_shape)

    def _read(self, slot: int, out: Array) -> bool:
        dst = self._as_bytes(out)
        dst.copy_(self._slot(slot).reshape(dst.shape))
        self._sync()
        return True

    def _write(self, slot: int, block: Array) -> None:
        src = self._as_bytes(block)
        self._slot(slot).reshape(src.shape).copy_(src)
        self._sync()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            self._torch.cuda.current_stream(self.device).synchronize()
