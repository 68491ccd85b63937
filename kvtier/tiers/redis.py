"""Redis / Valkey tier (G3.5 shared pool): a single server or a Redis Cluster, via redis-py.

Every node of a deployment points at the same server(s), so a block one node stores is a hit on
every other. kvtier runs no server; Redis evicts on its own (``maxmemory-policy allkeys-lru``
recommended), so the tier is unbounded (``capacity_blocks`` 0) and not persistent.

**Values.** A block is ONE Redis string: ``BlockSealer`` framing (64-byte header first, then the
payload, or nonce + AES-GCM ciphertext when a key is configured). ``SET`` is atomic, so a reader
sees the whole block or nothing; there is no separate metadata key to keep in step. Stores use
``SET NX`` (a present key keeps its first value) with an optional ``EX`` TTL.

**Keys and slots.** ``<prefix>:{<tenant>}:<hex key>`` by default (``hash_tag = "tenant"``): the
hash tag puts all of a tenant's blocks in one Cluster slot, so a whole prompt's prefix lookup is
ONE command -- a Lua script that walks the keys and stops at the first miss -- and one round
trip even in Cluster. The trade-off: one tenant lives on one shard (a hot tenant cannot use the
cluster's aggregate bandwidth or memory). ``hash_tag = "block"`` (``<prefix>:<tenant>:{<hex>}``)
spreads blocks over every shard instead; lookups and batches are then one pipeline that redis-py
fans out to the shards (requests to all nodes are written before any reply is read, so it is one
round trip in latency, one per shard in count). Nothing of such a pipeline is resent: redis-py
would resend each command a shard did not answer on its own, one ``timeout`` per key on a hung
shard; so a hung shard costs a batch one ``timeout`` (two when a fresh connection's set-up times
out and redis-py then asks that node for the slot map). A ``MOVED`` reply (the slot map changed:
resharding, failover) refreshes the map once and resends those commands once; a slot still
redirected (``ASK``: mid-migration) is that key's miss.

**Batches.** ``get_into``/``put``/``delete`` use one non-transactional pipeline per
``batch_bytes`` of values (16 MiB; at least one value). A pipeline's replies queue in the
server's output buffer for that connection until the client has read them, so a large read
pipeline costs the server that much memory per client and, measured on loopback, reads slower
than small ones (``docs/benchmarks.md``, shared tiers); 16 MiB is still more than a round
trip's worth of bytes at any network's rate, so the extra round trips cost little. Puts go out
zero-copy: the sealed buffer is handed to the socket as a ``memoryview`` (the pure-Python RESP
packer; hiredis' packer would copy each value twice). Replies are parsed by hiredis; the
payload is copied (and checksummed) once, from the reply into the caller's buffer.

**Failures.** Socket timeouts bound each call (``timeout``, ``connect_timeout``); redis-py retries
are off. Two kinds of error, told apart by ``refused``:

- *The server is not serving* (no connection, timeout, ``LOADING``, ``CLUSTERDOWN``, a cluster
  that cannot be reached at all -- redis-py's ``RedisClusterException``, which is no
  ``RedisError`` --, failed AUTH): a ``CircuitBreaker`` opens; the tier answers misses / False at
  once for ``cooldown`` seconds, reports ``healthy`` False, then lets one trial call through
  (``healthy`` is True again once the trial is due: see ``breaker``).
- *The server refused one request* (``OOM`` on a write when it is full with ``noeviction``,
  ``WRONGTYPE``, ``READONLY``, ``NOPERM``, a Cluster slot still redirected after one refresh of
  the slot map, ...): that block is a miss / not stored, counted in
  ``refusals`` and logged once per kind; the breaker is not touched, so reads go on while writes
  are refused. Pipelines run with ``raise_on_error=False``, so one refused key of a batch does
  not cost the others. A value of another Redis type at a block's key (``WRONGTYPE``) is not a
  block: it is deleted, like an undecodable value.

Config (``[[tiers]] kind = "redis"``)::

    url = "redis://127.0.0.1:6379/0"     # rediss:// for TLS, unix:///path; user:password@ for AUTH
    cluster = ["10.0.0.1:7000", ...]     # startup nodes: Redis Cluster mode (url then unused)
    username = "kv" ; password = "..."   # override the URL's credentials
    tls = false ; tls_ca_file = "" ; tls_cert_file = "" ; tls_key_file = "" ; tls_verify = true
    prefix = "kvtier" ; hash_tag = "tenant" | "block" ; ttl = 0 (seconds, 0 = no expiry)
    timeout = 1.0 ; connect_timeout = 1.0 ; cooldown = 5.0 ; batch_bytes = "16MiB"
    encryption_key = "<hex>" ; tenant_keys = {} ; quota = 0 ; tenant_quotas = {}

The connection settings (``RedisOptions``: URL and cluster checks, TLS, timeouts) and the
zero-copy connection classes under them live in ``kvtier.tiers.redis_client``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypeVar

import redis
import redis.cluster
from redis.exceptions import (
    AuthenticationWrongNumberOfArgsError,
    ClusterError,
    MovedError,
    RedisClusterException,
    ResponseError,
)

from kvtier.config import parse_bool, parse_float, parse_int, parse_size
from kvtier.errors import ConfigError
from kvtier.keys import BlockKey
from kvtier.layout import KVLayout
from kvtier.tiers.base import Array, TierUsage
from kvtier.tiers.redis_client import RedisOptions, masked
from kvtier.tiers.remote import Refusals, RemoteTier
from kvtier.tiers.secure import BlockSealer, TenantQuotas, tenant_token

__all__ = ["RedisOptions", "RedisTier", "masked", "refused"]

log = logging.getLogger(__name__)

T = TypeVar("T")
HashTag = Literal["tenant", "block"]
#: values per pipeline, in bytes (module docstring, "Batches")
BATCH_BYTES = 16 << 20
#: what a server call can raise: redis-py's errors, socket errors, and the Cluster client's own
#: exceptions, which are no RedisError ("Redis Cluster cannot be connected", SlotNotCoveredError)
_ERRORS: tuple[type[BaseException], ...] = (redis.RedisError, RedisClusterException, OSError)
#: error replies that still mean the cluster is not serving (CLUSTERDOWN, MASTERDOWN, redirections
#: redis-py gave up following, an AUTH the server does not understand). A MOVED or ASK reply to one
#: command of our pipelines is about that key's slot: a refused request (see ``_cluster_batch``).
_NOT_SERVING = (ClusterError, AuthenticationWrongNumberOfArgsError)
# Longest present prefix, in one command: stops at the first missing key.
_PREFIX_LUA = """
for i = 1, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then return i - 1 end
end
return #KEYS
"""


def refused(exc: BaseException) -> bool:
    """Did the server answer this one request with an error (``OOM`` on a write, ``WRONGTYPE``,
    ``READONLY``, ``NOPERM``, a slot redirected elsewhere, ...)? That is the request's outcome,
    not an outage: the server is up and answering, so it must not open the breaker. Anything
    else (connection, timeout, ``LOADING``, ``CLUSTERDOWN``, cluster unreachable, AUTH) means
    the server is not serving."""
    return isinstance(exc, ResponseError) and not isinstance(exc, _NOT_SERVING)


def _ok(reply: Any) -> bool:
    """A pipeline reply that is truthy and not a refused command's error."""
    return not isinstance(reply, Exception) and bool(reply)


