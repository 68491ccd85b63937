"""Tenant security for shared and archive tiers: namespacing, per-tenant encryption, quotas.

Every remote tier (Redis/Valkey, Mooncake Store, S3) stores a block as ONE value made by
``BlockSealer.seal`` and read back with ``BlockSealer.open_into``:

- authenticated: ``header(64) | payload | nonce(12) | tag(16)``  (header flag ``FLAG_MAC``)
- encrypted:     ``header(64) | nonce(12) | ciphertext | tag(16)``  (flag ``FLAG_ENCRYPTED``)
- plain:         ``header(64) | payload``   (header checksum = xxh3 of payload; trusted pools only)

A block read from outside the process is accepted only if it is authenticated, because an xxh3
checksum is no MAC: anyone who can write to the pool could plant KV under a key computed from
public token ids. With a deployment ``secret`` (and no encryption) the tag is AES-GMAC -- GCM
with no plaintext -- over ``header || payload || tenant`` under a key derived from the secret
with HKDF-SHA256, and a fresh random nonce per value. GMAC runs at GHASH speed (carry-less
multiply), faster than a memcpy, where HMAC-SHA256 or keyed BLAKE2b run at 1 GB/s or less.
A sealer with neither a secret nor encryption keys seals plain blocks and ``authenticated`` is
False: a shared tier refuses to start with one unless its config says ``trust_pool = true``.

The header comes first so a reader sees a whole block or nothing (the value is written in one
atomic operation by the tier) and can reject a foreign or wrong-key block before touching the
payload. When encryption is configured the payload is AES-256-GCM encrypted with the tenant's
key, and the associated data is ``header || tenant``: the header binds the block key, layout
fingerprint and length, so a ciphertext copied to another key or another tenant's namespace, or
any flipped bit, fails authentication -- and a failed authentication is a miss, never an error.
The header checksum of an encrypted block is zero (a plaintext hash would leak equality of
contents); GCM's tag is the integrity check. With encryption configured a *plaintext* block is a
miss too (anyone with write access to the server could otherwise plant one).

Per-tenant keys are given explicitly (``tenant_keys``) or derived from one master key with
HKDF-SHA256 (``info`` = tenant name), so a leaked tenant key exposes only that tenant.

``TenantQuotas`` caps the bytes each tenant may hold in the tier *as written through this
client* (a process-local account: each node enforces its own budget; blocks the server evicts
or expires on its own are not refunded until deleted through this client). A refusal is loud: it
is counted per tenant, logged, and the ``put`` reports ``False`` for that block.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kvtier import codec
from kvtier.config import parse_bool, parse_size
from kvtier.errors import ConfigError
from kvtier.keys import BlockKey
from kvtier.layout import KVLayout
from kvtier.tiers.base import Array

log = logging.getLogger(__name__)

NONCE_BYTES = 12
TAG_BYTES = 16
#: config keys understood by ``security_from_config`` (tiers add them to their allowed set)
SECURITY_KEYS = frozenset(
    {"encryption_key", "tenant_keys", "quota", "tenant_quotas", "secret", "trust_pool"}
)
MAC_TRAILER = NONCE_BYTES + TAG_BYTES
assert MAC_TRAILER <= codec.TRAILER_BYTES
_SAFE_TENANT = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


def tenant_token(tenant: str) -> str:
    """A server-key-safe form of a tenant name (no ``{}:/`` or spaces); injective in practice.

    Safe names are kept as they are (readable keys); anything else becomes ``~`` + 32 hex digits
    of its BLAKE2b digest, which cannot collide with a safe name (``~`` is never safe).
    """
    if not tenant:
        return "_"
    if _SAFE_TENANT.match(tenant):
        return tenant
    return "~" + hashlib.blake2b(tenant.encode(), digest_size=16).hexdigest()


def parse_key(value: Any, what: str) -> bytes:
    """A key from config: raw bytes, or a hex string. Raises ``ConfigError`` saying what to give."""
    if isinstance(value, bytes | bytearray):
        raw = bytes(value)
    elif isinstance(value, str):
        try:
            raw = bytes.fromhex(value.strip())
        except ValueError:
            raise ConfigError(
                f"{what}: give the key as hex digits (e.g. 64 for 32 bytes)"
            ) from None
    else:
        raise ConfigError(f"{what}: expected hex string or bytes, got {type(value).__name__}")
    if len(raw) < 16:
        raise ConfigError(f"{what}: key is {len(raw)} bytes; use at least 16 (32 recommended)")
    return raw


def mac_key(secret: bytes) -> bytes:
    """The AES-256 key of block MACs, derived from the deployment secret (HKDF-SHA256)."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=b"kvtier-block-mac-v1", info=b"").derive(
        secret
    )


