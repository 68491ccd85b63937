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
pool): that saves the per-call registration, ~15% of a 4 MiB transfer over TCP. Connection
setup, the client's lending and closing (``MasterLink``), the ``Prober``, master-address checks
and error codes live in ``kvtier.tiers.mooncake_engine``; the arena, registrations and each
batch's buffer lists in ``kvtier.tiers.mooncake_memory``.

Mooncake behaviours this tier is built around:

- ``put`` of an existing key keeps the old value: blocks are immutable under their
  content-addressed keys, so "already there" is success and nothing ever relies on overwrite.
- The pool evicts silently when full (and refuses puts until it has): misses and ``False``.
- A master restart without HA loses every key: misses, no exception; clients re-mount.
- An outage costs one caller one failed call: at once for a dead master (its connection is
  reset), ``rpc_timeout_s`` for a hung one. From then on every call is a miss at once
  (``healthy`` False) while a background ``Prober`` checks every ``cooldown_s`` (0.1 s at
  the least) -- a TCP connect, then one existence query -- and puts the tier back when the
  master answers. The client's own reconnect (~4 s per call against a dead master, whatever
  ``rpc_timeout_s`` says) so runs on the prober's thread, not a caller's. The prober also sets
  the client up: construction waits at most ``rpc_timeout_s`` for it, and not at all for a
  master that refuses connections.
- Per-key outcomes (not found, no space, a lease, a foreign size, a refused key) are that
  key's miss; only an unreachable master takes the tier out of service.
- Closing the client under a transfer crashes the process: ``close`` waits for the calls in
  flight (later ones are misses). The client's close against a master that does not answer
  takes ~4-20 s holding the GIL: such a client is closed on a daemon thread once the master
  answers again, so that ``close`` returns within ~``rpc_timeout_s`` and stalls no thread.
- Objects carry a lease (default 10 s) after each put/get, so ``delete`` removes with ``force``;
  a reader racing a forced removal can only see bytes that fail verification (a miss).

``usage()`` counts the blocks *this client* wrote that are still present (one batched existence
query); the pool's capacity is the cluster's business, so ``capacity_blocks`` is 0.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, TypeVar

import numpy as np

from kvtier import codec
from kvtier.config import parse_float, parse_int, parse_size
from kvtier.errors import ConfigError
from kvtier.keys import BlockKey
from kvtier.layout import KVLayout
from kvtier.tiers.base import Array, TierUsage
from kvtier.tiers.mooncake_engine import (
    MasterLink,
    ServerDown,
    check_down,
    foreign_size,
    master_endpoint,
    package_binary,
)
from kvtier.tiers.mooncake_memory import BatchBuffers, Registrations, StagingArena
from kvtier.tiers.remote import RemoteTier, flat_bytes
from kvtier.tiers.secure import BlockSealer, TenantQuotas, tenant_token

log = logging.getLogger(__name__)

T = TypeVar("T")
_TRACK_MAX = 1 << 20  # keys remembered for usage(); the oldest are forgotten beyond this
__all__ = ["MooncakeTier", "package_binary"]