class RedisTier(RemoteTier):
    """Shared tier on Redis/Valkey (single server or Cluster). Thread-safe."""

    name = "redis"
    errors = _ERRORS

    def __init__(
        self,
        layout: KVLayout,
        options: RedisOptions | None = None,
        *,
        prefix: str = "kvtier",
        hash_tag: HashTag = "tenant",
        ttl_s: int = 0,
        cooldown_s: float = 5.0,
        batch_bytes: int = BATCH_BYTES,
        sealer: BlockSealer | None = None,
        quotas: TenantQuotas | None = None,
        secret: bytes = b"",
        trust_pool: bool = False,
    ) -> None:
        super().__init__(
            layout,
            breaker_name="redis tier",
            cooldown_s=cooldown_s,
            sealer=sealer,
            quotas=quotas,
            secret=secret,
            trust_pool=trust_pool,
        )
        if hash_tag not in ("tenant", "block"):
            raise ConfigError(f"redis tier: hash_tag must be 'tenant' or 'block', got {hash_tag!r}")
        if not prefix or any(c in prefix for c in "{} "):
            raise ConfigError(
                f"redis tier: prefix {prefix!r} must be non-empty, without {{}} or spaces"
            )
        if ttl_s < 0:
            raise ConfigError(f"redis tier: ttl must be >= 0 seconds, got {ttl_s}")
        self.options = options or RedisOptions()
        self.prefix = prefix
        self.hash_tag = hash_tag
        self.ttl_s = ttl_s
        self.require_authentication()
        self._batch = max(1, batch_bytes // self.sealer.value_bytes)
        self._client: redis.Redis | redis.cluster.RedisCluster | None = None
        self._script: Any = None
        self._lock = threading.Lock()
        self._refusals = Refusals()

    @classmethod
    def from_config(cls, layout: KVLayout, spec: Mapping[str, Any]) -> RedisTier:
        """Build from a ``[[tiers]]`` table (keys listed in the module docstring)."""
        opt_keys = {
            "url",
            "cluster",
            "username",
            "password",
            "tls",
            "tls_ca_file",
            "tls_cert_file",
            "tls_key_file",
            "tls_verify",
            "timeout",
            "connect_timeout",
        }
        tier_keys = {"prefix", "hash_tag", "ttl", "cooldown", "batch_bytes"}
        sealer, quotas = cls.security_section(layout, spec, "tiers.redis", opt_keys | tier_keys)
        opts = {k: spec[k] for k in opt_keys if k in spec}
        for k in ("tls", "tls_verify"):
            if k in opts:
                opts[k] = parse_bool(opts[k], f"tiers.redis {k}")
        for k in ("timeout", "connect_timeout"):
            if k in opts:
                opts[k] = parse_float(opts[k], f"tiers.redis {k}")
        if "cluster" in opts:
            if not isinstance(opts["cluster"], list | tuple):
                raise ConfigError("tiers.redis cluster must be a list of 'host:port' strings")
            opts["cluster"] = tuple(str(n) for n in opts["cluster"])
        return cls(
            layout,
            RedisOptions(**opts),
            prefix=str(spec.get("prefix", "kvtier")),
            hash_tag=spec.get("hash_tag", "tenant"),
            ttl_s=parse_int(spec.get("ttl", 0), "tiers.redis ttl"),
            cooldown_s=parse_float(spec.get("cooldown", 5.0), "tiers.redis cooldown"),
            batch_bytes=parse_size(spec.get("batch_bytes", BATCH_BYTES), "tiers.redis batch_bytes"),
            sealer=sealer,
            quotas=quotas,
        )

    # -- plumbing --------------------------------------------------------------------------
    def redis_key(self, key: BlockKey, tenant: str) -> str:
        """The Redis key of block ``key`` of ``tenant`` (hash tag per ``hash_tag``)."""
        t = tenant_token(tenant)
        if self.hash_tag == "tenant":
            return f"{self.prefix}:{{{t}}}:{key.hex()}"
        return f"{self.prefix}:{t}:{{{key.hex()}}}"

    def client(self) -> redis.Redis | redis.cluster.RedisCluster:
        """The shared client, created on first use (raises redis errors if unreachable)."""
        with self._lock:
            if self._client is None:
                self._client = self.options.connect()
                self._script = self._client.register_script(_PREFIX_LUA)
            return self._client

    def _run(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Run ``commands`` (raw ``("GET", name)`` tuples) as one non-transactional pipeline: one
        reply per command, a refused command's error in its place. Raises the first error that
        means the server is not serving (for ``guard``'s breaker)."""
        client = self.client()
        if isinstance(client, redis.cluster.RedisCluster):
            replies = self._cluster_batch(client, commands)
        else:
            pipe: Any = client.pipeline(transaction=False)
            for c in commands:
                pipe.execute_command(*c)
            replies = list(pipe.execute(raise_on_error=False))
        for r in replies:
            if isinstance(r, Exception) and not refused(r):
                raise r
        return replies

    @staticmethod
    def _cluster_batch(
        client: redis.cluster.RedisCluster, commands: Sequence[tuple[Any, ...]]
    ) -> list[Any]:
        """``_run`` on a Cluster: every shard's commands are written before any reply is read,
        and none is resent (redis-py would resend each command of a shard that timed out on its
        own, one timeout per key). ``MOVED`` replies refresh the slot map once and those
        commands are sent once more; what is still redirected stays a (refused) error reply."""

        def send(cmds: Sequence[tuple[Any, ...]]) -> list[Any]:
            stack = [
                redis.cluster.PipelineCommand(c, {}, i)  # type: ignore[no-untyped-call]
                for i, c in enumerate(cmds)
            ]
            pipe = client.pipeline(transaction=False)  # type: ignore[no-untyped-call]
            return list(
                pipe.send_cluster_commands(stack, raise_on_error=False, allow_redirections=False)
            )

        replies = send(commands)
        moved = [i for i, r in enumerate(replies) if isinstance(r, MovedError)]
        if moved:
            client.nodes_manager.initialize()
            for i, r in zip(moved, send([commands[i] for i in moved]), strict=True):
                replies[i] = r
        return replies

    def guard(self, fn: Callable[[], T], fallback: T) -> T:
        """``RemoteTier.guard``; a request the server ``refused`` is ``fallback`` too, but
        leaves the breaker closed (the server answered)."""

        def call() -> T:
            try:
                return fn()
            except ResponseError as exc:
                if not refused(exc):
                    raise
                self._refused(exc)
                return fallback

        return super().guard(call, fallback)

    @property
    def refusals(self) -> int:
        """Requests the server refused (``refused``): misses / puts not stored, breaker closed."""
        return self._refusals.count

    def _refused(self, exc: Exception) -> None:
        """Count a refused request; log the first of each kind (a full server refuses every put)."""
        if self._refusals.add(f"{type(exc).__name__} {str(exc).split(' ', 1)[0]}"):
            log.warning("redis tier: server refused a request (%s): a miss / not stored", exc)

    def _chunks(self, n: int) -> list[range]:
        return [range(i, min(n, i + self._batch)) for i in range(0, n, self._batch)]

    # -- queries ---------------------------------------------------------------------------
    def usage(self) -> TierUsage:
        """Blocks under this tier's prefix, all tenants: a SCAN, meant for stats, not hot paths."""

        def count() -> int:
            client = self.client()
            pattern = f"{self.prefix}:*"
            if isinstance(client, redis.cluster.RedisCluster):
                nodes = client.get_primaries()  # type: ignore[no-untyped-call]
                return sum(
                    1 for _ in client.scan_iter(match=pattern, count=1000, target_nodes=nodes)
                )
            return sum(1 for _ in client.scan_iter(match=pattern, count=1000))

        return TierUsage(self.guard(count, 0), 0, self.block_bytes)

    def contains_prefix(self, keys: Sequence[BlockKey], tenant: str = "") -> int:
        if not keys:
            return 0
        names = [self.redis_key(k, tenant) for k in keys]

        def probe() -> int:
            self.client()
            if self.hash_tag == "tenant":  # one slot: one script call, one round trip
                return int(self._script(keys=names))
            found = self._run([("EXISTS", n) for n in names])
            return next((i for i, f in enumerate(found) if not _ok(f)), len(found))

        return self.guard(probe, 0)

    # -- data ------------------------------------------------------------------------------
    def get_into(
        self, keys: Sequence[BlockKey], outs: Sequence[Array], tenant: str = ""
    ) -> list[bool]:
        self.check_buffers(outs, keys)
        result = [False] * len(keys)
        bad: list[str] = []
        for chunk in self._chunks(len(keys)):
            names = [self.redis_key(keys[i], tenant) for i in chunk]

            def fetch(names: list[str] = names) -> list[Any]:
                return self._run([("GET", n) for n in names])

            values: list[Any] = self.guard(fetch, [])
            if not values:
                break  # server down: the rest are misses too
            for i, name, value in zip(chunk, names, values, strict=True):
                if value is None:
                    continue
                if isinstance(value, Exception):  # refused: a miss
                    self._refused(value)
                    if str(value).startswith("WRONGTYPE"):  # not a string: not a block
                        log.warning("redis tier: %s holds no block (WRONGTYPE): dropped", name)
                        bad.append(name)
                    continue
                ok = self.sealer.open_into(keys[i], value, outs[i], tenant)
                result[i] = ok
                if not ok and self.sealer.droppable(keys[i], value):
                    log.warning("redis tier: block %s failed verification: dropped", name)
                    bad.append(name)
        if bad:
            no_reply: list[int] = []
            self.guard(lambda: self._delete_names(bad), no_reply)
        return result

    def put(
        self, keys: Sequence[BlockKey], blocks: Sequence[Array], tenant: str = ""
    ) -> list[bool]:
        self.check_buffers(blocks, keys)
        result = [False] * len(keys)
        charge = self.quotas.active
        for chunk in self._chunks(len(keys)):
            present = self._present(keys, chunk, tenant) if charge else set()
            if present is None:
                break  # server down: nothing stored
            batch: list[tuple[int, str, memoryview]] = []
            for i in chunk:
                if i in present:  # kept as it is, and not charged again
                    result[i] = True
                    continue
                value = self.seal_charged(keys[i], blocks[i], tenant)
                if value is None:
                    continue
                batch.append((i, self.redis_key(keys[i], tenant), value))
            if not batch:
                continue

            def store(batch: list[tuple[int, str, memoryview]] = batch) -> list[Any]:
                ttl = ("EX", self.ttl_s) if self.ttl_s else ()
                return self._run([("SET", name, value, "NX", *ttl) for _, name, value in batch])

            replies: list[Any] = self.guard(store, [])
            for j, (i, _, _) in enumerate(batch):
                reply = replies[j] if replies else None
                if isinstance(reply, Exception):  # refused (OOM: the server is full)
                    self._refused(reply)
                # None reply: already present, kept (True); no replies: server down (False)
                result[i] = bool(replies) and not isinstance(reply, Exception)
                if not _ok(reply):
                    self.refund(tenant)
        return result

    def _present(self, keys: Sequence[BlockKey], chunk: range, tenant: str) -> set[int] | None:
        """Indices in ``chunk`` whose keys exist (one pipeline); ``None`` if the server failed."""
        names = [self.redis_key(keys[i], tenant) for i in chunk]

        def probe() -> set[int] | None:
            found = self._run([("EXISTS", n) for n in names])
            return {i for i, f in zip(chunk, found, strict=True) if _ok(f)}

        return self.guard(probe, None)

    def _delete_names(self, names: list[str]) -> list[int]:
        return [1 if _ok(x) else 0 for x in self._run([("DEL", n) for n in names])]

    def delete(self, keys: Sequence[BlockKey], tenant: str = "") -> None:
        if not keys:
            return
        names = [self.redis_key(k, tenant) for k in keys]
        removed: list[int] = self.guard(lambda: self._delete_names(names), [])
        self.refund(tenant, sum(1 for r in removed if r))

    def close(self) -> None:
        """Drop the client and close its connections (a call still in flight on one gets an
        error: a miss). Bounded: closing sockets waits for no server."""
        with self._lock:
            client, self._client = self._client, None
        if client is None:
            return
        # redis-py's close() leaves open the pools it was given, which ours all are (the
        # single server's, and each Cluster node's, built from our connection kwargs)
        if isinstance(client, redis.cluster.RedisCluster):
            known = client.get_nodes()  # type: ignore[no-untyped-call]
            nodes = [*known, *client.nodes_manager.startup_nodes.values()]
            pools = [n.redis_connection.connection_pool for n in nodes if n.redis_connection]
        else:
            pools = [client.connection_pool]
        with contextlib.suppress(*_ERRORS):
            client.close()
        for pool in pools:
            with contextlib.suppress(*_ERRORS):
                pool.disconnect()
