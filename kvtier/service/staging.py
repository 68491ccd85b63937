"""``Staging``: a region of shared memory both the service and one client map.

KV bytes between a client and the service travel through it, never through the socket: a
client's store puts a block range into the region (or the engine gathers straight into a
``buffer``) and the service's store copies it into the host tier; a load is the other way round.
The region is two areas: ``kv_bytes`` of KV, then an area for the token ids of a long prompt
(cheaper here than as a socket frame).

The region is a file under ``/dev/shm`` (the tmpfs every Linux has; the system temp directory
elsewhere) created by the service with owner-only permissions (group-readable when the socket
has a group), mapped by both sides, and unlinked as soon as the client has mapped it: nothing is
left behind when either side dies, and the memory is freed when the last mapping goes. Its
pages are allocated on first use (a session that never stages costs no memory).
"""

from __future__ import annotations

import os
import secrets
from typing import Any

import numpy as np

from kvtier.errors import LayoutError
from kvtier.layout import KVLayout
from kvtier.tiers.base import Array
from kvtier.tiers.shm import SharedMemory, shm_dir


class Staging:
    """One mapped region of ``nbytes``; ``view(layout, offset, tokens)`` is a KV array in it.

    Not thread-safe by itself: a session uses its region for one call at a time."""

    __slots__ = ("_shm", "kv_bytes", "nbytes", "path")

    def __init__(self, shm: SharedMemory, kv_bytes: int) -> None:
        assert shm.path is not None
        self.path = shm.path
        self.nbytes = shm.nbytes
        self.kv_bytes = kv_bytes
        self._shm = shm

    @classmethod
    def create(cls, kv_bytes: int, token_bytes: int, *, gid: int | None = None) -> Staging:
        """A new region of ``kv_bytes`` of KV and ``token_bytes`` of token ids (service side),
        mode 0600 (0660 with ``gid``)."""
        path = os.path.join(shm_dir(), f"kvtier-{os.getpid()}-{secrets.token_hex(8)}")
        shm = SharedMemory.create(kv_bytes + token_bytes, path, gid=gid, prefault=False)
        return cls(shm, kv_bytes)

    @classmethod
    def attach(cls, path: str, nbytes: int, kv_bytes: int) -> Staging:
        """Map the region a service created (client side); ``OSError`` if it cannot."""
        return cls(SharedMemory.attach(path, nbytes), kv_bytes)

    def unlink(self) -> None:
        """Remove the region's name (the mappings stay valid). Idempotent."""
        self._shm.unlink()

    def view(self, layout: KVLayout, offset: int, tokens: int) -> Array:
        """The ``[layers, kv_factor, tokens, kv_heads, head_dim]`` array at byte ``offset``.

        ``LayoutError`` if it does not fit in the region (a client naming a range outside
        it)."""
        if self._shm.closed:
            raise LayoutError("staging region is closed")
        nbytes = tokens * layout.bytes_per_token
        if offset < 0 or tokens < 0 or offset + nbytes > self.kv_bytes:
            raise LayoutError(
                f"staging range {offset}+{nbytes} bytes is outside the {self.kv_bytes}-byte KV area"
            )
        flat = self._shm.array[offset : offset + nbytes]
        return flat.view(layout.storage_dtype).reshape(layout.kv_shape(tokens))

    def offset_of(self, arr: Any) -> int | None:
        """The byte offset of ``arr`` in the region when it is a whole C-contiguous array there
        (so the service can address it without a copy), else ``None``."""
        if self._shm.closed or not isinstance(arr, np.ndarray) or not arr.flags.c_contiguous:
            return None
        lo = self._shm.array.__array_interface__["data"][0]
        ptr = arr.__array_interface__["data"][0]
        off = int(ptr - lo)
        return off if off >= 0 and off + arr.nbytes <= self.kv_bytes else None

    def put_tokens(self, raw: bytes) -> bool:
        """Copy token-id bytes into the token area; ``False`` if they do not fit."""
        if self._shm.closed or len(raw) > self.nbytes - self.kv_bytes:
            return False
        area = self._shm.array[self.kv_bytes : self.kv_bytes + len(raw)]
        area[:] = np.frombuffer(raw, np.uint8)
        return True

    def put_token_array(self, ids: Any) -> bool:
        """Copy a 1-D numpy array of token ids straight into the token area as uint32 (one
        pass, no intermediate bytes); ``False`` -- nothing placed -- unless it is one, fits,
        and every id is in ``[0, 2**32)`` (the caller then converts it the checked way, which
        names a bad id)."""
        if not isinstance(ids, np.ndarray) or ids.ndim != 1 or ids.dtype.kind not in "iu":
            return False
        if self._shm.closed or 4 * ids.size > self.nbytes - self.kv_bytes:
            return False
        wide = ids.dtype.kind == "i" or ids.dtype.itemsize > 4  # may hold what uint32 cannot
        if ids.size and wide and (int(ids.min()) < 0 or int(ids.max()) >= 2**32):
            return False
        np.copyto(self.tokens(ids.size), ids, casting="unsafe")
        return True

    def tokens(self, count: int) -> Array:
        """The first ``count`` token ids (uint32) of the token area: a view, no copy (the
        client writes into it, the service reads it). ``LayoutError`` if they do not fit."""
        if self._shm.closed or count < 0 or 4 * count > self.nbytes - self.kv_bytes:
            raise LayoutError(f"{count} token ids do not fit the staging token area")
        out: Array = self._shm.array[self.kv_bytes : self.kv_bytes + 4 * count].view("<u4")
        return out

    def close(self) -> None:
        """Drop this side's mapping (idempotent). Arrays still viewing it keep it alive."""
        self._shm.close()
