"""Block framing and integrity: the header every stored block carries, and checksummed copies.

Header (64 bytes, little-endian)::

    magic "KVTB" | version u16 | flags u16 | layout fingerprint 8B | key 32B |
    payload_len u64 | checksum u64 (xxh3_64 of the payload)

A header is *valid for a read* only if magic, version, fingerprint, key and length all match what
the reader expects and the payload hashes to the checksum; anything else is a foreign, torn or
corrupt block and must be treated as a miss (see ``verify``).

The copy helpers fuse the copy with the checksum: each chunk (one ``[layer, k|v]`` plane or
1 MiB of a flat buffer) is copied and then hashed while still in cache, so integrity costs a
cache-speed pass instead of a second trip to DRAM.
"""

from __future__ import annotations

import os
import struct
import threading
import weakref
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np
import xxhash

from kvtier.errors import LayoutError

MAGIC = b"KVTB"
FORMAT_VERSION = 1
HEADER = struct.Struct("<4sHH8s32sQQ")
HEADER_BYTES = 64
assert HEADER.size <= HEADER_BYTES
FLAG_ENCRYPTED = 1
FLAG_MAC = 2  # header | payload | nonce(12) | tag(16): keyed AES-GMAC (``tiers.secure``)
#: room kept after a framed payload, so an authenticated value is one buffer too
TRAILER_BYTES = 32
_FLAT_CHUNK = 1 << 20

Array = np.ndarray[Any, np.dtype[Any]]


class Header(NamedTuple):
    flags: int
    fingerprint: bytes
    key: bytes
    payload_len: int
    checksum: int


def pack_header(
    key: bytes, fingerprint: bytes, payload_len: int, checksum: int, flags: int = 0
) -> bytes:
    """The 64-byte header for a block (padded with zeros)."""
    raw = HEADER.pack(MAGIC, FORMAT_VERSION, flags, fingerprint, key, payload_len, checksum)
    return raw.ljust(HEADER_BYTES, b"\0")


def unpack_header(buf: bytes | memoryview | Array) -> Header | None:
    """Parse a header; ``None`` if it is not a kvtier header of this format version."""
    if isinstance(buf, np.ndarray):
        buf = buf.data
    raw = bytes(buf[:HEADER_BYTES]) if not isinstance(buf, bytes) else buf
    if len(raw) < HEADER.size:
        return None
    magic, version, flags, fp, key, plen, csum = HEADER.unpack_from(raw)
    if magic != MAGIC or version != FORMAT_VERSION:
        return None
    return Header(flags, fp, key, plen, csum)


def header_matches(h: Header | None, key: bytes, fingerprint: bytes, payload_len: int) -> bool:
    """True if ``h`` describes the block a reader asked for (not foreign, not a different key)."""
    return (
        h is not None
        and h.key == key
        and h.fingerprint == fingerprint
        and h.payload_len == payload_len
    )


#: buffers made by ``framed_empty`` (by id; weak, so a freed buffer drops out)
_FRAMES: weakref.WeakValueDictionary[int, Array] = weakref.WeakValueDictionary()


def framed_empty(nbytes: int) -> Array:
    """A page-touched uint8 payload of ``nbytes`` with ``HEADER_BYTES`` of room just before it
    and ``TRAILER_BYTES`` just after.

    A tier that stores header + payload (+ an authentication trailer) contiguously (a remote
    value) can write them into that room and move one buffer instead of two (``header_room``,
    ``frame``). kvtier's staging buffers are framed; the room belongs to whichever put or get is
    using the buffer, so one framed buffer must not be in two transfers at once.
    """
    full = np.empty(HEADER_BYTES + nbytes + TRAILER_BYTES, dtype=np.uint8)
    full.fill(0)
    _FRAMES[id(full)] = full
    return full[HEADER_BYTES : HEADER_BYTES + nbytes]


def frame(a: Array) -> Array | None:
    """The whole ``framed_empty`` buffer (header room | payload | trailer room) if ``a`` is (a
    contiguous view of) a whole framed payload, else ``None``."""
    full = a
    while isinstance(full.base, np.ndarray):
        full = full.base
    if _FRAMES.get(id(full)) is not full or not a.flags.c_contiguous:
        return None
    if (
        a.ctypes.data - full.ctypes.data != HEADER_BYTES
        or a.nbytes + HEADER_BYTES + TRAILER_BYTES != full.nbytes
    ):
        return None
    return full


def header_room(a: Array) -> Array | None:
    """The ``HEADER_BYTES`` just before ``a`` if ``a`` is (a contiguous view of) a whole
    ``framed_empty`` payload, else ``None``."""
    full = frame(a)
    return None if full is None else full[:HEADER_BYTES]


def checksum(buf: bytes | memoryview | Array) -> int:
    """xxh3_64 of a contiguous buffer."""
    return int(xxhash.xxh3_64_intdigest(buf.data if isinstance(buf, np.ndarray) else buf))