class BlockSealer:
    """Frames blocks as single values: authenticated (a ``secret``), encrypted per tenant
    (keys), or plain (``trusted``: the operator vouches for everyone who can write the pool).

    Thread-safe (AESGCM objects are stateless; the per-tenant cache is guarded).
    """

    def __init__(
        self,
        layout: KVLayout,
        master_key: bytes = b"",
        tenant_keys: Mapping[str, bytes] | None = None,
        *,
        secret: bytes = b"",
        trusted: bool = False,
    ) -> None:
        self.layout = layout
        self.block_bytes = layout.block_bytes
        self._fp = layout.fingerprint
        self._master = bytes(master_key)
        self._tenant_keys = dict(tenant_keys or {})
        for t, k in self._tenant_keys.items():
            if len(k) not in (16, 24, 32):
                raise ConfigError(f"tenant_keys[{t!r}]: AES key must be 16, 24 or 32 bytes")
        self._aeads: dict[str, AESGCM | None] = {}
        self._lock = threading.Lock()
        self._mac = (
            algorithms.AES(mac_key(bytes(secret))) if secret and not self.encrypted else None
        )
        self.trusted = bool(trusted)
        #: values that failed verification (foreign, torn, tampered, unauthenticated)
        self.rejected = 0

    @property
    def encrypted(self) -> bool:
        """True when blocks are encrypted (a master key or any tenant key is configured)."""
        return bool(self._master or self._tenant_keys)

    @property
    def authenticated(self) -> bool:
        """True when every block read is authenticated (encrypted, or MAC'd with a secret)."""
        return self.encrypted or self._mac is not None

    @property
    def in_place(self) -> bool:
        """True when a value is just ``header | payload`` (plain): a tier may then read or
        write the payload straight in the caller's buffer and verify it with
        ``verify_plain``."""
        return not self.authenticated

    @property
    def splits(self) -> bool:
        """True when a value is ``header | payload [| MAC trailer]`` with the payload as it is
        (plain or MAC'd, not encrypted): a tier may then move the payload straight from or into
        the caller's buffer, framing it with ``frame_parts`` and checking it with
        ``verify_parts``."""
        return not self.encrypted

    @property
    def trailer_bytes(self) -> int:
        """Bytes after the payload in a split value (the MAC's nonce and tag; 0 when plain)."""
        return MAC_TRAILER if self._mac is not None else 0

    def frame_parts(
        self, key: BlockKey, payload: Array, tenant: str, checksum: int
    ) -> tuple[bytes, bytes]:
        """The header and trailer of a split value around ``payload`` (contiguous, its xxh3
        ``checksum`` computed by the caller). Only for a sealer that ``splits``."""
        assert self.splits
        mac = self._mac is not None
        flags = codec.FLAG_MAC if mac else 0
        header = codec.pack_header(key, self._fp, self.block_bytes, checksum, flags)
        if not mac:
            return header, b""
        nonce = os.urandom(NONCE_BYTES)
        return header, nonce + self._tag(nonce, header, payload.data, tenant)

    def verify_parts(
        self,
        key: BlockKey,
        header: Array,
        payload: Array,
        trailer: Array,
        tenant: str,
        payload_checksum: int | None = None,
    ) -> bool:
        """Whether a split value read in place (``header``, ``payload`` in the caller's buffer,
        ``trailer``) is block ``key`` of ``tenant``: ``verify_plain`` for a plain sealer, the
        MAC for an authenticating one (``payload_checksum`` is then not needed). Counts what it
        rejects."""
        if self._mac is None:
            return self.verify_plain(key, header, payload, payload_checksum)
        hdr = codec.unpack_header(header)
        ok = (
            codec.header_matches(hdr, key, self._fp, self.block_bytes)
            and hdr is not None
            and hdr.flags == codec.FLAG_MAC
            and trailer.nbytes == MAC_TRAILER
        )
        if ok:
            raw = trailer.tobytes()
            tag = self._tag(raw[:NONCE_BYTES], header.data, payload.data, tenant)
            ok = hmac.compare_digest(tag, raw[NONCE_BYTES:])
        if not ok:
            self.reject()
        return ok

    @property
    def mode(self) -> str:
        """``"aes-gcm"``, ``"mac"`` or ``"trusted-unauthenticated"`` (``"none"`` unconfigured)."""
        if self.encrypted:
            return "aes-gcm"
        if self._mac is not None:
            return "mac"
        return "trusted-unauthenticated" if self.trusted else "none"

    @property
    def value_bytes(self) -> int:
        """Size of one sealed value."""
        extra = NONCE_BYTES + TAG_BYTES if self.authenticated else 0
        return codec.HEADER_BYTES + extra + self.block_bytes

    def _tag(self, nonce: bytes | memoryview, header: Any, payload: Any, tenant: str) -> bytes:
        """AES-GMAC of ``header || payload || tenant`` (no copy of the payload)."""
        assert self._mac is not None
        enc = Cipher(self._mac, modes.GCM(bytes(nonce))).encryptor()
        enc.authenticate_additional_data(header)
        enc.authenticate_additional_data(payload)
        enc.authenticate_additional_data(tenant.encode())
        enc.finalize()
        return bytes(enc.tag)

    def _aead(self, tenant: str) -> AESGCM | None:
        with self._lock:
            if tenant in self._aeads:
                return self._aeads[tenant]
            key = self._tenant_keys.get(tenant)
            if key is None and self._master:
                key = HKDF(
                    algorithm=hashes.SHA256(),
                    length=32,
                    salt=b"kvtier-tenant-key-v1",
                    info=tenant.encode(),
                ).derive(self._master)
            aead = AESGCM(key) if key is not None else None
            self._aeads[tenant] = aead
            return aead

    def seal(self, key: BlockKey, block: Array, tenant: str) -> memoryview | None:
        """One value holding ``block`` (any shape/strides, ``block_bytes`` bytes) for ``key``.

        A framed block (``codec.framed_empty``) gets its header (and MAC trailer) written into
        its room and is returned as is, without a copy: the value is valid while the caller's
        buffer is.

        ``None`` when encryption is configured but this tenant has no key (logged; the tier
        reports the put as ``False``).
        """
        n = self.block_bytes
        h = codec.HEADER_BYTES
        if not self.encrypted:
            mac = self._mac is not None
            flat = block.reshape(-1).view(np.uint8) if block.flags.c_contiguous else None
            full = codec.frame(flat) if flat is not None else None
            if flat is not None and full is not None:  # framed: header into its room, no copy
                value = full[: h + n + (MAC_TRAILER if mac else 0)]
                payload: Array = flat
                csum = codec.checksum(flat)
            else:
                value = np.empty(h + n + (MAC_TRAILER if mac else 0), np.uint8)
                payload = value[h : h + n]
                csum = codec.copy_in(payload, block)
            flags = codec.FLAG_MAC if mac else 0
            header = codec.pack_header(key, self._fp, n, csum, flags)
            value[:h] = np.frombuffer(header, np.uint8)
            if mac:
                nonce = os.urandom(NONCE_BYTES)
                value[h + n : h + n + NONCE_BYTES] = np.frombuffer(nonce, np.uint8)
                tag = self._tag(nonce, header, payload.data, tenant)
                value[h + n + NONCE_BYTES :] = np.frombuffer(tag, np.uint8)
            return value.data
        aead = self._aead(tenant)
        if aead is None:
            log.warning("no encryption key for tenant %r: block not stored", tenant)
            return None
        plain = np.ascontiguousarray(block).reshape(-1).view(np.uint8)
        header = codec.pack_header(key, self._fp, n, 0, codec.FLAG_ENCRYPTED)
        buf = bytearray(h + NONCE_BYTES + n + TAG_BYTES)
        nonce = os.urandom(NONCE_BYTES)
        buf[:h] = header
        buf[h : h + NONCE_BYTES] = nonce
        aead.encrypt_into(
            nonce, plain.data, header + tenant.encode(), memoryview(buf)[h + NONCE_BYTES :]
        )
        return memoryview(buf)

    def verify_plain(
        self,
        key: BlockKey,
        header: bytes | memoryview | Array,
        payload: Array,
        payload_checksum: int | None = None,
    ) -> bool:
        """Whether a plain block read *in place* -- its 64-byte ``header`` and its ``payload``
        already in the caller's contiguous buffer -- is block ``key``: header matches, no flags,
        checksum of ``payload`` matches (``payload_checksum`` if the caller hashed it already,
        e.g. a batch with ``codec.checksums``). Always ``False`` for an encrypting sealer (a
        plaintext block is then a miss). The zero-copy read path of tiers that can split a value.
        """
        if self.authenticated:
            return False
        hdr = codec.unpack_header(header)
        if not codec.header_matches(hdr, key, self._fp, self.block_bytes):
            self.reject()
            return False
        assert hdr is not None
        if payload_checksum is None:
            payload_checksum = codec.checksum(payload)
        ok = not hdr.flags and payload_checksum == hdr.checksum
        if not ok:
            self.reject()
        return ok

    def droppable(self, key: BlockKey, value: bytes | bytearray | memoryview) -> bool:
        """May a tier delete ``value``, read for block ``key``, after ``open_into`` rejected it?

        Yes for garbage, for a value whose header names another block (copied, or of another
        layout: no node writes one under this name), and for blocks whose payload fails its
        checksum (torn or corrupt: the
        header's xxh3 is kept in MAC'd blocks for this). No for a block that is intact but
        fails authentication: a MAC or GCM tag cannot tell tampering from a reader holding
        another secret (a misconfigured node), and such a node must not wipe the pool; the
        block stays a miss until it expires or is evicted. No for a plaintext block read by an
        authenticating sealer, for the same reason.
        """
        mv = memoryview(value)
        h, n = codec.HEADER_BYTES, self.block_bytes
        hdr = codec.unpack_header(mv[:h]) if len(mv) >= h else None
        if hdr is None or not codec.header_matches(hdr, key, self._fp, n):
            return True
        if hdr.flags == codec.FLAG_MAC and len(mv) == h + n + MAC_TRAILER:
            return codec.checksum(mv[h : h + n]) != hdr.checksum
        return not (self.authenticated or hdr.flags)

    def open_into(
        self, key: BlockKey, value: bytes | bytearray | memoryview, out: Array, tenant: str
    ) -> bool:
        """Verify ``value`` as block ``key`` of ``tenant`` and copy its payload into ``out``.

        ``False`` (a miss, counted in ``rejected``; ``out`` then holds unspecified bytes) for a
        foreign, torn, tampered, unauthenticated, wrong-tenant or wrong-key value. Never raises
        for bad data.
        """
        ok = self._open_into(key, value, out, tenant)
        if not ok:
            self.reject()
        return ok

    def reject(self) -> None:
        """Count one value that failed verification (a tier that rejects one itself)."""
        with self._lock:
            self.rejected += 1

    def _open_into(
        self, key: BlockKey, value: bytes | bytearray | memoryview, out: Array, tenant: str
    ) -> bool:
        mv = memoryview(value)
        h = codec.HEADER_BYTES
        n = self.block_bytes
        hdr = codec.unpack_header(mv[:h]) if len(mv) >= h else None
        if not codec.header_matches(hdr, key, self._fp, n):
            return False
        assert hdr is not None
        if hdr.flags == codec.FLAG_MAC:
            if self._mac is None or len(mv) != h + n + MAC_TRAILER:
                return False
            nonce = mv[h + n : h + n + NONCE_BYTES]
            tag = self._tag(nonce, mv[:h], mv[h : h + n], tenant)
            if not hmac.compare_digest(tag, mv[h + n + NONCE_BYTES :]):
                log.warning("block %s of tenant %r failed its MAC: miss", key[:8].hex(), tenant)
                return False
            codec.copy_plain(out, np.frombuffer(mv, np.uint8, n, h))  # the MAC checked it
            return True
        if not hdr.flags & codec.FLAG_ENCRYPTED:
            if self.authenticated or hdr.flags or len(mv) != h + n:
                return False
            return codec.copy_out(out, np.frombuffer(mv, np.uint8, n, h)) == hdr.checksum
        aead = self._aead(tenant) if self.encrypted else None
        if aead is None or len(mv) != h + NONCE_BYTES + n + TAG_BYTES:
            return False
        nonce = mv[h : h + NONCE_BYTES]
        aad = bytes(mv[:h]) + tenant.encode()
        direct = out.flags.c_contiguous and out.flags.writeable
        dst = out.reshape(-1).view(np.uint8) if direct else np.empty(n, np.uint8)
        try:
            aead.decrypt_into(nonce, mv[h + NONCE_BYTES :], aad, dst.data)
        except InvalidTag:
            log.warning("block %s of tenant %r failed authentication: miss", key[:8].hex(), tenant)
            return False
        if not direct:
            codec.copy_plain(out, dst)  # GCM checked it
        return True


