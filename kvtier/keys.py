"""Block keys: 32-byte chained, namespaced digests -- built here and nowhere else.

``key_0 = H(namespace_root, tokens[0:B])``, ``key_i = H(key_{i-1}, tokens[iB:(i+1)B])``, with
``H`` = SHA-256 over the parent key followed by the block's token ids as little-endian uint32. A
block's key therefore stands for its tokens *and everything before them*, so equal keys mean
equal prefixes.

The namespace root (``kvtier.identity.Namespace``) is a BLAKE2b-256 digest of the block's whole
identity -- model and revision, parallel position, engine layout, model configuration, layout
fingerprint, tenant or share group, adapter and salt -- keyed with the deployment's secret when
one is configured. Two tenants get disjoint key spaces unless they are mapped into the same
share group. Both hashes are cryptographic: finding a collision, or a token sequence that maps
onto another tenant's key, is infeasible. With a secret, no key can be computed outside the
deployment, because every chain starts at the secret-keyed root; keying each block's hash as
well would add nothing. SHA-256 is used per block because CPUs accelerate it (SHA-NI, ARMv8
crypto): a 128K-token prompt is 512 chained hashes, ~1 ms.

Only full blocks are keyed; a trailing partial block is never cached. Keys are produced lazily
so a lookup does work proportional to the matched prefix plus one block.
"""

from __future__ import annotations

import array
import hashlib
import sys
from collections.abc import Iterator, Sequence
from typing import Any, NewType

import numpy as np

from kvtier.errors import TokenError
from kvtier.identity import KEY_BYTES, Namespace

BlockKey = NewType("BlockKey", bytes)
_TOKEN_DTYPE = np.dtype("<u4")  # one canonical byte form, whatever the caller passed
_FAST_U32 = array.array("I").itemsize == 4 and sys.byteorder == "little"


