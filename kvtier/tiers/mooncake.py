"""Mooncake Store tier (G3.5): a cluster memory pool shared by every node, over TCP or RDMA.

Built on the ``mooncake.store.MooncakeDistributedStore`` client of the PyPI wheel
``mooncake-transfer-engine-non-cuda``. kvtier runs no server: a ``mooncake_master`` keeps the
object metadata and each participating client mounts ``segment_size`` bytes of its DRAM into the
pool (a standalone ``mooncake_client`` can hold pool memory too).

Objects. Block ``k`` of tenant ``t`` is the object ``<prefix>/<tenant token>/<hex k>``; its value
is one sealed block (``kvtier.tiers.secure``): ``header(64) | payload``, or the AES-GCM framing
when encryption is configured. A read verifies header (key, layout fingerprint, length) and
checksum (or the GCM tag); anything else is a miss and the object is removed.

Data path. One batched call per ``put``/``get_into`` (``batch_put_from_multi_buffers`` /
``batch_get_into_multi_buffers``) and one ``batch_is_exist`` per ``contains_prefix`` -- a whole
prompt's prefix in one round trip. Plain blocks in C-contiguous caller buffers move zero-copy:
the payload goes straight from / into the caller's array and only the 64-byte header is staged
(its checksum is one xxh3 pass over the payload). Strided buffers and encrypted blocks go
through a staging arena registered with the transfer engine once, at construction (one fused
copy+checksum). Contiguous caller buffers are registered with the transfer engine for the
duration of each call (transfers from unregistered memory are markedly slower), unless they lie
in a long-lived buffer the owner registered once with ``register`` (a host arena, an engine's KV
pool): that saves the per-call registration, ~15% of a 4 MiB transfer over TCP.

Mooncake behaviours this tier is built around:

- ``put`` of an existing key keeps the old value: blocks are immutable under their
  content-addressed keys, so "already there" is success and nothing ever relies on overwrite.
- The pool evicts silently when full (and refuses puts until it has): misses and ``False``.
- A master restart without HA loses every key: misses, no exception; clients re-mount.
- A dead master costs one failed RPC (~4 s to reconnect), a hung one ``rpc_timeout_s``; then
  the circuit breaker skips the tier (``healthy`` False, all misses) and lets one trial call
  through every ``cooldown_s``.
- Objects carry a lease (default 10 s) after each put/get, so ``delete`` removes with ``force``;
  a reader racing a forced removal can only see bytes that fail verification (a miss).

``usage()`` counts the blocks *this client* wrote that are still present (one batched existence
query); the pool's capacity is the cluster's business, so ``capacity_blocks`` is 0.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from kvtier import codec
from kvtier.config import check_keys, parse_size
from kvtier.errors import ConfigError
from kvtier.keys import BlockKey
from kvtier.layout import KVLayout
from kvtier.tiers.base import Array, Tier, TierUsage
from kvtier.tiers.breaker import CircuitBreaker
from kvtier.tiers.secure import (
    SECURITY_KEYS,
    BlockSealer,
    TenantQuotas,
    security_from_config,
    tenant_token,
)

log = logging.getLogger(__name__)

# Mooncake error codes (mooncake-store ErrorCode) the tier tells apart.
OBJECT_NOT_FOUND = -704
BUFFER_TOO_SMALL = -600  # the stored object is larger than our buffers: foreign
TRANSFER_FAIL = -800
RPC_FAIL = -900  # master unreachable
RPC_TIMEOUT = -901  # master hung or overloaded past rpc_timeout_s
NO_SPACE = -200
OBJECT_HAS_LEASE = -706
LEASE_EXPIRED = -707
_EXPECTED = frozenset(
    {OBJECT_NOT_FOUND, BUFFER_TOO_SMALL, TRANSFER_FAIL, NO_SPACE, OBJECT_HAS_LEASE, LEASE_EXPIRED}
)
_TRACK_MAX = 1 << 20
_ENV_LOCK = threading.Lock()  # keys remembered for usage(); the oldest are forgotten beyond this


class _ServerDown(Exception):
    """Raised inside a breaker-guarded call when the master is unreachable."""


class _Staging:
    """A registered arena of fixed-size slots (header + sealed value), handed out per call."""

    def __init__(self, slot_bytes: int, nslots: int) -> None:
        self.slot_bytes = slot_bytes
        self.arena: Array = np.zeros(slot_bytes * nslots, dtype=np.uint8)
        self.base = int(self.arena.ctypes.data)
        self._free = list(range(nslots))
        self._cond = threading.Condition()

    def acquire(self, want: int) -> list[int]:
        """Between 1 and ``want`` free slots (waits for one if none is free)."""
        with self._cond:
            while not self._free:
                self._cond.wait()
            n = min(want, len(self._free))
            taken, self._free = self._free[:n], self._free[n:]
            return taken

    def release(self, slots: list[int]) -> None:
        with self._cond:
            self._free.extend(slots)
            self._cond.notify_all()

    def view(self, slot: int, nbytes: int) -> Array:
        off = slot * self.slot_bytes
        return self.arena[off : off + nbytes]

    def ptr(self, slot: int) -> int:
        return self.base + slot * self.slot_bytes


def package_binary(name: str) -> Path | None:
    """A binary shipped in the ``mooncake`` package (``mooncake_master``, ``mooncake_client``)."""
    spec = importlib.util.find_spec("mooncake")
    for loc in (spec.submodule_search_locations or []) if spec is not None else []:
        p = Path(loc) / name
        if p.is_file():
            return p
    return None


def _flat(a: Array) -> Array | None:
    """A flat uint8 view of ``a`` if it is C-contiguous (zero-copy capable), else None."""
    if not a.flags.c_contiguous:
        return None
    return a.reshape(-1).view(np.uint8)


class MooncakeTier(Tier):
    """Blocks in a Mooncake Store pool; see the module docstring. Thread-safe."""

    name = "mooncake"
    shared = True
    persistent = False
    verifies_checksums = True

    def __init__(
        self,
        layout: KVLayout,
        master: str,
        *,
        metadata_server: str = "P2PHANDSHAKE",
        local_hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        rdma_devices: str = "",
        segment_size: int = 1 << 30,
        buffer_size: int = 64 << 20,
        prefix: str = "kvtier",
        replicas: int = 1,
        cooldown_s: float = 5.0,
        rpc_timeout_s: float = 5.0,
        sealer: BlockSealer | None = None,
        quotas: TenantQuotas | None = None,
    ) -> None:
        super().__init__(layout)
        if protocol not in ("tcp", "rdma"):
            raise ConfigError(f"mooncake tier protocol must be 'tcp' or 'rdma', got {protocol!r}")
        if replicas < 1:
            raise ConfigError(f"mooncake tier replicas must be >= 1, got {replicas}")
        self.master = master
        self.replicas = replicas
        self.rpc_timeout_s = rpc_timeout_s
        self.prefix = prefix.strip("/") or "kvtier"
        self._setup_args = (
            local_hostname,
            metadata_server,
            segment_size,
            buffer_size,
            protocol,
            rdma_devices,
            master,
        )
        self._sealer = sealer or BlockSealer(layout)
        self._quotas = quotas or TenantQuotas(name="mooncake")
        self._value_bytes = self._sealer.value_bytes
        slot_bytes = -(-self._value_bytes // 64) * 64
        self._staging = _Staging(slot_bytes, max(2, buffer_size // slot_bytes))
        self.breaker = CircuitBreaker(f"mooncake tier ({master})", cooldown_s)
        self._lock = threading.Lock()
        self._written: dict[tuple[str, BlockKey], None] = {}
        self._pinned: dict[int, int] = {}  # buffers registered by register(): ptr -> bytes
        self._closed = False
        self._client: Any = None
        self._replicate: Any = None
        self._connect()

    @classmethod
    def from_config(cls, layout: KVLayout, spec: Mapping[str, Any]) -> MooncakeTier:
        """``{"master": "host:port", "protocol": "tcp"|"rdma", "segment_size": "1GiB", ...}``.

        Also ``metadata_server`` (default "P2PHANDSHAKE"), ``local_hostname`` (this node's
        address as other nodes reach it), ``rdma_devices``, ``buffer_size`` (staging arena),
        ``prefix``, ``replicas``, ``cooldown_s``, ``rpc_timeout_s`` (a hung master costs this
        much per call; a dead one ~4 s, the client's connect timeout) and the security keys of
        ``tiers.secure``.
        """
        section = "tiers.mooncake"
        allowed = {
            "master",
            "metadata_server",
            "local_hostname",
            "protocol",
            "rdma_devices",
            "segment_size",
            "buffer_size",
            "prefix",
            "replicas",
            "cooldown_s",
        } | SECURITY_KEYS
        check_keys(section, spec, allowed)
        if "master" not in spec:
            raise ConfigError(f'[{section}] needs master = "host:port" of mooncake_master')
        sealer, quotas = security_from_config(layout, spec, section)
        return cls(
            layout,
            str(spec["master"]),
            metadata_server=str(spec.get("metadata_server", "P2PHANDSHAKE")),
            local_hostname=str(spec.get("local_hostname", "127.0.0.1")),
            protocol=str(spec.get("protocol", "tcp")),
            rdma_devices=str(spec.get("rdma_devices", "")),
            segment_size=parse_size(spec.get("segment_size", "1GiB"), f"{section} segment_size"),
            buffer_size=parse_size(spec.get("buffer_size", "64MiB"), f"{section} buffer_size"),
            prefix=str(spec.get("prefix", "kvtier")),
            replicas=int(spec.get("replicas", 1)),
            cooldown_s=float(spec.get("cooldown_s", 5.0)),
            rpc_timeout_s=float(spec.get("rpc_timeout_s", 5.0)),
            sealer=sealer,
            quotas=quotas,
        )

    # -- connection --------------------------------------------------------------------------
    def _connect(self) -> None:
        """Create and set up the client; on failure the breaker opens and a later call retries."""
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # the client logs every call at INFO
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")  # else ~20 x 4 s when down
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        with _ENV_LOCK:  # the client reads its RPC timeout from the environment at setup
            os.environ["MC_RPC_TIMEOUT_MS"] = str(max(1, int(self.rpc_timeout_s * 1000)))
            client = MooncakeDistributedStore()
            rc = client.setup(*self._setup_args)
        if rc != 0:
            client.close()
            self.breaker.failed(_ServerDown(f"setup with master {self.master} returned {rc}"))
            return
        if client.register_buffer(self._staging.base, self._staging.arena.nbytes) != 0:
            client.close()
            raise ConfigError("mooncake tier: the transfer engine refused the staging buffer")
        cfg = ReplicateConfig()
        cfg.replica_num = self.replicas
        self._replicate = cfg
        self._client = client

    def _ready(self) -> Any:
        """The set-up client (connecting now if an earlier setup failed), or raise _ServerDown."""
        if self._closed:
            raise _ServerDown("tier closed")
        if self._client is None:
            with self._lock:
                if self._client is None:
                    self._connect()
            if self._client is None:
                raise _ServerDown(f"no connection to master {self.master}")
        return self._client

    def _check_down(self, codes: Sequence[int]) -> None:
        """Raise _ServerDown if a code is an unexpected error and the master is unreachable.

        Expected outcomes (not found, no space, leases, a foreign size) never cost a ping.
        """
        odd = [c for c in codes if c < 0 and c not in _EXPECTED]
        # health_check() reflects the client's last heartbeat, so it can still say 0 right
        # after the master died; an RPC failure or timeout is taken at its word.
        if odd and (RPC_FAIL in odd or RPC_TIMEOUT in odd or self._client.health_check() != 0):
            raise _ServerDown(f"master {self.master} unreachable (codes {sorted(set(odd))})")

    def _names(self, keys: Sequence[BlockKey], tenant: str) -> list[str]:
        base = f"{self.prefix}/{tenant_token(tenant)}/"
        return [base + k.hex() for k in keys]

    def register(self, buf: Array) -> bool:
        """Register a long-lived buffer (a host arena, an engine's KV pool) with the transfer
        engine until ``unregister``/``close``. Blocks inside it then move without the per-call
        registration (which costs ~15% of a 4 MiB transfer over TCP). ``False`` if refused.

        The caller keeps ``buf`` alive while it is registered.
        """
        ptr, n = int(buf.ctypes.data), int(buf.nbytes)
        client = self._client
        if client is None or n == 0 or client.register_buffer(ptr, n) != 0:
            return False
        with self._lock:
            self._pinned[ptr] = n
        return True

    def unregister(self, buf: Array) -> None:
        """Undo ``register`` (idempotent)."""
        ptr = int(buf.ctypes.data)
        with self._lock:
            known = self._pinned.pop(ptr, None) is not None
        if known and self._client is not None:
            self._client.unregister_buffer(ptr)

    def _register_for_call(self, client: Any, ptr: int, n: int, registered: list[int]) -> None:
        """Register ``[ptr, ptr+n)`` for one call unless a ``register``ed buffer covers it."""
        with self._lock:
            if any(p <= ptr and ptr + n <= p + size for p, size in self._pinned.items()):
                return
        if client.register_buffer(ptr, n) == 0:
            registered.append(ptr)

    @property
    def client(self) -> Any:
        """The underlying ``MooncakeDistributedStore`` (None while not connected); for tools."""
        return self._client

    @property
    def value_bytes(self) -> int:
        """Size of one stored object (header + payload, + nonce and tag when encrypted)."""
        return self._value_bytes

    # -- queries -----------------------------------------------------------------------------
    @property
    def capacity_blocks(self) -> int:
        return 0

    @property
    def healthy(self) -> bool:
        return self._client is not None and self.breaker.healthy

    def _forget(self, tenant: str, keys: Sequence[BlockKey]) -> None:
        """Drop written-key records (deleted or evicted blocks) and refund their quota."""
        with self._lock:
            gone = sum(1 for k in keys if (tenant, k) in self._written)
            for k in keys:
                self._written.pop((tenant, k), None)
        for _ in range(gone):
            self._quotas.release(tenant, self.block_bytes)

    def usage(self) -> TierUsage:
        """Blocks this client wrote that are still in the pool (one batched existence query).

        Blocks found evicted are forgotten and their quota refunded.
        """
        with self._lock:
            items = list(self._written)
        present = 0
        if items:
            by_tenant: dict[str, list[BlockKey]] = {}
            for t, k in items:
                by_tenant.setdefault(t, []).append(k)

            def count() -> int:
                client = self._ready()
                n = 0
                for t, ks in by_tenant.items():
                    codes = client.batch_is_exist(self._names(ks, t))
                    self._check_down(codes)
                    n += sum(1 for c in codes if c == 1)
                    self._forget(t, [k for k, c in zip(ks, codes, strict=True) if c == 0])
                return n

            present = self.breaker.call(count, 0, (_ServerDown,))
        return TierUsage(present, 0, self.block_bytes)

    def contains_prefix(self, keys: Sequence[BlockKey], tenant: str = "") -> int:
        if not keys:
            return 0

        def query() -> int:
            codes = self._ready().batch_is_exist(self._names(keys, tenant))
            self._check_down(codes)
            n = 0
            for c in codes:
                if c != 1:
                    break
                n += 1
            return n

        return self.breaker.call(query, 0, (_ServerDown,))

    # -- data --------------------------------------------------------------------------------
    def put(
        self, keys: Sequence[BlockKey], blocks: Sequence[Array], tenant: str = ""
    ) -> list[bool]:
        self.check_buffers(blocks, keys)
        result = [False] * len(keys)
        with self._lock:
            known = {i for i, k in enumerate(keys) if (tenant, k) in self._written}
        todo = [
            i
            for i in range(len(keys))
            if i in known or self._quotas.reserve(tenant, self.block_bytes)
        ]
        done: set[int] = set()
        pending = todo
        try:
            while pending:
                slots = self._staging.acquire(len(pending))
                chunk, pending = pending[: len(slots)], pending[len(slots) :]
                try:
                    oks = self.breaker.call(
                        partial(self._put_chunk, keys, blocks, chunk, slots, tenant),
                        [False] * len(chunk),
                        (_ServerDown,),
                    )
                finally:
                    self._staging.release(slots)
                for i, ok in zip(chunk, oks, strict=True):
                    result[i] = ok
                    if ok:
                        done.add(i)
        finally:
            for i in todo:
                if i not in done and i not in known:
                    self._quotas.release(tenant, self.block_bytes)
        if done:
            with self._lock:
                for i in done:
                    self._written[(tenant, keys[i])] = None
                while len(self._written) > _TRACK_MAX:
                    del self._written[next(iter(self._written))]
        return result

    def _put_chunk(
        self,
        keys: Sequence[BlockKey],
        blocks: Sequence[Array],
        idx: list[int],
        slots: list[int],
        tenant: str,
    ) -> list[bool]:
        client = self._ready()
        st = self._staging
        h = codec.HEADER_BYTES
        fp = self.layout.fingerprint
        n = self.block_bytes
        ptrs: list[list[int]] = []
        sizes: list[list[int]] = []
        registered: list[int] = []
        ok = [True] * len(idx)
        try:
            for j, (i, slot) in enumerate(zip(idx, slots, strict=True)):
                key, block = keys[i], blocks[i]
                flat = None if self._sealer.encrypted else _flat(block)
                if flat is not None:  # zero-copy: header staged, payload from the caller
                    hdr = codec.pack_header(key, fp, n, codec.checksum(flat))
                    st.view(slot, h)[:] = np.frombuffer(hdr, np.uint8)
                    ptr = int(flat.ctypes.data)
                    self._register_for_call(client, ptr, n, registered)
                    ptrs.append([st.ptr(slot), ptr])
                    sizes.append([h, n])
                    continue
                value = self._sealer.seal(key, block, tenant)
                if value is None:
                    ok[j] = False
                    ptrs.append([st.ptr(slot)])
                    sizes.append([0])
                    continue
                st.view(slot, len(value))[:] = np.frombuffer(value, np.uint8)
                ptrs.append([st.ptr(slot)])
                sizes.append([len(value)])
            live = [j for j in range(len(idx)) if ok[j]]
            if not live:
                return ok
            names = self._names([keys[idx[j]] for j in live], tenant)
            codes = client.batch_put_from_multi_buffers(
                names, [ptrs[j] for j in live], [sizes[j] for j in live], self._replicate
            )
        finally:
            for ptr in registered:
                client.unregister_buffer(ptr)
        self._check_down(codes)
        for j, c in zip(live, codes, strict=True):
            ok[j] = c == 0
        return ok

    def get_into(
        self, keys: Sequence[BlockKey], outs: Sequence[Array], tenant: str = ""
    ) -> list[bool]:
        self.check_buffers(outs, keys)
        result = [False] * len(keys)
        pending = list(range(len(keys)))
        while pending:
            slots = self._staging.acquire(len(pending))
            chunk, pending = pending[: len(slots)], pending[len(slots) :]
            try:
                oks = self.breaker.call(
                    partial(self._get_chunk, keys, outs, chunk, slots, tenant),
                    [False] * len(chunk),
                    (_ServerDown,),
                )
            finally:
                self._staging.release(slots)
            for i, ok in zip(chunk, oks, strict=True):
                result[i] = ok
        return result

    def _get_chunk(
        self,
        keys: Sequence[BlockKey],
        outs: Sequence[Array],
        idx: list[int],
        slots: list[int],
        tenant: str,
    ) -> list[bool]:
        client = self._ready()
        st = self._staging
        h = codec.HEADER_BYTES
        n = self.block_bytes
        fp = self.layout.fingerprint
        ptrs: list[list[int]] = []
        sizes: list[list[int]] = []
        direct: list[Array | None] = []
        registered: list[int] = []
        for i, slot in zip(idx, slots, strict=True):
            out = outs[i]
            flat = None
            if not self._sealer.encrypted and out.flags.writeable:
                flat = _flat(out)
            direct.append(flat)
            if flat is not None:
                ptr = int(flat.ctypes.data)
                self._register_for_call(client, ptr, n, registered)
                ptrs.append([st.ptr(slot), ptr])
                sizes.append([h, n])
            else:
                ptrs.append([st.ptr(slot)])
                sizes.append([self._value_bytes])
        names = self._names([keys[i] for i in idx], tenant)
        try:
            codes = client.batch_get_into_multi_buffers(names, ptrs, sizes)
        finally:
            for ptr in registered:
                client.unregister_buffer(ptr)
        self._check_down(codes)
        ok = [False] * len(idx)
        bad: list[str] = []
        for j, (i, slot, code) in enumerate(zip(idx, slots, codes, strict=True)):
            key = keys[i]
            if code != self._value_bytes:
                if self._foreign_size(client, names[j], code):
                    bad.append(names[j])
                continue
            flat = direct[j]
            if flat is not None:
                hdr = codec.unpack_header(st.view(slot, h))
                good = (
                    codec.header_matches(hdr, key, fp, n)
                    and hdr is not None
                    and not hdr.flags
                    and codec.checksum(flat) == hdr.checksum
                )
            else:
                good = self._sealer.open_into(
                    key, st.view(slot, self._value_bytes).data, outs[i], tenant
                )
            if good:
                ok[j] = True
            else:
                log.warning("mooncake tier: block %s failed verification, removing", key[:8].hex())
                bad.append(names[j])
        if bad:
            client.batch_remove(bad, True)
        return ok

    def _foreign_size(self, client: Any, name: str, code: int) -> bool:
        """Whether a failed read found an object of the wrong size (a value kvtier never wrote).

        Too large reads as ``BUFFER_TOO_SMALL``; too small fails the transfer, which a lost
        segment also does, so only then is the size asked for (off the hot path).
        """
        if code >= 0 or code == BUFFER_TOO_SMALL:
            return True
        if code == TRANSFER_FAIL:
            size = int(client.get_size(name))
            return size >= 0 and size != self._value_bytes
        return False

    def delete(self, keys: Sequence[BlockKey], tenant: str = "") -> None:
        if not keys:
            return

        def remove() -> None:
            codes = self._ready().batch_remove(self._names(keys, tenant), True)
            self._check_down(codes)

        self.breaker.call(remove, None, (_ServerDown,))
        self._forget(tenant, keys)

    def close(self) -> None:
        """Close the client (its mounted segment leaves the pool with it). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            for ptr in [self._staging.base, *self._pinned]:
                client.unregister_buffer(ptr)
            self._pinned.clear()
            client.close()