class TenantQuotas:
    """Per-tenant byte budgets, accounted by this client. Thread-safe.

    ``default_bytes`` applies to every tenant without an entry in ``per_tenant``; 0 = no limit.
    """

    def __init__(
        self, default_bytes: int = 0, per_tenant: Mapping[str, int] | None = None, name: str = ""
    ) -> None:
        self.default_bytes = default_bytes
        self.per_tenant = dict(per_tenant or {})
        self.name = name
        self._used: dict[str, int] = {}
        self._refused: dict[str, int] = {}
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        return bool(self.default_bytes or any(self.per_tenant.values()))

    def limit(self, tenant: str) -> int:
        return self.per_tenant.get(tenant, self.default_bytes)

    def reserve(self, tenant: str, nbytes: int) -> bool:
        """Charge ``nbytes`` to ``tenant``; ``False`` (counted and logged) if over its quota."""
        with self._lock:
            used = self._used.get(tenant, 0)
            limit = self.limit(tenant)
            if limit and used + nbytes > limit:
                self._refused[tenant] = self._refused.get(tenant, 0) + 1
                count = self._refused[tenant]
            else:
                self._used[tenant] = used + nbytes
                return True
        log.warning(
            "%s: quota refusal #%d for tenant %r: %d + %d bytes exceeds its %d-byte quota",
            self.name,
            count,
            tenant,
            used,
            nbytes,
            limit,
        )
        return False

    def release(self, tenant: str, nbytes: int) -> None:
        """Refund ``nbytes`` (a block deleted, or a reserved put that did not store)."""
        with self._lock:
            self._used[tenant] = max(0, self._used.get(tenant, 0) - nbytes)

    def used(self, tenant: str) -> int:
        with self._lock:
            return self._used.get(tenant, 0)

    def refusals(self) -> dict[str, int]:
        """Refused puts per tenant since construction (a copy)."""
        with self._lock:
            return dict(self._refused)