class MooncakeTier(RemoteTier):
    """Blocks in a Mooncake Store pool; see the module docstring. Thread-safe."""

    name = "mooncake"
    errors = (ServerDown,)

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
        secret: bytes = b"",
        trust_pool: bool = False,
    ) -> None:
        super().__init__(
            layout,
            breaker_name=f"mooncake tier ({master})",
            cooldown_s=cooldown_s,
            sealer=sealer,
            quotas=quotas,
            secret=secret,
            trust_pool=trust_pool,
        )
        if protocol not in ("tcp", "rdma"):
            raise ConfigError(f"mooncake tier protocol must be 'tcp' or 'rdma', got {protocol!r}")
        if replicas < 1:
            raise ConfigError(f"mooncake tier replicas must be >= 1, got {replicas}")
        master_endpoint(master)  # a ConfigError before anything is allocated
        self.require_authentication()
        self.master = master
        self.replicas = replicas
        self.rpc_timeout_s = rpc_timeout_s
        self.prefix = prefix.strip("/") or "kvtier"
        setup_args = (
            local_hostname,
            metadata_server,
            segment_size,
            buffer_size,
            protocol,
            rdma_devices,
            master,
        )
        slot_bytes = -(-self.value_bytes // 64) * 64
        self._staging = StagingArena(slot_bytes, max(2, buffer_size // slot_bytes))
        self._regs = Registrations()
        self._lock = threading.Lock()
        self._written: dict[tuple[str, BlockKey], None] = {}
        self._link = MasterLink(
            master,
            setup_args,
            rpc_timeout_s,
            f"{self.prefix}/.probe",
            self._staging,
            self._regs,
            replicas,
            self.breaker,
        )
        self._link.start()

    @classmethod
    def from_config(cls, layout: KVLayout, spec: Mapping[str, Any]) -> MooncakeTier:
        """``{"master": "host:port", "protocol": "tcp"|"rdma", "segment_size": "1GiB", ...}``.

        Also ``metadata_server`` (default "P2PHANDSHAKE"), ``local_hostname`` (this node's
        address as other nodes reach it), ``rdma_devices``, ``buffer_size`` (staging arena),
        ``prefix``, ``replicas``, ``cooldown_s`` (how often an unreachable master is checked,
        off the callers' threads), ``rpc_timeout_s`` (what a hung master costs the one call that
        finds out) and the security keys of ``tiers.secure``. A ``master`` that is no
        ``host:port`` is a ``ConfigError``; one that is down is an outage (misses).
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
            "rpc_timeout_s",
        }
        sealer, quotas = cls.security_section(layout, spec, section, allowed)
        if "master" not in spec:
            raise ConfigError(f'[{section}] needs master = "host:port" of mooncake_master')
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
            replicas=parse_int(spec.get("replicas", 1), f"{section} replicas", 1),
            cooldown_s=parse_float(spec.get("cooldown_s", 5.0), f"{section} cooldown_s"),
            rpc_timeout_s=parse_float(spec.get("rpc_timeout_s", 5.0), f"{section} rpc_timeout_s"),
            sealer=sealer,
            quotas=quotas,
        )

    # -- connection --------------------------------------------------------------------------
    def _ready(self) -> Any:
        """The set-up client (unlent: for tests and tools), or raise ServerDown."""
        client = self._link.client
        if client is None:
            raise ServerDown(f"no connection to master {self.master}")
        return client

    def guard(self, fn: Callable[[], T], fallback: T) -> T:
        """``fn()``, or ``fallback`` at once while the master is known to be unreachable, or
        after ``close``. A call that finds it unreachable (``ServerDown``) is ``fallback`` too
        and hands recovery to the prober; no caller makes a trial call. (The tier's own calls
        use ``MasterLink.call``, which lends ``fn`` the client.)"""
        return self._link.call(lambda _client: fn(), fallback)

    def _names(self, keys: Sequence[BlockKey], tenant: str) -> list[str]:
        base = f"{self.prefix}/{tenant_token(tenant)}/"
        return [base + k.hex() for k in keys]

    def register(self, buf: Array) -> bool:
        """Register a long-lived buffer (a host arena, an engine's KV pool) with the transfer
        engine until ``unregister``/``close``. Blocks inside it then move without the per-call
        registration (which costs ~15% of a 4 MiB transfer over TCP). ``False`` if refused, or
        while the client is not set up yet (the master was down at construction).

        The caller keeps ``buf`` alive while it is registered.
        """
        with self._link.lend() as client:
            return self._regs.pin(client, buf)

    def unregister(self, buf: Array) -> None:
        """Undo ``register`` (idempotent)."""
        with self._link.lend() as client:
            self._regs.unpin(client, buf)

    @property
    def client(self) -> Any:
        """The underlying ``MooncakeDistributedStore`` (None while not connected); for tools."""
        return self._link.client

    # -- queries -----------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        """True while the master answers (set up, and the last call reached it)."""
        return self._link.prober.up.is_set()

    @property
    def skipped(self) -> int:
        """Calls answered with a miss without touching the master (it was unreachable)."""
        return self._link.prober.skipped

    def _forget(self, tenant: str, keys: Sequence[BlockKey]) -> None:
        """Drop written-key records (deleted or evicted blocks) and refund their quota."""
        with self._lock:
            gone = sum(1 for k in keys if self._written.pop((tenant, k), 0) is None)
        self.refund(tenant, gone)

    def usage(self) -> TierUsage:
        """Blocks this client wrote that are still in the pool (one batched existence query).

        Blocks found evicted are forgotten and their quota refunded.
        """
        by_tenant: dict[str, list[BlockKey]] = {}
        with self._lock:
            for t, k in self._written:
                by_tenant.setdefault(t, []).append(k)

        def count(client: Any) -> int:
            n = 0
            for t, ks in by_tenant.items():
                codes = client.batch_is_exist(self._names(ks, t))
                check_down(client, codes, self.master)
                n += sum(1 for c in codes if c == 1)
                self._forget(t, [k for k, c in zip(ks, codes, strict=True) if c == 0])
            return n

        present = self._link.call(count, 0) if by_tenant else 0
        return TierUsage(present, 0, self.block_bytes)

    def contains_prefix(self, keys: Sequence[BlockKey], tenant: str = "") -> int:
        if not keys:
            return 0

        def query(client: Any) -> int:
            codes = client.batch_is_exist(self._names(keys, tenant))
            check_down(client, codes, self.master)
            return next((i for i, c in enumerate(codes) if c != 1), len(codes))

        return self._link.call(query, 0)

    # -- data --------------------------------------------------------------------------------
    def _staged(
        self, idx: list[int], chunk_fn: Callable[[list[int], list[int], Any], list[bool]]
    ) -> dict[int, bool]:
        """Run ``chunk_fn(chunk, slots, client)`` over ``idx`` in chunks as large as the free
        staging slots allow, each a ``MasterLink.call``; every index's result (``False`` if
        skipped)."""
        result: dict[int, bool] = {}
        pending = idx
        while pending:
            slots = self._staging.acquire(len(pending))
            chunk, pending = pending[: len(slots)], pending[len(slots) :]
            try:
                oks = self._link.call(partial(chunk_fn, chunk, slots), [False] * len(chunk))
            finally:
                self._staging.release(slots)
            result.update(zip(chunk, oks, strict=True))
        return result

    def put(
        self, keys: Sequence[BlockKey], blocks: Sequence[Array], tenant: str = ""
    ) -> list[bool]:
        self.check_buffers(blocks, keys)
        with self._lock:
            known = {i for i, k in enumerate(keys) if (tenant, k) in self._written}
        todo = [i for i in range(len(keys)) if i in known or self.reserve(tenant)]
        done: set[int] = set()
        try:
            oks = self._staged(todo, partial(self._put_chunk, keys, blocks, tenant))
            done = {i for i, ok in oks.items() if ok}
        finally:
            self.refund(tenant, sum(1 for i in todo if i not in done and i not in known))
        if done:
            with self._lock:
                for i in done:
                    self._written[(tenant, keys[i])] = None
                while len(self._written) > _TRACK_MAX:
                    del self._written[next(iter(self._written))]
        return [i in done for i in range(len(keys))]

    def _put_chunk(
        self,
        keys: Sequence[BlockKey],
        blocks: Sequence[Array],
        tenant: str,
        idx: list[int],
        slots: list[int],
        client: Any,
    ) -> list[bool]:
        st = self._staging
        n = self.block_bytes
        batch = BatchBuffers(client, self._regs, st, n)
        ok = [True] * len(idx)
        sealer = self.sealer
        flats = [flat_bytes(blocks[i]) if sealer.splits else None for i in idx]
        plain = [f for f in flats if f is not None]
        sums = iter(codec.checksums(plain))  # in the order of ``plain``
        try:
            for j, (i, slot) in enumerate(zip(idx, slots, strict=True)):
                key, block = keys[i], blocks[i]
                flat = flats[j]
                if flat is not None:  # zero-copy: the payload moves from the caller's buffer
                    header, trailer = batch.in_place(flat, slot, sealer.trailer_bytes)
                    head, tail = sealer.frame_parts(key, flat, tenant, next(sums))
                    header[:] = np.frombuffer(head, np.uint8)
                    trailer[:] = np.frombuffer(tail, np.uint8)
                    continue
                value = self.sealer.seal(key, block, tenant)
                if value is None:
                    ok[j] = False
                    batch.staged(slot, 0)
                    continue
                st.view(slot, len(value))[:] = np.frombuffer(value, np.uint8)
                batch.staged(slot, len(value))
            live = [j for j in range(len(idx)) if ok[j]]
            if not live:
                return ok
            names = self._names([keys[idx[j]] for j in live], tenant)
            codes = client.batch_put_from_multi_buffers(
                names,
                [batch.ptrs[j] for j in live],
                [batch.sizes[j] for j in live],
                self._link.replicate,
            )
        finally:
            batch.release()
        check_down(client, codes, self.master)
        for j, c in zip(live, codes, strict=True):
            ok[j] = c == 0
        return ok

    def get_into(
        self, keys: Sequence[BlockKey], outs: Sequence[Array], tenant: str = ""
    ) -> list[bool]:
        self.check_buffers(outs, keys)
        oks = self._staged(list(range(len(keys))), partial(self._get_chunk, keys, outs, tenant))
        return [oks[i] for i in range(len(keys))]

    def _get_chunk(
        self,
        keys: Sequence[BlockKey],
        outs: Sequence[Array],
        tenant: str,
        idx: list[int],
        slots: list[int],
        client: Any,
    ) -> list[bool]:
        st = self._staging
        value_bytes = self.value_bytes
        batch = BatchBuffers(client, self._regs, st, self.block_bytes)
        sealer = self.sealer
        direct: list[Array | None] = []
        frames: list[tuple[Array, Array] | None] = []  # where each direct read's header lands
        for i, slot in zip(idx, slots, strict=True):
            out = outs[i]
            flat = None
            if sealer.splits and out.flags.writeable:
                flat = flat_bytes(out)
            direct.append(flat)
            if flat is not None:
                frames.append(batch.in_place(flat, slot, sealer.trailer_bytes))
            else:
                batch.staged(slot, value_bytes)
                frames.append(None)
        names = self._names([keys[i] for i in idx], tenant)
        try:
            codes = client.batch_get_into_multi_buffers(names, batch.ptrs, batch.sizes)
        finally:
            batch.release()
        check_down(client, codes, self.master)
        ok = [False] * len(idx)
        bad: list[str] = []
        # payloads read in place are hashed together (in parallel when the batch is large)
        arrived = {j: d for j, d in enumerate(direct) if d is not None and codes[j] == value_bytes}
        if sealer.trailer_bytes:  # the MAC is the pass over the payload
            sums: dict[int, int | None] = dict.fromkeys(arrived)
        else:
            sums = dict(zip(arrived, codec.checksums(list(arrived.values())), strict=True))
        for j, (i, slot, code) in enumerate(zip(idx, slots, codes, strict=True)):
            key = keys[i]
            if code != value_bytes:
                if foreign_size(client, names[j], code, value_bytes):
                    self.sealer.reject()  # not a value this deployment writes
                    bad.append(names[j])
                continue
            flat, frame = direct[j], frames[j]
            if flat is not None and frame is not None:
                good = sealer.verify_parts(key, frame[0], flat, frame[1], tenant, sums[j])
            else:
                good = self.sealer.open_into(key, st.view(slot, value_bytes).data, outs[i], tenant)
            if good:
                ok[j] = True
            else:
                log.warning("mooncake tier: block %s failed verification, removing", key[:8].hex())
                bad.append(names[j])
        if bad:
            client.batch_remove(bad, True)
        return ok

    def delete(self, keys: Sequence[BlockKey], tenant: str = "") -> None:
        if not keys:
            return

        def remove(client: Any) -> None:
            codes = client.batch_remove(self._names(keys, tenant), True)
            check_down(client, codes, self.master)

        self._link.call(remove, None)
        self._forget(tenant, keys)

    def close(self) -> None:
        """Stop the prober; calls from now on are misses. The client is closed (its mounted
        segment leaves the pool with it) once no call in flight uses it; ``close`` returns
        within about ``rpc_timeout_s`` (plus the client's own ~1-2 s close while the master
        answers): see ``MasterLink.close``. Idempotent."""
        self._link.close()