def as_tokens(tokens: Any) -> np.ndarray[Any, np.dtype[np.uint32]]:
    """Validate and convert token ids to a 1-D little-endian uint32 array.

    Accepts a sequence of ints, a numpy integer array or a CPU torch tensor (1-D, or 2-D with
    one row). Raises ``TokenError`` naming the problem for floats, bools, negatives, ids of 2**32
    or more, or other shapes. Never mutates the input.
    """
    if hasattr(tokens, "detach") and hasattr(
        tokens, "cpu"
    ):  # torch tensor, without importing torch
        tokens = tokens.detach().cpu().numpy()
    if isinstance(tokens, np.ndarray):
        arr = tokens
    else:
        try:
            arr = np.asarray(tokens)
        except (TypeError, ValueError) as exc:
            raise TokenError(f"tokens must be a sequence of integers: {exc}") from None
    if arr.ndim == 2 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != 1:
        raise TokenError(f"tokens must be 1-D (one sequence), got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype=_TOKEN_DTYPE)
    if arr.dtype.kind not in "iu":
        raise TokenError(f"tokens must be integers, got dtype {arr.dtype} (e.g. {arr[:3]!r})")
    if arr.dtype.kind == "i" and int(arr.min()) < 0:
        raise TokenError(f"token ids must be non-negative, found {int(arr.min())}")
    if arr.dtype.itemsize > 4 and int(arr.max()) >= 2**32:
        raise TokenError(f"token ids must be < 2**32, found {int(arr.max())}")
    return np.ascontiguousarray(arr, dtype=_TOKEN_DTYPE)


class TokenIds:
    """Token ids validated lazily, a chunk at a time, so a lookup that stops at the first
    missing block does not pay for converting (or even reading) the rest of a long prompt.

    Accepts what ``as_tokens`` accepts. Type and shape errors raise ``TokenError`` at once;
    value errors (negative, >= 2**32, nested, non-integer) when the chunk holding them is first
    keyed. A Python ``bool`` is rejected as the first element; later in a list it is taken as the
    integer it is (Python's ``bool`` is an ``int``), since checking every element's type would
    cost more than the hashing.
    """

    __slots__ = ("_n", "_src")

    def __init__(self, tokens: Any) -> None:
        if hasattr(tokens, "detach") and hasattr(tokens, "cpu"):  # torch, without importing it
            tokens = tokens.detach().cpu().numpy()
        if isinstance(tokens, np.ndarray):
            if tokens.ndim == 2 and tokens.shape[0] == 1:
                tokens = tokens[0]
            if tokens.ndim != 1:
                raise TokenError(f"tokens must be 1-D (one sequence), got shape {tokens.shape}")
            if tokens.size and tokens.dtype.kind not in "iu":
                raise TokenError(f"tokens must be integers, got dtype {tokens.dtype}")
        elif isinstance(tokens, list | tuple):
            head = tokens[0] if tokens else 0
            if isinstance(head, bool) or not isinstance(head, int | np.integer):
                raise TokenError(
                    f"tokens must be a flat sequence of integer ids, got {type(head).__name__} "
                    f"{head!r} first"
                )
        elif not isinstance(tokens, range):
            tokens = as_tokens(tokens)
        self._src: Any = tokens
        self._n = len(tokens)

    def __len__(self) -> int:
        return self._n

    def validate(self, start: int = 0) -> None:
        """Check every id from ``start`` on now (``store`` checks those past the blocks it
        keyed, so a bad id that is never keyed still raises instead of being ignored)."""
        for first in range(start, self._n, 1 << 16):
            self.chunk(first, min(self._n, first + (1 << 16)))

    def chunk(self, start: int, stop: int) -> bytes:
        """Canonical bytes (little-endian uint32) of ``tokens[start:stop]``, validated."""
        part = self._src[start:stop]
        if not isinstance(part, np.ndarray) and _FAST_U32:
            try:  # C-speed conversion with range checks; errors re-diagnosed below
                return array.array("I", part).tobytes()
            except (OverflowError, TypeError):
                pass
        try:
            arr = part if isinstance(part, np.ndarray) else np.asarray(part)
        except (TypeError, ValueError) as exc:
            raise TokenError(
                f"tokens must be a flat sequence of integers near {start}: {exc}"
            ) from None
        if arr.size == 0:
            return b""
        if arr.ndim != 1:
            raise TokenError(
                f"tokens must be 1-D (one sequence), got a nested element near {start}"
            )
        if arr.dtype.kind not in "iu":
            at = next((i for i, v in enumerate(part) if not isinstance(v, int | np.integer)), -1)
            if at < 0:  # all integers, some beyond 64 bits (numpy keeps those as objects)
                at, v = next((i, v) for i, v in enumerate(part) if not 0 <= v < 2**32)
                rule = "non-negative" if v < 0 else "< 2**32"
                raise TokenError(f"token ids must be {rule}, found {v} at position {start + at}")
            raise TokenError(
                f"tokens must be integers, got {arr.dtype} ({part[at]!r} at position {start + at})"
            )
        if arr.dtype != _TOKEN_DTYPE:
            lo, hi = int(arr.min()), int(arr.max())
            if lo < 0:
                at = start + int(np.argmin(arr))
                raise TokenError(f"token ids must be non-negative, found {lo} at position {at}")
            if hi >= 2**32:
                at = start + int(np.argmax(arr))
                raise TokenError(f"token ids must be < 2**32, found {hi} at position {at}")
        return arr.astype(_TOKEN_DTYPE, copy=False).tobytes()


_CHUNK_BLOCKS = 16


def iter_keys(ns: Namespace, tokens: TokenIds) -> Iterator[BlockKey]:
    """Yield the keys of the full blocks of ``tokens``.

    Lazy: a caller that stops at the first miss pays for the matched blocks plus at most one
    chunk of ``16`` blocks of conversion and one block of hashing.
    """
    return iter_chain(ns.root, ns.layout.block_tokens, tokens)


def iter_chain(root: bytes, bt: int, tokens: TokenIds) -> Iterator[BlockKey]:
    """``iter_keys`` from a namespace's ``root`` bytes with ``bt``-token blocks (a service's
    client computes its own keys this way: ``kvtier.service.presence``)."""
    parent = root
    step = bt * _TOKEN_DTYPE.itemsize
    full = len(tokens) // bt
    sha256 = hashlib.sha256
    for first in range(0, full, _CHUNK_BLOCKS):
        last = min(full, first + _CHUNK_BLOCKS)
        raw = tokens.chunk(first * bt, last * bt)
        for off in range(0, len(raw), step):
            parent = sha256(parent + raw[off : off + step]).digest()
            yield BlockKey(parent)


def block_keys(ns: Namespace, tokens: Any) -> list[BlockKey]:
    """All full-block keys of ``tokens`` (validating them)."""
    return list(iter_keys(ns, TokenIds(tokens)))


def key_hex(key: bytes | Sequence[int]) -> str:
    """Short printable form of a key, for logs."""
    return bytes(key)[:8].hex()


__all__ = [
    "KEY_BYTES",
    "BlockKey",
    "Namespace",
    "TokenIds",
    "as_tokens",
    "block_keys",
    "iter_keys",
    "key_hex",
]