def parse_secret(value: Any, what: str) -> bytes:
    """A deployment secret from config: a non-empty string or bytes (``None``: none)."""
    if value is None:
        return b""
    if isinstance(value, str | bytes) and value:
        return value.encode() if isinstance(value, str) else value
    raise ConfigError(f"{what}: expected a non-empty string, got {type(value).__name__}")


def require_authentication(sealer: BlockSealer, tier: str) -> None:
    """Refuse a shared tier whose blocks would be accepted unauthenticated, unless trusted.

    A trusted pool is logged at every start (and ``stats()`` shows its ``auth`` mode)."""
    if sealer.authenticated:
        return
    if not sealer.trusted:
        raise ConfigError(
            f"{tier}: blocks read from a shared pool must be authenticated, or anyone who can "
            "write to the pool can plant KV that this engine would serve; set a deployment "
            "secret ([store] secret = '...' or the tier's secret, the same on every node) or "
            "encryption (encryption_key), or, if every writer of the pool is trusted, say so "
            "with trust_pool = true"
        )
    log.warning("%s: trust_pool is set: blocks from the pool are NOT authenticated", tier)


def security_from_config(
    layout: KVLayout, spec: Mapping[str, Any], section: str
) -> tuple[BlockSealer, TenantQuotas]:
    """Build the sealer and quotas from the ``SECURITY_KEYS`` of a tier's config table.

    ``secret`` (the deployment secret that keys block MACs; the store passes its own to
    tiers built from its config), ``trust_pool`` (accept unauthenticated blocks),
    ``encryption_key`` (hex master key), ``tenant_keys`` ({tenant: hex AES key}), ``quota``
    (size per tenant, e.g. "10GiB"; 0 = none), ``tenant_quotas`` ({tenant: size}).
    """
    master = spec.get("encryption_key")
    tkeys = spec.get("tenant_keys") or {}
    if not isinstance(tkeys, Mapping):
        raise ConfigError(f"[{section}] tenant_keys must be a table {{tenant = 'hex key'}}")
    sealer = BlockSealer(
        layout,
        parse_key(master, f"[{section}] encryption_key") if master else b"",
        {str(t): parse_key(k, f"[{section}] tenant_keys.{t}") for t, k in tkeys.items()},
        secret=parse_secret(spec.get("secret"), f"[{section}] secret"),
        trusted=parse_bool(spec.get("trust_pool", False), f"[{section}] trust_pool"),
    )
    tq = spec.get("tenant_quotas") or {}
    if not isinstance(tq, Mapping):
        raise ConfigError(f"[{section}] tenant_quotas must be a table {{tenant = '1GiB'}}")
    quotas = TenantQuotas(
        parse_size(spec.get("quota", 0), f"[{section}] quota"),
        {str(t): parse_size(v, f"[{section}] tenant_quotas.{t}") for t, v in tq.items()},
        name=section,
    )
    return sealer, quotas


__all__ = [
    "SECURITY_KEYS",
    "BlockSealer",
    "TenantQuotas",
    "mac_key",
    "parse_key",
    "parse_secret",
    "require_authentication",
    "security_from_config",
    "tenant_token",
]
