"""The tier interface: one small, batch-first contract every storage medium implements.

A tier stores whole blocks (``layout.block_bytes`` of payload, framed with a ``codec`` header)
under 32-byte ``BlockKey``s. It knows nothing about tokens, prefixes beyond "the leading present
keys", eviction or other tiers: the ``TieredStore`` decides, tiers hold bytes.

Contract (every implementation, checked by ``tests/tier_conformance.py``):

- **Batch-first.** Every data method takes a sequence of keys; implementations should turn one
  call into as few round trips / syscalls as the medium allows.
- **Caller-provided buffers.** ``get_into`` fills arrays the caller owns (any shape/strides with
  exactly ``block_bytes`` bytes); ``put`` reads from arrays the caller owns. Neither keeps a
  reference after returning.
- **Integrity.** ``put`` records a checksum of the payload; ``get_into`` verifies header and
  checksum and reports ``False`` for anything that does not match (and drops it). A ``True`` from
  ``get_into`` means the buffer holds exactly the bytes that were put under that key.
- **Visibility.** A block is visible to ``contains_prefix``/``get_into`` only once its ``put``
  completed; a concurrent reader sees the old state or the whole new block, never half of it.
- **Failures are outcomes.** Full, down, slow, I/O error, corrupt: ``False`` / a miss, and
  ``healthy`` turns ``False`` when the tier is degraded. Only caller mistakes raise
  (``LayoutError`` for a buffer of the wrong size).
- **Thread-safety.** All methods may be called concurrently from several threads.
- ``tenant`` names the owner of the blocks (tenant or share group). Local tiers may ignore it;
  shared tiers namespace, encrypt and apply quotas by it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.errors import LayoutError
from kvtier.keys import BlockKey
from kvtier.layout import KVLayout

Array = np.ndarray[Any, np.dtype[Any]]


@dataclass(frozen=True, slots=True)
class TierUsage:
    """A point-in-time reading of a tier's occupancy. ``capacity_blocks`` 0 means unbounded."""

    used_blocks: int
    capacity_blocks: int
    block_bytes: int

    @property
    def used_bytes(self) -> int:
        return self.used_blocks * self.block_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.capacity_blocks * self.block_bytes

    @property
    def free_blocks(self) -> int:
        return max(0, self.capacity_blocks - self.used_blocks) if self.capacity_blocks else 1 << 62


class Tier(ABC):
    """Abstract tier; see the module docstring for the contract."""

    #: short name used in stats and logs ("host", "nvme", "redis", ...)
    name: str = "tier"
    #: survives a process restart (warm restart)
    persistent: bool = False
    #: visible to other processes / nodes
    shared: bool = False
    #: ``get_into`` verifies a checksum (False only for in-process device memory)
    verifies_checksums: bool = True
    #: implements ``get_layer_into`` (layer-wise streamed loads); False: whole blocks only
    layer_reads: bool = False

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.block_bytes = layout.block_bytes

    # -- queries (no side effects) -------------------------------------------------------
    @property
    @abstractmethod
    def capacity_blocks(self) -> int:
        """How many blocks fit; 0 if the tier is unbounded (evicts on its own)."""

    @abstractmethod
    def usage(self) -> TierUsage:
        """Current occupancy."""

    @abstractmethod
    def contains_prefix(self, keys: Sequence[BlockKey], tenant: str = "") -> int:
        """Number of leading ``keys`` present (complete and readable). Does not touch data."""

    @property
    def healthy(self) -> bool:
        """False while the tier is degraded (I/O errors, server down); it then serves misses."""
        return True

    def keys(self) -> Iterator[BlockKey]:
        """Every key held (for warm restart); tiers that cannot enumerate yield nothing."""
        return iter(())

    # -- data ------------------------------------------------------------------------------
    @abstractmethod
    def get_into(
        self, keys: Sequence[BlockKey], outs: Sequence[Array], tenant: str = ""
    ) -> list[bool]:
        """Fill ``outs[i]`` with block ``keys[i]``; ``True`` where it is a verified hit.

        Where the result is ``False`` the buffer content is unspecified and must not be used.
        """

    def get_layer_into(
        self, keys: Sequence[BlockKey], layer: int, outs: Sequence[Array], tenant: str = ""
    ) -> list[int | None]:
        """Optional (``layer_reads``): fill ``outs[i]`` with layer ``layer`` of block ``keys[i]``.

        Blocks are layer-major, so a layer is the contiguous payload range
        ``[layer * n, (layer + 1) * n)`` with ``n = block_bytes // layers``; ``outs[i]`` is any
        array of ``n`` bytes. Returns, per block, the checksum recorded at ``put`` for the
        *whole* payload, or ``None`` on a miss. The bytes are NOT verified (a layer cannot be):
        the caller must hash the assembled block (C order) and compare with the checksum before
        using the result, and treat a mismatch, or a checksum that changed between layers, as a
        miss.
        """
        raise NotImplementedError(f"{self.name} tier does not read single layers")

    @abstractmethod
    def put(
        self, keys: Sequence[BlockKey], blocks: Sequence[Array], tenant: str = ""
    ) -> list[bool]:
        """Store ``blocks[i]`` under ``keys[i]``; ``False`` where it was not stored (full, down).

        A key already present is left as it is and reported ``True``.
        """

    @abstractmethod
    def delete(self, keys: Sequence[BlockKey], tenant: str = "") -> None:
        """Drop the keys that are present; absent keys are ignored."""

    def sync(self) -> None:  # noqa: B027 - optional hook
        """Persistent tiers: make every block ``put`` reported ``True`` survive a power loss,
        not only a crash of this process (``TieredStore.flush(durable=True)`` calls it). Never
        raises: a tier that cannot sync is degraded (``healthy`` turns False). Default: nothing
        to do."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (threads, files, connections). Idempotent."""

    # -- helpers for implementations -------------------------------------------------------
    def check_buffers(self, bufs: Sequence[Array], keys: Sequence[BlockKey]) -> None:
        """Raise ``LayoutError`` unless there is one buffer of ``block_bytes`` per key."""
        if len(bufs) != len(keys):
            raise LayoutError(f"{len(keys)} keys but {len(bufs)} buffers")
        for b in bufs:
            if b.nbytes != self.block_bytes:
                raise LayoutError(
                    f"{self.name}: buffer of {b.nbytes} bytes, block is {self.block_bytes} bytes"
                )

    def __repr__(self) -> str:
        u = self.usage()
        return f"<{type(self).__name__} {self.name} {u.used_blocks}/{u.capacity_blocks} blocks>"