#: below this many bytes in all, ``checksums`` hashes on the calling thread
PARALLEL_HASH_BYTES = 8 << 20
_hash_pool: ThreadPoolExecutor | None = None
_hash_pool_lock = threading.Lock()


def checksums(bufs: Sequence[Array]) -> list[int]:
    """``checksum`` of each contiguous buffer. A large batch (a remote tier's transfer, already
    out of cache) is split over a few threads: xxhash releases the GIL, and on a 2-core machine
    two threads hash 192 MiB in 10-18 ms instead of 17-31 ms."""
    total = sum(int(b.nbytes) for b in bufs)
    workers = min(len(bufs), os.cpu_count() or 1, 4)
    if total < PARALLEL_HASH_BYTES or workers < 2:
        return [checksum(b) for b in bufs]
    global _hash_pool
    with _hash_pool_lock:
        if _hash_pool is None:
            _hash_pool = ThreadPoolExecutor(4, thread_name_prefix="kvtier-hash")
    parts = _hash_pool.map(lambda i: [checksum(b) for b in bufs[i::workers]], range(workers))
    out = [0] * len(bufs)
    for i, sums in enumerate(parts):
        out[i::workers] = sums
    return out


def _chunks(a: Array) -> Iterator[Array]:
    """``a`` as consecutive pieces in C order, each about ``_FLAT_CHUNK`` bytes or less and one
    ``np.copyto`` call: flat slices of a contiguous array; else runs of whole rows of its leading
    axis (a block's layers in an engine's buffer), a row larger than a piece split the same way
    (a strided 1-D array is one piece).
    Few, large pieces keep the per-piece Python cost below the copy's (a 16-token block of an 8B
    model has 64 contiguous runs of 32 KiB); pieces that fit in cache keep the checksum pass,
    which follows each copy, reading from cache."""
    if a.flags.c_contiguous:
        flat = a.reshape(-1).view(np.uint8)
        for off in range(0, flat.size, _FLAT_CHUNK):
            yield flat[off : off + _FLAT_CHUNK]
        return
    if a.ndim < 2 or a.shape[0] == 0:
        yield a
        return
    row = a[0].nbytes
    if row > _FLAT_CHUNK:
        for i in range(a.shape[0]):
            yield from _chunks(a[i])
        return
    step = _FLAT_CHUNK // max(row, 1)
    for i in range(0, a.shape[0], step):
        yield a[i : i + step]


def _check_sizes(dst_nbytes: int, src_nbytes: int) -> None:
    if dst_nbytes != src_nbytes:
        raise LayoutError(f"buffer is {dst_nbytes} bytes, block is {src_nbytes} bytes")


def copy_in(dst: Array, src: Array) -> int:
    """Copy ``src`` (any shape, may be strided) into contiguous ``dst``; return its checksum.

    ``dst`` must be a C-contiguous array of exactly ``src.nbytes`` bytes. The checksum is that of
    the C-order bytes of ``src``, i.e. of ``dst`` after the copy.
    """
    _check_sizes(dst.nbytes, src.nbytes)
    flat = dst.reshape(-1).view(np.uint8)
    h = xxhash.xxh3_64()
    off = 0
    for chunk in _chunks(src):
        n = chunk.nbytes
        part = flat[off : off + n]
        np.copyto(part.view(chunk.dtype).reshape(chunk.shape), chunk, casting="no")
        # the same bytes either way; the source was just read, so it is in cache even where
        # the copy's stores bypassed it (non-temporal stores)
        h.update(chunk.data if chunk.flags.c_contiguous else part.data)
        off += n
    return int(h.intdigest())


def copy_plain(dst: Array, src: Array) -> None:
    """Copy contiguous ``src`` into ``dst`` (any shape, may be strided) without a checksum: for
    a payload whose integrity a MAC has already checked (one pass fewer than ``copy_out``)."""
    _check_sizes(dst.nbytes, src.nbytes)
    flat = src.reshape(-1).view(np.uint8)
    np.copyto(dst, flat.view(dst.dtype).reshape(dst.shape), casting="no")


def copy_out(dst: Array, src: Array) -> int:
    """Copy contiguous ``src`` into ``dst`` (any shape, may be strided); return src's checksum.

    The caller compares the result with the expected checksum and treats a mismatch as a miss
    (the destination then holds garbage that must not be used).
    """
    _check_sizes(dst.nbytes, src.nbytes)
    flat = src.reshape(-1).view(np.uint8)
    h = xxhash.xxh3_64()
    off = 0
    for chunk in _chunks(dst):
        n = chunk.nbytes
        part = flat[off : off + n]
        np.copyto(chunk, part.view(chunk.dtype).reshape(chunk.shape), casting="no")
        h.update(part.data)
        off += n
    return int(h.intdigest())
